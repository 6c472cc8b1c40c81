"""Multi-head latent attention over one layer's paged latent cache: write this step's latent
rows, then attend (pallas_kernels/mla_paged_attention), inside a `shard_map` on a mesh.

Tensor parallelism: the query heads split as the rules split `q_heads` (each device scores its
heads against every latent row); the latent cache has one "head", so the rules leave it whole
on every device (`KV_CACHE_AXES`' kv_heads cannot split one head), and every device writes the
same rows into its copy. The pages may not be split here (the data-parallel step's "data" is
manual already and left out, as in layers/attention.py).

Quantized caches (fp8, int8; `pallas_kernels/kv_quant.py`): a row's two parts have a scale
each, the K row of the layer's `KVCacheScale` array = (latent's, rope's) (an input of the
compiled step, set by runner/kv_scales.py; a direct caller may give `spec.k_scale` numbers
instead, one value: the same for both): the latent columns are RMS-normed, the roped ones are
not, so their ranges differ. As in layers/attention.py the scales stay out of the kernels,
here, outside the `shard_map`: this step's rows are divided by their column's scale and
quantized before the write, q's latent and rope slices are multiplied by the same column
scales (q . (s * row_q) = (s * q) . row_q, column by column), and the output, a sum of the
rows' latent columns, is multiplied by the latent's scale (the value is the key's own
columns: the V row holds that same number and is not read here).

Absorbed or split (`mla_attention`, the one place that chooses; docs/DESIGN.md §5
"Multi-head latent attention"). Decode is absorbed: each head's query is mapped into the
latent space (W_UK) and scores the latent rows, its output mapped back (W_UV). A step whose
requests have long chunks is split: the queries read the cached context absorbed
(`mla_paged_attention(..., context_only=True)`, with its log-sum-exp), the step's own rows
expanded per head (`expanded.expanded_step_attention`: k = [W_UK c, k_rope], v = W_UV c), and
the two parts are merged by log-sum-exp. Which one a step takes is a function of its static
shape (`prefill_form`), so each compiled bucket has one form and serving adds no compile.
The split's own rows are this step's latent rows as computed, not as stored: with a quantized
cache only the cached context is read from one-byte pages.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P
from jaxserve.models import sharding as ax
from jaxserve.models.interface import KV_CACHE_AXES
from jaxserve.models.layers.attention import AttentionSpec
from jaxserve.models.layers.linear import dense
from jaxserve.pallas_kernels.kv_quant import attention_dtype, is_quantized, quantize_scaled
from jaxserve.pallas_kernels.mla_paged_attention.expanded import (
    expanded_pairs,
    expanded_step_attention,
    merge_by_lse,
)
from jaxserve.pallas_kernels.mla_paged_attention.ops import write_latent_and_attend
from jaxserve.pallas_kernels.ragged_paged_attention.metadata import AttentionMetadata

# Logical axes of a step's queries [tokens, heads, W].
Q_AXES = (None, ax.Q_HEADS, None)
# The per-head up-projections: absorbed (each head's query into the latent space, its latent
# output back to its value; head-major: XLA:CPU has no bfloat16 batched dot whose batch dim is
# not the leading one) and expanded (the step's latent rows to each head's key part and value).
ABSORB_SPECS = {"w_uk": "htd,hdc->htc", "w_uv": "htc,hcv->htv"}
EXPAND_SPECS = {"w_uk": "tc,hdc->thd", "w_uv": "tc,hcv->thv"}

# How prefill attends: "auto" (`prefill_form`'s cost model), "absorbed" (every step) or
# "split" (every step: the tests' and benchmarks' switch), from this environment variable.
PREFILL_FORM_ENV = "JAXSERVE_MLA_PREFILL"
PREFILL_FORMS = ("auto", "absorbed", "split")


def own_rows_macs(num_tokens: int, num_reqs: int, *, latent: int, nope: int, rope: int,
                  value: int) -> dict[str, int]:
    """Predicted multiply-adds per head that the two forms spend on a step's own rows, for a
    (T, R) step shape whose T tokens are R equal chunks of n = T / R (the rest, the queries'
    absorption, the output's W_UV and the cached context, is the same in both):

    - absorbed: every causal (query, own row) pair scores C + Dr columns and sums C value
      columns: (2C + Dr) * R * n (n + 1) / 2 = (2C + Dr) * T (n + 1) / 2;
    - split: each row expanded, C (Dn + Dv) (its key part and value), plus Dn + Dr + Dv per
      pair over the pairs `expanded_step_attention` scores (its block triangle of the flat
      tokens, which includes other requests' pairs, masked).

    Per pair the split saves (2C + Dr) - (Dn + Dr + Dv) (768 for V3: C 512, Dn Dr Dv 128 64
    128); per row it pays C (Dn + Dv) (131,072). For one request of n tokens the pairs are
    n (n + 1) / 2, so it pays off from n + 1 > 2 C (Dn + Dv) / (2C - Dn - Dv) (V3: 341 tokens,
    not the 170 of counting n * n pairs), later still with the block triangle's extra pairs.
    """
    T, R = num_tokens, max(1, num_reqs)
    n = T / R
    absorbed = (2 * latent + rope) * T * (n + 1) / 2
    split = latent * (nope + value) * T + (nope + rope + value) * expanded_pairs(T)
    return {"absorbed": int(absorbed), "split": int(split)}


def prefill_form(num_tokens: int, num_reqs: int, *, latent: int, nope: int, rope: int,
                 value: int) -> str:
    """"absorbed" or "split" for a step of static shape (T tokens, R request rows):
    `PREFILL_FORM_ENV`'s form when it names one, else the cheaper by `own_rows_macs` (decode
    shapes, T = R, are always absorbed: each row would be expanded for one pair)."""
    form = os.environ.get(PREFILL_FORM_ENV, "auto") or "auto"
    if form not in PREFILL_FORMS:
        raise ValueError(f"{PREFILL_FORM_ENV} must be one of {PREFILL_FORMS}; got {form!r}")
    if form != "auto":
        return form
    macs = own_rows_macs(num_tokens, num_reqs, latent=latent, nope=nope, rope=rope, value=value)
    return "split" if macs["split"] < macs["absorbed"] else "absorbed"


def mla_attention(
    q_nope: jax.Array,  # [T, H, Dn]
    q_rope: jax.Array,  # [T, H, Dr], roped
    latent: jax.Array,  # [T, C], normed
    k_rope: jax.Array,  # [T, Dr], roped
    latent_cache: jax.Array,  # [N, page_size, C + Dr], this layer's
    md: AttentionMetadata,
    spec: AttentionSpec,
    w_uk: jax.Array,  # [H, Dn, C]
    w_uv: jax.Array,  # [H, C, Dv]
    mesh: Mesh | None,
    rules: ax.Rules = ax.DEFAULT_RULES,
    kv_scale: jax.Array | None = None,  # a quantized cache's [2, 2] (`KVCacheScale`), or None
) -> tuple[jax.Array, jax.Array]:
    """One layer's multi-head latent attention: write this step's latent rows [c, k_rope] and
    attend, absorbed or split (`prefill_form` of the step's shape) -> (each head's value-space
    output [T, H, Dv] float32, latent_cache)."""
    C, Dn, Dr, Dv = latent.shape[-1], q_nope.shape[-1], q_rope.shape[-1], w_uv.shape[-1]
    q_latent = _per_head(ABSORB_SPECS["w_uk"], q_nope, w_uk)  # [T, H, C]
    dtype = attention_dtype(latent_cache.dtype, q_latent.dtype)
    q_rows = jnp.concatenate([q_latent, q_rope.astype(q_latent.dtype)], axis=-1).astype(dtype)
    rows = jnp.concatenate([latent, k_rope.astype(latent.dtype)], axis=-1)
    form = prefill_form(md.num_tokens, md.max_num_seqs, latent=C, nope=Dn, rope=Dr, value=Dv)
    if form == "absorbed":
        out, latent_cache = paged_mla_attention(q_rows, rows, latent_cache, md, spec, C, mesh,
                                                rules, kv_scale=kv_scale)
        return _per_head(ABSORB_SPECS["w_uv"], out, w_uv), latent_cache
    with jax.named_scope("mla_split_prefill"):
        ctx, ctx_lse, latent_cache = paged_mla_attention(
            q_rows, rows, latent_cache, md, spec, C, mesh, rules, context_only=True,
            kv_scale=kv_scale)
        ctx = _per_head(ABSORB_SPECS["w_uv"], ctx, w_uv)  # [T, H, Dv]
        k_nope = dense(EXPAND_SPECS["w_uk"], latent, w_uk).astype(dtype)  # [T, H, Dn]
        v = dense(EXPAND_SPECS["w_uv"], latent, w_uv).astype(dtype)  # [T, H, Dv]
        own, own_lse = expanded_step_attention(q_nope.astype(dtype), q_rope.astype(dtype),
                                               k_nope, k_rope.astype(dtype), v, md,
                                               sm_scale=spec.sm_scale)
        return merge_by_lse(ctx, ctx_lse, own, own_lse), latent_cache


def _per_head(spec: str, x: jax.Array, w: jax.Array) -> jax.Array:
    """x [T, H, a] through each head's own matrix w [H, a, b] -> [T, H, b] float32."""
    return jnp.swapaxes(dense(spec, jnp.swapaxes(x, 0, 1), w), 0, 1)


def paged_mla_attention(
    q: jax.Array,  # [T, H, W]
    latent: jax.Array,  # [T, W]
    latent_cache: jax.Array,  # [N, page_size, W], this layer's
    md: AttentionMetadata,
    spec: AttentionSpec,
    value_dim: int,
    mesh: Mesh | None,
    rules: ax.Rules = ax.DEFAULT_RULES,
    *,
    context_only: bool = False,
    kv_scale: jax.Array | None = None,
) -> tuple[jax.Array, ...]:
    """q in the dtype attention computes in (the cache's, or the model's for a quantized
    cache); `latent` is cast (or quantized) to the cache's with the K row of `kv_scale` (the
    layer's [2, 2] `KVCacheScale`), or the spec's `k_scale` when None. Returns (out [T, H,
    value_dim], latent_cache); with `context_only` (out over the cached context only, its
    log-sum-exp [T, H] float32, latent_cache) (`ops.mla_paged_attention`)."""
    quantized = is_quantized(latent_cache.dtype)
    if quantized:
        k_scale = spec.k_scale if kv_scale is None else kv_scale[0]
        cols = latent_column_scales(k_scale, latent_cache.shape[2], value_dim)
        q = (q.astype(jnp.float32) * cols).astype(q.dtype)
        latent = quantize_scaled(latent, cols, latent_cache.dtype)
    else:
        latent = latent.astype(latent_cache.dtype)
    out, *lse, latent_cache = _attend(q, latent, latent_cache, md, spec, value_dim, mesh, rules,
                                      context_only)
    if quantized:  # the scores were exact (q's columns scaled): so is the log-sum-exp
        out = (out.astype(jnp.float32) * cols[:value_dim]).astype(out.dtype)
    return (out, *lse, latent_cache)


def latent_column_scales(k_scale: tuple[float, ...] | jax.Array | None, width: int,
                         value_dim: int) -> jax.Array:
    """[width] float32: each cache column's scale, the latent's (`k_scale[0]`) on the first
    `value_dim` columns and the rope part's (`k_scale[-1]`) on the rest; None: ones. Static
    numbers, or an array (the layer's `KVCacheScale` K row, a step input)."""
    if k_scale is None:
        return jnp.ones((width,), jnp.float32)
    if isinstance(k_scale, jax.Array):
        s = k_scale.astype(jnp.float32).reshape(-1)
        return jnp.where(jnp.arange(width) < value_dim, s[0], s[-1])
    s = np.asarray(k_scale, np.float32).reshape(-1)
    if s.size not in (1, 2):
        raise ValueError(f"a latent cache takes one scale or two (latent, rope); got "
                         f"{s.tolist()}")
    return jnp.asarray(np.where(np.arange(width) < value_dim, s[0], s[-1]).astype(np.float32))


def _attend(q, latent, latent_cache, md, spec: AttentionSpec, value_dim: int, mesh, rules,
            context_only: bool = False):
    """Write the rows and attend (the op), inside the `shard_map` on a multi-device mesh:
    (out, latent_cache), or (out, lse, latent_cache) with `context_only`."""
    def local(q, latent, latent_cache, md):
        return write_latent_and_attend(q, latent, latent_cache, md, sm_scale=spec.sm_scale,
                                       value_dim=value_dim, impl=spec.impl,
                                       context_only=context_only)

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
        out_specs=(heads, P(*heads[:2]), cache) if context_only else (heads, cache),
        check_vma=False,
    )(q, latent, latent_cache, md)
