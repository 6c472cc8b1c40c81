"""The accelerator this host serves on, told from its device files without loading JAX.

`serving_platform()` answers for the frontend (which must not open a TPU: only one process may,
and with `--engine-core process` that is the engine's). `pin_cpu_without_accelerator()` runs when
`jaxserve` is imported: on a Linux host with no accelerator device files and no JAX_PLATFORMS,
JAX is told to use the CPU, so that the compile-only plugins installed beside it (JAX's CUDA
plugin of the `gpu-compile` extra, libtpu of the `tpu` extra) do not try to initialise a chip
that is not there and print their tracebacks ("Jax plugin configuration error ... Unable to
load CUDA"). Compiling for a GPU or TPU from such a host goes through compile-only topologies,
which do not need the plugin initialised as a backend.
"""

from __future__ import annotations

import os
import pathlib
import sys
from collections.abc import Mapping, MutableMapping
from typing import Literal

Platform = Literal["cpu", "tpu", "gpu"]


def serving_platform(env: Mapping[str, str] | None = None, dev: str = "/dev") -> Platform:
    """The accelerator JAX will serve on: the first entry of JAX_PLATFORMS when set, else the
    device files present (TPU: /dev/accel<N> or /dev/vfio/<N>; GPU: /dev/nvidia<N>, ROCm's
    /dev/kfd or WSL's /dev/dxg), else the CPU."""
    env = os.environ if env is None else env
    first = env.get("JAX_PLATFORMS", "").split(",")[0].strip().lower()
    if first:
        return "tpu" if first == "tpu" else "cpu" if first == "cpu" else "gpu"
    root = pathlib.Path(dev)
    if any(root.glob("accel[0-9]*")) or any(p.name.isdigit() for p in root.glob("vfio/*")):
        return "tpu"
    if (any(p.name[len("nvidia"):].isdigit() for p in root.glob("nvidia[0-9]*"))
            or (root / "kfd").exists() or (root / "dxg").exists()):
        return "gpu"
    return "cpu"


def pin_cpu_without_accelerator(env: MutableMapping[str, str] | None = None, dev: str = "/dev",
                                system: str = sys.platform) -> bool:
    """Set JAX_PLATFORMS=cpu in `env` when it is unset and this Linux host has no accelerator
    device files; True when it did. Elsewhere (macOS, Windows) the device files say nothing, and
    the choice stays JAX's."""
    env = os.environ if env is None else env
    if system != "linux" or env.get("JAX_PLATFORMS") or serving_platform(env, dev) != "cpu":
        return False
    env["JAX_PLATFORMS"] = "cpu"
    return True
