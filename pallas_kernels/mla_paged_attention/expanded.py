"""Multi-head latent attention in its expanded form over a step's own rows, and the
log-sum-exp merge that joins it to the absorbed form's attention over the cached context.

The split prefill (models/layers/mla.py chooses it per step shape): each head's keys of this
step's tokens are built from their latent rows, `k_h = [W_UK_h c, rope(k_rope)]` (Dn + Dr
wide), and its values `v_h = W_UV_h c` (Dv wide); every query attends causally to the tokens of
its own request in this step, as a standard multi-head attention (`expanded_step_attention`).
The cached context, read absorbed by `ops.mla_paged_attention(..., context_only=True,
return_lse=True)`, and this part together are the whole attention: with each part's
normalised output o_i and log-sum-exp L_i of its scaled scores,

    o = (exp(L_1 - L) o_1 + exp(L_2 - L) o_2),   L = log(exp(L_1) + exp(L_2)),

exactly (`merge_by_lse`); a part that saw no key has L_i = -inf and weight zero.

Shapes are static: the step's T tokens are laid out flat and each request's tokens are
consecutive (`metadata.py`), so every key a query sees precedes it in the flat order. The
queries go in blocks of `EXPANDED_QUERY_BLOCK`, and block b scores the keys of flat tokens
[0, (b + 1) * block): a block lower triangle of the [T, T] pairs, T (T + block) / 2 pairs per
head instead of T * T, masked to the same request and causal order (`expanded_pairs`). Pairs of
different requests in one block triangle are computed and masked, which is why the layer only
takes this form for steps whose requests have long chunks on average.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxserve.pallas_kernels.ragged_paged_attention.metadata import AttentionMetadata

_F32 = jnp.float32
_I32 = jnp.int32

# Queries per block of the block lower triangle (a multiple of 8 and of 128 lanes on a TPU).
EXPANDED_QUERY_BLOCK = 128


def expanded_pairs(num_tokens: int, block: int = EXPANDED_QUERY_BLOCK) -> int:
    """The (query, key) pairs per head that `expanded_step_attention` scores for T tokens: the
    blocks' triangle, sum over query blocks of (block's rows) x (keys up to its end)."""
    total, start = 0, 0
    while start < num_tokens:
        end = min(start + block, num_tokens)
        total += (end - start) * end
        start = end
    return total


def _token_requests(md: AttentionMetadata) -> tuple[jax.Array, jax.Array]:
    """([T] each token's request, [T] whether it is live): a compare-all count (searchsorted
    lowers to a loop)."""
    T, R = md.num_tokens, md.max_num_seqs
    qsl = md.query_start_loc.astype(_I32)
    t = jnp.arange(T, dtype=_I32)
    req = jnp.minimum(jnp.sum(qsl[None, 1:] <= t[:, None], axis=1, dtype=_I32), R - 1)
    return req, t < qsl[md.num_seqs.astype(_I32)]


def expanded_step_attention(
    q_nope: jax.Array,  # [T, H, Dn]
    q_rope: jax.Array,  # [T, H, Dr], roped
    k_nope: jax.Array,  # [T, H, Dn]: W_UK_h c per token and head
    k_rope: jax.Array,  # [T, Dr], roped, shared by the heads
    v: jax.Array,  # [T, H, Dv]: W_UV_h c
    md: AttentionMetadata,
    *,
    sm_scale: float,
    block: int = EXPANDED_QUERY_BLOCK,
) -> tuple[jax.Array, jax.Array]:
    """Causal attention of each query over its own request's tokens of this step ->
    (out [T, H, Dv] float32, normalised; lse [T, H] float32, -inf for padding tokens).
    Products in the inputs' dtype with float32 accumulation; softmax in float32."""
    T = q_nope.shape[0]
    req, live = _token_requests(md)
    t = jnp.arange(T, dtype=_I32)
    outs, lses = [], []
    for start in range(0, T, block):
        end = min(start + block, T)
        rows = slice(start, end)
        s = (jnp.einsum("qhd,khd->hqk", q_nope[rows], k_nope[:end], preferred_element_type=_F32)
             + jnp.einsum("qhd,kd->hqk", q_rope[rows], k_rope[:end],
                          preferred_element_type=_F32)) * _F32(sm_scale)
        seen = ((req[rows, None] == req[None, :end]) & (t[None, :end] <= t[rows, None])
                & live[rows, None] & live[None, :end])
        s = jnp.where(seen[None], s, -jnp.inf)
        m = s.max(axis=-1)
        base = jnp.where(m == -jnp.inf, 0.0, m)
        p = jnp.exp(s - base[..., None])
        denom = p.sum(axis=-1)
        o = jnp.einsum("hqk,khv->qhv", p.astype(v.dtype), v[:end], preferred_element_type=_F32)
        denom_safe = jnp.where(denom > 0, denom, 1.0)
        outs.append(o / denom_safe.T[..., None])
        lses.append(jnp.where(denom > 0, base + jnp.log(denom_safe), -jnp.inf).T)
    return jnp.concatenate(outs, axis=0), jnp.concatenate(lses, axis=0)


def merge_by_lse(out_a: jax.Array, lse_a: jax.Array, out_b: jax.Array, lse_b: jax.Array
                 ) -> jax.Array:
    """Two normalised attention parts over disjoint keys, out [T, H, D] with their
    log-sum-exps [T, H], as one: [T, H, D] float32 (zeros where neither saw a key)."""
    m = jnp.maximum(lse_a, lse_b)
    base = jnp.where(m == -jnp.inf, 0.0, m)
    wa, wb = jnp.exp(lse_a - base), jnp.exp(lse_b - base)
    den = wa + wb
    den = jnp.where(den > 0, den, 1.0)
    return ((wa / den)[..., None] * out_a.astype(_F32) + (wb / den)[..., None]
            * out_b.astype(_F32))


__all__ = ["EXPANDED_QUERY_BLOCK", "expanded_pairs", "expanded_step_attention", "merge_by_lse"]
