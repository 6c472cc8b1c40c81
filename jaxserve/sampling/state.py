"""SamplingState: per-slot device state that lives across steps (donated through the step).

A running request owns a slot s in [0, S). The step calls `update_state_from_tokens` on its
INPUT tokens before sampling: prompt tokens set their prompt bit in `token_counts`, output tokens
(a decode step feeds the token sampled by the previous step; a request recomputed after
preemption re-feeds its outputs) increment their count there and shift into `recent_outputs`, so
at sampling time the state describes exactly prompt ∪ outputs-so-far. Slots of newly admitted
requests are reset first (in the same call). Every update writes only the elements (or rows) it
changes, in place in the donated state: nothing in a step copies an [S, V] array.

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


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class SamplingState:
    # [S, V] int32: bits 0-29 the times the slot's request generated each token, bit 30
    # (PROMPT_BIT) set when the token occurs in its prompt
    token_counts: jax.Array
    logit_bias: jax.Array  # [S, V] float32 bias, -inf for disallowed / single-token bad words
    bad_words: jax.Array  # [S, B, L] int32 multi-token bad words, right-aligned, PAD_WORD-filled
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
        bad_words=jnp.full((S, B, L), PAD_WORD, jnp.int32),
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
        bad_words=state.bad_words.at[slots].set(jnp.asarray(rows.bad_words), mode="drop"),
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


def update_state_from_tokens(
    state: SamplingState,
    slots: jax.Array,  # [T] int32 slot of each input token
    token_ids: jax.Array,  # [T] int32
    is_prompt: jax.Array,  # [T] bool  prompt token (else an output token being re-fed)
    valid: jax.Array,  # [T] bool  False for padding tokens
    reset_slots: jax.Array,  # [N] int32 slots to clear first (newly admitted); >= S = none
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
    T = token_ids.shape[0]
    ok = valid & (slots >= 0) & (slots < S) & (token_ids >= 0) & (token_ids < V)
    is_out = ok & ~is_prompt
    prompt_rows = jnp.where(ok & is_prompt, slots, S)  # [T]
    out_rows = jnp.where(is_out, slots, S)  # [T]
    # A scatter of one element is rewritten by XLA into a dynamic slice and update, which the
    # SPMD partitioner cannot keep on the device holding that part of a vocabulary-split array
    # (it gathers the whole [S, V] array): a one-token step scatters one more, dropped, element.
    def pad(a, v):
        return jnp.concatenate([a, jnp.full((1,), v, a.dtype)]) if T == 1 else a

    tokens = pad(token_ids, 0)
    counts = state.token_counts.at[pad(prompt_rows, S), tokens].apply(
        lambda c: c | PROMPT_BIT, mode="drop"
    )
    counts = counts.at[pad(out_rows, S), tokens].add(1, mode="drop")

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
