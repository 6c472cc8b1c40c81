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

NEG_INF = float("-inf")


def block_size(V: int, target: int) -> int:
    """Largest power of two <= target dividing V with at least two blocks; 1 if none >= 4."""
    b = 1
    while b * 2 <= target and V % (b * 2) == 0 and V // (b * 2) >= 2:
        b *= 2
    return b if b >= 4 else 1


def argmax_first(x: jax.Array) -> jax.Array:
    """[R, V] -> [R] int32: index of the first maximum (== jnp.argmax for non-NaN rows)."""
    R, V = x.shape
    b = block_size(V, 256)
    if b == 1:
        return jnp.argmax(x, axis=-1).astype(jnp.int32)
    xb = x.reshape(R, V // b, b)
    bmax = xb.max(-1)  # [R, nb]
    m = bmax.max(-1, keepdims=True)  # [R, 1]
    blk = jnp.argmax(bmax == m, axis=-1).astype(jnp.int32)  # [R] first block holding the max
    g = jnp.take_along_axis(xb, blk[:, None, None], axis=1)[:, 0]  # [R, b]
    return blk * b + jnp.argmax(g == m, axis=-1).astype(jnp.int32)


def top_k_exact(x: jax.Array, k: int, block: int | None = None,
                block_max: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """[R, V] -> (values [R, k] descending, ids [R, k]); ties: lower id first (as lax.top_k).

    Two levels: the k blocks with the largest maxima (ties: lower block first) hold the top k
    elements, so lax.top_k runs on [R, nb] and on the k gathered blocks, kept in id order.
    `block_max` ([R, V // block]) may be passed when the caller already has it."""
    R, V = x.shape
    if k == 0:
        return jnp.zeros((R, 0), x.dtype), jnp.zeros((R, 0), jnp.int32)
    b = block if block is not None else block_size(V, max(4, min(64, V // (4 * k))))
    if b == 1 or k > V // b or 2 * k * b > V:
        v, i = jax.lax.top_k(x, k)
        return v, i.astype(jnp.int32)
    nb = V // b
    xb = x.reshape(R, nb, b)
    bmax = xb.max(-1) if block_max is None else block_max  # [R, nb]
    _, bi = jax.lax.top_k(bmax, k)  # [R, k]
    bi = jnp.sort(bi.astype(jnp.int32), axis=-1)  # id order, so ties resolve to the lower id
    g = jnp.take_along_axis(xb, bi[:, :, None], axis=1).reshape(R, k * b)  # [R, k*b]
    v, j = jax.lax.top_k(g, k)
    ids = jnp.take_along_axis(bi, j // b, axis=1) * b + (j % b).astype(jnp.int32)
    return v, ids


def inverse_cdf_blocks(
    block_weights: jax.Array,  # [R, nb] sum of weights per block (>= 0)
    weights_of_block,  # blk [R] -> [R, b] weights of the elements of that block
    u: jax.Array,  # [R] uniform in [0, 1)
    b: int,
) -> jax.Array:
    """Sample index i with probability w_i / sum(w) given per-block sums; two levels, exact up
    to float32 rounding; never returns a zero-weight element of a row with positive mass."""
    R, nb = block_weights.shape
    cb = jnp.cumsum(block_weights, axis=-1)  # [R, nb]
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
    R, n = w.shape
    cw = jnp.cumsum(w, axis=-1)
    target = t * cw[:, -1] if scaled else t
    j = jnp.sum(cw <= target[:, None], axis=-1).astype(jnp.int32)
    last = jnp.max(jnp.where(w > 0, jnp.arange(n, dtype=jnp.int32), 0), axis=-1)
    return jnp.minimum(j, last)


def float_key(x: jax.Array) -> jax.Array:
    """float32 -> uint32 with the same order (for exact bisection over float values)."""
    bits = jax.lax.bitcast_convert_type(x, jnp.uint32)
    return jnp.where(bits >> 31 == 1, ~bits, bits | jnp.uint32(0x80000000))


def bisect_threshold(keys: jax.Array, weights: jax.Array, target: jax.Array) -> jax.Array:
    """Largest key t (per row) with sum(weights[keys >= t]) >= target, assuming the full row
    reaches the target ([R, V], [R, V], [R] -> [R] uint32). 32 passes over the row."""
    R = keys.shape[0]

    def body(_, c):
        lo, hi = c
        mid = lo + (hi - lo) // 2
        mass = jnp.sum(jnp.where(keys >= mid[:, None], weights, 0), axis=-1)
        ok = mass >= target
        return jnp.where(ok, mid, lo), jnp.where(ok, hi, mid)

    lo = jnp.zeros((R,), jnp.uint32)
    hi = jnp.full((R,), 0xFFFFFFFF, jnp.uint32)
    lo, _ = jax.lax.fori_loop(0, 32, body, (lo, hi))
    return lo


def nth_true_index(mask: jax.Array, n: jax.Array) -> jax.Array:
    """[R, V] bool, [R] int (1-based, clamped to [1, count]) -> index of the n-th True; V if a
    row has no True."""
    R, V = mask.shape
    b = block_size(V, 256)
    if b == 1:
        c = jnp.cumsum(mask.astype(jnp.int32), axis=-1)
        return jnp.sum(c < n[:, None], axis=-1).astype(jnp.int32)
    mb = mask.reshape(R, V // b, b)
    counts = mb.sum(-1, dtype=jnp.int32)  # [R, nb]
    cb = jnp.cumsum(counts, axis=-1)
    blk = jnp.sum(cb < n[:, None], axis=-1).astype(jnp.int32)
    blk_c = jnp.minimum(blk, V // b - 1)
    before = jnp.take_along_axis(cb - counts, blk_c[:, None], axis=1)[:, 0]
    g = jnp.take_along_axis(mb, blk_c[:, None, None], axis=1)[:, 0].astype(jnp.int32)
    j = jnp.sum(jnp.cumsum(g, axis=-1) < (n - before)[:, None], axis=-1).astype(jnp.int32)
    return jnp.where(blk < V // b, blk_c * b + j, V)
