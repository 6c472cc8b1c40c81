"""Paged attention for one layer (its own cache arrays): write this step's K/V into the cache, then attend.

The kernels are mesh-agnostic; this is where the `shard_map` over KV heads lives. When the
model axis of the mesh divides the number of KV heads, each device writes and reads only its
own heads (the query heads of a KV group sit on the same device because query head h uses KV
head h // (Hq // Hkv)). Otherwise attention runs replicated.
"""

from __future__ import annotations

import dataclasses

import jax
from jax.sharding import Mesh, PartitionSpec as P

from jaxserve.pallas_kernels.ragged_paged_attention.metadata import AttentionMetadata
from jaxserve.models.layers.rotary import apply_rotary
from jaxserve.pallas_kernels.ragged_paged_attention.ops import (
    fused_rope_kernel,
    write_kv_and_attend,
)


@dataclasses.dataclass(frozen=True)
class AttentionSpec:
    """Static attention settings of a model (hashable: part of the compiled function)."""

    sm_scale: float
    sliding_window: int | None = None
    soft_cap: float | None = None
    impl: str = "auto"


def paged_attention(
    q: jax.Array,  # [T, Hq, D]
    k: jax.Array,  # [T, Hkv, D]
    v: jax.Array,  # [T, Hkv, D]
    k_cache: jax.Array,  # [N, page_size, Hkv, D], this layer's
    v_cache: jax.Array,
    md: AttentionMetadata,
    spec: AttentionSpec,
    mesh: Mesh | None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    def local(q, k, v, k_cache, v_cache, md):
        return write_kv_and_attend(
            q, k, v, k_cache, v_cache, md,
            sm_scale=spec.sm_scale,
            sliding_window=spec.sliding_window,
            soft_cap=spec.soft_cap,
            impl=spec.impl,
        )

    tp = 1 if mesh is None else mesh.shape.get("model", 1)
    num_kv_heads = k.shape[1]
    if tp == 1 or num_kv_heads % tp:
        return local(q, k, v, k_cache, v_cache, md)
    heads = P(None, "model", None)
    cache = P(None, None, "model", None)
    md_spec = jax.tree.map(lambda _: P(), md)
    return jax.shard_map(
        local,
        mesh=mesh,
        in_specs=(heads, heads, heads, cache, cache, md_spec),
        out_specs=(heads, cache, cache),
        check_vma=False,
    )(q, k, v, k_cache, v_cache, md)


def paged_attention_qkv(
    qkv: jax.Array,  # [T, (Hq + 2 Hkv) * D] float32: a fused q/k/v product
    rope: tuple[jax.Array, jax.Array],  # cos, sin [T, 1, D/2] from `rotary_tables`
    k_cache: jax.Array,
    v_cache: jax.Array,
    md: AttentionMetadata,
    spec: AttentionSpec,
    num_heads: int,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Rotary on q and k, then `paged_attention` (one device): one kernel call where the
    attention kernel takes the whole block (the CPU kernel), else the composed ops. Returns
    (out [T, Hq, D], k_cache, v_cache)."""
    T = qkv.shape[0]
    hkv, d = k_cache.shape[2], k_cache.shape[3]
    x = qkv.reshape(T, num_heads + 2 * hkv, d)
    q, k, v = x[:, :num_heads], x[:, num_heads:num_heads + hkv], x[:, num_heads + hkv:]
    kernel = fused_rope_kernel(spec.impl, q, k_cache)
    if kernel is not None:
        cos, sin = (t.reshape(T, d // 2) for t in rope)
        return kernel(qkv, cos, sin, k_cache, v_cache, md, num_heads=num_heads,
                      sm_scale=spec.sm_scale, sliding_window=spec.sliding_window,
                      soft_cap=spec.soft_cap)
    dt = k_cache.dtype
    return paged_attention(apply_rotary(q, *rope).astype(dt), apply_rotary(k, *rope).astype(dt),
                           v.astype(dt), k_cache, v_cache, md, spec, None)
