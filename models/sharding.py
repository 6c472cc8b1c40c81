"""Logical axis names and the rules that map them onto mesh axes.

Every parameter and the KV cache carry a tuple of logical axis names (one per dimension). One
rules table turns those names into a `PartitionSpec` for a given mesh (`logical_to_spec`: the
one place that does); the attention `shard_map` derives its specs from the same table.
Changing the sharding strategy is an edit here, a named preset, or a rules file
(`load_rules`), never a change to model code.

A rule maps a logical axis to a mesh axis ("data" or "model"), to several mesh axes (a list:
the dimension is split over their product), or to None (replicated). A dimension whose size
the mesh axes do not divide is replicated instead; `spec_entries` tells what was asked and
what was granted, so that silent replication can be reported.
"""

from __future__ import annotations

import json
import logging
import math
import os
import pathlib
from collections.abc import Mapping, Sequence

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec

logger = logging.getLogger(__name__)

# Logical axis names used by the models.
VOCAB = "vocab"
EMBED = "embed"
Q_HEADS = "q_heads"
KV_HEADS = "kv_heads"
HEAD_DIM = "head_dim"
MLP = "mlp"
PAGES = "pages"  # KV cache page axis
EXPERT = "expert"  # the stacked experts of a mixture-of-experts layer
LOGICAL_AXES = (VOCAB, EMBED, Q_HEADS, KV_HEADS, HEAD_DIM, MLP, PAGES, EXPERT)
MESH_AXIS_NAMES = ("data", "model")

MeshAxes = str | tuple[str, ...] | None
LogicalAxes = tuple[str | None, ...]
Rules = Mapping[str, MeshAxes]

