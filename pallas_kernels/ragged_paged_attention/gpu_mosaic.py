"""Pallas Mosaic GPU ragged paged attention (Hopper): the same op as `gpu.py`'s Triton kernel,
written for JAX's Mosaic GPU backend (TMA copies, wgmma, one warpgroup a program). What `auto`
takes on compute capability 9.x (docs/DESIGN.md §5 says why).

Two kernels share one body, and a call runs both over the ragged batch:

- **decode** (requests with exactly one query this step), grid `(R, Hkv, S)`: one program
  attends the one query of request r for ALL the query heads of KV head h (the GQA group is the
  rows of its wgmma tile: `Mq = G` rounded up to 8 rows are loaded and stored, inside a 64-row
  tile, wgmma's M), over split s of the request's keys (split-KV: S programs a request and KV
  head for long contexts; `gpu_blocks.decode_splits`), and writes `Mq` rows of float32 partial
  output and log-sum-exp. Nothing per query is padded to 64 rows in memory: q is
  `[R, Hkv, Mq, D]`, the partial outputs `[S, R, Hkv, Mq, D]`.
- **prefill** (requests with several queries: prefill, chunked prefill, a prefix hit),
  grid `(NB, Hkv, S)` over query blocks of `Bq = 64 / Gp` queries (`blocks.py`): rows
  (query, group head), all 64 stored. Decode requests own no blocks here, so in a decode step
  every program of this grid exits at once (no copy, no store).

The body: the keys a program reads arrive by TMA, one copy per page and K/V
(the cache `[N, page_size, Hkv * D]` viewed per head, a free reshape: `[page, :, h, :]` is a
strided `[page_size, D]` box: Hopper's TMA has no gather) into
shared memory laid out for wgmma (8-row tiles, 128-byte swizzle), `slots` chunks deep (the
pipeline: chunks c + 1 .. c + slots - 1 are in flight while chunk c is computed; a chunk's
page copies arrive on one barrier; copies past the program's last chunk are not issued, and a
program with nothing to read copies and stores nothing). The decode kernel keeps q in
registers (32 of a thread's at head dim 128), loaded from the memory of a K/V slot that the
pipeline fills after it: a program's shared memory is its K/V chunks alone. Scores `q @ k^T` (wgmma, k transposed in shared memory), the online
softmax in wgmma's register layout, `p @ v` with p from registers. Keys past a sequence's end
get p = 0 (the rows a chunk reads past the end are the cache's own: finite).

Pages: bfloat16/float16 go to wgmma as they are; one-byte pages (fp8 e4m3, int8:
`kv_quant.py`, scales folded into q and the output by the caller) are copied as they are (half
the bytes), then widened chunk by chunk into a 16-bit staging buffer that wgmma reads. q is in
the compute dtype (the cache's, or the model's 16-bit dtype for one-byte pages).

Head dims 64 and 128: at 192 and 256 ptxas spills registers (255 a thread: the float32
accumulator of a 64-row tile alone takes D / 2), so `supports` refuses them and `auto` takes
the Triton kernel. Block sizes (chunk keys, pipeline depth, split target) come from the
per-chip table in `gpu_blocks.py`, and shared memory must fit a Hopper block's 227 KiB.

The splits are combined by log-sum-exp (`blocks.merge_splits`), where attention sinks join
(one more split per row, of output zero: the kernels are the same with or without them).
`interpret=True` runs the
kernels in Pallas's Mosaic GPU interpreter (CPU) with `jnp` products where the wgmmas are (the
interpreter takes no transposed or register operands): copies, barriers, the page walk, the
masks, the widening and the softmax are the kernels' own.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from jaxserve.pallas_kernels.kv_quant import is_quantized
from jaxserve.pallas_kernels.ragged_paged_attention import blocks, gpu_blocks
from jaxserve.pallas_kernels.ragged_paged_attention.metadata import (
    AttentionMetadata,
    head_view,
    num_kv_heads,
)

_F32 = jnp.float32
_I32 = jnp.int32
ROWS = 64  # one warpgroup's wgmma tile (M)
_SWIZZLE = 128  # bytes: the widest wgmma swizzle
HOPPER_SMEM_PER_BLOCK = 232448  # shared_memory_per_block_optin of sm_90 (XLA's H100/H200 specs)
_COMPUTE = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
HEAD_DIMS = (64, 128)


def _transforms(dtype, cols: int):
    """Tiling and swizzle of a [rows, cols] wgmma operand of `dtype` in shared memory."""
    itemsize = jnp.dtype(dtype).itemsize
    swizzle = min(_SWIZZLE, cols * itemsize)
    return (plgpu.TilingTransform((8, swizzle // itemsize)), plgpu.SwizzleTransform(swizzle))


def query_rows(group: int) -> int:
    """Rows of a decode program's q and output: the group, rounded up to 8 (a tile's rows)."""
    return -(-group // 8) * 8


def chunk_size(page_size: int, chunk_keys: int) -> tuple[int, int]:
    """(pages a chunk, keys a chunk)."""
    keys = max(chunk_keys, page_size)
    return keys // page_size, keys


def shared_memory_bytes(head_dim: int, page_size: int, *, cache_itemsize: int = 2,
                        slots: int = 2, chunk_keys: int = 64, rows: int = ROWS) -> int:
    """What a program asks for (an upper estimate of Mosaic GPU's own count): q (16-bit, 64
    rows), `slots` K and V chunks, for one-byte pages one 16-bit K and V staging chunk; the
    float32 output and log-sum-exp reuse that memory after the loop. Plus barriers and the
    1 KiB alignment of swizzled buffers."""
    _, K = chunk_size(page_size, chunk_keys)
    D = head_dim
    main = D * 2 * ROWS + slots * 2 * K * D * cache_itemsize
    if cache_itemsize == 1:
        main += 2 * K * D * 2
    epilogue = rows * D * 4 + rows * 4
    return max(main, epilogue) + 3500


def supports(q: jax.Array, k_cache: jax.Array) -> None:
    """Raise ValueError when the kernel cannot take these shapes."""
    D, ps = q.shape[-1], k_cache.shape[1]
    Hkv = num_kv_heads(k_cache, D)
    G = q.shape[-2] // Hkv if q.ndim == 3 and q.shape[-2] % Hkv == 0 else 1
    cache = jnp.dtype(k_cache.dtype)
    one_byte = is_quantized(cache)
    if cache not in _COMPUTE and not one_byte:
        raise ValueError(
            f"the gpu-mosaic kernel needs a bfloat16, float16, fp8 or int8 cache, got {cache}"
        )
    if one_byte and jnp.dtype(q.dtype) not in _COMPUTE:
        raise ValueError(
            f"the gpu-mosaic kernel reads one-byte pages with bfloat16 or float16 queries, got "
            f"{q.dtype}"
        )
    if D not in HEAD_DIMS:
        raise ValueError(
            f"the gpu-mosaic kernel takes head dims {HEAD_DIMS} (larger ones spill registers: "
            f"the float32 accumulator of a 64-row tile is D / 2 of a thread's 255); got D={D}"
        )
    if ps & (ps - 1) or ps < 8 or ps > 256:
        raise ValueError(
            f"the gpu-mosaic kernel needs a power-of-two page_size in [8, 256], got {ps}"
        )
    if blocks.pow2_ceil(G) > ROWS:
        raise ValueError(
            f"the gpu-mosaic kernel takes at most {ROWS} query heads per KV head, got {G}"
        )
    b = gpu_blocks.lookup(D, cache.itemsize)
    need = shared_memory_bytes(D, ps, cache_itemsize=cache.itemsize,
                               slots=min(b.decode_slots, b.prefill_slots),
                               chunk_keys=b.chunk_keys)
    if need > HOPPER_SMEM_PER_BLOCK:
        raise ValueError(
            f"the gpu-mosaic kernel needs ~{need} bytes of shared memory for head dim {D} and "
            f"pages of {ps}, more than a Hopper block's {HOPPER_SMEM_PER_BLOCK}"
        )


def _kernel(*refs, decode, group, group_pad, block_q, page_size, chunk_pages, slots,
            num_splits, min_split_chunks, q_in_regs, sm_scale, sliding_window, soft_cap,
            interpret):
    if decode:
        qsl_ref, kvl_ref, bt_ref, q_ref, k_ref, v_ref, o_ref, lse_ref = refs
    else:
        blk_req_ref, blk_idx_ref, qsl_ref, kvl_ref, bt_ref, q_ref, k_ref, v_ref, o_ref, lse_ref = (
            refs)
    b, h, s = lax.axis_index("b"), lax.axis_index("h"), lax.axis_index("s")

    def iota(shape, dim):
        if interpret:  # the interpreter keeps no register layouts
            return lax.broadcasted_iota(_I32, shape, dim)
        return plgpu.broadcasted_iota(_I32, shape, dim, layout=plgpu.Layout.WGMMA)

    def cast(x, layout):
        return x if interpret else plgpu.layout_cast(x, layout)

    ps, C = page_size, chunk_pages
    K = C * ps
    Mq, D = q_ref.shape[-2:]
    P = bt_ref.shape[1]
    dtype = q_ref.dtype
    staged = k_ref.dtype != dtype  # one-byte pages, widened in shared memory

    if decode:
        r = b
        q_end = qsl_ref[r + 1]
        nq = jnp.where(q_end - qsl_ref[r] == 1, 1, 0)  # this kernel's request, or nothing
    else:
        r = blk_req_ref[b]
        j = blk_idx_ref[b]
        q_end = qsl_ref[r + 1]
        t0 = qsl_ref[r] + jnp.maximum(j, 0) * block_q
        nq = jnp.where(j >= 0, jnp.minimum(block_q, q_end - t0), 0)
    pos0 = kvl_ref[r] - (q_end - qsl_ref[r] if decode else q_end - t0)  # first query's position
    hi = pos0 + nq  # keys < hi
    lo = 0 if sliding_window is None else jnp.maximum(pos0 - sliding_window + 1, 0)
    first = lo // K  # chunks are K-aligned key ranges: chunk c holds pages c*C .. c*C + C - 1
    n_chunks = jnp.where(nq > 0, blocks.cdiv(hi, K) - first, 0)
    per_split = jnp.maximum(blocks.cdiv(n_chunks, num_splits), min_split_chunks)
    c_lo = first + s * per_split
    n = jnp.clip(n_chunks - s * per_split, 0, per_split)  # this program's chunks
    live = nq > 0

    def fetch(i, slot, k_dst, v_dst, k_bar, v_bar):
        """Copy chunk c_lo + i into `slot`, unless it is past the program's last."""

        @pl.when(i < n)
        def _():
            for p in range(C):
                page = bt_ref[r, jnp.minimum((c_lo + i) * C + p, P - 1)]
                dst = pl.ds(p * ps, ps)
                plgpu.copy_gmem_to_smem(
                    k_ref.at[page, :, h, :], k_dst.at[slot, dst], k_bar.at[slot]
                )
                plgpu.copy_gmem_to_smem(
                    v_ref.at[page, :, h, :], v_dst.at[slot, dst], v_bar.at[slot]
                )

    def main(k_smem, v_smem, q_bar, k_bar, v_bar, *extra):
        if q_in_regs:  # q waits in memory a chunk uses later: slot 0, or K's staging buffer
            stage = extra
            q_smem = stage[0] if staged else k_smem.at[0]
        else:
            q_smem, *stage = extra

        def slot_of(i):  # slot 0 holds q until the loop starts: chunk i goes to slot i + 1
            return lax.rem(i + 1 if q_in_regs and not staged else i, slots)

        @pl.when(live)
        def _():
            plgpu.copy_gmem_to_smem(q_ref.at[b, h], q_smem.at[pl.ds(0, Mq)], q_bar)

        for i in range(slots - 1):
            fetch(i, slot_of(i), k_smem, v_smem, k_bar, v_bar)

        @pl.when(live)
        def _():
            plgpu.barrier_wait(q_bar)

        q_op = q_smem
        if q_in_regs:  # rows past Mq are whatever the memory held: their scores are masked
            q_op = q_smem[pl.ds(0, ROWS)]
            plgpu.commit_smem()  # every thread has read q before a copy overwrites it
        elif interpret:
            q_op = q_smem[...]

        rows, cols = iota((ROWS, K), 0), iota((ROWS, K), 1)
        if decode:
            row_pos = pos0
            row_ok = rows < group
        else:
            row_pos = pos0 + rows // group_pad
            row_ok = (rows // group_pad < nq) & (rows % group_pad < group)
        m0 = cast(jnp.full((ROWS,), -jnp.inf, _F32), plgpu.Layout.WGMMA.reduce(1))
        l0 = cast(jnp.full((ROWS,), 0.0, _F32), plgpu.Layout.WGMMA.reduce(1))
        a0 = cast(jnp.full((ROWS, D), 0.0, _F32), plgpu.Layout.WGMMA)

        def operand(src, slot, dst):
            """The chunk in `slot` as wgmma reads it: as copied (16-bit pages), or widened
            into the staging buffer `dst` (one-byte pages)."""
            if not staged:
                return src.at[slot]
            x = src[slot]
            if x.dtype == jnp.float8_e4m3fn and dtype != jnp.float16:
                x = x.astype(jnp.float16)  # Hopper widens e4m3 to f16 only; exact in bf16
            dst[...] = x.astype(dtype)
            plgpu.commit_smem()  # the stores, visible to wgmma
            return dst

        def body(i, carry):
            acc, m, den = carry
            slot = slot_of(i)
            ahead = i + slots - 1  # its slot was chunk i - 1's, done
            fetch(ahead, slot_of(ahead), k_smem, v_smem, k_bar, v_bar)
            plgpu.barrier_wait(k_bar.at[slot])  # the chunk's C page copies arrive on it
            k_op = operand(k_smem, slot, stage[0] if staged else None)
            if interpret:
                sc = lax.dot_general(q_op, k_op[...], (((1,), (1,)), ((), ())),
                                     preferred_element_type=_F32)
            else:

                def qk(acc_ref):
                    plgpu.wgmma(acc_ref, q_op, k_op.T)
                    return acc_ref[...]

                sc = pl.run_scoped(qk, plgpu.ACC((ROWS, K), _F32))
            sc = sc * sm_scale
            if soft_cap is not None:
                sc = soft_cap * jnp.tanh(sc / soft_cap)
            kpos = (c_lo + i) * K + cols
            mask = (kpos <= row_pos) & row_ok
            if sliding_window is not None:
                mask &= kpos > row_pos - sliding_window
            sc = jnp.where(mask, sc, -jnp.inf)
            m_new = jnp.maximum(m, sc.max(axis=1))
            base = jnp.where(m_new == -jnp.inf, 0.0, m_new)
            p_ = jnp.exp(sc - lax.broadcast_in_dim(base, sc.shape, [0]))
            alpha = jnp.exp(m - base)
            l_new = alpha * den + p_.sum(axis=1)
            plgpu.barrier_wait(v_bar.at[slot])
            v_op = operand(v_smem, slot, stage[1] if staged else None)
            if interpret:
                pv = lax.dot_general(p_.astype(dtype), v_op[...], (((1,), (0,)), ((), ())),
                                     preferred_element_type=_F32)
            else:

                def pv_fn(acc_ref):
                    plgpu.wgmma(acc_ref, p_.astype(dtype), v_op)
                    return acc_ref[...]

                pv = pl.run_scoped(pv_fn, plgpu.ACC((ROWS, D), _F32))
            return acc * lax.broadcast_in_dim(alpha, acc.shape, [0]) + pv, m_new, l_new

        return lax.fori_loop(0, n, body, (a0, m0, l0))

    kv_dtype = k_ref.dtype
    scratch = [
        plgpu.SMEM((slots, K, D), kv_dtype, transforms=_transforms(kv_dtype, D)),
        plgpu.SMEM((slots, K, D), kv_dtype, transforms=_transforms(kv_dtype, D)),
        plgpu.Barrier(num_barriers=1),
        plgpu.Barrier(num_arrivals=C, num_barriers=slots),
        plgpu.Barrier(num_arrivals=C, num_barriers=slots),
    ]
    if not q_in_regs:
        scratch.append(plgpu.SMEM((ROWS, D), dtype, transforms=_transforms(dtype, D)))
    if staged:
        scratch += [plgpu.SMEM((K, D), dtype, transforms=_transforms(dtype, D))] * 2
    acc, m, den = pl.run_scoped(main, *scratch)

    def epilogue(o_smem, lse_smem):  # in the memory the loop used
        l_safe = jnp.where(den > 0, den, 1.0)
        o_smem[...] = acc / lax.broadcast_in_dim(l_safe, acc.shape, [0])
        lse_smem[...] = jnp.where(den > 0, m + jnp.log(l_safe), -jnp.inf)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_smem.at[pl.ds(0, Mq)], o_ref.at[s, b, h])
        plgpu.copy_smem_to_gmem(lse_smem.at[pl.ds(0, Mq)], lse_ref.at[s, b, h])
        plgpu.wait_smem_to_gmem(0)

    @pl.when(live)
    def _():
        pl.run_scoped(epilogue, plgpu.SMEM((ROWS, D), _F32), plgpu.SMEM((ROWS,), _F32))


