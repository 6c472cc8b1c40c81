"""The devices an engine is planned for, as facts: what the backend's resolution reads of them.

`DeviceSet.local(n)` takes them from JAX (this process's view of the first n devices of the
run); `DeviceSet.described(...)` states them for a target this host does not have (a TPU slice,
GPU hosts), so that an engine's plan (engine/plan.py) resolves for it without opening a device.
A described device carries the attributes the resolution reads of a JAX device: its kind, its
coordinates (a TPU's place in the slice), its CUDA compute capability.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
from collections.abc import Sequence
from typing import Any

import numpy as np


@dataclasses.dataclass(frozen=True)
class DescribedDevice:
    """A device as a plan reads it (the attribute names of a JAX device)."""

    platform: str
    device_kind: str
    coords: tuple[int, ...] | None = None
    compute_capability: str | None = None


@dataclasses.dataclass(frozen=True)
class DeviceSet:
    """The devices of an engine's mesh (data x model of them) and the host around them."""

    platform: str  # "cpu", "tpu", "gpu"
    devices: tuple[Any, ...]  # JAX devices or DescribedDevices
    processes: int = 1  # processes (hosts) the run spans
    host_cores: int = dataclasses.field(default_factory=lambda: os.cpu_count() or 1)

    @property
    def size(self) -> int:
        return len(self.devices)

    @property
    def device_kind(self) -> str:
        return self.devices[0].device_kind if self.devices else ""

    def flat(self) -> np.ndarray:
        """The devices as a flat array (`Mesh.devices.flat`'s kind of sequence)."""
        out = np.empty(len(self.devices), dtype=object)
        out[:] = list(self.devices)
        return out

    @classmethod
    def of_mesh(cls, mesh, platform: str) -> DeviceSet:
        """The devices of `mesh` (every process's), as JAX sees them."""
        import jax

        return cls(platform, tuple(mesh.devices.flat), processes=jax.process_count())

    @classmethod
    def described(cls, platform: str, device_kind: str, count: int, *, slice_shape: Sequence[int] | None = None,
                  compute_capability: str | None = None, processes: int = 1,
                  host_cores: int | None = None) -> DeviceSet:
        """`count` devices of `device_kind` that need not exist here: a TPU slice of
        `slice_shape` chips (their coordinates, as libtpu reports them), GPUs of
        `compute_capability`."""
        coords: list[tuple[int, ...] | None] = [None] * count
        if slice_shape is not None:
            coords = [tuple(reversed(c)) for c in itertools.product(*(range(d) for d in reversed(slice_shape)))]
            coords = [(*c, *(0,) * (3 - len(c))) for c in coords][:count]
        devices = tuple(DescribedDevice(platform, device_kind, c, compute_capability) for c in coords)
        return cls(platform, devices, processes, host_cores or os.cpu_count() or 1)


def tpu_slice_devices(topology: str) -> list:
    """The devices of libtpu's compile-only TPU slice `topology` ("v6e:2x4"; JAX_PLATFORMS=cpu
    where no TPU is attached). libtpu assumes hosts of 2x2 chips: a smaller slice (v6e:1x1, a
    one-chip host) is described as one host of its own shape."""
    from jax.experimental import topologies

    dims = [int(d) for d in topology.split(":")[-1].split("x")]
    kwargs = {}
    if len(dims) <= 3 and any(d < 2 for d in dims[:2]):
        kwargs["chips_per_host_bounds"] = [*dims, *[1] * (3 - len(dims))]
    return list(topologies.get_topology_desc(topology_name=topology, platform="tpu", **kwargs).devices)
