"""Paged attention for one layer (its own cache arrays): write this step's K/V into the cache, then attend.

The kernels are mesh-agnostic; this is where the `shard_map` over KV heads lives. Its specs
come from the sharding rules (`attention_specs`, through `sharding.logical_to_spec`, the same
function that places the weights and the KV cache): when the rules split `kv_heads` over some
mesh axes and their size divides the number of KV heads, each device writes and reads only
its own heads (the query heads of a KV group sit on the same device because query head h uses
KV head h // (Hq // Hkv)); otherwise attention runs replicated. On a multi-device mesh the
kernel always runs inside the `shard_map` (Mosaic kernels must), replicated specs included.

Attention sinks (gpt-oss: one learned logit per query head, a layer's weight, so an array
argument and not an `AttentionSpec` setting): `sinks=` [Hq] float32 goes to the op as it is,
and inside the `shard_map` it is split like the query heads (`P(<q's head axes>)`).

Quantized caches (fp8, int8; `pallas_kernels/kv_quant.py`): this step's K and V are quantized
with the layer's scales, and the scales folded into q and the output, here, outside the
`shard_map` (on the whole heads: XLA splits these element-wise ops like the heads). The
scales are an array of the layer (`KVCacheScale`, [2, Hkv] float32: K's row, V's row), an
input of the compiled step like its weights, replicated: the step's program depends on the
cache's dtype, never on the scales' values (runner/kv_scales.py sets them).
"""

from __future__ import annotations

import dataclasses

import jax
from flax import nnx
from jax.sharding import Mesh, PartitionSpec as P

from jaxserve.models import sharding as ax
from jaxserve.models.interface import KV_CACHE_AXES
from jaxserve.pallas_kernels.kv_quant import is_quantized, quantize, scale_output, scale_query
from jaxserve.pallas_kernels.ragged_paged_attention.metadata import AttentionMetadata, num_kv_heads
from jaxserve.pallas_kernels.ragged_paged_attention.ops import (
    ragged_paged_attention,
    write_kv_and_attend,
)

# Logical axes of a step's k and v: [tokens, kv_heads, head_dim].
KV_AXES = (None, ax.KV_HEADS, ax.HEAD_DIM)


@dataclasses.dataclass(frozen=True)
class AttentionSpec:
    """Static attention settings of a model (hashable: part of the compiled function)."""

    sm_scale: float
    sliding_window: int | None = None
    soft_cap: float | None = None
    impl: str = "auto"
    # A quantized cache's scales as static numbers (per tensor: one value, or per KV head;
    # None: 1.0), for a direct caller of the ops; the models give each layer's as an array
    # instead (`KVCacheScale`, `kv_scale=`), which wins. Unused with a float cache.
    k_scale: tuple[float, ...] | None = None
    v_scale: tuple[float, ...] | None = None


class KVCacheScale(nnx.Variable):
    """A layer's quantized-KV-cache scales, [2, n] float32: row 0 the keys', row 1 the values'
    (n: one per KV head; a latent cache's: the latent's and the roped part's columns). A
    variable of the model beside its weights, so an input of the compiled step (not a Param:
    no checkpoint tensor, no product reads it); set by runner/kv_scales.py."""


def layer_kv_scale(layer) -> jax.Array | None:
    """`layer`'s KVCacheScale value, or None (a float cache, or a model without scales: 1.0)."""
    var = getattr(layer, "kv_scale", None)
    return None if var is None else var[...]


def _scales(spec: AttentionSpec, kv_scale: jax.Array | None):
    """(K's, V's) scales: the layer's array's rows, else the spec's numbers."""
    return (spec.k_scale, spec.v_scale) if kv_scale is None else (kv_scale[0], kv_scale[1])


def attention_specs(k_shape, cache_shape, mesh: Mesh, rules: ax.Rules,
                    manual: frozenset[str] = frozenset()) -> tuple[P, P]:
    """(spec of q, k and v [T, H, D], spec of a cache [N, page_size, Hkv * D]) for the
    attention `shard_map`, from the rules, leaving out the mesh axes already `manual` (the
    data-parallel step's "data": there the cache is the rank's own pages). Query heads follow
    the KV heads' split (a query head group stays with its KV head); the cache's rows are split
    as its per-head view's heads (`KV_CACHE_AXES`), so each device holds whole heads."""
    _, hkv, d = k_shape
    heads = ax.without_axes(ax.logical_to_spec(KV_AXES, k_shape, mesh, rules), manual)
    per_head = (cache_shape[0], cache_shape[1], hkv, d)
    cache = ax.without_axes(ax.logical_to_spec(KV_CACHE_AXES, per_head, mesh, rules), manual)
    if cache[0] is not None or cache[3] is not None or heads[2] is not None:
        raise ValueError(f"attention cannot run with the KV cache split as {cache}: pages and "
                         "head_dim must stay whole on each device (see sharding.check_servable)")
    assert cache[2] == heads[1], (cache, heads)
    return heads, ax.merge_minor_dims(cache)


