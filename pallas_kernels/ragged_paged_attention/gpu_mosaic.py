"""Pallas Mosaic GPU ragged paged attention (Hopper and newer): the same op as `gpu.py`'s
Triton kernel, written for JAX's Mosaic GPU backend (TMA copies, wgmma, one warpgroup).

Registered as "gpu-mosaic" beside the Triton kernel ("gpu", the default on a GPU): see
docs/DESIGN.md §5 for why both exist and which one `auto` takes.

Grid `(NB, Hkv, S)` as the Triton kernel's (query block, KV head, KV split; `blocks.py` plans
the blocks). The differences come from the hardware path Mosaic GPU exposes:

- wgmma works on 64-row tiles, so a query block is always 64 rows: `Bq = 64 / Gp` queries of
  `Gp` (power-of-two padded) group heads. Decode rows are mostly padding, which costs tensor-core
  work but no memory traffic (decode is bound by the K/V reads).
- The keys of a chunk (`K = 64` keys for 16-bit caches: the 128-byte swizzle of a wgmma operand)
  arrive by TMA, one copy per page: `k_cache[page, :, h, :]` is a strided `[page_size, D]` box
  that TMA reads as is (no gather instruction exists on Hopper), into shared memory laid out
  for wgmma (8 x 64 tiles, 128-byte swizzle). Two slots: chunk c + 1 is copied while chunk c
  is computed. Copies are issued unconditionally (the interpreter cannot run a copy under a
  condition): the one after the last chunk re-reads the last chunk, from L2, and is waited for
  before the kernel ends; an empty block reads one chunk of its request's pages.
- Scores are `q @ k^T` (wgmma, k transposed in shared memory), the online softmax runs in the
  wgmma register layout, and `p @ v` takes p from registers. Keys past a sequence's length get
  p = 0 and their rows are not zeroed (the Triton kernel zeroes them): the rows a chunk reads
  past the end are the cache's own (zeros, or K/V of other tokens), finite.
- Only 16-bit caches (bfloat16, float16): wgmma has no float32 operands. Head dims 64-256 in
  steps of 64, but a block's shared memory must fit a Hopper SM's 227 KiB: head dim 256 needs
  232,584 bytes (Mosaic GPU's count), 136 too many, and is refused. `supports` refuses what the
  kernel cannot take, and `auto` then falls back as for any unsupported shape.

The result is normalised per split with its log-sum-exp; `blocks.merge_splits` combines the
splits as in the Triton kernel. `interpret=True` runs the kernel in Pallas's Mosaic GPU
interpreter (CPU), with `jnp` products in place of the two wgmmas (the interpreter takes no
transposed or register operands): the copies, page walk, masks and softmax are the kernel's own.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu
from jaxserve.pallas_kernels.ragged_paged_attention import blocks
from jaxserve.pallas_kernels.ragged_paged_attention.metadata import AttentionMetadata

_F32 = jnp.float32
_I32 = jnp.int32
ROWS = 64  # one warpgroup's wgmma tile
_SWIZZLE_ELEMS = 64  # 128-byte swizzle / 2-byte elements: wgmma's K granule
_SLOTS = 2  # chunks in flight
HOPPER_SMEM_PER_BLOCK = 232448  # shared_memory_per_block_optin of sm_90 (XLA's H100/H200 specs)


def supports(q: jax.Array, k_cache: jax.Array) -> None:
    """Raise ValueError when the kernel cannot take these shapes."""
    D, ps, Hkv = q.shape[-1], k_cache.shape[1], k_cache.shape[2]
    G = q.shape[-2] // Hkv if q.ndim == 3 and q.shape[-2] % Hkv == 0 else 1
    if jnp.dtype(k_cache.dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        raise ValueError(
            f"the gpu-mosaic kernel needs a bfloat16 or float16 cache, got {k_cache.dtype}"
        )
    if D % 64 or D > 256:
        raise ValueError(
            f"the gpu-mosaic kernel needs a head dim that is a multiple of 64, at most 256; "
            f"got D={D}"
        )
    if ps & (ps - 1) or ps < 8 or ps > 256:
        raise ValueError(
            f"the gpu-mosaic kernel needs a power-of-two page_size in [8, 256], got {ps}"
        )
    if blocks.pow2_ceil(G) > ROWS:
        raise ValueError(
            f"the gpu-mosaic kernel takes at most {ROWS} query heads per KV head, got {G}"
        )
    if shared_memory_bytes(D, ps) > HOPPER_SMEM_PER_BLOCK:
        raise ValueError(
            f"the gpu-mosaic kernel needs ~{shared_memory_bytes(D, ps)} bytes of shared memory "
            f"for head dim {D} and pages of {ps}, more than a Hopper block's "
            f"{HOPPER_SMEM_PER_BLOCK}"
        )


def shared_memory_bytes(head_dim: int, page_size: int) -> int:
    """What a block asks for (an upper estimate of Mosaic GPU's own count: within 300 bytes of
    it at D 64-256): q (16-bit), two slots of K and V chunks (16-bit), the float32 output and
    log-sum-exp, barriers, and the 1 KiB alignment of swizzled buffers."""
    K = max(_SWIZZLE_ELEMS, page_size)
    return head_dim * (2 * ROWS + 2 * _SLOTS * 2 * K + 4 * ROWS) + 3500


def _kernel(
    blk_req_ref,
    blk_idx_ref,
    qsl_ref,
    kvl_ref,
    bt_ref,
    q_ref,
    k_ref,
    v_ref,
    o_ref,
    lse_ref,
    *,
    block_q,
    group,
    group_pad,
    page_size,
    chunk_pages,
    num_splits,
    sm_scale,
    sliding_window,
    soft_cap,
    interpret,
):
    b, h, s = lax.axis_index("b"), lax.axis_index("h"), lax.axis_index("s")

    def iota(shape, dim):
        if interpret:  # the interpreter keeps no register layouts
            return lax.broadcasted_iota(_I32, shape, dim)
        return plgpu.broadcasted_iota(_I32, shape, dim, layout=plgpu.Layout.WGMMA)

    def cast(x, layout):
        return x if interpret else plgpu.layout_cast(x, layout)

    ps, C = page_size, chunk_pages
    K = C * ps
    D = q_ref.shape[-1]
    P = bt_ref.shape[1]
    dtype = q_ref.dtype

    r = blk_req_ref[b]
    j = blk_idx_ref[b]
    q_end = qsl_ref[r + 1]
    t0 = qsl_ref[r] + jnp.maximum(j, 0) * block_q
    nq = jnp.where(j >= 0, jnp.minimum(block_q, q_end - t0), 0)
    pos0 = kvl_ref[r] - (q_end - t0)  # sequence position of the block's first query
    hi = pos0 + nq  # keys < hi
    lo = 0 if sliding_window is None else jnp.maximum(pos0 - sliding_window + 1, 0)
    first = lo // K  # chunks are K-aligned key ranges: chunk c holds pages c*C .. c*C + C - 1
    n_chunks = jnp.where(nq > 0, blocks.cdiv(hi, K) - first, 0)
    per_split = blocks.cdiv(n_chunks, num_splits)
    c_lo = first + s * per_split
    c_hi = first + jnp.minimum((s + 1) * per_split, n_chunks)

    def scoped(q_smem, k_smem, v_smem, o_smem, lse_smem, q_bar, k_bar, v_bar):
        def fetch(c, slot):
            for i in range(C):
                page = bt_ref[r, jnp.clip(c * C + i, 0, P - 1)]
                dst = pl.ds(i * ps, ps)
                plgpu.copy_gmem_to_smem(
                    k_ref.at[page, :, h, :], k_smem.at[slot, dst], k_bar.at[slot * C + i]
                )
                plgpu.copy_gmem_to_smem(
                    v_ref.at[page, :, h, :], v_smem.at[slot, dst], v_bar.at[slot * C + i]
                )

        plgpu.copy_gmem_to_smem(q_ref.at[b, h], q_smem, q_bar)
        fetch(c_lo, 0)

        plgpu.barrier_wait(q_bar)
        rows, cols = iota((ROWS, K), 0), iota((ROWS, K), 1)
        row_pos = pos0 + rows // group_pad
        row_ok = (rows // group_pad < nq) & (rows % group_pad < group)
        m0 = cast(jnp.full((ROWS,), -jnp.inf, _F32), plgpu.Layout.WGMMA.reduce(1))
        l0 = cast(jnp.full((ROWS,), 0.0, _F32), plgpu.Layout.WGMMA.reduce(1))
        a0 = cast(jnp.full((ROWS, D), 0.0, _F32), plgpu.Layout.WGMMA)

        def body(c, carry):
            acc, m, den = carry
            slot = lax.rem(c - c_lo, _SLOTS)
            fetch(jnp.minimum(c + 1, c_hi - 1), 1 - slot)  # past the last: the last again (from L2)

            for i in range(C):
                plgpu.barrier_wait(k_bar.at[slot * C + i])
            if interpret:
                sc = lax.dot_general(
                    q_smem[...], k_smem[slot], (((1,), (1,)), ((), ())), preferred_element_type=_F32
                )
            else:

                def qk(acc_ref):
                    plgpu.wgmma(acc_ref, q_smem, plgpu.transpose_ref(k_smem.at[slot], (1, 0)))
                    return acc_ref[...]

                sc = pl.run_scoped(qk, plgpu.ACC((ROWS, K), _F32))
            sc = sc * sm_scale
            if soft_cap is not None:
                sc = soft_cap * jnp.tanh(sc / soft_cap)
            kpos = c * K + cols
            mask = (kpos <= row_pos) & row_ok
            if sliding_window is not None:
                mask &= kpos > row_pos - sliding_window
            sc = jnp.where(mask, sc, -jnp.inf)
            m_new = jnp.maximum(m, sc.max(axis=1))
            base = jnp.where(m_new == -jnp.inf, 0.0, m_new)
            p = jnp.exp(sc - lax.broadcast_in_dim(base, sc.shape, [0]))
            alpha = jnp.exp(m - base)
            l_new = alpha * den + p.sum(axis=1)
            for i in range(C):
                plgpu.barrier_wait(v_bar.at[slot * C + i])
            if interpret:
                pv = lax.dot_general(
                    p.astype(dtype),
                    v_smem[slot],
                    (((1,), (0,)), ((), ())),
                    preferred_element_type=_F32,
                )
            else:

                def pv_fn(acc_ref):
                    plgpu.wgmma(acc_ref, p.astype(dtype), v_smem.at[slot])
                    return acc_ref[...]

                pv = pl.run_scoped(pv_fn, plgpu.ACC((ROWS, D), _F32))
            return acc * lax.broadcast_in_dim(alpha, acc.shape, [0]) + pv, m_new, l_new

        acc, m, den = lax.fori_loop(c_lo, c_hi, body, (a0, m0, l0))
        last = lax.rem(jnp.maximum(c_hi - c_lo, 0), _SLOTS)  # the slot of the copy nobody used
        for i in range(C):
            plgpu.barrier_wait(k_bar.at[last * C + i])
            plgpu.barrier_wait(v_bar.at[last * C + i])
        l_safe = jnp.where(den > 0, den, 1.0)
        o_smem[...] = acc / lax.broadcast_in_dim(l_safe, acc.shape, [0])
        lse_smem[...] = jnp.where(den > 0, m + jnp.log(l_safe), -jnp.inf)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_smem, o_ref.at[s, b, h])
        plgpu.copy_smem_to_gmem(lse_smem, lse_ref.at[s, b, h])
        plgpu.wait_smem_to_gmem(0)

    operand = (plgpu.TilingTransform((8, _SWIZZLE_ELEMS)), plgpu.SwizzleTransform(128))
    pl.run_scoped(
        scoped,
        plgpu.SMEM((ROWS, D), dtype, transforms=operand),
        plgpu.SMEM((_SLOTS, K, D), dtype, transforms=operand),
        plgpu.SMEM((_SLOTS, K, D), dtype, transforms=operand),
        plgpu.SMEM((ROWS, D), _F32),
        plgpu.SMEM((ROWS,), _F32),
        plgpu.Barrier(num_barriers=1),
        plgpu.Barrier(num_barriers=_SLOTS * C),
        plgpu.Barrier(num_barriers=_SLOTS * C),
    )


def _gpu_interpreter():
    """Pallas's Mosaic GPU interpreter (barriers, TMA copies, shared memory simulated on the
    CPU). JAX 0.10 does not export its parameters yet; `interpret=True` would take the generic
    interpreter, which cannot run Mosaic GPU's copies."""
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams

    return InterpretGPUParams()


