"""Logical axis names and the rules that map them onto mesh axes.

Every parameter and the KV cache carry a tuple of logical axis names (one per dimension). One
rules table turns those names into a `PartitionSpec` for a given mesh. Changing the sharding
strategy is an edit here (or passing other rules), never to model code.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

logger = logging.getLogger(__name__)

# Logical axis names used by the models.
VOCAB = "vocab"
EMBED = "embed"
Q_HEADS = "q_heads"
KV_HEADS = "kv_heads"
HEAD_DIM = "head_dim"
MLP = "mlp"
PAGES = "pages"  # KV cache page axis (never sharded today)
EXPERT = "expert"  # the stacked experts of a mixture-of-experts layer

LogicalAxes = tuple[str | None, ...]

# Tensor parallelism over the "model" mesh axis (Megatron-style: heads and MLP columns split,
# partial sums reduced by XLA); the "data" axis replicates weights.
DEFAULT_RULES: Mapping[str, str | None] = {
    VOCAB: "model",
    EMBED: None,
    Q_HEADS: "model",
    KV_HEADS: "model",
    HEAD_DIM: None,
    MLP: "model",
    PAGES: None,
    EXPERT: None,  # experts replicated; each split along its intermediate dim (MLP)
}

# Expert parallelism: the stacked experts of MoE layers split over the "model" axis (each device
# holds num_experts / n whole experts and computes them for every token; see layers/moe.py);
# everything else as DEFAULT_RULES. An array uses a mesh axis once, so an expert weight's
# intermediate dim stays whole.
EXPERT_PARALLEL_RULES: Mapping[str, str | None] = {**DEFAULT_RULES, EXPERT: "model"}

# Named rule presets (for a future `--sharding-rules` flag).
RULE_PRESETS: Mapping[str, Mapping[str, str | None]] = {
    "default": DEFAULT_RULES,
    "expert_parallel": EXPERT_PARALLEL_RULES,
}


def logical_to_spec(
    axes: Sequence[str | None],
    shape: Sequence[int],
    mesh: Mesh,
    rules: Mapping[str, str | None] = DEFAULT_RULES,
) -> PartitionSpec:
    """PartitionSpec for an array with these logical axes.

    A dimension whose size the mesh axis does not divide is replicated instead (for example
    SmolLM2's 9 query heads on a 4-way model axis), with a debug log line.
    """
    if len(axes) != len(shape):
        raise ValueError(f"logical axes {axes} do not match shape {tuple(shape)}")
    spec: list[str | None] = []
    used: set[str] = set()
    for name, size in zip(axes, shape):
        mesh_axis = rules.get(name) if name is not None else None
        if mesh_axis is None or mesh_axis in used or mesh_axis not in mesh.shape:
            spec.append(None)
            continue
        if size % mesh.shape[mesh_axis]:
            logger.debug("replicating axis %s (size %d) over %s", name, size, mesh_axis)
            spec.append(None)
            continue
        used.add(mesh_axis)
        spec.append(mesh_axis)
    return PartitionSpec(*spec)


def named_sharding(
    axes: Sequence[str | None],
    shape: Sequence[int],
    mesh: Mesh,
    rules: Mapping[str, str | None] = DEFAULT_RULES,
) -> NamedSharding:
    return NamedSharding(mesh, logical_to_spec(axes, shape, mesh, rules))


def state_shardings(state, mesh: Mesh, rules: Mapping[str, str | None] = DEFAULT_RULES):
    """Map an nnx State (abstract or concrete) to a pytree of NamedShardings of the same shape."""
    from flax import nnx

    def one(var):
        value = var.get_value()
        axes = var.get_metadata().get("logical_axes")
        if axes is None:
            return NamedSharding(mesh, PartitionSpec())
        return named_sharding(axes, value.shape, mesh, rules)

    return jax.tree.map(one, state, is_leaf=lambda x: isinstance(x, nnx.Variable))


def single_device_mesh() -> Mesh:
    """The 1x1 ("data", "model") mesh on the first device: the unsharded case of the same code."""
    import numpy as np

    return Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("data", "model"))
