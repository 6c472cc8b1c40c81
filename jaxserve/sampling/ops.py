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



def batch_cond(flag, true_fn, false_fn, *operands):
    """`lax.cond` on a batch-wide flag, taken the same way on every data-parallel rank (a rank's
    branch may hold collectives over the other mesh axes: see sharding.same_on_every_rank)."""
    return jax.lax.cond(same_on_every_rank(flag), true_fn, false_fn, *operands)

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
    R, V = x.shape
    return None if b == 1 else x.reshape(R, V // b, b).max(-1)


def argmax_first(
    x: jax.Array, block: int | None = None, bmax: jax.Array | None = None
) -> jax.Array:
    """[R, V] -> [R] int32: index of the first maximum (== jnp.argmax for non-NaN rows).
    `bmax`: block_max(x, block), when the caller has it (exact for any block width)."""
    R, V = x.shape
    b = block if block is not None else block_size(V, 256)
    if b == 1:
        return jnp.argmax(x, axis=-1).astype(jnp.int32)
    bmax = x.reshape(R, V // b, b).max(-1) if bmax is None else bmax  # [R, nb]
    m = bmax.max(-1, keepdims=True)  # [R, 1]
    blk = jnp.argmax(bmax == m, axis=-1).astype(jnp.int32)  # [R] first block holding the max
    # The block gathered from x itself: x reshaped to blocks is a relayout on a TPU (a pass)
    cols = blk[:, None] * b + jnp.arange(b, dtype=jnp.int32)[None, :]
    g = jnp.take_along_axis(x, cols, axis=1)  # [R, b]
    return blk * b + jnp.argmax(g == m, axis=-1).astype(jnp.int32)


def top_k_exact(
    x: jax.Array, k: int, block: int | None = None, bmax: jax.Array | None = None
) -> tuple[jax.Array, jax.Array]:
    """[R, V] -> (values [R, k] descending, ids [R, k]); ties: lower id first (as lax.top_k).

    Two levels: the k blocks with the largest maxima (ties: lower block first) hold the top k
    elements, so lax.top_k runs on [R, nb] and on the k gathered blocks, kept in id order.
    `bmax`: block_max(x, block), when the caller has it (the pass over x is then shared)."""
    R, V = x.shape
    if k == 0:
        return jnp.zeros((R, 0), x.dtype), jnp.zeros((R, 0), jnp.int32)
    b = block if block is not None else top_k_block(V, k)
    if b == 1 or k > V // b or 2 * k * b > V:
        v, i = jax.lax.top_k(x, k)
        return v, i.astype(jnp.int32)
    nb = V // b
    xb = x.reshape(R, nb, b)
    _, bi = jax.lax.top_k(xb.max(-1) if bmax is None else bmax, k)  # [R, k] largest maxima
    bi = jnp.sort(bi.astype(jnp.int32), axis=-1)  # id order, so ties resolve to the lower id
    g = jnp.take_along_axis(xb, bi[:, :, None], axis=1).reshape(R, k * b)  # [R, k*b]
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
    lo: jax.Array,  # [R] a value with weight(x >= lo) >= target
    active: jax.Array,  # [R] bool rows to solve (others return garbage)
    C: int,  # extraction width
    upper: tuple[jax.Array, jax.Array, jax.Array] | None = None,
    scale: tuple[jax.Array, jax.Array] | None = None,
    max_iter: int = 100,
) -> tuple[jax.Array, jax.Array]:
    """Exact boundary of the order (value desc, id asc): the first element at which the
    cumulative weight reaches `target`. Returns (its value [R], its id [R]).

    Shrinks a bracket [lo, hi) around the boundary (one pass over x per probe, the weights
    computed from x where they are summed, so no [R, V] array of weights is read or written:
    interpolated probes, a halving every third step, and a snap onto the values inside when a
    probe made no progress) until it holds at most C elements (8-12 probes for nuclei of
    thousands of tokens, 4-6 for large tie groups), then extracts it exactly with top_k_exact.
    A bracket that collapses onto one value held by more than C elements (ties) is resolved
    by counting ties in id order. `upper` = (hi, weight and
    count of positive weights of {x >= hi}) may start the bracket lower than above the max:
    the weight of {x >= hi} must be < target. `scale` = (mx [R], 1/T [R]) says that the
    weight of an element of value v is exp((v - mx) / T) (it guides the probes)."""
    R = x.shape[0]
    f32 = jnp.float32

    def stats(t):  # weight, and count of positive weights, of {x >= t}; t [R]
        y = jnp.where(x >= t[:, None], w_of_values(x), 0.0)  # weights are non-decreasing in x
        return jnp.sum(y, axis=-1), jnp.sum((y > 0).astype(f32), axis=-1)

    top = jnp.max(x, axis=-1)
    hi = jnp.nextafter(top, jnp.full_like(top, jnp.inf))  # nothing at or above hi
    w_hi = n_hi = jnp.zeros((R,), f32)
    if upper is not None:
        ok = upper[0] < hi
        hi, w_hi, n_hi = (jnp.where(ok, a, b) for a, b in zip(upper, (hi, w_hi, n_hi)))
    w_lo, n_lo = stats(lo)

    def unresolved(c):
        lo, hi, _, _, n_lo, n_hi, _, it = c
        open_ = jnp.nextafter(lo, hi) < hi
        return active & (n_lo - n_hi > C) & open_ & (it < max_iter)

    def probe(c):
        lo, hi, w_lo, w_hi, n_lo, n_hi, _, it = c
        go = unresolved(c)
        # Probe near the interpolated boundary (elements spread evenly over the bracket's
        # values, so the weight above t is linear in the weight of one element at t), C / 4
        # elements above it on even steps and below it on odd ones, so that two probes can
        # close the bracket; every third step halves the bracket instead.
        frac = jnp.clip((target - w_hi) / jnp.maximum(w_lo - w_hi, 1e-30), 0.0, 1.0)
        if scale is None:
            est = hi - (hi - lo) * frac
        else:
            mx, inv_t = scale
            top_w, bot_w = jnp.exp((hi - mx) * inv_t), jnp.exp((lo - mx) * inv_t)
            w_est = jnp.maximum(top_w - frac * (top_w - bot_w), 1e-38)
            est = mx + jnp.log(w_est) / inv_t
        delta = (hi - lo) * jnp.minimum(0.25 * C / jnp.maximum(n_lo - n_hi, 1.0), 0.5)
        halve = lo + (hi - lo) * 0.5
        halve = jnp.where((halve > lo) & (halve < hi), halve, _key_midpoint(lo, hi))
        mid = jnp.where(it % 2 == 0, est + delta, est - delta)
        mid = jnp.where((it % 3 == 2) | (mid <= lo) | (mid >= hi), halve, mid)
        w_mid, n_mid = stats(mid)
        up = go & (w_mid >= target)  # boundary at or above mid
        down = go & ~(w_mid >= target)
        return (
            jnp.where(up, mid, lo), jnp.where(down, mid, hi),
            jnp.where(up, w_mid, w_lo), jnp.where(down, w_mid, w_hi),
            jnp.where(up, n_mid, n_lo), jnp.where(down, n_mid, n_hi), n_lo - n_hi, it + 1,
        )

    def snap(c):
        # A probe that left the bracket's count unchanged suggests a cluster of (nearly)
        # equal values: shrink [lo, hi) onto the smallest and largest values inside it. A
        # bracket holding a single value (ties) then closes at once.
        lo, hi, w_lo, w_hi, n_lo, n_hi, _, it = c
        go = unresolved(c)
        inside = (x >= lo[:, None]) & (x < hi[:, None])
        top_in = jnp.max(jnp.where(inside, x, -jnp.inf), axis=-1)
        bot_in = jnp.min(jnp.where(inside, x, jnp.inf), axis=-1)
        ok = go & (bot_in <= top_in)
        new_hi = jnp.nextafter(top_in, jnp.full_like(top_in, jnp.inf))
        return (
            jnp.where(ok, bot_in, lo), jnp.where(ok & (new_hi < hi), new_hi, hi),
            w_lo, w_hi, n_lo, n_hi, jnp.full_like(n_lo, -1.0), it + 1,
        )

    def body(c):
        stalled = unresolved(c) & (c[4] - c[5] == c[6])
        return batch_cond(jnp.any(stalled), snap, probe, c)

    init = (lo, hi, w_lo, w_hi, n_lo, n_hi, jnp.full_like(n_lo, -1.0), jnp.int32(0))
    lo, hi, _, w_hi, n_lo, n_hi, _, _ = jax.lax.while_loop(
        lambda c: same_on_every_rank(jnp.any(unresolved(c))), body, init
    )
    below = jnp.where(x < hi[:, None], x, -jnp.inf)
    vals, ids = top_k_exact(below, C)  # [R, C] every element of [lo, hi) when it has <= C
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
        return nth_true_index(x == lo[:, None], need)

    ib = batch_cond(jnp.any(tied), lambda: jnp.where(tied, resolve_ties(), ib), lambda: ib)
    return jnp.where(tied, lo, tau), ib


def _key_midpoint(lo: jax.Array, hi: jax.Array) -> jax.Array:
    """A float strictly between lo and hi (lo < hi, not adjacent) halving the count of
    float32 values between them: the midpoint of their order-preserving integer keys."""

    def key(v):
        b = jax.lax.bitcast_convert_type(v, jnp.int32)
        return jnp.where(b < 0, jnp.int32(-(2**31)) - b, b)  # -0.0 and 0.0 both map to 0

    def val(k):
        return jax.lax.bitcast_convert_type(jnp.where(k < 0, jnp.int32(-(2**31)) - k, k),
                                            jnp.float32)

    klo, khi = key(lo), key(hi)
    mid = val((klo >> 1) + (khi >> 1) + (klo & khi & 1))  # floor((klo + khi) / 2), no overflow
    return jnp.where((mid > lo) & (mid < hi), mid, jnp.nextafter(lo, hi))


def nth_true_index(mask: jax.Array, n: jax.Array) -> jax.Array:
    """[R, V] bool, [R] int (1-based, clamped to [1, count]) -> index of the n-th True; V if a
    row has no True."""
    R, V = mask.shape
    b = block_size(V, 256)
    if b == 1:
        c = cumsum(mask.astype(jnp.float32))
        return jnp.sum(c < n[:, None], axis=-1).astype(jnp.int32)
    mb = mask.reshape(R, V // b, b)
    counts = mb.sum(-1, dtype=jnp.int32)  # [R, nb]
    cb = cumsum(counts.astype(jnp.float32))
    blk = jnp.sum(cb < n[:, None], axis=-1).astype(jnp.int32)
    blk_c = jnp.minimum(blk, V // b - 1)
    before = jnp.take_along_axis(cb - counts, blk_c[:, None], axis=1)[:, 0]
    g = jnp.take_along_axis(mb, blk_c[:, None, None], axis=1)[:, 0].astype(jnp.int32)
    j = jnp.sum(cumsum(g) < (n - before)[:, None], axis=-1).astype(jnp.int32)
    return jnp.where(blk < V // b, blk_c * b + j, V)
