"""Query-block planning shared by the TPU and GPU kernels: how a ragged batch becomes a grid.

Both kernels work on *query blocks*: up to `Bq` consecutive query tokens of ONE request. A
request with `n` queries this step owns `cdiv(n, Bq)` blocks; padding requests own none. With
`T` padded tokens and `R` padded requests there are never more than `NB = cdiv(T, Bq) + R`
blocks (every request adds at most one partial block), so `NB` is the static grid size; blocks
past the live ones are empty (their kernel program reads nothing and writes zeros).

Block b is described by two int32 scalars, `blk_req[b]` (its request; 0 for an empty block)
and `blk_idx[b]` (its index inside the request; -1 for an empty block). The kernels read those
plus `query_start_loc`, `kv_lens` and the block table, and derive everything else:
`t0 = qsl[r] + j * Bq` (first token), `nq = min(Bq, qsl[r+1] - t0)` (live rows),
`pos0 = kv_lens[r] - (qsl[r+1] - t0)` (sequence position of token t0).

Queries are handed to the kernels in block layout `[NB, Hkv, Bq * Gp, D]`: for KV head h the
block's rows are (token i, group head g) pairs at row `i * Gp + g`, so one matmul against the
KV head's keys serves all the query heads that share it (GQA without repeating K/V). `Gp >= G`
is the group size padded for the kernel (the GPU kernel needs a power of two; padded heads are
zero queries whose outputs are dropped). The layout costs one gather of q and one scatter of the
output, O(T * Hq * D) each, negligible against the K/V traffic; to bound the padding rows
(`R * Bq` at most) the default `Bq` follows the bucket's token/request ratio (`default_block_q`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxserve.pallas_kernels.ragged_paged_attention.metadata import AttentionMetadata

_F32 = jnp.float32
_I32 = jnp.int32


def cdiv(a, b):
    return (a + b - 1) // b


def pow2_floor(x: int) -> int:
    return 1 << (max(int(x), 1).bit_length() - 1)


def pow2_ceil(x: int) -> int:
    return 1 << (max(int(x), 1) - 1).bit_length()


def default_block_q(num_tokens: int, num_reqs: int, *, max_rows: int, group: int,
                    min_rows: int = 1) -> int:
    """Queries per block for a [T tokens, R requests] bucket.

    Decode-shaped buckets (T ~ R) get 1 query per block (no wasted rows; decode is bound by the
    K/V reads anyway); prefill-shaped ones (T >> R) get up to `max_rows // group` queries so the
    matmuls are MXU / tensor-core sized and cached context is read once per block. The padding
    rows of the block layout stay below ~T: R * Bq <= max(T, R * min_rows / group).
    """
    bq = pow2_floor(max(num_tokens // max(num_reqs, 1), 1))
    bq = min(bq, pow2_floor(max(max_rows // group, 1)))
    while bq * group < min_rows:
        bq *= 2
    return max(bq, 1)


def plan_blocks(md: AttentionMetadata, block_q: int,
                num_blocks: int | None = None) -> tuple[jax.Array, jax.Array, int]:
    """(blk_req [NB], blk_idx [NB], NB): the request and in-request index of every block.
    `num_blocks`: a smaller static NB that the caller knows to be enough (default: the bound
    `cdiv(T, Bq) + R`)."""
    T, R = md.num_tokens, md.max_num_seqs
    nb = num_blocks or cdiv(T, block_q) + R
    qsl = md.query_start_loc.astype(_I32)
    live = jnp.arange(R, dtype=_I32) < md.num_seqs.astype(_I32)
    q_len = jnp.where(live, qsl[1:] - qsl[:-1], 0)
    n_blocks = cdiv(q_len, block_q)
    ends = jnp.cumsum(n_blocks)  # blocks of requests 0..r
    b = jnp.arange(nb, dtype=_I32)
    req = jnp.sum(ends[None, :] <= b[:, None], axis=1, dtype=_I32)  # [NB]; R when empty
    valid = req < R
    req_c = jnp.minimum(req, R - 1)
    idx = b - (ends[req_c] - n_blocks[req_c])
    return jnp.where(valid, req_c, 0), jnp.where(valid, idx, -1), nb


def block_tokens(md: AttentionMetadata, blk_req, blk_idx, block_q: int) -> jax.Array:
    """[NB, Bq] int32: the flat token of each block row, T (out of range) for empty rows."""
    T = md.num_tokens
    qsl = md.query_start_loc.astype(_I32)
    t0 = qsl[blk_req] + jnp.maximum(blk_idx, 0) * block_q
    q_end = qsl[blk_req + 1]
    t = t0[:, None] + jnp.arange(block_q, dtype=_I32)[None, :]
    ok = (blk_idx[:, None] >= 0) & (t < q_end[:, None])
    return jnp.where(ok, t, T)


def gather_queries(q: jax.Array, tokens: jax.Array, num_kv_heads: int, group_pad: int):
    """q [T, Hq, D] -> [NB, Hkv, Bq * Gp, D] (zeros for empty rows and padded heads)."""
    T, Hq, D = q.shape
    G = Hq // num_kv_heads
    NB, Bq = tokens.shape
    qb = q.at[tokens].get(mode="fill", fill_value=0)  # [NB, Bq, Hq, D]
    qb = qb.reshape(NB, Bq, num_kv_heads, G, D)
    if group_pad > G:
        qb = jnp.pad(qb, ((0, 0), (0, 0), (0, 0), (0, group_pad - G), (0, 0)))
    return qb.transpose(0, 2, 1, 3, 4).reshape(NB, num_kv_heads, Bq * group_pad, D)


def row_sinks(sinks: jax.Array, num_kv_heads: int, group_pad: int, block_q: int) -> jax.Array:
    """[Hq] attention-sink logits -> [Hkv, Bq * Gp], the sink of every row of a KV head's
    block (row i is group head i % Gp); padded heads get -inf (no sink: their rows are
    dropped)."""
    G = sinks.shape[0] // num_kv_heads
    rows = sinks.astype(_F32).reshape(num_kv_heads, 1, G)
    if group_pad > G:
        rows = jnp.pad(rows, ((0, 0), (0, 0), (0, group_pad - G)), constant_values=-jnp.inf)
    return jnp.tile(rows, (1, block_q, 1)).reshape(num_kv_heads, block_q * group_pad)


def merge_splits(o_part: jax.Array, lse: jax.Array, sinks: jax.Array | None = None) -> jax.Array:
    """Merge the KV splits of a split-K kernel by log-sum-exp: o_part [S, NB, Hkv, M, D]
    (each split's normalised output), lse [S, NB, Hkv, M] (-inf for an empty split) ->
    [NB, Hkv, M, D]. `sinks`, [Hkv, M] (`row_sinks`): attention sinks, each row's one more
    split of log-sum-exp `sink` and output zero (it joins the denominator only)."""
    if o_part.shape[0] == 1 and sinks is None:
        return o_part[0]
    mx = lse.max(axis=0)
    if sinks is not None:
        mx = jnp.maximum(mx, sinks)
    base = jnp.where(mx == -jnp.inf, 0.0, mx)
    w = jnp.exp(lse - base[None])  # 0 for empty splits
    den = w.sum(axis=0)
    if sinks is not None:
        den = den + jnp.exp(sinks - base)
    return (w[..., None] * o_part).sum(axis=0) / jnp.where(den > 0, den, 1.0)[..., None]


def merge_split_lse(lse: jax.Array) -> jax.Array:
    """The log-sum-exp of the splits together: lse [S, NB, Hkv, M] -> [NB, Hkv, M] (-inf
    where every split was empty)."""
    mx = lse.max(axis=0)
    base = jnp.where(mx == -jnp.inf, 0.0, mx)
    den = jnp.exp(lse - base[None]).sum(axis=0)
    return jnp.where(den > 0, base + jnp.log(jnp.where(den > 0, den, 1.0)), -jnp.inf)


def scatter_outputs(o_blk: jax.Array, tokens: jax.Array, num_tokens: int, num_q_heads: int,
                    out: jax.Array | None = None):
    """[NB, Hkv, Bq * Gp, D] -> [T, Hq, D]; tokens nobody writes (padding) are zeros, or
    `out`'s rows when given."""
    NB, Hkv, rows, D = o_blk.shape
    Bq = tokens.shape[1]
    Gp = rows // Bq
    G = num_q_heads // Hkv
    o = o_blk.reshape(NB, Hkv, Bq, Gp, D)[:, :, :, :G].transpose(0, 2, 1, 3, 4)
    o = o.reshape(NB * Bq, num_q_heads, D)
    if out is None:
        out = jnp.zeros((num_tokens, num_q_heads, D), o_blk.dtype)
    # Every live token sits in exactly one block row; empty rows (index T) are dropped.
    return out.at[tokens.reshape(-1)].set(o, mode="drop")
