"""SamplingState: per-slot device state that lives across steps (donated through the step).

A running request owns a slot s in [0, S). The step calls `update_state_from_tokens` on its
INPUT tokens before sampling: prompt tokens set their prompt bit in `token_counts`, output tokens
(a decode step feeds the token sampled by the previous step; a request recomputed after
preemption re-feeds its outputs) increment their count there and shift into `recent_outputs`, so
at sampling time the state describes exactly prompt ∪ outputs-so-far. Only the slots of requests
with penalties keep counts (`metadata.penalty_slots`; no other request reads its counts), and a
step without such a request writes none. Slots of newly admitted requests are reset first (in
the same call). Every update writes only the elements (or rows) it changes, in place in the
donated state: nothing in a step copies or rewrites an [S, V] array.

The prompt mask and the output counts share one int32 array (`output_counts` and `prompt_mask`
read them apart): the penalties read one [R, V] array instead of two, and there is no boolean
[S, V] array, which a TPU tiles unlike its scatter's operand (XLA relayouts it, whole, twice a
step).

Dense per-request rows that do not change while the request runs (logit bias, the -inf mask of
allowed_token_ids and single-token bad words, and the multi-token bad-word table) are written
once at admission by `write_slot_rows`, a separate small jitted function with fixed shapes; the
step reads them only for rows whose `use_slot_rows` flag is set, so stale rows of earlier
requests never need clearing.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.sampling.config import SamplerConfig

PAD_WORD = -2  # bad-word table filler: "any token" in a prefix position, "no word" as last token
PROMPT_BIT = 1 << 30  # token_counts: set when the token occurs in the prompt
COUNT_MASK = PROMPT_BIT - 1  # token_counts: the bits that count the outputs
# A TPU step of at most this many tokens updates a counted slot's row in one fused pass over it
# (a [T, V] comparison); a larger one scatters into the row
DENSE_COUNT_TOKENS = 64


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class SamplingState:
    # [S, V] int32: bits 0-29 the times the slot's request generated each token, bit 30
    # (PROMPT_BIT) set when the token occurs in its prompt
    token_counts: jax.Array
    logit_bias: jax.Array  # [S, V] float32 bias, -inf for disallowed / single-token bad words
    # [S, B * L] int32 the slot's [B, L] table of multi-token bad words, right-aligned,
    # PAD_WORD-filled, one row a slot (a TPU lays an [S, B, L] array out with the slots as its
    # minor dimension, and then copies it whole to read one slot's table)
    bad_words: jax.Array
    recent_outputs: jax.Array  # [S, L-1] int32 last L-1 output tokens (oldest first), -1 = none
    # [S] int32 the token the slot's request sampled last: the input of its next step when the
    # host has not seen it yet (overlapped steps; see runner/model_runner.py)
    last_tokens: jax.Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class SlotRowsWrite:
    """Rows to store at admission (numpy on the host; A = config.slot_write_batch)."""

    slots: jax.Array | np.ndarray  # [A] int32, S = padding (dropped)
    logit_bias: jax.Array | np.ndarray  # [A, V] float32
    bad_words: jax.Array | np.ndarray  # [A, B, L] int32


def init_sampling_state(config: SamplerConfig) -> SamplingState:
    S, V = config.max_num_seqs, config.vocab_size
    B, L = config.max_bad_words, config.max_bad_word_len
    return SamplingState(
        token_counts=jnp.zeros((S, V), jnp.int32),
        logit_bias=jnp.zeros((S, V), jnp.float32),
        bad_words=jnp.full((S, B * L), PAD_WORD, jnp.int32),
        recent_outputs=jnp.full((S, L - 1), -1, jnp.int32),
        last_tokens=jnp.zeros((S,), jnp.int32),
    )


def output_counts(token_counts: jax.Array) -> jax.Array:
    """The output counts held in (rows of) `token_counts`: int32, same shape."""
    return token_counts & COUNT_MASK


def prompt_mask(token_counts: jax.Array) -> jax.Array:
    """Whether each token occurs in the prompt, from (rows of) `token_counts`: bool."""
    return (token_counts & PROMPT_BIT) != 0


def sampling_state_shardings(
    config: SamplerConfig, mesh, rules, data_parallel: bool
) -> SamplingState:
    """Where each array of the sampling state lives on `mesh` (a SamplingState of
    NamedShardings): the slots over "data" with data parallelism (each rank owns a slot range,
    like its pages), and the [S, V] arrays' vocabulary split as the serving `rules` split the
    logits' (the LM head's vocabulary axis), so that the sampler reads the penalty counts, the
    prompt mask and the bias rows where the logits are and no step gathers them."""
    from jax.sharding import NamedSharding, PartitionSpec

    from jaxserve.models.sharding import VOCAB, logical_to_spec

    S, V = config.max_num_seqs, config.vocab_size
    slots = "data" if data_parallel else None
    row = PartitionSpec(slots)
    dense = logical_to_spec(
        ("slots", VOCAB), (S, V), mesh, {"slots": slots, VOCAB: rules.get(VOCAB)}
    )
    return SamplingState(
        token_counts=NamedSharding(mesh, dense),
        logit_bias=NamedSharding(mesh, dense),
        bad_words=NamedSharding(mesh, row),
        recent_outputs=NamedSharding(mesh, row),
        last_tokens=NamedSharding(mesh, row),
    )


def resolve_pending_tokens(state: SamplingState, token_ids: jax.Array, slots: jax.Array) -> jax.Array:
    """The step's input tokens with every pending one (< 0) replaced by the token its slot's
    request sampled last. token_ids, slots: [T] int32."""
    return jnp.where(token_ids < 0, state.last_tokens[slots], token_ids)


def record_sampled_tokens(state: SamplingState, token_ids: jax.Array, sample_slots: jax.Array) -> SamplingState:
    """Keep each row's sampled token in its slot (rows with slot >= S keep nothing)."""
    return dataclasses.replace(state, last_tokens=state.last_tokens.at[sample_slots].set(token_ids, mode="drop"))


