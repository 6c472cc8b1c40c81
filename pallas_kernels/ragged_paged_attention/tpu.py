"""Pallas Mosaic TPU ragged paged attention: mixed prefill + decode over the paged KV cache.

Grid and raggedness. The grid is 1-D over query blocks (`blocks.py`): block b holds up to `Bq`
consecutive queries of one request, `NB = cdiv(T, Bq) + R` blocks in all (a static bound; the
blocks past the live ones are empty and cost one grid step each). The scalar-prefetch operands
(SMEM, available to the kernel before its body runs) are each block's request and in-request
index, `query_start_loc`, `kv_lens` and the flattened block table; from them the kernel derives
the block's first token, its live row count and the sequence position of its first query, so
one compiled kernel serves every mix of prefills and decodes and every context length (all loop
trip counts are traced).

Queries come in block layout `[NB, Hkv, Bq * G, D]` (one VMEM block per grid step, through a
normal BlockSpec: its last two dims are whole, so any Bq * G is legal); outputs leave the same
way and `blocks.scatter_outputs` puts them back in token order.

K/V streaming. The layer's caches stay in HBM (`memory_space=ANY`) in the layout they are
stored in, `[N, ps, Hkv * D]` (`metadata.py`): XLA:TPU tiles a page's rows and lanes in whole
(8, 128) tiles, so a page is ONE contiguous DMA of `ps * Hkv * D` elements, all KV heads at
once, lane-dense, and the kernel's operand is the cache as the write left it (no relayout). A KV block is `chunk_pages` pages (`block_k = chunk_pages * ps`
keys). The kernel visits only the keys the query block can see (sliding-window start of its
first query .. its last query) and double-buffers: before computing on KV block c it starts the
DMAs of block c + 1 into the other VMEM slot (`pltpu.make_async_copy`, one DMA semaphore per
slot), then waits for block c. Pages past the end of the visible range are neither copied nor
waited for; their (stale VMEM) rows are masked out of the scores and zeroed in V, so garbage can
never leak in as 0 * NaN.

Compute. For every KV head (a static loop) the `[Bq * G, D]` query rows of that head (GQA:
the G query heads sharing the KV head are rows of the same matmul, K/V are never repeated) are
multiplied with the head's `[block_k, D]` keys (a static lane slice of the page buffer), masked
(per-request causal, optional sliding window, live rows) with comparisons only (row // G is
never computed: `row // G >= x` iff `row >= x * G`), soft-capped if asked, and folded into an
online softmax whose state (m, l, acc per head) lives in VMEM scratch. Scores accumulate in
float32 (`preferred_element_type`), float32 inputs use HIGHEST precision; `p` is cast to the V
dtype for the second matmul (bfloat16 MXU path for bfloat16 caches). fp8 and int8 pages
(`kv_quant.py`) are DMA'd as they are (half a bfloat16 page's bytes) and converted to q's dtype
in VMEM, per KV block, before the products.

Attention sinks (optional, [Hq] logits): a VMEM input of every row's sink, `[Hkv, M, 1]` (row
i of head h is query head h * G + i % G), the same block for every grid step; each row's
online softmax then starts from (m, l) = (sink, 1) instead of (-inf, 0), and the sink is one
more score of value zero. Without sinks the kernel has no such input and is unchanged.

Block sizes. `queries_per_block` (Bq) defaults from the bucket's T/R ratio, up to 128 rows per
head (`blocks.default_block_q`); `chunk_pages` defaults to ~128 keys per KV block when
`Hkv * D <= 1024`, fewer for wider pages (VMEM per buffer: 2 slots x 2 (K, V) x block_k x
Hkv * D x itemsize, ~1 MiB for 8 x 128 bfloat16). The grid axis is "parallel" (no state
crosses grid steps, so megacore chips may split it).

Device requirements not checked by interpret mode (see `validate_tpu_shapes`): page_size must
be a multiple of the sublane tiling (8 for 32-bit, 16 for bfloat16, 32 for fp8 and int8) so
each page DMA lands on whole VMEM tiles, and `Hkv * D` a multiple of 128 (XLA:TPU lays out a
cache whose rows are not whole lane tiles with the pages in the lanes, `{0,2,1}`: no page is
contiguous there; models with such rows, SmolLM2's 3 KV heads of 64, are served with zero KV
heads appended where this kernel runs: `ops.lane_dense_kv_heads`). Head dim 64 with an
odd KV head index uses a lane-offset-64 slice of the page buffer (Mosaic handles it with a lane
shift; only exercised in interpret mode so far).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from jaxserve.pallas_kernels.kv_quant import upcast
from jaxserve.pallas_kernels.ragged_paged_attention import blocks
from jaxserve.pallas_kernels.ragged_paged_attention.metadata import (
    AttentionMetadata,
    num_kv_heads,
)

_F32 = jnp.float32
_I32 = jnp.int32


def validate_tpu_shapes(page_size: int, num_kv_heads: int, head_dim: int, dtype) -> None:
    packing = max(1, 4 // jnp.dtype(dtype).itemsize)
    if page_size % (8 * packing):
        raise ValueError(
            f"the tpu kernel needs page_size to be a multiple of {8 * packing} for "
            f"{jnp.dtype(dtype).name} caches (whole VMEM tiles per page DMA); got {page_size}"
        )
    if (num_kv_heads * head_dim) % 128:
        raise ValueError(
            f"the tpu kernel needs Hkv * D to be a multiple of 128 (lane-dense pages); got "
            f"{num_kv_heads} * {head_dim}"
        )


def supports(q: jax.Array, k_cache: jax.Array) -> None:
    """Raise ValueError when the kernel cannot take these shapes."""
    d = q.shape[-1]
    validate_tpu_shapes(k_cache.shape[1], num_kv_heads(k_cache, d), d, k_cache.dtype)


def default_chunk_pages(page_size: int, num_kv_heads: int, head_dim: int) -> int:
    keys = 128 if num_kv_heads * head_dim <= 1024 else 64
    return max(1, keys // page_size)


def _kernel(
    # scalar prefetch (SMEM)
    blk_req_ref, blk_idx_ref, qsl_ref, kvl_ref, bt_ref,
    # blocked inputs / HBM refs
    q_ref,  # VMEM [Hkv, M, D]
    *refs,  # (sinks VMEM [Hkv, M, 1] f32, when has_sinks), then:
    # k_hbm, v_hbm: HBM [N, ps, Hkv * D]
    # outputs: o_ref, VMEM [Hkv, M, D]
    # scratch: k_buf, v_buf, VMEM [2, block_k, Hkv * D]; sem, DMA semaphores [2];
    #          m_ref, l_ref, VMEM [Hkv, M, 1] f32; acc_ref, VMEM [Hkv, M, D] f32
    block_q, group, page_size, pages_per_req, chunk_pages, sm_scale, sliding_window,
    soft_cap, has_sinks,
):
    sinks_ref, refs = (refs[0], refs[1:]) if has_sinks else (None, refs)
    k_hbm, v_hbm, o_ref, k_buf, v_buf, sem, m_ref, l_ref, acc_ref = refs
    b = pl.program_id(0)
    Hkv, M, D = q_ref.shape
    ps, C, P = page_size, chunk_pages, pages_per_req
    K = C * ps

    r = blk_req_ref[b]
    j = blk_idx_ref[b]
    q_end = qsl_ref[r + 1]
    t0 = qsl_ref[r] + jnp.maximum(j, 0) * block_q
    nq = jnp.where(j >= 0, jnp.minimum(block_q, q_end - t0), 0)
    pos0 = kvl_ref[r] - (q_end - t0)  # sequence position of the block's first query
    hi = pos0 + nq  # keys < hi
    lo = 0 if sliding_window is None else jnp.maximum(pos0 - sliding_window + 1, 0)
    first_page = lo // ps
    end_page = blocks.cdiv(hi, ps)
    n_blocks = jnp.where(nq > 0, blocks.cdiv(end_page - first_page, C), 0)

    def page_copies(c, slot):
        """(predicate, K copy, V copy) for each page of KV block c into buffer slot `slot`."""
        out = []
        for i in range(C):
            page_idx = first_page + c * C + i
            page = bt_ref[r * P + jnp.minimum(page_idx, P - 1)]
            dst = pl.ds(i * ps, ps)
            out.append((
                page_idx < end_page,
                pltpu.make_async_copy(k_hbm.at[page], k_buf.at[slot, dst], sem.at[slot]),
                pltpu.make_async_copy(v_hbm.at[page], v_buf.at[slot, dst], sem.at[slot]),
            ))
        return out

    def start(c, slot):
        for ok, ck, cv in page_copies(c, slot):
            @pl.when(ok)
            def _():
                ck.start()
                cv.start()

    def wait(c, slot):
        for ok, ck, cv in page_copies(c, slot):
            @pl.when(ok)
            def _():
                ck.wait()
                cv.wait()

    if has_sinks:  # the sink is one more score, of value zero
        m_ref[...] = sinks_ref[...]
        l_ref[...] = jnp.ones(l_ref.shape, _F32)
    else:
        m_ref[...] = jnp.full(m_ref.shape, -jnp.inf, _F32)
        l_ref[...] = jnp.zeros(l_ref.shape, _F32)
    acc_ref[...] = jnp.zeros(acc_ref.shape, _F32)

    @pl.when(n_blocks > 0)
    def _():
        start(0, 0)

    # Row i of a head's [M, D] query rows is (query i // G, group head i % G).
    row = lax.broadcasted_iota(_I32, (M, K), 0)
    col = lax.broadcasted_iota(_I32, (M, K), 1)
    key_row = lax.broadcasted_iota(_I32, (K, D), 0)

    def body(c, carry):
        slot = c % 2

        @pl.when(c + 1 < n_blocks)
        def _():
            start(c + 1, 1 - slot)

        wait(c, slot)
        key0 = (first_page + c * C) * ps
        rel = key0 + col - pos0  # key position relative to the block's first query
        mask = (row >= rel * group) & (row < nq * group)  # causal, live rows
        if sliding_window is not None:
            mask &= row < (rel + sliding_window) * group
        v_ok = key0 + key_row < hi
        for h in range(Hkv):
            q = q_ref[h]  # [M, D]
            k = upcast(k_buf[slot, :, pl.ds(h * D, D)], q.dtype)  # [K, D]
            v = upcast(v_buf[slot, :, pl.ds(h * D, D)], q.dtype)
            v = jnp.where(v_ok, v, jnp.zeros_like(v))
            precision = lax.Precision.HIGHEST if q.dtype == jnp.float32 else None
            s = lax.dot_general(q, k, (((1,), (1,)), ((), ())), precision=precision,
                                preferred_element_type=_F32) * sm_scale
            if soft_cap is not None:
                s = soft_cap * jnp.tanh(s / soft_cap)
            s = jnp.where(mask, s, -jnp.inf)
            m_prev = m_ref[h]  # [M, 1]
            m_new = jnp.maximum(m_prev, s.max(axis=1, keepdims=True))
            base = jnp.where(m_new == -jnp.inf, 0.0, m_new)
            p = jnp.exp(s - base)
            alpha = jnp.exp(m_prev - base)
            l_ref[h] = alpha * l_ref[h] + p.sum(axis=1, keepdims=True)
            pv = lax.dot_general(p.astype(v.dtype), v, (((1,), (0,)), ((), ())),
                                 precision=precision, preferred_element_type=_F32)
            acc_ref[h] = alpha * acc_ref[h] + pv
            m_ref[h] = m_new
        return carry

    lax.fori_loop(0, n_blocks, body, 0)
    l = l_ref[...]
    o_ref[...] = (acc_ref[...] / jnp.where(l > 0, l, 1.0)).astype(o_ref.dtype)


def ragged_paged_attention_tpu(
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
    vmem_limit_bytes: int | None = None,
    interpret: bool = False,
    sinks: jax.Array | None = None,
) -> jax.Array:
    """The op (see `ops.ragged_paged_attention`) as a Pallas Mosaic TPU kernel; `sinks`:
    [Hq] attention-sink logits, or None.

    Tuning: `chunk_pages` (pages per KV block), `queries_per_block` (Bq), `vmem_limit_bytes`.
    `interpret=True` runs it in TPU interpret mode (any backend; DMAs and semaphores are
    simulated).
    """
    T, Hq, D = q.shape
    ps = k_cache.shape[1]
    Hkv = num_kv_heads(k_cache, D)
    R, P = md.block_tables.shape
    G = Hq // Hkv
    validate_tpu_shapes(ps, Hkv, D, k_cache.dtype)
    C = min(chunk_pages or default_chunk_pages(ps, Hkv, D), P)
    Bq = queries_per_block or blocks.default_block_q(T, R, max_rows=128, group=G)
    M = Bq * G
    K = C * ps

    blk_req, blk_idx, NB = blocks.plan_blocks(md, Bq)
    tokens = blocks.block_tokens(md, blk_req, blk_idx, Bq)
    q_blk = blocks.gather_queries(q, tokens, Hkv, G)  # [NB, Hkv, M, D]
    kernel = functools.partial(
        _kernel, block_q=Bq, group=G, page_size=ps, pages_per_req=P, chunk_pages=C,
        sm_scale=float(sm_scale), sliding_window=sliding_window,
        soft_cap=None if soft_cap is None else float(soft_cap), has_sinks=sinks is not None,
    )
    q_spec = pl.BlockSpec((None, Hkv, M, D), lambda b, *_: (b, 0, 0, 0))
    sink_specs, sink_args = [], []
    if sinks is not None:  # every row's sink: row i of head h is query head h * G + i % G
        rows = jnp.tile(sinks.astype(_F32).reshape(Hkv, 1, G), (1, Bq, 1)).reshape(Hkv, M, 1)
        sink_specs = [pl.BlockSpec((Hkv, M, 1), lambda b, *_: (0, 0, 0))]
        sink_args = [rows]
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=5,
        grid=(NB,),
        in_specs=[q_spec, *sink_specs, pl.BlockSpec(memory_space=pl.ANY),
                  pl.BlockSpec(memory_space=pl.ANY)],
        out_specs=q_spec,
        scratch_shapes=[
            pltpu.VMEM((2, K, Hkv * D), k_cache.dtype),
            pltpu.VMEM((2, K, Hkv * D), v_cache.dtype),
            pltpu.SemaphoreType.DMA((2,)),
            pltpu.VMEM((Hkv, M, 1), _F32),
            pltpu.VMEM((Hkv, M, 1), _F32),
            pltpu.VMEM((Hkv, M, D), _F32),
        ],
    )
    o_blk = pl.pallas_call(
        kernel,
        grid_spec=grid_spec,
        out_shape=jax.ShapeDtypeStruct((NB, Hkv, M, D), q.dtype),
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel",), vmem_limit_bytes=vmem_limit_bytes
        ),
        interpret=pltpu.InterpretParams() if interpret else False,
        name="ragged_paged_attention_tpu",
    )(
        blk_req, blk_idx, md.query_start_loc.astype(_I32), md.kv_lens.astype(_I32),
        md.block_tables.astype(_I32).reshape(R * P), q_blk, *sink_args, k_cache, v_cache,
    )
    return blocks.scatter_outputs(o_blk, tokens, T, Hq)
