"""The sampler fused into the compiled step: logits [R, V] -> tokens (+ raw logprobs).

Order of transforms (vLLM v1's):
  0. structured output's token bitmask: tokens the request's grammar does not allow -> -inf
     (vLLM applies it to the logits before its sampler; greedy rows included; here it is
     applied to the buffer of steps 1-3, which gives the same logits: -inf stays -inf);
  1. per-slot row: allowed_token_ids mask, bad words (single-token: always; multi-token: when
     the last outputs match the word's prefix) -> -inf, then + logit_bias;
  2. min_tokens: EOS and stop_token_ids -> -inf while output_len < min_tokens;
  3. penalties: repetition over prompt ∪ output tokens (logit > 0: / p, else * p), then
     frequency (- f * count) and presence (- p * [count > 0]) over output tokens;
  4. greedy rows (temperature 0) take the first argmax here (exactly argmax of the raw logits
     when steps 1-3 do not apply);
  5. temperature: logits / T;
  6. min_p (keep p >= min_p * p_max), then top_k (keep values >= the k-th largest: ties at the
     k-th value are kept, as in vLLM and HF), then top_p over the renormalised survivors: keep
     the shortest prefix, in order (probability desc, token id asc), whose mass >= top_p (the
     top token always survives; ties at the boundary resolve to the lower token ids);
  7. sample by inverse CDF with the row's uniform, a host-side hash of (request seed, output
     position) (metadata.row_uniforms): the token depends only on the row's logits,
     parameters, seed and position, never on the batch composition or the row index.
     (With SamplerConfig.native, steps 5-7 run in the backend's native kernel: native.py.)

Logprobs, ranks and top logprobs are vLLM's "raw" ones (its default logprobs_mode): log_softmax
of the logits the sampler receives, so after step 0 (as in vLLM, where the bitmask is applied
before the sampler) and before steps 1-7; rank = #{tokens with logit >= the sampled token's}
(1-based).

Optional work sits behind lax.conds on batch-wide flags (scalars computed from the [R]
parameter arrays), so a batch that does not use a feature does not pay for it, and both
branches live in the same executable: no parameter mix ever recompiles. Each conditional costs
a GPU a synchronisation (XLA:GPU reads its predicate back to the host before it launches a
branch), so the optional features (steps 0-3, the logprobs, and the caller's prompt logprobs:
`sample_with_extra`) share one conditional, with each feature's own nested in its branch, and
work that costs no pass over [R, V] takes no conditional: the greedy argmax and the top-K
candidates come from the row's block maxima, one pass shared by the argmax, the candidates, the
row max and the raw logprobs' top k. A plain batch (no optional feature) reads back that one
predicate, and any_random's when it has random rows.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from jaxserve.sampling import native as native_impls
from jaxserve.sampling import ops
from jaxserve.sampling.config import SamplerConfig
from jaxserve.sampling.metadata import SamplingMetadata, uses_penalties
from jaxserve.sampling.state import PAD_WORD, SamplingState, output_counts

NEG_INF = float("-inf")


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class SamplerOutput:
    token_ids: jax.Array  # [R] int32
    logprobs: jax.Array  # [R] f32  raw log-prob of the sampled token (0 where not requested)
    topk_ids: jax.Array  # [R, max_logprobs] int32 (a row uses its first `logprobs` entries)
    topk_logprobs: jax.Array  # [R, max_logprobs] f32
    rank: jax.Array  # [R] int32 1-based rank of the sampled token (0 where not requested)


def sample(
    logits: jax.Array, meta: SamplingMetadata, state: SamplingState, config: SamplerConfig
) -> SamplerOutput:
    """logits [R, V] (any float dtype; computed in float32) -> SamplerOutput. `config` is
    static (close over it or use functools.partial); `state` is read only."""
    return sample_with_extra(logits, meta, state, config)[0]


def sample_with_extra(
    logits: jax.Array,
    meta: SamplingMetadata,
    state: SamplingState,
    config: SamplerConfig,
    extra: tuple | None = None,
):
    """`sample`, and work of the caller's that only some batches need: `extra` = (flag, fn,
    none_fn): fn() when the batch-wide `flag` is set, else none_fn() (same structure, zeros).
    It joins the sampler's conditional of optional work (the step's prompt logprobs): a batch
    that uses no optional feature takes one branch, whose predicate a GPU reads back once.
    Returns (SamplerOutput, the extra's result or None)."""
    raw = logits.astype(jnp.float32)  # [R, V]
    R, V = raw.shape
    bitmask = meta.token_bitmask
    any_mask = jnp.any(bitmask != -1) if bitmask is not None else jnp.asarray(False)
    greedy = meta.temperature == 0.0  # [R]  (padding rows have temperature < 0: neither)
    random = meta.temperature > 0.0
    any_random = jnp.any(random)
    # One block width for every reduction that picks elements of a row (the greedy argmax, the
    # top-K candidates, the logprobs' top k): each of them is exact for any width, so the
    # block maxima of a row are computed once and shared.
    bc = ops.top_k_block(V, min(config.topk_candidates + 1, V))

    def choose(x, bmax):  # steps 4-7 on the processed logits; returns tokens [R]
        if bmax is not None:  # the JAX steps share the block maxima: the argmax is a gather
            tok_greedy = ops.argmax_first(x, bc, bmax)
        else:  # (the native kernel reads the row itself: a pass only when some row is greedy)
            tok_greedy = ops.batch_cond(
                jnp.any(greedy), lambda: ops.argmax_first(x), lambda: jnp.zeros((R,), jnp.int32)
            )
        return ops.batch_cond(
            any_random,
            lambda: jnp.where(random, _sample_random(x, meta, ~random, config, bmax), tok_greedy),
            lambda: tok_greedy,
        )

    # The raw logits' block maxima: the plain path's argmax and the logprobs' top k read them.
    raw_bmax = ops.block_max(raw, bc) if config.native is None else None

    # Steps 0-3 and the logprobs only when some row uses them, under one conditional (each
    # conditional costs a GPU a predicate read back by the host), the features' own
    # conditionals nested in it. `choose` sits inside the branches, so the untouched logits
    # are never copied through a cond.
    pen = uses_penalties(meta)
    use_rows, stops = jnp.any(meta.use_slot_rows), jnp.any(meta.stop_ids >= 0)

    def processed():
        x = _process(raw, meta, state, use_rows, jnp.any(pen), bitmask)
        return choose(x, ops.block_max(x, bc) if config.native is None else None)

    k = config.max_logprobs

    def no_logprobs():
        z = jnp.zeros((R,), jnp.float32)
        return (z, jnp.zeros((R, k), jnp.int32), jnp.zeros((R, k), jnp.float32),
                jnp.zeros((R,), jnp.int32))

    def with_features():  # some row uses steps 0-3, logprobs, or the caller's extra
        with jax.named_scope("sampler"):
            tok = ops.batch_cond(
                use_rows | stops | jnp.any(pen) | any_mask, processed,
                lambda: choose(raw, raw_bmax),
            )
        with jax.named_scope("sampler_logprobs"):
            lps = functools.partial(_raw_logprobs, tok=tok, k=k, native=config.native, block=bc)

            def logprobs():
                # After step 0, as vLLM: a grammar's mask applies to the raw logprobs (then
                # the masked row has block maxima of its own).
                if bitmask is None:
                    return lps(raw, bmax=raw_bmax)
                return ops.batch_cond(
                    any_mask, lambda: lps(apply_token_bitmask(raw, bitmask)),
                    lambda: lps(raw, bmax=raw_bmax),
                )

            lp = ops.batch_cond(jnp.any(meta.logprobs >= 0), logprobs, no_logprobs)
        ex = None if extra is None else ops.batch_cond(extra[0], extra[1], extra[2])
        return tok, lp, ex

    def plain():  # no row uses an optional feature: choose on the raw logits
        with jax.named_scope("sampler"):
            tok = choose(raw, raw_bmax)
        return tok, no_logprobs(), None if extra is None else extra[2]()

    uses = use_rows | stops | jnp.any(pen) | any_mask | jnp.any(meta.logprobs >= 0)
    if extra is not None:
        uses = uses | extra[0]
    tok, (lp, ids, top_lp, rank), ex = ops.batch_cond(uses, with_features, plain)
    out = SamplerOutput(token_ids=tok, logprobs=lp, topk_ids=ids, topk_logprobs=top_lp, rank=rank)
    return out, ex


def prompt_logprobs(
    logits: jax.Array, next_token_ids: jax.Array, k_max: int, native: str | None = None
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """Raw logprobs at prompt positions: logits [T, V], next_token_ids [T] (the prompt token
    that follows each position) -> (token_logprob [T], topk_ids [T, k_max],
    topk_logprobs [T, k_max], rank [T]). Jittable; k_max static; `native`: the registered
    native implementation to run (SamplerConfig.native), None for JAX's ops."""
    raw = logits.astype(jnp.float32)
    return _raw_logprobs(raw, jnp.asarray(next_token_ids, jnp.int32), k_max, native)


# ---------------------------------------------------------------------------- transforms
def apply_token_bitmask(x: jax.Array, bitmask: jax.Array) -> jax.Array:
    """Step 0: x [R, V] with every token whose bit is clear in bitmask [R, ceil(V/32)] int32
    (bit t % 32 of word t // 32) set to -inf."""
    R, V = x.shape
    shifts = jnp.arange(32, dtype=jnp.int32)
    bits = (jnp.right_shift(bitmask[:, :, None], shifts) & 1).reshape(R, -1)[:, :V]  # [R, V]
    return jnp.where(bits != 0, x, NEG_INF)


def _process(x, meta, state, any_rows, any_pen, bitmask=None):
    """Steps 0-3 in one pass over the logits: bias, penalties and the grammar's bitmask (step
    0: a masked token stays -inf through bias and penalties, so applying it last gives the
    same logits) are one elementwise expression per branch, and the -inf bans (bad words,
    min_tokens), which commute with the penalties (-inf stays -inf), are scattered last, in
    place into the fresh buffer that pass made. The bitmask is applied in every branch (a
    row without a grammar has every bit set, and reading the bitmask costs 1/32 of the
    logits): a cond of its own would cost another pass over the logits."""

    def step0(y):
        return y if bitmask is None else apply_token_bitmask(y, bitmask)

    x = ops.batch_cond(
        any_rows,
        lambda: ops.batch_cond(
            any_pen,
            lambda: step0(_apply_penalties(_apply_bias(x, meta, state), meta, state)),
            lambda: step0(_apply_bias(x, meta, state)),
        ),
        lambda: ops.batch_cond(
            any_pen,
            lambda: step0(_apply_penalties(x, meta, state)),
            lambda: step0(x) if bitmask is not None else x + 0.0,
        ),
    )
    rows = jnp.arange(x.shape[0], dtype=jnp.int32)[:, None]  # [R, 1]
    return x.at[rows, _bans(meta, state, any_rows, x.shape[1])].set(NEG_INF, mode="drop")


def _apply_bias(x: jax.Array, meta: SamplingMetadata, state: SamplingState) -> jax.Array:
    """Step 1, dense part: + the slot's row (logit_bias; -inf for tokens outside
    allowed_token_ids and for single-token bad words)."""
    bias = _slot_rows(state.logit_bias, meta.slots)  # [R, V]
    return jnp.where(meta.use_slot_rows[:, None], x + bias, x)


def _slot_rows(table: jax.Array, slots: jax.Array) -> jax.Array:
    """table[slots]: the rows [R, ...] of a per-slot table of the sampling state ([S, ...]).

    On a TPU, one dynamic slice a row (a loop over the R rows): XLA:TPU copies a table that a
    gather reads, whole, into on-chip memory before the conditional whose branch holds the
    gather, in every step, whether the branch runs or not (an [S, V] table: the largest array
    a plain decode step moved), while it reads a dynamic slice's row where it lies. Elsewhere
    one gather (a loop costs a GPU a predicate read back to the host each trip)."""
    return jax.lax.platform_dependent(
        table, slots, tpu=_slot_rows_by_loop, default=lambda t, s: t[s]
    )


def _slot_rows_by_loop(table: jax.Array, slots: jax.Array) -> jax.Array:
    """_slot_rows' rows, one dynamic slice each."""
    R = slots.shape[0]

    def row(i, out):
        r = jax.lax.dynamic_slice_in_dim(table, slots[i], 1, 0)
        return jax.lax.dynamic_update_slice_in_dim(out, r, i, 0)

    return jax.lax.fori_loop(0, R, row, jnp.zeros((R,) + table.shape[1:], table.dtype))


def _bans(meta: SamplingMetadata, state: SamplingState, any_rows, V: int) -> jax.Array:
    """[R, B+M] token ids to set to -inf (V = none): multi-token bad words whose prefix matches
    the last outputs (step 1), and min_tokens' stop ids (step 2)."""
    R = meta.slots.shape[0]
    L = state.recent_outputs.shape[1] + 1
    B = state.bad_words.shape[1] // L

    def words():
        table = _slot_rows(state.bad_words, meta.slots).reshape(R, B, L)  # [R, B, L]
        recent = _slot_rows(state.recent_outputs, meta.slots)  # [R, L-1]
        prefix, last = table[:, :, : L - 1], table[:, :, L - 1]  # [R, B, L-1], [R, B]
        match = jnp.all((prefix == PAD_WORD) | (prefix == recent[:, None, :]), axis=-1)
        return jnp.where(match & (last >= 0) & meta.use_slot_rows[:, None], last, V)

    word_bans = ops.batch_cond(any_rows, words, lambda: jnp.full((R, B), V, jnp.int32))
    stop = jnp.where(meta.stop_ids >= 0, meta.stop_ids, V)  # [R, M]
    return jnp.concatenate([word_bans, stop], axis=1)


def _apply_penalties(x: jax.Array, meta: SamplingMetadata, state: SamplingState) -> jax.Array:
    """Step 3, vLLM's apply_penalties (neutral parameters leave a row bit-identical)."""
    packed = _slot_rows(state.token_counts, meta.slots)  # [R, V] int32: output counts, prompt bits
    counts = output_counts(packed)
    out_mask = counts > 0
    seen = packed != 0  # in the prompt or the outputs
    rp = meta.repetition_penalty[:, None]
    x = jnp.where(seen, jnp.where(x > 0, x / rp, x * rp), x)
    x = x - meta.frequency_penalty[:, None] * counts.astype(jnp.float32)
    return x - meta.presence_penalty[:, None] * out_mask.astype(jnp.float32)


def _sample_random(
    x: jax.Array,
    meta: SamplingMetadata,
    greedy: jax.Array,
    config: SamplerConfig,
    bmax: jax.Array | None = None,
    with_mask: bool = False,
):
    """Steps 5-7 for every row; `greedy` marks the rows whose result the caller discards
    (greedy and padding rows). `bmax`: the block maxima of x (ops.block_max at the width
    ops.top_k_block gives for K + 1 candidates), when the caller has them. With `with_mask`
    (tests only) also returns the [R, V] set of tokens each row may emit.

    Works on x (not x / T): the order of the tokens is the same, thresholds are mapped into
    x's scale, and probabilities are exp((x - max) / T) — this saves passes over [R, V].
    With config.native the backend's native kernel does all of it (the CPU's draw walks the
    kept set in id order)."""
    if config.native is not None:
        tok, mask = native_impls.get(config.native).sample_rows(
            x, meta.temperature, meta.top_k, meta.top_p, meta.min_p, meta.uniform, ~greedy,
            with_mask)
        return (tok, mask) if with_mask else tok
    R, V = x.shape
    K = min(config.topk_candidates, V)  # top_k <= K runs on the candidates
    K1 = min(K + 1, V)  # one more candidate: a tie at the k-th value that runs past the list
    b = _sample_block(V)
    nb = V // b
    temp = jnp.where(greedy, 1.0, meta.temperature)  # [R]
    inv_t = (1.0 / temp)[:, None]  # [R, 1]
    k = meta.top_k
    use_k = ~greedy & (k > 0) & (k < V)
    small_k = use_k & (k <= K)
    use_p = ~greedy & (meta.top_p < 1.0)

    # The candidates [R, K1]: values desc, ids (ties: lower id first). From the block maxima
    # they cost a gather of K1 blocks, not a pass over the row, so on accelerators every
    # random batch takes them (no cond: a GPU would read its predicate back to the host). On
    # the CPU, whose top-k over the block maxima is slow, only batches with a row that uses
    # them do.
    bc = ops.top_k_block(V, K1)
    if bmax is None:
        bmax = ops.block_max(x, bc)

    def candidates():
        return ops.top_k_exact(x, K1, block=bc, bmax=bmax)

    def when_used():
        return ops.batch_cond(
            jnp.any(small_k | use_p), candidates,
            lambda: (jnp.full((R, K1), NEG_INF, x.dtype), jnp.zeros((R, K1), jnp.int32)),
        )

    c, ci = jax.lax.platform_dependent(cpu=when_used, default=candidates)
    mx = c.max(axis=-1) if bmax is None else bmax.max(axis=-1)  # (a slice would defeat TopK)
    # min_p: p / p_max = exp((x - mx) / T) >= min_p  <=>  x >= mx + T * log(min_p)
    tau_minp = jnp.where(
        ~greedy & (meta.min_p > 0), mx + temp * jnp.log(jnp.maximum(meta.min_p, 1e-38)), NEG_INF
    )
    kth = jnp.take_along_axis(c, jnp.clip(k - 1, 0, K1 - 1)[:, None], axis=1)[:, 0]
    tau1 = jnp.maximum(tau_minp, jnp.where(small_k, kth, NEG_INF))  # keep x >= tau1
    # A top-k row whose kept set may continue past the candidates (ties) takes the fallback.
    overflow = small_k & (c.min(axis=-1) >= tau1) & (K1 < V)  # min: no slice of TopK

    # Rows with top_k <= K keep a subset of the candidates: everything happens on [R, K].
    # The others (plain temperature, min_p, top_p alone) need the mass of the whole row:
    # exp((x - mx) / T) summed per block, masked by min_p only when some row uses it.
    full = ~greedy & ~small_k

    def block_mass():  # [R, nb]; tau1 = -inf keeps every token (exp(-inf) = 0 either way)
        t1, m1, it = _row_values(tau1, mx, inv_t)
        arg = jnp.where(x >= t1[:, None], (x - m1[:, None]) * it, NEG_INF)  # [R, V]
        return ops.block_reduce(jnp.exp(arg), b, "sum")

    block_mass = ops.batch_cond(
        jnp.any(full), block_mass, lambda: jnp.zeros((R, nb), jnp.float32)
    )

    # top-p on the candidates: shortest prefix of (prob desc, id asc) with mass >= top_p.
    w = jnp.where(c >= tau1[:, None], jnp.exp((c - mx[:, None]) * inv_t), 0.0)  # [R, K]
    cw = ops.cumsum(w)
    z = jnp.where(small_k, cw[:, -1], block_mass.sum(-1))  # [R] mass after min_p, top_k
    jstar = jnp.sum(cw < (meta.top_p * z)[:, None], axis=-1).astype(jnp.int32)  # [R]
    found = jstar < K1
    last = jnp.where(use_p, jstar, K1 - 1)  # last candidate kept

    u = meta.uniform  # [R]
    wc = jnp.where(jnp.arange(K1, dtype=jnp.int32)[None, :] <= last[:, None], w, 0.0)
    tok_c = jnp.take_along_axis(ci, ops.inverse_cdf(wc, u)[:, None], axis=1)[:, 0]

    def kept_block(blk):  # [R] -> [R, b] probabilities of the chosen block
        g = ops.take_blocks(x, blk[:, None], b)[:, 0]
        return jnp.where(g >= tau1[:, None], jnp.exp((g - mx[:, None]) * inv_t), 0.0)

    tok_f = ops.inverse_cdf_blocks(block_mass, kept_block, u, b)
    tok = jnp.where(use_p | small_k, tok_c, tok_f)

    fallback = (use_k & (k > K)) | overflow | (use_p & ~found)
    use_k_fb = use_k & ((k > K) | overflow)

    def with_fallback():
        # Top-p rows that only overflowed the candidates: everything above the smallest
        # candidate is in the list, so the search may start below it.
        cmin = c.min(axis=-1)
        above = c > cmin[:, None]
        upper = (
            jnp.where(use_k_fb, jnp.inf, jnp.nextafter(cmin, jnp.full_like(cmin, jnp.inf))),
            jnp.where(use_k_fb, 0.0, jnp.sum(jnp.where(above, w, 0.0), axis=-1)),
            jnp.where(use_k_fb, 0.0, jnp.sum((above & (w > 0)).astype(jnp.float32), axis=-1)),
        )
        res = _sample_bisect(
            x, mx, inv_t, tau_minp, k, use_k_fb, meta.top_p, use_p & fallback, u, b, K1, upper,
            with_mask,
        )
        return jax.tree.map(lambda a, b_: jnp.where(fallback.reshape((R,) + (1,) * (a.ndim - 1)),
                                                    a, b_), res, out)

    if with_mask:
        rows = jnp.arange(R, dtype=jnp.int32)[:, None]
        mask_c = jnp.zeros((R, V), jnp.bool_).at[rows, ci].set(wc > 0)
        mask = jnp.where((use_p | small_k)[:, None], mask_c, x >= tau1[:, None])
        out = (tok, mask)
    else:
        out = tok
    return ops.batch_cond(jnp.any(fallback), with_fallback, lambda: out)


def _sample_bisect(
    x, mx, inv_t, tau_minp, k, use_k, top_p, use_p, u, b, C, upper, with_mask=False
):
    """Exact min_p / top_k / top_p + sampling over the whole row, for rows with top_k > K, a
    tie at the k-th value running past the candidates, or a top-p nucleus wider than them:
    thresholds by a search on the value (ops.boundary: at most ops.MAX_PASSES passes over the
    row), then the block inverse CDF."""
    R, V = x.shape
    f32 = jnp.float32

    def kth_value():
        return ops.boundary(x, lambda v: jnp.ones_like(v), jnp.maximum(k, 1).astype(f32),
                            jnp.full((R,), NEG_INF), use_k, C, top=mx)[0]

    tau_k = ops.batch_cond(jnp.any(use_k), kth_value, lambda: jnp.full((R,), NEG_INF))
    tau1 = jnp.maximum(tau_minp, jnp.where(use_k, tau_k, NEG_INF))  # keep x >= tau1

    def prob(v):  # unnormalised probability after min_p and top_k
        return jnp.where(v >= tau1[:, None], jnp.exp((v - mx[:, None]) * inv_t), 0.0)

    # (The probabilities are computed from x where they are summed: the program holds no
    # [R, V] array of them.)
    z = jnp.sum(prob(x), axis=-1)
    # Start the top-p bracket above the tail: the (at most V) tokens below
    # mx + T * (log((1 - top_p) * z / V) - 1) weigh at most (1 - top_p) * z / e in all (the max
    # weighs 1), so the nucleus boundary lies above (a factor e of margin for rounding).
    t = 1.0 / inv_t[:, 0]
    tail = mx + t * (jnp.log(jnp.maximum((1.0 - top_p) * z / V, 1e-38)) - 1.0)
    tau_p, ib = ops.batch_cond(
        jnp.any(use_p),
        lambda: ops.boundary(x, prob, top_p * z, jnp.maximum(tau1, tail), use_p, C, upper,
                             top=mx),
        lambda: (jnp.full((R,), NEG_INF), jnp.full((R,), V, jnp.int32)),
    )

    def kept(v, ids):  # the kept tokens' probabilities; v, ids [R, n]
        cut = (v > tau_p[:, None]) | ((v == tau_p[:, None]) & (ids <= ib[:, None]))
        return jnp.where((v >= tau1[:, None]) & (~use_p[:, None] | cut), prob(v), 0.0)

    iota = jnp.arange(V, dtype=jnp.int32)[None, :]
    pf_blocks = ops.block_reduce(kept(ops.unshared_on_gpu(x), iota), b, "sum")  # [R, nb]

    def kept_block(blk):  # [R] -> [R, b]
        g = ops.take_blocks(x, blk[:, None], b)[:, 0]
        return kept(g, blk[:, None] * b + jnp.arange(b, dtype=jnp.int32)[None, :])

    tok = ops.inverse_cdf_blocks(pf_blocks, kept_block, u, b)
    if not with_mask:
        return tok
    keep = (x >= tau1[:, None]) & (~use_p[:, None] | (x > tau_p[:, None])
                                   | ((x == tau_p[:, None]) & (iota <= ib[:, None])))
    return tok, keep


def _row_values(*values: jax.Array) -> tuple[jax.Array, ...]:
    """Per-row values ([R]: a max, a threshold) that a pass over [R, V] reads, computed before
    it: without the barrier XLA fuses their own reduction or gather into the pass's
    elementwise part, which then cannot join the pass's reduction (it writes an [R, V] array
    that the reduction reads back)."""
    return tuple(jax.lax.optimization_barrier(values))


def _sample_block(V: int) -> int:
    b = ops.block_size(V, 64)
    return V if b == 1 else b


def _raw_logprobs(raw: jax.Array, tok: jax.Array, k: int, native: str | None = None,
                  block: int | None = None, bmax: jax.Array | None = None):
    """log_softmax of the raw logits at `tok`, its rank, and the top k. Two passes over the
    row: its block maxima (the top k's first level and the max; `bmax`: ops.block_max(raw,
    block) when the caller has them), then the log-sum-exp's sum and the rank's count."""
    if native is not None:
        return native_impls.get(native).raw_logprobs(raw, tok, k)
    R, V = raw.shape
    kk = max(k, 1)  # the top list also gives the max
    if block is not None and bmax is None:
        bmax = ops.block_max(raw, block)
    vals, ids = ops.top_k_exact(raw, kk, block=block, bmax=bmax)  # [R, kk]
    # (a reduction, not a slice of the TopK output, which would turn it into a full sort)
    m = vals.max(axis=-1) if bmax is None else bmax.max(axis=-1)
    tv = jnp.take_along_axis(raw, tok[:, None], axis=1)[:, 0]
    m, tv = _row_values(m, tv)
    # One pass over the row: the log-sum-exp's sum and the rank's count read the same logits
    # (one reduction of both: as sibling reductions XLA:GPU may launch them apart, each a pass;
    # rank = #{logit >= tv}, exact in int32).
    total, rank = jax.lax.reduce(
        (jnp.exp(raw - m[:, None]), (raw >= tv[:, None]).astype(jnp.int32)),
        (jnp.float32(0), jnp.int32(0)), lambda a, b: (a[0] + b[0], a[1] + b[1]), (1,),
    )
    lse = m + jnp.log(total)  # [R]
    if k == 0:  # (slicing the TopK outputs would turn them into a full sort)
        ids, vals = jnp.zeros((R, 0), jnp.int32), jnp.zeros((R, 0), jnp.float32)
    return tv - lse, ids, vals - lse[:, None], rank