def write_slot_rows(state: SamplingState, rows: SlotRowsWrite) -> SamplingState:
    """Store the bias rows and bad-word tables of newly admitted requests (jit it once, with
    `donate_argnums=0`; shapes are fixed by the config, so it compiles once)."""
    S = state.logit_bias.shape[0]
    slots = jnp.asarray(rows.slots, jnp.int32)  # [A]
    slots = jnp.where((slots >= 0) & (slots < S), slots, S)
    return dataclasses.replace(
        state,
        logit_bias=state.logit_bias.at[slots].set(jnp.asarray(rows.logit_bias), mode="drop"),
        bad_words=state.bad_words.at[slots].set(
            jnp.asarray(rows.bad_words).reshape(slots.shape[0], -1), mode="drop"),
    )


def _reset(state: SamplingState, reset_slots: jax.Array) -> SamplingState:
    """Clear the rows of `reset_slots` ([N], S = none) in place, without copying the state (a
    `lax.cond` around a whole-array update would copy the [S, V] array in both branches and
    once more on the way out, every step).

    On a GPU: one scatter of zero rows (rows of S dropped). XLA:GPU runs a data-dependent loop
    by reading its predicate back to the host each trip (a synchronisation inside the step);
    the scatter writes only the rows it keeps (its zeros are a constant, nothing is read).
    Elsewhere (TPUs, where a loop's predicate stays on the chip, and the CPU): a loop over the
    slots to clear (none in most steps), one row write each."""
    counts, recent = jax.lax.platform_dependent(
        state.token_counts, state.recent_outputs, reset_slots,
        cuda=_reset_by_scatter, rocm=_reset_by_scatter, default=_reset_by_loop,
    )
    return dataclasses.replace(state, token_counts=counts, recent_outputs=recent)


