"""Build a model with its parameters placed on a mesh: from a checkpoint or at random.

The model is first created abstractly (`nnx.eval_shape`, no memory), each parameter's target
sharding is derived from its logical axes, and every tensor is then read from the checkpoint,
converted, and placed straight into that sharding (each device receives only its shard).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from jaxserve.models.arch_config import ArchConfig
from jaxserve.models.loader import load_checkpoint
from jaxserve.models.placement import put_sharded
from jaxserve.models.registry import get_model_class
from jaxserve.models.sharding import single_device_mesh, state_shardings

logger = logging.getLogger(__name__)


def _is_var(x) -> bool:
    return isinstance(x, nnx.Variable)


def _path_key(path) -> str:
    return ".".join(str(getattr(p, "key", getattr(p, "name", p))) for p in path)


def create_model(
    cfg: ArchConfig,
    *,
    dtype=jnp.float32,
    mesh: Mesh | None = None,
    attention_impl: str = "auto",
    get_tensor: Callable[[str], np.ndarray] | None = None,
    seed: int = 0,
):
    """A model of cfg.architecture; weights from `get_tensor` (HF names) or random (seeded)."""
    cls = get_model_class(cfg.architecture)
    mesh = mesh or single_device_mesh()

    def build(rngs: nnx.Rngs):
        return cls(cfg, dtype=dtype, rngs=rngs, mesh=mesh, attention_impl=attention_impl)

    abstract = nnx.eval_shape(lambda: build(nnx.Rngs(seed)))
    graphdef, abs_state = nnx.split(abstract)
    shardings = state_shardings(abs_state, mesh)

    if get_tensor is None:
        # Random weights (tests, benchmarks): initialise under jit straight into the shardings.
        out_shardings = jax.tree.map(lambda v: v, shardings)
        init = jax.jit(lambda: nnx.split(build(nnx.Rngs(seed)))[1], out_shardings=out_shardings)
        return nnx.merge(graphdef, init())

    weight_map = cls.hf_weight_map(cfg)
    flat_shardings = {
        _path_key(p): s for p, s in jax.tree_util.tree_leaves_with_path(shardings)
    }

    def load(path, var):
        key = _path_key(path)
        if key not in weight_map:
            raise ValueError(f"no checkpoint mapping for parameter {key!r} of {cfg.architecture}")
        host = weight_map[key](get_tensor)
        expected = var.get_value().shape
        if tuple(host.shape) != tuple(expected):
            raise ValueError(
                f"checkpoint tensor for {key} has shape {tuple(host.shape)}, expected {tuple(expected)}"
            )
        return var.replace(put_sharded(host, flat_shardings[key], var.get_value().dtype))

    state = jax.tree_util.tree_map_with_path(load, abs_state, is_leaf=_is_var)
    return nnx.merge(graphdef, state)


def load_model(path, *, dtype=jnp.float32, mesh: Mesh | None = None, attention_impl: str = "auto"):
    """The model in the HF directory `path` (see loader.resolve_model), weights on `mesh`."""
    ckpt = load_checkpoint(path)
    cfg = ArchConfig.from_hf(ckpt.config)
    return create_model(
        cfg, dtype=dtype, mesh=mesh, attention_impl=attention_impl, get_tensor=ckpt.get_tensor
    )
