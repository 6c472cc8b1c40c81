"""Multi-head latent attention over one layer's paged latent cache: write this step's latent
rows, then attend (pallas_kernels/mla_paged_attention), inside a `shard_map` on a mesh.

Tensor parallelism: the query heads split as the rules split `q_heads` (each device scores its
heads against every latent row); the latent cache has one "head", so the rules leave it whole
on every device (`KV_CACHE_AXES`' kv_heads cannot split one head), and every device writes the
same rows into its copy. The pages may not be split here (the data-parallel step's "data" is
manual already and left out, as in layers/attention.py).

Quantized caches (fp8, int8; `pallas_kernels/kv_quant.py`): a row's two parts have a scale
each, `spec.k_scale` = (latent's, rope's) (one value: the same for both), from
runner/kv_scales.py: the latent columns are RMS-normed, the roped ones are not, so their
ranges differ. As in layers/attention.py the scales stay out of the kernels, here, outside the
`shard_map`: this step's rows are divided by their column's scale and quantized before the
write, q's latent and rope slices are multiplied by the same column scales (q . (s * row_q) =
(s * q) . row_q, column by column), and the output, a sum of the rows' latent columns, is
multiplied by the latent's scale (the value is the key's own columns: `spec.v_scale` holds
that same number and is not read here).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P
from jaxserve.models import sharding as ax
from jaxserve.models.interface import KV_CACHE_AXES
from jaxserve.models.layers.attention import AttentionSpec
from jaxserve.pallas_kernels.kv_quant import is_quantized, quantize_scaled
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
    """q in the dtype attention computes in (the cache's, or the model's for a quantized
    cache); `latent` is cast (or quantized) to the cache's. Returns (out [T, H, value_dim],
    latent_cache)."""
    quantized = is_quantized(latent_cache.dtype)
    if quantized:
        cols = latent_column_scales(spec.k_scale, latent_cache.shape[2], value_dim)
        q = (q.astype(jnp.float32) * cols).astype(q.dtype)
        latent = quantize_scaled(latent, cols, latent_cache.dtype)
    else:
        latent = latent.astype(latent_cache.dtype)
    out, latent_cache = _attend(q, latent, latent_cache, md, spec, value_dim, mesh, rules)
    if quantized:
        out = (out.astype(jnp.float32) * cols[:value_dim]).astype(out.dtype)
    return out, latent_cache


def latent_column_scales(k_scale: tuple[float, ...] | None, width: int,
                         value_dim: int) -> jax.Array:
    """[width] float32: each cache column's scale, the latent's (`k_scale[0]`) on the first
    `value_dim` columns and the rope part's (`k_scale[-1]`) on the rest; None: ones."""
    if k_scale is None:
        return jnp.ones((width,), jnp.float32)
    s = np.asarray(k_scale, np.float32).reshape(-1)
    if s.size not in (1, 2):
        raise ValueError(f"a latent cache takes one scale or two (latent, rope); got "
                         f"{s.tolist()}")
    return jnp.asarray(np.where(np.arange(width) < value_dim, s[0], s[-1]).astype(np.float32))


def _attend(q, latent, latent_cache, md, spec: AttentionSpec, value_dim: int, mesh, rules):
    """Write the rows and attend (the op), inside the `shard_map` on a multi-device mesh."""
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