# Tensor parallelism over the "model" mesh axis (Megatron-style: heads and MLP columns split,
# partial sums reduced by XLA); the "data" axis replicates weights.
DEFAULT_RULES: Rules = {
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
EXPERT_PARALLEL_RULES: Rules = {**DEFAULT_RULES, EXPERT: "model"}

# Attention data parallelism for models with fewer KV heads than the tensor-parallel degree
# (tpu-inference's "DP attention"), on a data x model mesh whose model axis is the KV-head
# split: KV heads and query heads over "model", the KV pages (and so the requests) over
# "data", the MLP and the vocabulary over both axes. Serving it needs the data-parallel
# scheduler (requests pinned to a data rank, each rank with its own page range), so the
# engine refuses rules that shard the pages; `jaxserve shard-plan` sizes its memory.
ATTENTION_DP_RULES: Rules = {
    **DEFAULT_RULES, VOCAB: ("data", "model"), MLP: ("data", "model"), PAGES: "data",
}

# Named rule presets (`--sharding-rules NAME`; a path to a JSON/YAML file works too).
RULE_PRESETS: Mapping[str, Rules] = {
    "tp": DEFAULT_RULES,
    # The embedding / LM head whole on every device: no all-gather of the logits or of the
    # embedded tokens, at the price of V x E weights per device.
    "tp-replicate-vocab": {**DEFAULT_RULES, VOCAB: None},
    # K/V projections and the KV cache whole on every device; attention computed replicated.
    "tp-kv-replicated": {**DEFAULT_RULES, KV_HEADS: None},
    # Fully sharded weights: the tensor-parallel split over "model", and the hidden (embed)
    # dim of every weight over "data" (XLA gathers them per use), so that a data x model mesh
    # holds each weight once.
    "fsdp": {**DEFAULT_RULES, EMBED: "data"},
    "expert-parallel": EXPERT_PARALLEL_RULES,
    "attn-dp": ATTENTION_DP_RULES,
}


def _axes_tuple(value: MeshAxes) -> tuple[str, ...]:
    if value is None:
        return ()
    return (value,) if isinstance(value, str) else tuple(value)


def spec_entries(
    axes: Sequence[str | None],
    shape: Sequence[int],
    mesh: Mesh,
    rules: Rules = DEFAULT_RULES,
) -> list[tuple[tuple[str, ...], tuple[str, ...]]]:
    """Per dimension: (the mesh axes the rules ask for, the mesh axes it is split over).

    Asked-for axes missing from the mesh are dropped; a mesh axis is used once per array (the
    first dimension asking for it gets it); a dimension the axes' product does not divide is
    replicated (granted ()).
    """
    if len(axes) != len(shape):
        raise ValueError(f"logical axes {axes} do not match shape {tuple(shape)}")
    out = []
    used: set[str] = set()
    for name, size in zip(axes, shape):
        asked = _axes_tuple(rules.get(name)) if name is not None else ()
        usable = tuple(a for a in asked if a in mesh.shape and a not in used)
        if usable and size % math.prod(mesh.shape[a] for a in usable):
            logger.debug("replicating axis %s (size %d) over %s", name, size, usable)
            usable = ()
        used.update(usable)
        out.append((asked, usable))
    return out


def logical_to_spec(
    axes: Sequence[str | None],
    shape: Sequence[int],
    mesh: Mesh,
    rules: Rules = DEFAULT_RULES,
) -> PartitionSpec:
    """PartitionSpec for an array with these logical axes.

    A dimension whose size the mesh axes do not divide is replicated instead (for example
    SmolLM2's 9 query heads on a 4-way model axis), with a debug log line.
    """
    spec: list[MeshAxes] = []
    for _, granted in spec_entries(axes, shape, mesh, rules):
        spec.append(None if not granted else granted[0] if len(granted) == 1 else granted)
    return PartitionSpec(*spec)


def named_sharding(
    axes: Sequence[str | None],
    shape: Sequence[int],
    mesh: Mesh,
    rules: Rules = DEFAULT_RULES,
) -> NamedSharding:
    return NamedSharding(mesh, logical_to_spec(axes, shape, mesh, rules))


def state_shardings(state, mesh: Mesh, rules: Rules = DEFAULT_RULES):
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


# ----------------------------------------------------------------------------- configuration


def validate_rules(rules: Rules, where: str = "sharding rules") -> dict[str, MeshAxes]:
    """The rules as a plain dict with every logical axis present (missing ones replicated);
    ValueError naming the problem for an unknown logical axis or mesh axis."""
    out: dict[str, MeshAxes] = {name: None for name in LOGICAL_AXES}
    for name, value in rules.items():
        if name not in LOGICAL_AXES:
            raise ValueError(f"{where}: unknown logical axis {name!r}; known: {', '.join(LOGICAL_AXES)}")
        if isinstance(value, list):
            value = tuple(value)
        for axis in _axes_tuple(value):
            if not isinstance(axis, str) or axis not in MESH_AXIS_NAMES:
                raise ValueError(f"{where}: {name!r} maps to {axis!r}; mesh axes are "
                                 f"{', '.join(MESH_AXIS_NAMES)} (or null, or a list of them)")
        if isinstance(value, tuple) and len(set(value)) != len(value):
            raise ValueError(f"{where}: {name!r} names a mesh axis twice: {list(value)}")
        out[name] = value[0] if isinstance(value, tuple) and len(value) == 1 else value
    return out


def _read_rules_file(path: pathlib.Path) -> Mapping:
    text = path.read_text()
    if path.suffix.lower() in (".yaml", ".yml"):
        try:
            import yaml
        except ImportError:
            raise ValueError(f"{path} is YAML, but PyYAML is not installed; install it "
                             "(pip install pyyaml) or write the rules as JSON") from None
        data = yaml.safe_load(text)
    else:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(data, Mapping):
        raise ValueError(f"{path}: expected a mapping of logical axis -> mesh axis")
    return data


def load_rules(spec: str | Rules | None) -> dict[str, MeshAxes]:
    """Rules from a preset name (RULE_PRESETS), a JSON or YAML file, or a mapping.

    A file is a mapping `{logical axis: mesh axis | [mesh axes] | null}`; it may name a
    preset to start from with `"base": "<preset>"` (default "tp") and then list only what
    differs. YAML files need PyYAML.
    """
    if spec is None:
        return validate_rules(DEFAULT_RULES)
    if isinstance(spec, Mapping):
        return validate_rules(spec)
    if spec in RULE_PRESETS:
        return validate_rules(RULE_PRESETS[spec], f"preset {spec!r}")
    path = pathlib.Path(os.path.expanduser(spec))
    if not path.is_file():
        raise ValueError(f"sharding rules {spec!r}: neither a preset ({', '.join(RULE_PRESETS)}) "
                         "nor a rules file (JSON, or YAML with PyYAML)")
    data = dict(_read_rules_file(path))
    base = data.pop("base", "tp")
    if base not in RULE_PRESETS:
        raise ValueError(f"{path}: base {base!r} is not a preset ({', '.join(RULE_PRESETS)})")
    return validate_rules({**RULE_PRESETS[base], **data}, str(path))


def rules_name(spec: str | Rules | None) -> str:
    """A short name for reports: the preset or the file's stem."""
    if spec is None:
        return "tp"
    if isinstance(spec, Mapping):
        return "custom"
    return spec if spec in RULE_PRESETS else pathlib.Path(spec).stem


def check_servable(rules: Rules) -> None:
    """ValueError when the engine cannot run these rules: the KV pages split over anything but
    "data" (each data rank owns a page range: the data-parallel scheduler), or the head dim
    split (attention needs whole heads)."""
    if _axes_tuple(rules.get(PAGES)) not in ((), ("data",)):
        raise ValueError(
            f"these sharding rules split the KV cache pages over {list(_axes_tuple(rules[PAGES]))}; "
            "only the data axis can own pages (each data-parallel rank a range of them).")
    if _axes_tuple(rules.get(HEAD_DIM)):
        raise ValueError("sharding rules may not split head_dim: attention needs whole heads")


def serving_rules(rules: Rules, data_parallel_size: int) -> dict[str, MeshAxes]:
    """The rules the engine serves with: with data parallelism the KV pages go over "data"
    (each rank owns a range of them, see core/dp_scheduler.py)."""
    return {**rules, PAGES: "data"} if data_parallel_size > 1 else dict(rules)


def context_mesh(mesh: Mesh) -> tuple[Mesh, frozenset[str]]:
    """The mesh a `shard_map` inside the model must use, and the axes already manual there:
    inside the data-parallel step (a `shard_map` manual over "data") that is the context's
    abstract mesh; elsewhere `mesh` itself."""
    ctx = jax.sharding.get_abstract_mesh()
    manual = frozenset(getattr(ctx, "manual_axes", ()) or ())
    return (ctx, manual) if manual else (mesh, frozenset())


def same_on_every_rank(flag: jax.Array) -> jax.Array:
    """A batch-wide boolean flag made the same on every data rank: inside the data-parallel step
    (a `shard_map` manual over "data") the OR over the ranks, elsewhere `flag` itself. A
    `lax.cond` or `while_loop` whose branches hold collectives over the other mesh axes (the
    sampler's over a vocabulary split on "model") must take the same path on every device, or
    the collectives wait for each other forever."""
    _, manual = context_mesh(None)
    if "data" not in manual:
        return flag
    return jax.lax.pmax(jnp.asarray(flag).astype(jnp.int32), "data") > 0


def without_axes(spec: PartitionSpec, axes: frozenset[str]) -> PartitionSpec:
    """`spec` with the mesh axes `axes` left out (they are manual in the context already)."""
    if not axes:
        return spec
    out = []
    for entry in spec:
        kept = tuple(a for a in _axes_tuple(entry) if a not in axes)
        out.append(None if not kept else kept[0] if len(kept) == 1 else kept)
    return PartitionSpec(*out)


def merge_minor_dims(spec: PartitionSpec) -> PartitionSpec:
    """The spec of an array whose last two dimensions are merged into one (row-major, `[.., A, B]`
    as `[.., A * B]`) from the spec of the unmerged view: the merged dimension is split by A's
    mesh axes, then B's, which places every element on the devices the unmerged spec does.
    `spec`: one entry for every dimension of the unmerged view."""
    entries = list(spec)
    merged = _axes_tuple(entries[-2]) + _axes_tuple(entries[-1])
    return PartitionSpec(*entries[:-2],
                         None if not merged else merged[0] if len(merged) == 1 else merged)


def mesh_axes_size(mesh: Mesh, axes: MeshAxes) -> int:
    """How many ways `axes` (a spec entry) split a dimension on `mesh`."""
    return math.prod(mesh.shape[a] for a in _axes_tuple(axes))