def _reset_by_scatter(counts: jax.Array, recent: jax.Array, reset_slots: jax.Array):
    """_reset's rows cleared by one scatter each (rows of S dropped)."""
    (N,), V, W = reset_slots.shape, counts.shape[1], recent.shape[1]
    return (
        counts.at[reset_slots].set(jnp.zeros((N, V), counts.dtype), mode="drop"),
        recent.at[reset_slots].set(jnp.full((N, W), -1, recent.dtype), mode="drop"),
    )


def _reset_by_loop(counts: jax.Array, recent: jax.Array, reset_slots: jax.Array):
    """_reset's rows cleared by a loop over the slots to clear, one row write each."""
    S, V = counts.shape
    W = recent.shape[1]
    todo = jnp.sort(reset_slots)  # the slots to clear first, then the S's
    n = jnp.sum(todo < S)

    def clear(i, arrays):
        counts, recent = arrays
        s = todo[i]
        return (
            jax.lax.dynamic_update_slice(counts, jnp.zeros((1, V), counts.dtype), (s, 0)),
            jax.lax.dynamic_update_slice(recent, jnp.full((1, W), -1, recent.dtype), (s, 0)),
        )

    return jax.lax.fori_loop(0, n, clear, (counts, recent))


def _count(counts, slots, tokens, is_prompt, ok, count_slots):
    """Fold the step's tokens of the slots in `count_slots` ([N], S = none; repeats allowed)
    into their rows of `counts`: a prompt token sets its prompt bit, an output token adds one
    to its count. The other slots' rows are left alone: no other request reads its counts.

    On a GPU and the CPU: one scatter of the counted tokens (the others dropped), which writes
    only the elements it keeps (XLA:GPU runs a data-dependent loop by reading its predicate
    back to the host each trip). On a TPU, whose scatter into an [S, V] array reads and writes
    all of it (on the SparseCore), whatever the elements it keeps: a loop over the distinct
    slots to count (none in a step without penalties), each trip one row read, updated by the
    slot's tokens and written back in place (a small step's update is dense: the SparseCore's
    scatter into the row would copy it out and back)."""
    S = counts.shape[0]
    counted = jnp.zeros((S + 1,), jnp.bool_).at[count_slots].set(True)[:S]  # [S]
    keep = ok & counted[jnp.minimum(slots, S - 1)]  # [T]
    return jax.lax.platform_dependent(
        counts, slots, tokens, is_prompt, keep, count_slots,
        tpu=_count_by_loop, default=_count_by_scatter,
    )


def _row_updates(slots, tokens, is_prompt, keep, size):
    """(prompt rows, output rows, columns) of a scatter of the kept tokens into an array of
    `size` rows (the others: row `size`, dropped). A scatter of one element is rewritten by
    XLA into a dynamic slice and update, which the SPMD partitioner cannot keep on the device
    holding that part of a vocabulary-split array (it gathers the whole array): a one-token
    step scatters one more, dropped, element."""

    def pad(a, v):
        return jnp.concatenate([a, jnp.full((1,), v, a.dtype)]) if tokens.shape[0] == 1 else a

    prompt_rows = pad(jnp.where(keep & is_prompt, slots, size), size)
    out_rows = pad(jnp.where(keep & ~is_prompt, slots, size), size)
    return prompt_rows, out_rows, pad(tokens, 0)


def _count_by_scatter(counts, slots, tokens, is_prompt, keep, count_slots):
    """_count's tokens scattered into [S, V] (the others dropped)."""
    prompt_rows, out_rows, tokens = _row_updates(slots, tokens, is_prompt, keep, counts.shape[0])
    counts = counts.at[prompt_rows, tokens].apply(lambda c: c | PROMPT_BIT, mode="drop")
    return counts.at[out_rows, tokens].add(1, mode="drop")