def paged_attention(
    q: jax.Array,  # [T, Hq, D]
    k: jax.Array,  # [T, Hkv, D]
    v: jax.Array,  # [T, Hkv, D]
    k_cache: jax.Array,  # [N, page_size, Hkv * D], this layer's
    v_cache: jax.Array,
    md: AttentionMetadata,
    spec: AttentionSpec,
    mesh: Mesh | None,
    rules: ax.Rules = ax.DEFAULT_RULES,
    sinks: jax.Array | None = None,
    kv_scale: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """q in the dtype attention computes in (the cache's, or the model's for a quantized
    cache); k, v are cast (or quantized) to the cache's; `sinks`: the layer's [Hq]
    attention-sink logits, or None; `kv_scale`: a quantized cache's [2, Hkv] scales
    (`KVCacheScale`), or None for the spec's. Returns (out [T, Hq, D], caches)."""
    hkv = k.shape[1]
    quantized = is_quantized(k_cache.dtype)
    k_scale, v_scale = _scales(spec, kv_scale)
    if quantized:
        q = scale_query(q, k_scale, hkv, q.dtype)
        k, v = quantize(k, k_scale, k_cache.dtype), quantize(v, v_scale, k_cache.dtype)
    else:
        k, v = k.astype(k_cache.dtype), v.astype(k_cache.dtype)
    out, k_cache, v_cache = _attend(q, k, v, k_cache, v_cache, md, spec, mesh, rules, sinks)
    return (scale_output(out, v_scale, hkv) if quantized else out), k_cache, v_cache


def paged_attention_read(
    q: jax.Array,  # [T, Hq, D]
    k_cache: jax.Array,  # [N, page_size, Hkv * D], another layer's, holding this step's K/V
    v_cache: jax.Array,
    md: AttentionMetadata,
    spec: AttentionSpec,
    mesh: Mesh | None,
    rules: ax.Rules = ax.DEFAULT_RULES,
    sinks: jax.Array | None = None,
    kv_scale: jax.Array | None = None,
) -> jax.Array:
    """Attention over a cache this layer does not write: a layer reading the keys and values an
    earlier layer of the step wrote (Gemma 4's KV-sharing layers). `kv_scale` (or the spec's
    numbers) holds the scales of that layer's cache; `sinks`: this layer's [Hq] attention-sink
    logits, or None. Returns out [T, Hq, D]."""
    hkv = num_kv_heads(k_cache, q.shape[2])
    quantized = is_quantized(k_cache.dtype)
    k_scale, v_scale = _scales(spec, kv_scale)
    if quantized:
        q = scale_query(q, k_scale, hkv, q.dtype)

    def local(q, k_cache, v_cache, md, sinks):
        return ragged_paged_attention(q, k_cache, v_cache, md, sm_scale=spec.sm_scale,
                                      sliding_window=spec.sliding_window, soft_cap=spec.soft_cap,
                                      impl=spec.impl, sinks=sinks)

    if mesh is None or mesh.size == 1:
        out = local(q, k_cache, v_cache, md, sinks)
    else:
        mesh, manual = ax.context_mesh(mesh)
        shape = (q.shape[0], hkv, q.shape[2])
        heads, cache = attention_specs(shape, k_cache.shape, mesh, rules, manual)
        out = jax.shard_map(local, mesh=mesh,
                            in_specs=(heads, cache, cache, jax.tree.map(lambda _: P(), md),
                                      _sinks_spec(heads, sinks)),
                            out_specs=heads, check_vma=False)(q, k_cache, v_cache, md, sinks)
    return scale_output(out, v_scale, hkv) if quantized else out


def _sinks_spec(heads: P, sinks) -> P | None:
    """The `shard_map` spec of a layer's sinks [Hq]: split as q's heads ([T, H, D] spec
    `heads`); None (no operand) without sinks."""
    return None if sinks is None else P(heads[1])


def _attend(q, k, v, k_cache, v_cache, md, spec: AttentionSpec, mesh: Mesh | None, rules,
            sinks=None):
    def local(q, k, v, k_cache, v_cache, md, sinks):
        return write_kv_and_attend(
            q, k, v, k_cache, v_cache, md,
            sm_scale=spec.sm_scale,
            sliding_window=spec.sliding_window,
            soft_cap=spec.soft_cap,
            impl=spec.impl,
            sinks=sinks,
        )

    if mesh is None or mesh.size == 1:
        return local(q, k, v, k_cache, v_cache, md, sinks)
    mesh, manual = ax.context_mesh(mesh)  # inside the data-parallel step "data" is manual
    heads, cache = attention_specs(k.shape, k_cache.shape, mesh, rules, manual)
    md_spec = jax.tree.map(lambda _: P(), md)
    return jax.shard_map(
        local,
        mesh=mesh,
        in_specs=(heads, heads, heads, cache, cache, md_spec, _sinks_spec(heads, sinks)),
        out_specs=(heads, cache, cache),
        check_vma=False,
    )(q, k, v, k_cache, v_cache, md, sinks)