def ragged_paged_attention_gpu_mosaic(
    q: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    md: AttentionMetadata,
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    chunk_pages: int | None = None,
    kv_splits: int | None = None,
    interpret: bool = False,
) -> jax.Array:
    """The op (see `ops.ragged_paged_attention`) as a Pallas Mosaic GPU kernel.

    `chunk_pages` is fixed by the hardware (64 keys a chunk, or one page of 64+ rows) and
    ignored; `kv_splits` (S; default 4 for decode-shaped buckets, 1 when T > 4 R)."""
    T, Hq, D = q.shape
    N, ps, Hkv, _ = k_cache.shape
    R, P = md.block_tables.shape
    G = Hq // Hkv
    supports(q, k_cache)
    Gp = blocks.pow2_ceil(G)
    C = max(1, _SWIZZLE_ELEMS // ps)
    Bq = ROWS // Gp
    S = kv_splits or (1 if T > 4 * R else 4)
    blk_req, blk_idx, NB = blocks.plan_blocks(md, Bq)
    tokens = blocks.block_tokens(md, blk_req, blk_idx, Bq)
    q_blk = blocks.gather_queries(q.astype(k_cache.dtype), tokens, Hkv, Gp)  # [NB, Hkv, 64, D]
    kernel = functools.partial(
        _kernel,
        block_q=Bq,
        group=G,
        group_pad=Gp,
        page_size=ps,
        chunk_pages=C,
        num_splits=S,
        sm_scale=float(sm_scale),
        sliding_window=sliding_window,
        soft_cap=None if soft_cap is None else float(soft_cap),
        interpret=interpret,
    )
    o_part, lse = plgpu.kernel(
        kernel,
        out_type=[
            jax.ShapeDtypeStruct((S, NB, Hkv, ROWS, D), _F32),
            jax.ShapeDtypeStruct((S, NB, Hkv, ROWS), _F32),
        ],
        grid=(NB, Hkv, S),
        grid_names=("b", "h", "s"),
        compiler_params=plgpu.CompilerParams(),
        kernel_name="ragged_paged_attention_gpu_mosaic",
        interpret=_gpu_interpreter() if interpret else False,
    )(
        blk_req,
        blk_idx,
        md.query_start_loc.astype(_I32),
        md.kv_lens.astype(_I32),
        md.block_tables.astype(_I32),
        q_blk,
        k_cache,
        v_cache,
    )
    return blocks.scatter_outputs(blocks.merge_splits(o_part, lse).astype(q.dtype), tokens, T, Hq)
