"""Multi-head latent attention over one layer's paged latent cache: write this step's latent
rows, then attend (pallas_kernels/mla_paged_attention), inside a `shard_map` on a mesh.

Tensor parallelism: the query heads split as the rules split `q_heads` (each device scores its
heads against every latent row); the latent cache has one "head", so the rules leave it whole
on every device (`KV_CACHE_AXES`' kv_heads cannot split one head), and every device writes the
same rows into its copy. The pages may not be split here (the data-parallel step's "data" is
manual already and left out, as in layers/attention.py).
"""

from __future__ import annotations

import jax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P
from jaxserve.models import sharding as ax
from jaxserve.models.interface import KV_CACHE_AXES
from jaxserve.models.layers.attention import AttentionSpec
from jaxserve.pallas_kernels.mla_paged_attention.ops import write_latent_and_attend
from jaxserve.pallas_kernels.ragged_paged_attention.metadata import AttentionMetadata

# Logical axes of a step's queries [tokens, heads, W].
Q_AXES = (None, ax.Q_HEADS, None)


def paged_mla_attention(
    q: jax.Array,  # [T, H, W]
    latent: jax.Array,  # [T, W]
    latent_cache: jax.Array,  # [N, page_size, W], this layer's
    md: AttentionMetadata,
    spec: AttentionSpec,
    value_dim: int,
    mesh: Mesh | None,
    rules: ax.Rules = ax.DEFAULT_RULES,
) -> tuple[jax.Array, jax.Array]:
    """q in the cache's dtype; `latent` is cast to it. Returns (out [T, H, value_dim],
    latent_cache)."""
    latent = latent.astype(latent_cache.dtype)

    def local(q, latent, latent_cache, md):
        return write_latent_and_attend(q, latent, latent_cache, md, sm_scale=spec.sm_scale,
                                       value_dim=value_dim, impl=spec.impl)

    if mesh is None or mesh.size == 1:
        return local(q, latent, latent_cache, md)
    mesh, manual = ax.context_mesh(mesh)
    heads = ax.without_axes(ax.logical_to_spec(Q_AXES, q.shape, mesh, rules), manual)
    n, page_size, width = latent_cache.shape
    cache = ax.without_axes(
        ax.logical_to_spec(KV_CACHE_AXES, (n, page_size, 1, width), mesh, rules), manual)
    if any(entry is not None for entry in cache):
        raise ValueError(f"multi-head latent attention needs the latent cache whole on each "
                         f"device; the rules split it as {cache}")
    cache = ax.merge_minor_dims(cache)
    return jax.shard_map(
        local, mesh=mesh,
        in_specs=(heads, P(), cache, jax.tree.map(lambda _: P(), md)),
        out_specs=(heads, cache), check_vma=False,
    )(q, latent, latent_cache, md)
