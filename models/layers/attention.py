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
from jaxserve.pallas_kernels.ragged_paged_attention.ops import write_kv_and_attend


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

