"""The device mesh: ("data", "model") axes from a ParallelConfig-like pair of sizes, and what a
model placed on it holds per device."""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import Mesh

MESH_AXES = ("data", "model")


def make_mesh(data: int = 1, model: int = 1, devices: list | None = None) -> Mesh:
    """A data x model mesh over the first data*model devices (all processes' devices)."""
    devices = list(devices if devices is not None else jax.devices())
    need = data * model
    if data < 1 or model < 1:
        raise ValueError(f"mesh sizes must be >= 1, got data={data}, model={model}")
    if need > len(devices):
        raise ValueError(
            f"a mesh of data={data} x model={model} needs {need} devices, but only "
            f"{len(devices)} are visible ({jax.default_backend()})"
        )
    return Mesh(np.array(devices[:need]).reshape(data, model), MESH_AXES)


def bytes_per_device(arrays) -> int:
    """Bytes the arrays hold on the first local device (what each device holds, for the
    evenly sharded or replicated arrays of a mesh)."""
    device = jax.local_devices()[0]
    return sum(s.data.nbytes for x in arrays for s in x.addressable_shards if s.device == device)


def replicated_axes(model, mesh: Mesh, rules=None) -> dict[str, list[str]]:
    """Logical axes the sharding rules map onto a mesh axis of size > 1 but that stayed whole
    (the size is not divisible), with the parameters that are replicated because of it:
    {"kv_heads (3) over model=2": ["layers.0.wk", ...]}."""
    from flax import nnx

    from jaxserve.models import sharding

    rules = sharding.DEFAULT_RULES if rules is None else rules
    out: dict[str, list[str]] = {}
    state = nnx.state(model)
    for path, var in jax.tree_util.tree_leaves_with_path(state, is_leaf=lambda x: isinstance(x, nnx.Variable)):
        axes = var.get_metadata().get("logical_axes")
        value = var.get_value()
        if axes is None or not hasattr(value, "sharding"):
            continue
        spec = tuple(value.sharding.spec) + (None,) * (value.ndim - len(value.sharding.spec))
        for name, size, placed in zip(axes, value.shape, spec):
            target = rules.get(name) if name is not None else None
            if target is None or placed is not None or mesh.shape.get(target, 1) == 1:
                continue
            key = f"{name} ({size}) over {target}={mesh.shape[target]}"
            out.setdefault(key, []).append(".".join(str(getattr(p, "key", p)) for p in path))
    return out
