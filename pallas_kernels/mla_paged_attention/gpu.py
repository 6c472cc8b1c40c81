"""Pallas GPU (Triton lowering) kernel of paged multi-head latent attention, absorbed form.

The GQA kernel (`ragged_paged_attention/gpu.py`) computes MLA when handed the latent array as
both caches, but it reads each page twice (as keys, then as values), sums the values' roped
columns for nothing, and needs a power-of-two row width (DeepSeek V3's 576 is not). Here each
chunk of rows is gathered once, as two power-of-two column slices of the same rows: the latent
part `[K, C]` (the value, and the key's first C columns) and the roped part `[K, Dr]`; the
scores are `q_lat . lat + q_rope . rope`, the output `p . lat` ([M, C]).

Grid `(NB, head blocks, S)`: query blocks as in `ragged_paged_attention/blocks.py` (the same
planning, query gather and output scatter), the heads in blocks of `Hb` (every head reads the
same rows, so a program's rows are (query, head) pairs of one head block: `blocks`' layout with
the head blocks in the KV-head slot), and S splits of the keys merged by log-sum-exp. Block
shapes are powers of two: C, Dr >= 16 and page_size powers of two.

Numerics as the GQA kernel's: float32 accumulation (IEEE for float32 inputs), softmax in
float32, p cast to the cache's dtype for the value product. Tested in interpret mode against a
float64 oracle (tests/pallas_kernels/test_mla_attention.py); not yet run on a GPU.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu
from jaxserve.pallas_kernels.kv_quant import upcast
from jaxserve.pallas_kernels.ragged_paged_attention import blocks
from jaxserve.pallas_kernels.ragged_paged_attention.metadata import AttentionMetadata

_F32 = jnp.float32
_I32 = jnp.int32
_MIN_DOT = 16  # tl.dot needs every operand dim >= 16
MAX_HEADS_PER_BLOCK = 16  # bounds a program's [M, C] float32 accumulator


def _kernel(blk_req_ref, blk_idx_ref, qsl_ref, kvl_ref, bt_ref,
            ql_ref,  # [M, C] block: the latent-space queries
            qr_ref,  # [M, Dr] block: the roped query parts
            c_ref,  # [N * page_size, C + Dr]: the layer's latent rows
            o_ref,  # [M, C] block (float32, normalised)
            lse_ref,  # [M] block
            *, block_q, heads, page_size, chunk_pages, num_splits, sm_scale, context_only):
    b, s = pl.program_id(0), pl.program_id(2)
    M, C = ql_ref.shape
    Dr = qr_ref.shape[1]
    K = chunk_pages * page_size
    P = bt_ref.shape[1]
    ps = page_size

    r = blk_req_ref[b]
    j = blk_idx_ref[b]
    q_end = qsl_ref[r + 1]
    t0 = qsl_ref[r] + jnp.maximum(j, 0) * block_q
    nq = jnp.where(j >= 0, jnp.minimum(block_q, q_end - t0), 0)
    pos0 = kvl_ref[r] - (q_end - t0)
    # the keys the block reads end after its last query, or before the request's first
    # (`context_only`: its cached context)
    hi = kvl_ref[r] - (q_end - qsl_ref[r]) if context_only else pos0 + nq
    n_chunks = jnp.where(nq > 0, blocks.cdiv(blocks.cdiv(hi, ps), chunk_pages), 0)
    per_split = blocks.cdiv(n_chunks, num_splits)
    c_lo = s * per_split
    c_hi = jnp.minimum(c_lo + per_split, n_chunks)

    row_q = lax.iota(_I32, M) // heads  # power of two: a shift
    row_ok = row_q < nq
    row_pos = pos0 + row_q
    kk = lax.iota(_I32, K)
    ql, qr = ql_ref[...], qr_ref[...]
    precision = lax.Precision.HIGHEST if ql.dtype == jnp.float32 else None
    nt = (((1,), (1,)), ((), ()))

    def body(c, carry):
        m, l, acc = carry
        kpos = c * K + kk
        page = bt_ref[r, jnp.minimum(kpos // ps, P - 1)]
        tok = page * ps + kpos % ps
        lat = upcast(c_ref[tok, pl.ds(0, C)], ql.dtype)  # [K, C]: keys' first part and values
        rope = upcast(c_ref[tok, pl.ds(C, Dr)], ql.dtype)  # [K, Dr]
        lat = jnp.where((kpos < hi)[:, None], lat, jnp.zeros_like(lat))  # never 0 * garbage
        sc = (lax.dot_general(ql, lat, nt, precision=precision, preferred_element_type=_F32)
              + lax.dot_general(qr, rope, nt, precision=precision, preferred_element_type=_F32))
        seen = (kpos[None, :] <= row_pos[:, None]) & row_ok[:, None]
        if context_only:
            seen &= (kpos < hi)[None, :]
        sc = jnp.where(seen, sc * sm_scale, -jnp.inf)
        m_new = jnp.maximum(m, sc.max(axis=1))
        base = jnp.where(m_new == -jnp.inf, 0.0, m_new)
        p = jnp.exp(sc - base[:, None])
        alpha = jnp.exp(m - base)
        pv = lax.dot_general(p.astype(lat.dtype), lat, (((1,), (0,)), ((), ())),
                             precision=precision, preferred_element_type=_F32)
        return m_new, alpha * l + p.sum(axis=1), alpha[:, None] * acc + pv

    init = (jnp.full((M,), -jnp.inf, _F32), jnp.zeros((M,), _F32), jnp.zeros((M, C), _F32))
    m, l, acc = lax.fori_loop(c_lo, c_hi, body, init)
    l_safe = jnp.where(l > 0, l, 1.0)
    o_ref[...] = acc / l_safe[:, None]
    lse_ref[...] = jnp.where(l > 0, m + jnp.log(l_safe), -jnp.inf)


def _pow2(x: int) -> bool:
    return x >= _MIN_DOT and not x & (x - 1)


def supports(q: jax.Array, latent_cache: jax.Array, value_dim: int) -> None:
    """Raise ValueError when the kernel cannot take these shapes."""
    C, Dr, ps = value_dim, latent_cache.shape[2] - value_dim, latent_cache.shape[1]
    if not (_pow2(C) and _pow2(Dr)):
        raise ValueError(f"the MLA gpu kernel needs the latent ({C}) and roped ({Dr}) widths "
                         "to be powers of two >= 16")
    if ps & (ps - 1):
        raise ValueError(f"the MLA gpu kernel needs a power-of-two page_size, got {ps}")


def heads_per_block(num_heads: int) -> int:
    """The largest power of two <= MAX_HEADS_PER_BLOCK dividing the head count."""
    hb = MAX_HEADS_PER_BLOCK
    while num_heads % hb:
        hb //= 2
    return hb


def mla_paged_attention_gpu(
    q: jax.Array,
    latent_cache: jax.Array,
    md: AttentionMetadata,
    *,
    sm_scale: float,
    value_dim: int,
    chunk_pages: int | None = None,
    kv_splits: int | None = None,
    num_warps: int = 4,
    num_stages: int = 2,
    interpret: bool = False,
    context_only: bool = False,
    return_lse: bool = False,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """The op (`ops.mla_paged_attention`) as a Pallas Triton kernel -> [T, H, value_dim]
    (and with `return_lse` each row's log-sum-exp, [T, H] float32: the splits' merged;
    `context_only`: the cached context only, as the op's).
    Tuning: `chunk_pages` (keys per chunk = chunk_pages * page_size, a power of two >= 16),
    `kv_splits` (default 4 for decode-shaped buckets, 1 when T > 4 R)."""
    T, H, W = q.shape
    N, ps, _ = latent_cache.shape
    R = md.block_tables.shape[0]
    supports(q, latent_cache, value_dim)
    C = value_dim
    Hb = heads_per_block(H)
    chunk = chunk_pages or max(1, max(32, _MIN_DOT) // ps)
    if (chunk * ps) & (chunk * ps - 1) or chunk * ps < _MIN_DOT:
        raise ValueError(f"the MLA gpu kernel needs chunk_pages * page_size a power of two "
                         f">= 16; got {chunk} * {ps}")
    Bq = blocks.default_block_q(T, R, max_rows=64, group=Hb, min_rows=_MIN_DOT)
    S = kv_splits or (1 if T > 4 * R else 4)
    M = Bq * Hb
    blk_req, blk_idx, NB = blocks.plan_blocks(md, Bq)
    tokens = blocks.block_tokens(md, blk_req, blk_idx, Bq)
    q_blk = blocks.gather_queries(q, tokens, H // Hb, Hb)  # [NB, H / Hb, M, W]
    kernel = functools.partial(_kernel, block_q=Bq, heads=Hb, page_size=ps, chunk_pages=chunk,
                               num_splits=S, sm_scale=float(sm_scale),
                               context_only=context_only)
    whole = pl.no_block_spec
    o_part, lse = pl.pallas_call(
        kernel,
        grid=(NB, H // Hb, S),
        in_specs=[
            whole, whole, whole, whole, whole,
            pl.BlockSpec((None, None, M, C), lambda b, g, s: (b, g, 0, 0)),
            pl.BlockSpec((None, None, M, W - C), lambda b, g, s: (b, g, 0, 0)),
            whole,
        ],
        out_specs=[
            pl.BlockSpec((None, None, None, M, C), lambda b, g, s: (s, b, g, 0, 0)),
            pl.BlockSpec((None, None, None, M), lambda b, g, s: (s, b, g, 0)),
        ],
        out_shape=[jax.ShapeDtypeStruct((S, NB, H // Hb, M, C), _F32),
                   jax.ShapeDtypeStruct((S, NB, H // Hb, M), _F32)],
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="mla_paged_attention_gpu",
    )(
        blk_req, blk_idx, md.query_start_loc.astype(_I32), md.kv_lens.astype(_I32),
        md.block_tables.astype(_I32), q_blk[..., :C], q_blk[..., C:],
        latent_cache.reshape(N * ps, W),
    )
    o_blk = blocks.merge_splits(o_part, lse)
    out = blocks.scatter_outputs(o_blk.astype(q.dtype), tokens, T, H)
    if not return_lse:
        return out
    lse_blk = blocks.merge_split_lse(lse)[..., None]  # [NB, H / Hb, M, 1]
    return out, blocks.scatter_outputs(lse_blk, tokens, T, H,
                                       out=jnp.full((T, H, 1), -jnp.inf, _F32))[..., 0]