def _gpu_interpreter():
    """Pallas's Mosaic GPU interpreter (barriers, TMA copies, shared memory simulated on the
    CPU). JAX 0.10 does not export its parameters yet; `interpret=True` would take the generic
    interpreter, which cannot run Mosaic GPU's copies."""
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams

    return InterpretGPUParams()


def _call(kernel, name, out_shape, grid, args, interpret):
    return plgpu.kernel(
        kernel,
        out_type=[jax.ShapeDtypeStruct(out_shape, _F32),
                  jax.ShapeDtypeStruct(out_shape[:-1], _F32)],
        grid=grid,
        grid_names=("b", "h", "s"),
        compiler_params=plgpu.CompilerParams(),
        kernel_name=name,
        interpret=_gpu_interpreter() if interpret else False,
    )(*args)


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
    prefill_splits: int | None = None,
    decode_slots: int | None = None,
    prefill_slots: int | None = None,
    chunk_keys: int | None = None,
    interpret: bool = False,
    sinks: jax.Array | None = None,
) -> jax.Array:
    """The op (see `ops.ragged_paged_attention`) as two Pallas Mosaic GPU kernels (decode
    rows, and query blocks of the requests with several queries). `sinks`: [Hq]
    attention-sink logits, or None; they join the splits' combine (`blocks.merge_splits`), the
    kernels are the same with and without them.

    Block sizes default to the chip's entry of `gpu_blocks` (the table); `kv_splits` (the
    decode grid's S), `prefill_splits` (1 when T > 4 R, else 4), `decode_slots`,
    `prefill_slots` (pipeline depths) and `chunk_keys` override it (the benchmark's sweep,
    tests). `chunk_pages` (the op's knob for the reference) is ignored: a chunk is
    `chunk_keys` keys."""
    T, Hq, D = q.shape
    N, ps, _ = k_cache.shape
    Hkv = num_kv_heads(k_cache, D)
    R, P = md.block_tables.shape
    G = Hq // Hkv
    supports(q, k_cache)
    k_cache, v_cache = head_view(k_cache, D), head_view(v_cache, D)  # free: row-major
    tb = gpu_blocks.lookup(D, jnp.dtype(k_cache.dtype).itemsize)
    C, K = chunk_size(ps, chunk_keys or tb.chunk_keys)
    dtype = q.dtype if is_quantized(k_cache.dtype) else k_cache.dtype
    q = q.astype(dtype)
    qsl = md.query_start_loc.astype(_I32)
    kvl = md.kv_lens.astype(_I32)
    bt = md.block_tables.astype(_I32)
    live = jnp.arange(R, dtype=_I32) < md.num_seqs.astype(_I32)
    q_len = jnp.where(live, qsl[1:] - qsl[:-1], 0)
    qsl = jnp.concatenate([qsl[:1], qsl[0] + jnp.cumsum(q_len)])  # padding requests: empty
    common = dict(group=G, page_size=ps, chunk_pages=C, sm_scale=float(sm_scale),
                  sliding_window=sliding_window,
                  soft_cap=None if soft_cap is None else float(soft_cap), interpret=interpret)

    # Decode: one program per (request, KV head, split); rows are the group's heads.
    Mq = query_rows(G)
    S = kv_splits or gpu_blocks.decode_splits(tb, R, Hkv, P * ps)
    min_chunks = max(1, tb.min_split_keys // K) if kv_splits is None else 1
    tok = jnp.clip(qsl[1:] - 1, 0, T - 1)  # a decode request's one token
    q_dec = q[tok].reshape(R, Hkv, G, D)
    q_dec = jnp.pad(q_dec, ((0, 0), (0, 0), (0, Mq - G), (0, 0)))
    kernel = functools.partial(_kernel, decode=True, group_pad=G, block_q=1,
                               slots=decode_slots or tb.decode_slots, num_splits=S,
                               min_split_chunks=min_chunks, q_in_regs=True, **common)
    o_dec, lse_dec = _call(kernel, "ragged_paged_attention_gpu_mosaic_decode",
                           (S, R, Hkv, Mq, D), (R, Hkv, S),
                           (qsl, kvl, bt, q_dec, k_cache, v_cache), interpret)
    o_dec = blocks.merge_splits(
        o_dec, lse_dec, None if sinks is None else blocks.row_sinks(sinks, Hkv, Mq, 1)[None]
    )[:, :, :G].reshape(R, Hq, D)
    dest = jnp.where(q_len == 1, tok, T)  # other requests' rows: dropped
    out = jnp.zeros((T, Hq, D), q.dtype).at[dest].set(o_dec.astype(q.dtype), mode="drop")
    if T < 2:  # no request can have several queries
        return out

    # Prefill: query blocks of the requests with several queries (decode requests own none).
    Gp = blocks.pow2_ceil(G)
    Bq = ROWS // Gp
    multi = jnp.where(q_len > 1, q_len, 0)
    # The blocks are planned over the multi-query requests alone (a request's block count
    # from its query count), then read their tokens where the batch has them. At most
    # min(R, T / 2) requests have several queries, each adding at most one partial block.
    plan_md = AttentionMetadata(
        block_tables=bt, kv_lens=kvl,
        query_start_loc=jnp.concatenate([qsl[:1], qsl[0] + jnp.cumsum(multi)]),
        num_seqs=md.num_seqs, slot_mapping=md.slot_mapping)
    nb_max = blocks.cdiv(T, Bq) + min(R, T // 2)
    blk_req, blk_idx, _ = blocks.plan_blocks(plan_md, Bq, num_blocks=nb_max)
    S_pf = prefill_splits or (1 if T > 4 * R else 4)
    batch_md = AttentionMetadata(block_tables=bt, kv_lens=kvl, query_start_loc=qsl,
                                 num_seqs=md.num_seqs, slot_mapping=md.slot_mapping)
    tokens = blocks.block_tokens(batch_md, blk_req, blk_idx, Bq)  # the batch's token indices
    q_blk = blocks.gather_queries(q, tokens, Hkv, Gp)  # [NB, Hkv, 64, D]
    kernel = functools.partial(_kernel, decode=False, group_pad=Gp, block_q=Bq,
                               slots=prefill_slots or tb.prefill_slots, num_splits=S_pf,
                               min_split_chunks=1, q_in_regs=False, **common)
    o_pf, lse_pf = _call(kernel, "ragged_paged_attention_gpu_mosaic_prefill",
                         (S_pf, nb_max, Hkv, ROWS, D), (nb_max, Hkv, S_pf),
                         (blk_req, blk_idx, qsl, kvl, bt, q_blk, k_cache, v_cache), interpret)
    o_pf = blocks.merge_splits(
        o_pf, lse_pf, None if sinks is None else blocks.row_sinks(sinks, Hkv, Gp, Bq)[None]
    ).astype(q.dtype)
    return blocks.scatter_outputs(o_pf, tokens, T, Hq, out=out)
