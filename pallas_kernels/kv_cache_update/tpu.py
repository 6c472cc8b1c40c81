"""Pallas TPU write of new K/V rows into a one-byte (fp8, int8) paged cache, in place.

Why a kernel. XLA:TPU lays out a one-byte cache `[N, ps, Hkv * D]` (`Hkv * D` a multiple of
128) with a page's rows in the tiled second-minor dimension: whole (32, 128) tiles in which
four rows share each 32-bit word. XLA's scatter of token rows into that layout is not in place:
it copies the layer array to another tiling, scatters and copies it back (the write of 64 rows
into a v6e layer cache of 4,097 pages of 32 rows of 1,024 bytes: 270 MB accessed). (A 16-bit
cache packs two rows a word, and there XLA's scatter is in place; so it is for 32-bit caches.)

View. The kernel takes the cache as `[N, 1, ps, Hkv * D]` (a bitcast), aliased input to
output. One token's row is not addressable by a DMA; four rows are (a quad: rows 4i..4i+3 of a
page, one packed sublane row; Mosaic accepts DMAs of 4-aligned 4-row slices of an 8-bit array,
not of single rows, and vector loads of whole (32, 128) tiles only). So the write works on
quads, listed by `quad_plan.plan_tasks` (XLA, on T-element arrays): a task is the rows one run
of consecutive slots writes in one quad.

Kernel. Grid over blocks of `quads_per_block` tasks. Per block: a whole task (all four rows
new) is one DMA from the shifted copy of the new rows (`quad_plan.shifted_rows`: there the
run's quads are aligned quads) into the cache, HBM to HBM; any other task's quad and its new
quad are DMA'd into VMEM (task j of the block at rows 4j..4j+3 of the buffers), merged under
the row mask by one vector select over the block's buffers, and DMA'd back. All DMAs of a kind
are started, then waited. Tasks of a block never share a quad unless serial (`quad_plan`);
serial tasks run last, one at a time (read, merge, write, wait), in the last grid step. The
cache is touched only through these DMAs: the bytes moved are the touched quads (read and
written, or only written when whole) and the new rows, never the layer array.

Shapes it takes (`supports`): a one-byte cache with lane-dense rows (`Hkv * D` a multiple of
128: `rows_are_second_minor`) and pages of a multiple of 32 rows (whole tiles per page, as the
attention kernel needs for one-byte pages). The ops module sends the others to the reference
scatter.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from jaxserve.pallas_kernels.kv_cache_update.quad_plan import (
    ROWS_PER_WORD,
    plan_tasks,
    shifted_rows,
    unpack_info,
)


def rows_are_second_minor(k_cache) -> bool:
    """Whether XLA:TPU's default layout of the one-byte cache `k_cache` ([N, ps, Hkv * D]) puts
    the page's rows in the tiled second-minor dimension, four to a word ({2,1,0}), as it does
    when the rows are whole lane tiles (`Hkv * D` a multiple of 128). Other widths put the pages
    in the lanes ({0,2,1}): no row DMA reaches a token there."""
    return jnp.dtype(k_cache.dtype).itemsize == 1 and k_cache.shape[2] % 128 == 0


def supports(k_cache) -> None:
    """Raise ValueError when the kernel cannot write into `k_cache` ([N, ps, Hkv * D]) in place."""
    _, ps, width = k_cache.shape
    if not rows_are_second_minor(k_cache):
        raise ValueError(
            f"the tpu write kernel is for one-byte caches with lane-dense rows (Hkv * D a "
            f"multiple of 128); got {k_cache.dtype} rows of {width}")
    if ps % 32:
        raise ValueError(f"the tpu write kernel needs page_size to be a multiple of 32 for "
                         f"one-byte caches (whole (32, 128) tiles per page); got {ps}")


def _kernel(
    quads_ref, info_ref, count_ref, serial_ref, serial_count_ref,  # scalar prefetch (SMEM)
    row_mask_ref,  # VMEM block [R, 1] int32: the rows the block's tasks write
    k_new, v_new,  # HBM [4, 1, rows, Hkv * D]: the shifted copies of the new rows
    k_in, v_in,  # the caches, HBM [N, 1, ps, Hkv * D] (aliased to the outputs)
    k_out, v_out,  # the same buffers
    k_old, v_old, k_add, v_add,  # VMEM [1, R, Hkv * D]: quads read from the cache; their new rows
    sem,  # DMA semaphores [2]: reads, writes
    *, quads_per_block, quads_per_page, num_blocks,
):
    del k_in, v_in  # read and written through the outputs (the same memory)
    w = ROWS_PER_WORD
    base = pl.program_id(0) * quads_per_block
    n = jnp.clip(count_ref[0] - base, 0, quads_per_block)
    pairs = ((k_new, k_out, k_old, k_add), (v_new, v_out, v_old, v_add))

    def task(i):
        _, shift, whole, serial, src = unpack_info(info_ref[i])
        quad = quads_ref[i]
        page = lax.div(quad, quads_per_page)  # non-negative: truncation is floor
        row = pl.multiple_of(lax.rem(quad, quads_per_page) * w, w)
        return page, row, shift, pl.multiple_of(src, w), whole, serial

    def slot(buf, j):
        return buf.at[:, pl.ds(pl.multiple_of(j * w, w), w)]

    def dmas(i, j, what):
        """Task i's DMAs of one kind, K then V (j: its slot in the block's buffers)."""
        page, row, shift, src, _, _ = task(i)
        out = []
        for new, cache, old, add in pairs:
            quad, new_quad = cache.at[page, :, pl.ds(row, w)], new.at[shift, :, pl.ds(src, w)]
            if what == "write_whole":
                out.append(pltpu.make_async_copy(new_quad, quad, sem.at[1]))
            elif what == "read":
                out.append(pltpu.make_async_copy(quad, slot(old, j), sem.at[0]))
                out.append(pltpu.make_async_copy(new_quad, slot(add, j), sem.at[0]))
            else:  # "write_merged"
                out.append(pltpu.make_async_copy(slot(old, j), quad, sem.at[1]))
        return out

    def each_task(fn, whole_part, partial_part):
        def body(j, carry):
            i = base + j
            whole, serial = task(i)[4:]
            partial = (whole == 0) & (serial == 0)
            for what, when in ((whole_part, whole == 1), (partial_part, partial)):
                if what is not None:
                    @pl.when(when)
                    def _(what=what):
                        for c in dmas(i, j, what):
                            fn(c)
            return carry
        lax.fori_loop(0, n, body, 0)

    # Whole quads: written from the new rows. The others: read, merged, written back.
    each_task(lambda c: c.start(), "write_whole", "read")
    each_task(lambda c: c.wait(), None, "read")
    new = row_mask_ref[...] != 0  # [R, 1]
    for _, _, old, add in pairs:
        for h in range(old.shape[0]):
            old[h] = jnp.where(new, add[h], old[h])
    each_task(lambda c: c.start(), None, "write_merged")
    each_task(lambda c: c.wait(), "write_whole", "write_merged")

    # Serial tasks, one at a time after all the others (the last block): each reads its quad
    # as the tasks before it left it. Through the first tile of the buffers.
    @pl.when(pl.program_id(0) == num_blocks - 1)
    def _serial():
        rows = lax.broadcasted_iota(jnp.int32, (k_old.shape[0], 8 * w, k_old.shape[2]), 1)

        def body(m, carry):
            i = serial_ref[m]
            mask = unpack_info(info_ref[i])[0]
            for c in dmas(i, 0, "read"):
                c.start()
            for c in dmas(i, 0, "read"):
                c.wait()
            keep = (rows < w) & (((mask >> rows) & 1) == 1)
            for _, _, old, add in pairs:
                old[:, : 8 * w] = jnp.where(keep, add[:, : 8 * w], old[:, : 8 * w])
            for c in dmas(i, 0, "write_merged"):
                c.start()
            for c in dmas(i, 0, "write_merged"):
                c.wait()
            return carry

        lax.fori_loop(0, serial_count_ref[0], body, 0)


def write_kv_tpu(
    k_cache: jax.Array,
    v_cache: jax.Array,
    k: jax.Array,
    v: jax.Array,
    slot_mapping: jax.Array,
    *,
    quads_per_block: int = 64,
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """`write_kv_reference`'s semantics for the caches `supports` takes, by DMA into the
    aliased caches. `interpret=True` runs the kernel in TPU interpret mode (any backend)."""
    supports(k_cache)
    n, ps, width = k_cache.shape
    t = slot_mapping.shape[0]
    dtype = k_cache.dtype
    tasks = plan_tasks(slot_mapping, n * ps)
    rows = pl.cdiv(t + 2 * ROWS_PER_WORD, 32) * 32  # whole (32, 128) tiles
    # The kernel's view: one "head" of whole rows (all KV heads of a token, lane-dense).
    hkv, d = 1, width
    k_new, v_new = (shifted_rows(x.astype(dtype).reshape(t, hkv, d), rows) for x in (k, v))

    qb = min(quads_per_block, pl.cdiv(t, 8) * 8)  # a multiple of 8: whole tiles of quads
    blocks = pl.cdiv(t, qb)
    pad = blocks * qb - t
    quads, info, serial = (jnp.pad(x, (0, pad)) for x in (tasks.quads, tasks.info, tasks.serial))
    row_mask = jnp.pad(tasks.row_mask, ((0, pad * ROWS_PER_WORD), (0, 0)))
    r = qb * ROWS_PER_WORD

    def live_block(g, quads_ref, info_ref, count_ref, *_):
        # Blocks past the live ones map to the last live block: nothing is fetched again.
        return (jnp.minimum(g, jnp.maximum(pl.cdiv(count_ref[0], qb) - 1, 0)), 0)

    any_ = pl.BlockSpec(memory_space=pl.ANY)
    kernel = functools.partial(_kernel, quads_per_block=qb, quads_per_page=ps // ROWS_PER_WORD,
                               num_blocks=blocks)
    quad_bytes = hkv * ROWS_PER_WORD * d * jnp.dtype(dtype).itemsize
    # At most: each of the T tasks reads a cache quad and a new quad and writes one, K and V.
    bytes_moved = 2 * 3 * t * quad_bytes + row_mask.size * 4 + 5 * 4 * t
    # The caches as [N, 1, ps, Hkv * D]: a bitcast.
    k_view, v_view = (x.reshape(n, hkv, ps, d) for x in (k_cache, v_cache))
    buf = pltpu.VMEM((hkv, r, d), dtype)
    k_pages, v_pages = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=5,
            grid=(blocks,),
            in_specs=[pl.BlockSpec((r, 1), live_block), any_, any_, any_, any_],
            out_specs=[any_, any_],
            scratch_shapes=[buf, buf, buf, buf, pltpu.SemaphoreType.DMA((2,))],
        ),
        out_shape=[jax.ShapeDtypeStruct(k_view.shape, dtype)] * 2,
        # Operands: 5 scalar arrays, row_mask, k_new, v_new, k cache, v cache.
        input_output_aliases={8: 0, 9: 1},
        # Sequential: the last block runs the serial tasks after every other block's.
        compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary",)),
        cost_estimate=pl.CostEstimate(flops=0, transcendentals=0, bytes_accessed=bytes_moved),
        interpret=pltpu.InterpretParams() if interpret else False,
        name="write_kv_tpu",
    )(quads, info, tasks.count, serial, tasks.serial_count, row_mask, k_new, v_new,
      k_view, v_view)
    return k_pages.reshape(n, ps, width), v_pages.reshape(n, ps, width)
