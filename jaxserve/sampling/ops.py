"""Row-wise reductions over [R, V] used by the sampler, written for XLA's CPU backend too.

On the CPU, XLA's variadic (value, index) reductions and its comparator sort are slow (at
R=32, V=49152: jnp.argmax ~3 ms, lax.top_k(64) ~5 ms, a full sort ~400 ms), while plain
single-operand reductions over blocks are cheap (~0.4 ms). So the vocabulary is viewed as
[R, nb, b] blocks: a block-level reduction picks the block(s), and the exact answer comes from
gathered blocks only. Every helper is exact (same result as the obvious full-width formula).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.models.sharding import same_on_every_rank

NEG_INF = float("-inf")

# probes of one pass over the row: the bracket's lower end, VALUE_PROBES spread evenly over its
# values and KEY_PROBES over its float32 keys (the latter cut the bracket's keys 16-fold a pass)
VALUE_PROBES = 15
KEY_PROBES = 15
# passes that close any bracket: its keys (at most 2**32) shrink (KEY_PROBES + 1)-fold a pass
MAX_PASSES = 8


def batch_cond(flag, true_fn, false_fn, *operands):
    """`lax.cond` on a batch-wide flag, taken the same way on every data-parallel rank (a rank's
    branch may hold collectives over the other mesh axes: see sharding.same_on_every_rank)."""
    return jax.lax.cond(same_on_every_rank(flag), true_fn, false_fn, *operands)


def unshared_on_gpu(x: jax.Array) -> jax.Array:
    """x, on a GPU through an optimization barrier: a new value that XLA:GPU cannot merge with
    x, so that two reductions of the same elementwise function of x (the probabilities of the
    logits) each compute it where they read x, rather than one of them writing it, an [R, V]
    array, for the other to read back. (On a TPU the barrier costs more than it saves: XLA
    then writes broadcasts of per-row values, [R, V] arrays, for the branch that reads x.)"""

    def barrier(y):
        return jax.lax.optimization_barrier(y)

    return jax.lax.platform_dependent(x, cuda=barrier, rocm=barrier, default=lambda y: y)


def block_size(V: int, target: int) -> int:
    """Largest power of two <= target dividing V with at least two blocks; 1 if none >= 4."""
    b = 1
    while b * 2 <= target and V % (b * 2) == 0 and V // (b * 2) >= 2:
        b *= 2
    return b if b >= 4 else 1


def top_k_block(V: int, k: int) -> int:
    """The block width top_k_exact uses for k of V by default (1: none, lax.top_k runs)."""
    return block_size(V, max(4, min(64, V // (4 * k))))


def block_max(x: jax.Array, b: int) -> jax.Array | None:
    """[R, V] -> [R, V // b] the maximum of each block of b (None when b == 1): one pass over x
    that argmax_first, top_k_exact and the row max can share."""
    return None if b == 1 else block_reduce(x, b, "max")


def block_reduce(x: jax.Array, b: int, op: str) -> jax.Array:
    """[R, V] -> [R, V // b]: the max or sum (`op`) of each block of b columns. On a TPU a
    reduce-window over x as it lies (x reshaped to [R, V // b, b] splits its lanes: a relayout,
    one more pass over it, before the reduction reads it); elsewhere the reshape's reduction."""
    R, V = x.shape
    init, fn = (-jnp.inf, jax.lax.max) if op == "max" else (0, jax.lax.add)

    def windows(y):
        return jax.lax.reduce_window(y, jnp.asarray(init, y.dtype), fn, (1, b), (1, b), "VALID")

    def blocks(y):
        yb = y.reshape(R, V // b, b)
        return yb.max(-1) if op == "max" else yb.sum(-1, dtype=y.dtype)

    return jax.lax.platform_dependent(x, tpu=windows, default=blocks)


def take_blocks(x: jax.Array, blk: jax.Array, b: int) -> jax.Array:
    """[R, V], block ids [R, k] -> [R, k, b] the elements of those blocks. On a TPU gathered
    from x itself by column (x reshaped to blocks is a relayout there: a pass); elsewhere from
    the blocks' view."""
    R, V = x.shape
    k = blk.shape[1]

    def by_column(y, i):
        cols = (i[:, :, None] * b + jnp.arange(b, dtype=i.dtype)).reshape(R, k * b)
        return jnp.take_along_axis(y, cols, axis=1).reshape(R, k, b)

    def by_block(y, i):
        return jnp.take_along_axis(y.reshape(R, V // b, b), i[:, :, None], axis=1)

    return jax.lax.platform_dependent(x, blk, tpu=by_column, default=by_block)


def argmax_first(
    x: jax.Array, block: int | None = None, bmax: jax.Array | None = None
) -> jax.Array:
    """[R, V] -> [R] int32: index of the first maximum (== jnp.argmax for non-NaN rows).
    `bmax`: block_max(x, block), when the caller has it (exact for any block width)."""
    R, V = x.shape
    b = block if block is not None else block_size(V, 256)
    if b == 1:
        return jnp.argmax(x, axis=-1).astype(jnp.int32)
    bmax = block_reduce(x, b, "max") if bmax is None else bmax  # [R, nb]
    m = bmax.max(-1, keepdims=True)  # [R, 1]
    blk = jnp.argmax(bmax == m, axis=-1).astype(jnp.int32)  # [R] first block holding the max
    # The block gathered from x itself: x reshaped to blocks is a relayout on a TPU (a pass)
    cols = blk[:, None] * b + jnp.arange(b, dtype=jnp.int32)[None, :]
    g = jnp.take_along_axis(x, cols, axis=1)  # [R, b]
    return blk * b + jnp.argmax(g == m, axis=-1).astype(jnp.int32)


def top_k_exact(
    x: jax.Array,
    k: int,
    block: int | None = None,
    bmax: jax.Array | None = None,
    below: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    """[R, V] -> (values [R, k] descending, ids [R, k]); ties: lower id first (as lax.top_k).

    Two levels: the k blocks with the largest maxima (ties: lower block first) hold the top k
    elements, so lax.top_k runs on [R, nb] and on the k gathered blocks, kept in id order.
    `bmax`: block_max(x, block), when the caller has it (the pass over x is then shared).
    `below` [R]: only the elements < below count (the others as -inf), cut where they are read
    (the gathered blocks are cut after the gather, so it reads only them)."""
    R, V = x.shape
    if k == 0:
        return jnp.zeros((R, 0), x.dtype), jnp.zeros((R, 0), jnp.int32)

    def cut(y):
        if below is None:
            return y
        return jnp.where(y < below.reshape((R,) + (1,) * (y.ndim - 1)), y, NEG_INF)

    b = block if block is not None else top_k_block(V, k)
    if b == 1 or k > V // b or 2 * k * b > V:
        v, i = jax.lax.top_k(cut(x), k)
        return v, i.astype(jnp.int32)
    _, bi = jax.lax.top_k(block_reduce(cut(x), b, "max") if bmax is None else bmax, k)
    bi = jnp.sort(bi.astype(jnp.int32), axis=-1)  # id order, so ties resolve to the lower id
    g = cut(take_blocks(x, bi, b)).reshape(R, k * b)  # [R, k*b]
    v, j = jax.lax.top_k(g, k)
    ids = jnp.take_along_axis(bi, j // b, axis=1) * b + (j % b).astype(jnp.int32)
    return v, ids


def cumsum(x: jax.Array) -> jax.Array:
    """Inclusive cumulative sum over the last axis of a small [R, n] float array, as products
    with a triangular matrix (in chunks of 32 when n is large): on the CPU this compiles in a
    fraction of the time of jnp.cumsum's reduce-window and runs as fast. Exact for integer
    counts below 2**24."""
    R, n = x.shape
    hi = jax.lax.Precision.HIGHEST

    def tri(m):
        return jnp.asarray(np.triu(np.ones((m, m), np.float32)))

    x = x.astype(jnp.float32)
    if n <= 128:
        return jnp.dot(x, tri(n), precision=hi)
    pad = -n % 32
    xc = jnp.pad(x, ((0, 0), (0, pad))).reshape(R, (n + pad) // 32, 32)
    within = jnp.einsum("rci,ij->rcj", xc, tri(32), precision=hi)  # [R, c, 32]
    totals = within[:, :, -1]  # [R, c]
    offsets = cumsum(totals) - totals  # exclusive, recursively
    return (within + offsets[:, :, None]).reshape(R, n + pad)[:, :n]


def inverse_cdf_blocks(
    block_weights: jax.Array,  # [R, nb] sum of weights per block (>= 0)
    weights_of_block,  # blk [R] -> [R, b] weights of the elements of that block
    u: jax.Array,  # [R] uniform in [0, 1)
    b: int,
) -> jax.Array:
    """Sample index i with probability w_i / sum(w) given per-block sums; two levels, exact up
    to float32 rounding; never returns a zero-weight element of a row with positive mass."""
    nb = block_weights.shape[1]
    cb = cumsum(block_weights)  # [R, nb]
    target = u * cb[:, -1]  # [R]
    blk = jnp.sum(cb <= target[:, None], axis=-1).astype(jnp.int32)
    last = jnp.max(jnp.where(block_weights > 0, jnp.arange(nb, dtype=jnp.int32), 0), axis=-1)
    blk = jnp.minimum(blk, last)
    before = jnp.take_along_axis(cb - block_weights, blk[:, None], axis=1)[:, 0]
    w = weights_of_block(blk)  # [R, b]
    j = inverse_cdf(w, jnp.maximum(target - before, 0.0), scaled=False)
    return blk * b + j


def inverse_cdf(w: jax.Array, t: jax.Array, scaled: bool = True) -> jax.Array:
    """[R, n] weights, [R] target (a fraction of the row's total when scaled, else absolute)
    -> first index whose cumulative weight exceeds the target, clamped to the last positive."""
    n = w.shape[1]
    cw = cumsum(w)
    target = t * cw[:, -1] if scaled else t
    j = jnp.sum(cw <= target[:, None], axis=-1).astype(jnp.int32)
    last = jnp.max(jnp.where(w > 0, jnp.arange(n, dtype=jnp.int32), 0), axis=-1)
    return jnp.minimum(j, last)


def boundary(
    x: jax.Array,  # [R, V] values
    w_of_values,  # f(values [R, n]) -> their weights, >= 0 and non-decreasing in the value
    target: jax.Array,  # [R] > 0, at most the weight of {x >= lo}
    lo: jax.Array,  # [R] a value with weight(x >= lo) >= target (-inf: every element)
    active: jax.Array,  # [R] bool rows to solve (others return garbage)
    C: int,  # extraction width
    upper: tuple[jax.Array, jax.Array, jax.Array] | None = None,
    top: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Exact boundary of the order (value desc, id asc): the first element at which the
    cumulative weight reaches `target`. Returns (its value [R], its id [R]).

    Shrinks a bracket [lo, hi) around the boundary until it holds at most C elements of
    positive weight, then extracts it exactly with top_k_exact. Each pass reads x once and
    evaluates the weight (and count of positive weights) of {x >= t} at 31 probes t at once
    (one reduction; the weights are computed from x where they are summed, so no [R, V] array
    of them is read or written): the bracket's lower end, 15 values spread evenly over the
    bracket (on rows of 49152 normal logits the search is exact after 4 passes) and 15 spread
    evenly over its float32 keys (`_key`), which divide its keys (at most 2**32) by 16 a pass,
    so that MAX_PASSES = 8 passes close any bracket onto one value: a bound, not a cap. A
    bracket that closes onto one value held by more than C elements (ties) is resolved by
    counting ties in id order. `upper` = (hi, weight and count of positive weights of
    {x >= hi}) may start the bracket lower than above the max: the weight of {x >= hi} must be
    < target. `top`: the row's max, when the caller has it."""
    R = x.shape[0]
    f32 = jnp.float32
    def stats(t):  # t [R, P] -> weight, count of positive weights, of {x >= t}: [R, P] each
        wx = w_of_values(x)  # [R, V], fused into the reduction
        ge = x[:, None, :] >= t[:, :, None]  # weights are non-decreasing in x
        w = jnp.where(ge, wx[:, None, :], 0.0)
        n = jnp.where(ge & (wx[:, None, :] > 0), 1.0, 0.0)
        return jax.lax.reduce(
            (w, n), (f32(0), f32(0)), lambda a, b: (a[0] + b[0], a[1] + b[1]), (2,)
        )

    top = jnp.max(x, axis=-1) if top is None else top
    hi = jnp.nextafter(top, jnp.full_like(top, jnp.inf))  # nothing at or above hi
    w_hi = n_hi = jnp.zeros((R,), f32)
    if upper is not None:
        ok = upper[0] < hi
        hi, w_hi, n_hi = (jnp.where(ok, a, b) for a, b in zip(upper, (hi, w_hi, n_hi)))
    # lo's weight is unknown until the first pass, which probes lo itself
    w_lo = n_lo = jnp.full((R,), jnp.inf, f32)
    value_steps = jnp.arange(1, VALUE_PROBES + 1, dtype=f32) / (VALUE_PROBES + 1)
    key_steps = jnp.arange(1, KEY_PROBES + 1, dtype=jnp.uint32)

    def unresolved(c):
        lo, hi, _, _, n_lo, n_hi, it = c
        # (it < MAX_PASSES holds while a bracket is open: the loop's bound, stated)
        return active & (n_lo - n_hi > C) & (_key(hi) - _key(lo) > 1) & (it < MAX_PASSES)

    def probe(c):
        lo, hi, w_lo, w_hi, n_lo, n_hi, it = c
        go = unresolved(c)
        k_lo, k_hi = _key(lo), _key(hi)
        d = k_hi - k_lo  # >= 1
        q, r = d // (KEY_PROBES + 1), d % (KEY_PROBES + 1)
        by_key = _value(k_lo[:, None] + q[:, None] * key_steps + jnp.minimum(key_steps, r[:, None]))
        by_value = lo[:, None] + (hi - lo)[:, None] * value_steps
        t = jnp.concatenate([lo[:, None], by_value, by_key], axis=1)  # [R, P]
        k_t = _key(t)
        inside = (k_t > k_lo[:, None]) & (k_t < k_hi[:, None]) & ~jnp.isnan(t)
        is_lo = jnp.arange(t.shape[1]) == 0
        w, n = stats(jax.lax.optimization_barrier(t))
        # W is non-increasing in t: the bracket's new ends are the adjacent probes around the
        # boundary (lo itself is on the lower side by the caller's word)
        below = (inside & (w >= target[:, None])) | is_lo
        above = inside & ~(w >= target[:, None]) & ~is_lo
        new_lo = _value(jnp.max(jnp.where(below, k_t, k_lo[:, None]), axis=-1))
        new_hi = _value(jnp.min(jnp.where(above, k_t, k_hi[:, None]), axis=-1))
        new = (
            new_lo, new_hi,
            jnp.min(jnp.where(below, w, w_lo[:, None]), axis=-1),
            jnp.max(jnp.where(above, w, w_hi[:, None]), axis=-1),
            jnp.min(jnp.where(below, n, n_lo[:, None]), axis=-1),
            jnp.max(jnp.where(above, n, n_hi[:, None]), axis=-1),
        )
        old = (lo, hi, w_lo, w_hi, n_lo, n_hi)
        return tuple(jnp.where(go, a, b) for a, b in zip(new, old)) + (it + 1,)

    init = (lo, hi, w_lo, w_hi, n_lo, n_hi, jnp.int32(0))
    lo, hi, _, w_hi, n_lo, n_hi, _ = jax.lax.while_loop(
        lambda c: same_on_every_rank(jnp.any(unresolved(c))), probe, init
    )
    vals, ids = top_k_exact(x, C, below=hi)  # [R, C] every element of [lo, hi) if <= C
    cum = w_hi[:, None] + cumsum(jnp.where(vals >= lo[:, None], w_of_values(vals), 0.0))
    n_br = jnp.clip(n_lo - n_hi, 1, C).astype(jnp.int32)
    j = jnp.minimum(jnp.sum(cum < target[:, None], axis=-1).astype(jnp.int32), n_br - 1)
    tau = jnp.take_along_axis(vals, j[:, None], axis=1)[:, 0]
    ib = jnp.take_along_axis(ids, j[:, None], axis=1)[:, 0]

    # Ties: the bracket is the single value lo, held by more than C elements.
    tied = active & (n_lo - n_hi > C)

    def resolve_ties():
        wt = w_of_values(lo[:, None])[:, 0]
        need = jnp.ceil((target - w_hi) / jnp.where(wt > 0, wt, 1.0))
        need = jnp.clip(need, 1, n_lo - n_hi).astype(jnp.int32)
        return nth_equal_index(x, lo, need)

    ib = batch_cond(jnp.any(tied), lambda: jnp.where(tied, resolve_ties(), ib), lambda: ib)
    # (a tie group's value is its extracted elements' own: lo may be a float that only compares
    # equal to them, a denormal where the backend flushes them to zero)
    return jnp.where(tied, vals[:, 0], tau), ib


def _key(v: jax.Array) -> jax.Array:
    """float32 -> uint32 key, in the values' order: adjacent keys are adjacent floats, -0.0
    and 0.0 share one (0x80000000), -inf is 0x00800000 and inf 0xFF800000 (no NaN)."""
    b = jax.lax.bitcast_convert_type(v, jnp.uint32)
    return jnp.where(b >> 31 == 0, b | jnp.uint32(0x80000000), ~b + jnp.uint32(1))


def _value(k: jax.Array) -> jax.Array:
    """The float32 of a key (_key's inverse)."""
    b = jnp.where(k >> 31 == 1, k & jnp.uint32(0x7FFFFFFF), ~(k - jnp.uint32(1)))
    return jax.lax.bitcast_convert_type(b, jnp.float32)


def nth_equal_index(x: jax.Array, value: jax.Array, n: jax.Array) -> jax.Array:
    """[R, V], [R], [R] int (1-based, clamped to [1, count]) -> index of the n-th element of x
    equal to value; V if a row has none. (The block holding it is gathered from x, then
    compared: the gather reads that block only.)"""
    R, V = x.shape
    mask = x == value[:, None]
    b = block_size(V, 256)
    if b == 1:
        c = cumsum(mask.astype(jnp.float32))
        return jnp.sum(c < n[:, None], axis=-1).astype(jnp.int32)
    counts = block_reduce(mask.astype(jnp.int32), b, "sum")  # [R, nb]
    cb = cumsum(counts.astype(jnp.float32))
    blk = jnp.sum(cb < n[:, None], axis=-1).astype(jnp.int32)
    blk_c = jnp.minimum(blk, V // b - 1)
    before = jnp.take_along_axis(cb - counts, blk_c[:, None], axis=1)[:, 0]
    g = (take_blocks(x, blk_c[:, None], b)[:, 0] == value[:, None]).astype(jnp.int32)
    j = jnp.sum(cumsum(g) < (n - before)[:, None], axis=-1).astype(jnp.int32)
    return jnp.where(blk < V // b, blk_c * b + j, V)
