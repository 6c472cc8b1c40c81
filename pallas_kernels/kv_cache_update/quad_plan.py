"""The work list of the TPU write of one-byte K/V: which cache quads the step writes, and how.

A quad is four rows of a page (rows 4i..4i+3): in XLA:TPU's layout of a one-byte cache, four
rows share each 32-bit word, and a quad is the smallest DMA-addressable unit (`tpu.py`).

Runs. Tokens whose slots follow one another (slot[t] = slot[t-1] + 1) form a run; a request's
chunk is one run (or one per page), padding tokens another. Quads never straddle pages, so a
run's quads are its rows grouped by slot // 4. A task is one quad of one run: it starts at
the run's first token or at a token whose slot is a multiple of 4, and covers the run's rows
in that quad (`mask`, bit r for row r). A task with all four rows is whole: the kernel writes
it with one DMA, no read. At most T tasks.

Shifted copies. Row r of a quad must come from the token with slot 4q + r, and DMAs move whole
quads, so a run's token t must sit at a row congruent to its slot mod 4. `shifted_rows` gives
four copies of the new rows, copy d holding token t at row t + d; a run uses copy
`(slot - t) mod 4`, where its quads are aligned quads.

Conflicts. A task that is not whole and whose quad another task also writes (tokens writing
the same quad from different runs: padding tokens wrapping around the null page, arbitrary
slot mappings) is serial: the kernel does those one at a time, after every other task, so that
each reads the quad as the others left it. Whole tasks need no order (they only write; tasks
sharing a slot: one of them wins, as with the reference scatter).

Everything here is elementwise, cumulative, sorts, or scatters of T int32 values: no gather
or scatter of rows (XLA:TPU's row gathers from packed 8-bit arrays cost a tile a row).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

ROWS_PER_WORD = 4  # 8-bit rows packed in one 32-bit sublane word: a quad
_I32 = jnp.int32
# Bits of a task's `info`: the row mask (4), then the shift d (2), whole (1), serial (1), then
# the quad's first row in copy d.
_MASK_BITS, _SHIFT_AT, _WHOLE_AT, _SERIAL_AT, _SRC_AT = 4, 4, 6, 7, 8


class QuadTasks(NamedTuple):
    quads: jax.Array  # [T] int32: task i's quad, as slot // 4 (tasks past `count`: 0)
    info: jax.Array  # [T] int32: task i's mask, shift, whole and serial bits and source row
    count: jax.Array  # [1] int32: number of tasks
    serial: jax.Array  # [T] int32: the serial tasks' indices, in step order
    serial_count: jax.Array  # [1] int32
    row_mask: jax.Array  # [4T, 1] int32: row 4i + r is 1 where task i writes row r


def unpack_info(info):
    """(mask, shift, whole, serial, source row) of a task's `info` (jnp or traced scalars)."""
    mask = info & ((1 << _MASK_BITS) - 1)
    shift = (info >> _SHIFT_AT) & 3
    whole = (info >> _WHOLE_AT) & 1
    serial = (info >> _SERIAL_AT) & 1
    return mask, shift, whole, serial, info >> _SRC_AT


def plan_tasks(slot_mapping: jax.Array, num_slots: int) -> QuadTasks:
    """The tasks writing the tokens of `slot_mapping` ([T]) into a cache of `num_slots` slots
    (slots outside it are dropped)."""
    t = slot_mapping.shape[0]
    tok = jnp.arange(t, dtype=_I32)
    s = slot_mapping.astype(_I32)
    valid = (s >= 0) & (s < num_slots)
    prev_s = jnp.concatenate([jnp.full((1,), -2, _I32), s[:-1]])
    prev_valid = jnp.concatenate([jnp.zeros((1,), bool), valid[:-1]])
    run_start = valid & ~(prev_valid & (s == prev_s + 1))
    row = s & (ROWS_PER_WORD - 1)
    leader = valid & (run_start | (row == 0))
    # The last token of each token's run: the first run end at or after it.
    next_start = jnp.concatenate([run_start[1:] | ~valid[1:], jnp.ones((1,), bool)])
    run_end = lax.cummin(jnp.where(valid & next_start, tok, t), reverse=True)
    hi = jnp.minimum(ROWS_PER_WORD - 1, row + (run_end - tok))
    mask = ((1 << (hi + 1)) - 1) & ~((1 << row) - 1)
    whole = mask == (1 << ROWS_PER_WORD) - 1
    shift = (s - tok) & (ROWS_PER_WORD - 1)
    src = tok + shift - row  # the quad's first row in copy `shift`: a multiple of 4
    quad = s >> 2

    # Compact the leaders into the task list (in step order).
    idx = jnp.cumsum(leader.astype(_I32)) - 1
    count = jnp.sum(leader.astype(_I32))
    at = jnp.where(leader, idx, t)  # non-leaders dropped
    quads = jnp.zeros((t,), _I32).at[at].set(quad, mode="drop")
    info = (mask | (shift << _SHIFT_AT) | (whole.astype(_I32) << _WHOLE_AT)
            | (src << _SRC_AT))
    info = jnp.zeros((t,), _I32).at[at].set(info, mode="drop")

    # Serial tasks: not whole, and their quad is another task's too.
    live = tok < count
    key = jnp.where(live, quads, jnp.iinfo(jnp.int32).max - tok)  # dead tasks: distinct keys
    sk, order = lax.sort((key, tok), num_keys=1)
    dup = jnp.concatenate([sk[1:] == sk[:-1], jnp.zeros((1,), bool)])
    shared_sorted = dup | jnp.concatenate([jnp.zeros((1,), bool), dup[:-1]])
    shared = jnp.zeros((t,), bool).at[order].set(shared_sorted)
    serial = live & shared & ((info >> _WHOLE_AT) & 1 == 0)
    info = info | (serial.astype(_I32) << _SERIAL_AT)
    sidx = jnp.cumsum(serial.astype(_I32)) - 1
    serial_list = jnp.zeros((t,), _I32).at[jnp.where(serial, sidx, t)].set(tok, mode="drop")
    serial_count = jnp.sum(serial.astype(_I32))

    task_mask = jnp.where(live, info & ((1 << _MASK_BITS) - 1), 0)
    bits = (task_mask[:, None] >> jnp.arange(ROWS_PER_WORD, dtype=_I32)[None, :]) & 1
    return QuadTasks(quads, info, count.reshape(1), serial_list, serial_count.reshape(1),
                     bits.reshape(ROWS_PER_WORD * t, 1))


def shifted_rows(x: jax.Array, rows: int) -> jax.Array:
    """x: [T, Hkv, D] -> [4, Hkv, rows, D]: copy d holds token t at row t + d (zeros elsewhere).
    A task's quad starts at most at row T + 2: `rows` >= T + 6."""
    t = x.shape[0]
    xt = x.transpose(1, 0, 2)
    return jnp.stack([jnp.pad(xt, ((0, 0), (d, rows - t - d), (0, 0)))
                      for d in range(ROWS_PER_WORD)])