def _count_by_loop(counts, slots, tokens, is_prompt, keep, count_slots):
    """_count's rows updated one distinct slot a trip, in place."""
    S, V = counts.shape
    todo = jnp.sort(count_slots)  # the slots to count first (repeats side by side), then S's
    repeat = jnp.concatenate([jnp.zeros((1,), jnp.bool_), todo[1:] == todo[:-1]])
    n = jnp.sum(todo < S)

    def count(i, counts):
        s = todo[i]
        mine = keep & (slots == s) & ~repeat[i]  # a repeat's trip writes its row unchanged
        row = jax.lax.dynamic_slice(counts, (s, 0), (1, V))
        if tokens.shape[0] <= DENSE_COUNT_TOKENS:
            hit = tokens[:, None] == jnp.arange(V, dtype=jnp.int32)[None, :]  # [T, V]
            bits = jnp.any(hit & (mine & is_prompt)[:, None], axis=0)
            adds = jnp.sum(hit & (mine & ~is_prompt)[:, None], axis=0, dtype=jnp.int32)
            row = (row | jnp.where(bits, PROMPT_BIT, 0)) + adds
        else:
            prompt_rows, out_rows, cols = _row_updates(
                jnp.zeros_like(slots), tokens, is_prompt, mine, 1)  # rows of the [1, V] row
            row = row.at[prompt_rows, cols].apply(lambda c: c | PROMPT_BIT, mode="drop")
            row = row.at[out_rows, cols].add(1, mode="drop")
        return jax.lax.dynamic_update_slice(counts, row, (s, 0))

    return jax.lax.fori_loop(0, n, count, counts)


def update_state_from_tokens(
    state: SamplingState,
    slots: jax.Array,  # [T] int32 slot of each input token
    token_ids: jax.Array,  # [T] int32
    is_prompt: jax.Array,  # [T] bool  prompt token (else an output token being re-fed)
    valid: jax.Array,  # [T] bool  False for padding tokens
    reset_slots: jax.Array,  # [N] int32 slots to clear first (newly admitted); >= S = none
    count_slots: jax.Array,  # [N] int32 slots whose token counts to keep (penalties); >= S = none
) -> SamplingState:
    """Fold the step's input tokens into the per-slot state. Jittable, shapes fixed by T and N.

    Assumes the flat layout of the step: the tokens of one request are contiguous and in order
    (needed only for `recent_outputs`, the window used by multi-token bad words).
    """
    S, V = state.token_counts.shape
    W = state.recent_outputs.shape[1]
    reset_slots = jnp.asarray(reset_slots, jnp.int32)
    reset_slots = jnp.where((reset_slots >= 0) & (reset_slots < S), reset_slots, S)
    state = _reset(state, reset_slots)

    slots = jnp.asarray(slots, jnp.int32)
    token_ids = jnp.asarray(token_ids, jnp.int32)
    ok = valid & (slots >= 0) & (slots < S) & (token_ids >= 0) & (token_ids < V)
    is_out = ok & ~is_prompt
    out_rows = jnp.where(is_out, slots, S)  # [T]
    count_slots = jnp.asarray(count_slots, jnp.int32)
    count_slots = jnp.where((count_slots >= 0) & (count_slots < S), count_slots, S)
    counts = _count(state.token_counts, jnp.where(ok, slots, S), token_ids, is_prompt, ok,
                    count_slots)

    recent = state.recent_outputs
    if W > 0:
        one = is_out.astype(jnp.int32)
        n_new = jax.ops.segment_sum(one, out_rows, num_segments=S + 1)[:S]  # [S]
        csum = jnp.cumsum(one)  # [T] inclusive count of outputs up to t
        last = jax.ops.segment_max(csum, out_rows, num_segments=S + 1)  # [S+1]
        after = last[out_rows] - csum  # [T] outputs of the same slot after t (contiguity)
        src = jnp.arange(W, dtype=jnp.int32)[None, :] + n_new[:, None]  # [S, W]
        shifted = jnp.where(
            src < W, jnp.take_along_axis(recent, jnp.minimum(src, W - 1), axis=1), -1
        )
        rows = jnp.where(is_out & (after < W), out_rows, S)
        recent = shifted.at[rows, W - 1 - jnp.minimum(after, W - 1)].set(token_ids, mode="drop")

    return dataclasses.replace(state, token_counts=counts, recent_outputs=recent)
