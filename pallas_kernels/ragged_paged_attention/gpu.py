"""Pallas GPU (Triton lowering) ragged paged attention: mixed prefill + decode, split-K decode.

Why Triton and not Mosaic GPU. Mosaic GPU targets Hopper/Blackwell only (wgmma/TMA, warpgroup
semantics) and its TMA copies need a static, tile-aligned source box: a gather of pages through
a block table, a KV-head slice out of `[.., Hkv, D]` and a partial last page each need manual
per-page TMA descriptors and barrier bookkeeping. The Triton lowering runs on every CUDA (and
ROCm) GPU JAX supports, lowers `ref[vector_of_rows, h, :]` to one coalesced pointer gather (the
page gather is free), lets the loop trip counts be traced (one compiled kernel for every
context length), and Triton pipelines the K/V loads itself (`num_stages`). For a memory-bound
decode kernel it reaches close to the copy bandwidth; Mosaic GPU would matter for prefill on
H100+ (wgmma), which is future work behind the same op.

Grid: `(NB, Hkv, S)` = (query block, KV head, KV split). See `blocks.py` for how the ragged
batch becomes query blocks: block b holds up to `Bq` consecutive queries of one request, in
block layout `[NB, Hkv, M = Bq * Gp, D]`, rows (query, group head). A program loads its rows
once, then walks its request's keys in chunks of `block_k = chunk_pages * page_size` tokens:
the chunk's pages come from the block table (clamped), the keys are gathered straight from the
layer's cache (viewed as `[N * page_size, Hkv, D]`, a free reshape) and it runs an online
softmax. Only the keys the block can see are visited: from the sliding-window start of
its first query to its last query. Split s of S takes an equal share of those chunks (decode
over long contexts then uses S programs per request and KV head); each split writes its
normalised partial output and log-sum-exp, and a small JAX combine merges them (one pass over
`S * NB * Hq * D` floats, tiny next to the K/V bytes).

Attention sinks (optional, [Hq] logits) join the combine, not the kernel: a row's sink is one
more split of log-sum-exp `sink` and output zero (`blocks.merge_splits`), so the Triton kernel
is the same with and without them.

GQA: the `G = Hq / Hkv` query heads of a KV head are rows of the same program, so K/V are read
once per KV head. Triton needs power-of-two block shapes and `tl.dot` operands of at least 16:
`G` is padded to a power of two (`Gp`, padded heads are zero queries whose output is dropped),
`M = Bq * Gp >= 16` and `block_k >= 16`; `D` and `page_size` must be powers of two.

Numerics: scores are `dot(q, k)` in the input dtype with float32 accumulation (IEEE precision
for float32 inputs, not TF32), softmax in float32, then `p` is cast to the V dtype for the
second matmul (float32 accumulation). With float32 caches this is the reference's arithmetic;
with bfloat16 it rounds p to bfloat16 (error ~ 2^-9 relative, well inside the 2e-2 test bound).
fp8 and int8 pages (`kv_quant.py`) are gathered as they are (one byte an element) and converted
to q's dtype in registers before the products.
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
from jaxserve.pallas_kernels.ragged_paged_attention.metadata import (
    AttentionMetadata,
    num_kv_heads,
)

_F32 = jnp.float32
_I32 = jnp.int32
_MIN_DOT = 16  # tl.dot needs every operand dim >= 16


def _kernel(
    # inputs (whole arrays in global memory unless blocked)
    blk_req_ref, blk_idx_ref, qsl_ref, kvl_ref, bt_ref,
    q_ref,  # [M, D] block
    k_ref, v_ref,  # [N * page_size, Hkv, D]
    # outputs
    o_ref,  # [M, D] block (float32, normalised)
    lse_ref,  # [M] block (float32)
    *, block_q, group, group_pad, page_size, chunk_pages, num_splits, sm_scale, sliding_window,
    soft_cap,
):
    b, h, s = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    M, D = q_ref.shape
    K = chunk_pages * page_size
    P = bt_ref.shape[1]
    ps = page_size

    r = blk_req_ref[b]
    j = blk_idx_ref[b]
    q_end = qsl_ref[r + 1]
    t0 = qsl_ref[r] + jnp.maximum(j, 0) * block_q
    nq = jnp.where(j >= 0, jnp.minimum(block_q, q_end - t0), 0)
    pos0 = kvl_ref[r] - (q_end - t0)  # sequence position of the block's first query
    hi = pos0 + nq  # keys < hi (exclusive)
    lo = 0 if sliding_window is None else jnp.maximum(pos0 - sliding_window + 1, 0)
    first_page = lo // ps
    n_chunks = jnp.where(nq > 0, blocks.cdiv(blocks.cdiv(hi, ps) - first_page, chunk_pages), 0)
    per_split = blocks.cdiv(n_chunks, num_splits)
    c_lo = s * per_split
    c_hi = jnp.minimum(c_lo + per_split, n_chunks)

    rows = lax.iota(_I32, M)
    row_q = rows // group_pad  # power of two: a shift
    row_ok = (row_q < nq) & (rows % group_pad < group)
    row_pos = pos0 + row_q
    kk = lax.iota(_I32, K)
    q = q_ref[...]
    precision = lax.Precision.HIGHEST if q.dtype == jnp.float32 else None

    def body(c, carry):
        m, l, acc = carry
        key0 = (first_page + c * chunk_pages) * ps
        kpos = key0 + kk  # [K] sequence positions
        page_idx = jnp.minimum(kpos // ps, P - 1)
        page = bt_ref[r, page_idx]  # [K] gather from the block table row
        tok = page * ps + kpos % ps
        k = upcast(k_ref[tok, h, :], q.dtype)  # [K, D] gathered rows of the cache
        v = upcast(v_ref[tok, h, :], q.dtype)
        v = jnp.where((kpos < hi)[:, None], v, jnp.zeros_like(v))  # never 0 * garbage
        sc = lax.dot_general(q, k, (((1,), (1,)), ((), ())), precision=precision,
                             preferred_element_type=_F32) * sm_scale
        if soft_cap is not None:
            sc = soft_cap * jnp.tanh(sc / soft_cap)
        mask = (kpos[None, :] <= row_pos[:, None]) & row_ok[:, None]
        if sliding_window is not None:
            mask &= kpos[None, :] > row_pos[:, None] - sliding_window
        sc = jnp.where(mask, sc, -jnp.inf)
        m_new = jnp.maximum(m, sc.max(axis=1))
        base = jnp.where(m_new == -jnp.inf, 0.0, m_new)
        p = jnp.exp(sc - base[:, None])
        alpha = jnp.exp(m - base)
        l_new = alpha * l + p.sum(axis=1)
        pv = lax.dot_general(p.astype(v.dtype), v, (((1,), (0,)), ((), ())),
                             precision=precision, preferred_element_type=_F32)
        return m_new, l_new, alpha[:, None] * acc + pv

    init = (
        jnp.full((M,), -jnp.inf, _F32),
        jnp.zeros((M,), _F32),
        jnp.zeros((M, D), _F32),
    )
    m, l, acc = lax.fori_loop(c_lo, c_hi, body, init)
    l_safe = jnp.where(l > 0, l, 1.0)
    o_ref[...] = acc / l_safe[:, None]
    lse_ref[...] = jnp.where(l > 0, m + jnp.log(l_safe), -jnp.inf)


def supports(q: jax.Array, k_cache: jax.Array) -> None:
    """Raise ValueError when the kernel cannot take these shapes."""
    D, ps = q.shape[-1], k_cache.shape[1]
    if D & (D - 1) or D < _MIN_DOT:
        raise ValueError(f"the gpu kernel needs a power-of-two head dim >= 16, got D={D}")
    if ps & (ps - 1):
        raise ValueError(f"the gpu kernel needs a power-of-two page_size, got {ps}")


def default_chunk_pages(page_size: int, head_dim: int) -> int:
    """Pages per key chunk: 64 keys for D <= 128 (32 for larger D), at least 16 keys."""
    keys = 64 if head_dim <= 128 else 32
    return max(1, max(keys, _MIN_DOT) // page_size)


def ragged_paged_attention_gpu(
    q: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    md: AttentionMetadata,
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    chunk_pages: int | None = None,
    queries_per_block: int | None = None,
    kv_splits: int | None = None,
    num_warps: int = 4,
    num_stages: int = 2,
    interpret: bool = False,
    sinks: jax.Array | None = None,
) -> jax.Array:
    """The op (see `ops.ragged_paged_attention`) as a Pallas Triton kernel; `sinks`: [Hq]
    attention-sink logits, or None.

    Tuning: `chunk_pages` (pages per key chunk; block_k = chunk_pages * page_size, a power of
    two >= 16), `queries_per_block` (Bq, a power of two; default from the bucket's T/R ratio),
    `kv_splits` (S; default 4 for decode-shaped buckets, 1 when T > 4 R), `num_warps`,
    `num_stages`. `interpret=True` runs the kernel with the Pallas interpreter (any backend).
    """
    T, Hq, D = q.shape
    N, ps, _ = k_cache.shape
    Hkv = num_kv_heads(k_cache, D)
    R, P = md.block_tables.shape
    G = Hq // Hkv
    supports(q, k_cache)
    Gp = blocks.pow2_ceil(G)
    C = chunk_pages or default_chunk_pages(ps, D)
    if (C * ps) & (C * ps - 1) or C * ps < _MIN_DOT:
        raise ValueError(
            f"the gpu kernel needs chunk_pages * page_size a power of two >= 16; got "
            f"{C} * {ps}"
        )
    Bq = queries_per_block or blocks.default_block_q(T, R, max_rows=64, group=Gp,
                                                    min_rows=_MIN_DOT)
    if Bq & (Bq - 1) or Bq * Gp < _MIN_DOT:
        raise ValueError(
            f"queries_per_block must be a power of two with queries_per_block * {Gp} >= 16; "
            f"got {Bq}"
        )
    S = kv_splits or (1 if T > 4 * R else 4)
    M = Bq * Gp

    blk_req, blk_idx, NB = blocks.plan_blocks(md, Bq)
    tokens = blocks.block_tokens(md, blk_req, blk_idx, Bq)
    q_blk = blocks.gather_queries(q, tokens, Hkv, Gp)  # [NB, Hkv, M, D]
    k_rows = k_cache.reshape(N * ps, Hkv, D)  # free: row-major
    v_rows = v_cache.reshape(N * ps, Hkv, D)

    kernel = functools.partial(
        _kernel, block_q=Bq, group=G, group_pad=Gp, page_size=ps, chunk_pages=C, num_splits=S,
        sm_scale=float(sm_scale), sliding_window=sliding_window,
        soft_cap=None if soft_cap is None else float(soft_cap),
    )
    whole = pl.no_block_spec
    o_part, lse = pl.pallas_call(
        kernel,
        grid=(NB, Hkv, S),
        in_specs=[
            whole, whole, whole, whole, whole,
            pl.BlockSpec((None, None, M, D), lambda b, h, s: (b, h, 0, 0)),
            whole, whole,
        ],
        out_specs=[
            pl.BlockSpec((None, None, None, M, D), lambda b, h, s: (s, b, h, 0, 0)),
            pl.BlockSpec((None, None, None, M), lambda b, h, s: (s, b, h, 0)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((S, NB, Hkv, M, D), _F32),
            jax.ShapeDtypeStruct((S, NB, Hkv, M), _F32),
        ],
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="ragged_paged_attention_gpu",
    )(
        blk_req, blk_idx, md.query_start_loc.astype(_I32), md.kv_lens.astype(_I32),
        md.block_tables.astype(_I32), q_blk, k_rows, v_rows,
    )
    o_blk = blocks.merge_splits(
        o_part, lse, None if sinks is None else blocks.row_sinks(sinks, Hkv, Gp, Bq)[None])
    return blocks.scatter_outputs(o_blk.astype(q.dtype), tokens, T, Hq)

