"""Pallas Mosaic TPU kernel of paged multi-head latent attention, absorbed form.

The GQA TPU kernel's structure (`ragged_paged_attention/tpu.py`: a 1-D grid over query blocks,
scalar-prefetched block tables, pages DMA'd from HBM into a double-buffered VMEM block, an
online softmax in VMEM scratch) with MLA's one latent array: each page is copied once and read
as the keys' latent part `[K, C]` (also the values) and roped part `[K, Dr]`, two static lane
slices of the same buffer (C a multiple of 128, so both start on a lane tile). Every query head
is a row of one program (rows (query, head), as the GQA kernel's group heads), so the rows are
scored against each page once: `q_lat . lat + q_rope . rope`, then `p . lat` into a
`[M, C]` float32 accumulator.

The row width. XLA:TPU tiles a cache's two minor dims in (8, 128) tiles only when its rows are
whole lane tiles; DeepSeek V3's 576-wide rows are not (the GQA kernel refuses such caches for
that reason: `validate_tpu_shapes`), and what a page's DMA then costs has not been measured on
a chip. So "auto" takes this kernel only for lane-dense rows (W a multiple of 128); "tpu" by
name runs it for any W with C a multiple of 128. Tested in interpret mode against a float64
oracle (tests/pallas_kernels/test_mla_attention.py); not yet run on a TPU.
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
from jaxserve.pallas_kernels.ragged_paged_attention.metadata import AttentionMetadata

_F32 = jnp.float32
_I32 = jnp.int32


def _kernel(blk_req_ref, blk_idx_ref, qsl_ref, kvl_ref, bt_ref,  # scalar prefetch (SMEM)
            ql_ref,  # VMEM [M, C]
            qr_ref,  # VMEM [M, Dr]
            c_hbm,  # HBM [N, ps, C + Dr]
            o_ref,  # VMEM [M, C]
            lse_ref,  # VMEM [M, 1]
            buf, sem, m_ref, l_ref, acc_ref,  # VMEM [2, K, W]; DMA sems [2]; [M, 1] x 2; [M, C]
            *, block_q, heads, page_size, pages_per_req, chunk_pages, sm_scale, context_only):
    b = pl.program_id(0)
    M, C = ql_ref.shape
    Dr = qr_ref.shape[1]
    ps, CP, P = page_size, chunk_pages, pages_per_req
    K = CP * ps

    r = blk_req_ref[b]
    j = blk_idx_ref[b]
    q_end = qsl_ref[r + 1]
    t0 = qsl_ref[r] + jnp.maximum(j, 0) * block_q
    nq = jnp.where(j >= 0, jnp.minimum(block_q, q_end - t0), 0)
    pos0 = kvl_ref[r] - (q_end - t0)
    # the keys the block reads end after its last query, or before the request's first
    # (`context_only`: its cached context)
    hi = kvl_ref[r] - (q_end - qsl_ref[r]) if context_only else pos0 + nq
    end_page = blocks.cdiv(hi, ps)
    n_blocks = jnp.where(nq > 0, blocks.cdiv(end_page, CP), 0)

    def copies(c, slot):
        out = []
        for i in range(CP):
            page_idx = c * CP + i
            page = bt_ref[r * P + jnp.minimum(page_idx, P - 1)]
            copy = pltpu.make_async_copy(c_hbm.at[page], buf.at[slot, pl.ds(i * ps, ps)],
                                         sem.at[slot])
            out.append((page_idx < end_page, copy))
        return out

    def start(c, slot):
        for ok, copy in copies(c, slot):
            @pl.when(ok)
            def _():
                copy.start()

    def wait(c, slot):
        for ok, copy in copies(c, slot):
            @pl.when(ok)
            def _():
                copy.wait()

    m_ref[...] = jnp.full(m_ref.shape, -jnp.inf, _F32)
    l_ref[...] = jnp.zeros(l_ref.shape, _F32)
    acc_ref[...] = jnp.zeros(acc_ref.shape, _F32)

    @pl.when(n_blocks > 0)
    def _():
        start(0, 0)

    # Row i is (query i // heads, head i % heads); comparisons only (no division).
    row = lax.broadcasted_iota(_I32, (M, K), 0)
    col = lax.broadcasted_iota(_I32, (M, K), 1)
    key_row = lax.broadcasted_iota(_I32, (K, C), 0)
    ql, qr = ql_ref[...], qr_ref[...]
    precision = lax.Precision.HIGHEST if ql.dtype == jnp.float32 else None
    nt = (((1,), (1,)), ((), ()))

    def body(c, carry):
        slot = c % 2

        @pl.when(c + 1 < n_blocks)
        def _():
            start(c + 1, 1 - slot)

        wait(c, slot)
        key0 = c * K
        rel = key0 + col - pos0  # key position relative to the block's first query
        mask = (row >= rel * heads) & (row < nq * heads)  # causal, live rows
        if context_only:
            mask &= key0 + col < hi
        lat = upcast(buf[slot, :, pl.ds(0, C)], ql.dtype)  # [K, C]
        rope = upcast(buf[slot, :, pl.ds(C, Dr)], ql.dtype)  # [K, Dr]
        lat = jnp.where(key0 + key_row < hi, lat, jnp.zeros_like(lat))  # stale rows: zeros
        s = (lax.dot_general(ql, lat, nt, precision=precision, preferred_element_type=_F32)
             + lax.dot_general(qr, rope, nt, precision=precision, preferred_element_type=_F32))
        s = jnp.where(mask, s * sm_scale, -jnp.inf)
        m_prev = m_ref[...]
        m_new = jnp.maximum(m_prev, s.max(axis=1, keepdims=True))
        base = jnp.where(m_new == -jnp.inf, 0.0, m_new)
        p = jnp.exp(s - base)
        alpha = jnp.exp(m_prev - base)
        l_ref[...] = alpha * l_ref[...] + p.sum(axis=1, keepdims=True)
        pv = lax.dot_general(p.astype(lat.dtype), lat, (((1,), (0,)), ((), ())),
                             precision=precision, preferred_element_type=_F32)
        acc_ref[...] = alpha * acc_ref[...] + pv
        m_ref[...] = m_new
        return carry

    lax.fori_loop(0, n_blocks, body, 0)
    l = l_ref[...]
    l_safe = jnp.where(l > 0, l, 1.0)
    o_ref[...] = (acc_ref[...] / l_safe).astype(o_ref.dtype)
    lse_ref[...] = jnp.where(l > 0, m_ref[...] + jnp.log(l_safe), -jnp.inf)


def supports(q: jax.Array, latent_cache: jax.Array, value_dim: int, *, auto: bool = False
             ) -> None:
    """Raise ValueError when the kernel cannot take these shapes; `auto`: also rows that are
    not lane-dense (what "auto" leaves to the reference, see the module docstring)."""
    W, ps = latent_cache.shape[2], latent_cache.shape[1]
    packing = max(1, 4 // jnp.dtype(latent_cache.dtype).itemsize)
    if value_dim % 128:
        raise ValueError(f"the MLA tpu kernel needs the latent width ({value_dim}) to be a "
                         "multiple of 128")
    if ps % (8 * packing):
        raise ValueError(f"the MLA tpu kernel needs page_size a multiple of {8 * packing} for "
                         f"{jnp.dtype(latent_cache.dtype).name} pages; got {ps}")
    if auto and W % 128:
        raise ValueError(f"{W}-wide latent rows are not lane-dense")


def mla_paged_attention_tpu(
    q: jax.Array,
    latent_cache: jax.Array,
    md: AttentionMetadata,
    *,
    sm_scale: float,
    value_dim: int,
    chunk_pages: int | None = None,
    queries_per_block: int | None = None,
    vmem_limit_bytes: int | None = None,
    interpret: bool = False,
    context_only: bool = False,
    return_lse: bool = False,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """The op (`ops.mla_paged_attention`) as a Pallas Mosaic TPU kernel -> [T, H, value_dim]
    (and with `return_lse` each row's log-sum-exp, [T, H] float32; `context_only`: the cached
    context only, as the op's). `interpret=True` runs it in TPU interpret mode (any backend)."""
    T, H, W = q.shape
    ps = latent_cache.shape[1]
    R, P = md.block_tables.shape
    C = value_dim
    supports(q, latent_cache, value_dim)
    CP = min(chunk_pages or max(1, 64 // ps), P)
    Bq = queries_per_block or blocks.default_block_q(T, R, max_rows=128, group=H)
    M = Bq * H
    blk_req, blk_idx, NB = blocks.plan_blocks(md, Bq)
    tokens = blocks.block_tokens(md, blk_req, blk_idx, Bq)
    q_blk = blocks.gather_queries(q, tokens, 1, H)[:, 0]  # [NB, M, W]
    kernel = functools.partial(_kernel, block_q=Bq, heads=H, page_size=ps, pages_per_req=P,
                               chunk_pages=CP, sm_scale=float(sm_scale),
                               context_only=context_only)
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=5,
        grid=(NB,),
        in_specs=[pl.BlockSpec((None, M, C), lambda b, *_: (b, 0, 0)),
                  pl.BlockSpec((None, M, W - C), lambda b, *_: (b, 0, 0)),
                  pl.BlockSpec(memory_space=pl.ANY)],
        out_specs=[pl.BlockSpec((None, M, C), lambda b, *_: (b, 0, 0)),
                   pl.BlockSpec((None, M, 1), lambda b, *_: (b, 0, 0))],
        scratch_shapes=[
            pltpu.VMEM((2, CP * ps, W), latent_cache.dtype),
            pltpu.SemaphoreType.DMA((2,)),
            pltpu.VMEM((M, 1), _F32),
            pltpu.VMEM((M, 1), _F32),
            pltpu.VMEM((M, C), _F32),
        ],
    )
    o_blk, lse_blk = pl.pallas_call(
        kernel,
        grid_spec=grid_spec,
        out_shape=[jax.ShapeDtypeStruct((NB, M, C), q.dtype),
                   jax.ShapeDtypeStruct((NB, M, 1), _F32)],
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",),
                                             vmem_limit_bytes=vmem_limit_bytes),
        interpret=pltpu.InterpretParams() if interpret else False,
        name="mla_paged_attention_tpu",
    )(
        blk_req, blk_idx, md.query_start_loc.astype(_I32), md.kv_lens.astype(_I32),
        md.block_tables.astype(_I32).reshape(R * P), q_blk[..., :C], q_blk[..., C:],
        latent_cache,
    )
    out = blocks.scatter_outputs(o_blk[:, None], tokens, T, H)
    if not return_lse:
        return out
    return out, blocks.scatter_outputs(lse_blk[:, None], tokens, T, H,
                                       out=jnp.full((T, H, 1), -jnp.inf, _F32))[..., 0]
