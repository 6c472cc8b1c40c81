"""The device mesh: ("data", "model") axes from a ParallelConfig-like pair of sizes."""

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
