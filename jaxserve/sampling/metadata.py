"""Per-step sampling inputs (a device pytree of [R] rows) and the host-side builder.

Every sampling parameter travels as an array, so changing parameters, the mix of features in a
batch, or the batch composition never changes a shape or a static argument. Padding rows
(after the live ones) are neutral: temperature -1 (neither greedy nor random: their token is
meaningless), no penalties, no logprobs.

Host flow (numpy only, cheap per step): the runner calls `builder.admit(slot, params, ...)` when
a request gets a slot (first schedule, or again after preemption: admission resets the slot's
counts), `builder.take_slot_writes()` before dispatching the step (bias rows / bad-word tables
for `write_slot_rows`), and `builder.build(slots, output_lens, num_rows)` every step. Per-slot
values are cached in [S+1] tables (row S = the neutral padding row), so a step costs about a
dozen numpy fancy-indexing operations.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.sampling.config import SamplerConfig
from jaxserve.sampling.state import PAD_WORD, SlotRowsWrite
from jaxserve.sampling_params import SamplingParams

_U64 = (1 << 64) - 1


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class SamplingMetadata:
    """One step's sampling parameters, one row per scheduled request (R rows, padded)."""

    slots: jax.Array  # [R] int32 persistent slot of each row (padding rows: 0, unused)
    temperature: jax.Array  # [R] f32   0 = greedy, < 0 = padding row
    top_k: jax.Array  # [R] int32 0 = off
    top_p: jax.Array  # [R] f32   1 = off
    min_p: jax.Array  # [R] f32   0 = off
    presence_penalty: jax.Array  # [R] f32
    frequency_penalty: jax.Array  # [R] f32
    repetition_penalty: jax.Array  # [R] f32
    use_slot_rows: jax.Array  # [R] bool  apply the slot's bias row and bad-word table
    stop_ids: jax.Array  # [R, M] int32 ids suppressed by min_tokens this step, -1 padded
    uniform: jax.Array  # [R] f32 in [0, 1): the row's random number, row_uniforms(seed, pos)
    logprobs: jax.Array  # [R] int32 -1 = none, k >= 0: sampled token + top k
    reset_slots: jax.Array  # [R] int32 slots to reset in update_state_from_tokens; S = none
    # [R, ceil(V/32)] int32 structured output's allowed tokens (bit t % 32 of word t // 32);
    # all ones (-1) for free rows. The builder always sets it; None: nothing is masked.
    token_bitmask: jax.Array | None = None


def uses_penalties(meta: SamplingMetadata) -> jax.Array:
    """[R] bool: the rows whose request asks for a presence, frequency or repetition penalty
    (fixed at admission, so the same in every step of the request)."""
    return (
        (meta.presence_penalty != 0.0)
        | (meta.frequency_penalty != 0.0)
        | (meta.repetition_penalty != 1.0)
    )


def penalty_slots(meta: SamplingMetadata) -> jax.Array:
    """[R] int32: the slot of each row that uses penalties, -1 for the others: the slots whose
    token counts `update_state_from_tokens` keeps. Every request with tokens in a step has a
    row in it (one that samples nothing while its prompt is being prefilled), so the slot of a
    request with penalties counts all its prompt and output tokens, and no other request's
    counts are ever read."""
    return jnp.where(uses_penalties(meta), meta.slots, -1)


def abstract_metadata(config: SamplerConfig, num_rows: int) -> SamplingMetadata:
    """ShapeDtypeStructs of a step's metadata with `num_rows` rows (for AOT lowering)."""
    sample = SamplingMetadataBuilder(config).build([], [], num_rows)
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), sample)


_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_M1, _M2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)
_S30, _S27, _S31, _S40 = (np.uint64(n) for n in (30, 27, 31, 40))


def row_uniforms(seeds: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """The random number of each row: output `position` of the splitmix64 stream of the
    request's seed, as float32 in [0, 1) with 24 random bits. It depends on nothing else, so a
    seeded request samples the same tokens whatever the batch, the row or the bucket.
    [n] uint64, [n] int -> [n] float32. (uint64 arithmetic wraps mod 2**64.)"""
    z = np.asarray(seeds, np.uint64) + (np.asarray(positions, np.uint64) + np.uint64(1)) * _GOLDEN
    z = (z ^ (z >> _S30)) * _M1
    z = (z ^ (z >> _S27)) * _M2
    z ^= z >> _S31
    return (z >> _S40).astype(np.float32) * np.float32(2.0**-24)


class SamplingMetadataBuilder:
    """Turns admitted requests + per-step (slot, output_len) rows into `SamplingMetadata`."""

    def __init__(self, config: SamplerConfig, seed: int | None = None) -> None:
        self.config = config
        S, M = config.max_num_seqs, config.max_stop_ids
        B, L = config.max_bad_words, config.max_bad_word_len
        self._rng = np.random.default_rng(seed)
        n = S + 1  # row S: the padding row (temperature -1: no token is computed for it)
        self._temperature = np.zeros(n, np.float32)
        self._temperature[S] = -1.0
        self._top_k = np.zeros(n, np.int32)
        self._top_p = np.ones(n, np.float32)
        self._min_p = np.zeros(n, np.float32)
        self._presence = np.zeros(n, np.float32)
        self._frequency = np.zeros(n, np.float32)
        self._repetition = np.ones(n, np.float32)
        self._use_rows = np.zeros(n, np.bool_)
        self._min_tokens = np.zeros(n, np.int64)
        self._stop_ids = np.full((n, M), -1, np.int32)
        self._seed = np.zeros(n, np.uint64)
        self._logprobs = np.full(n, -1, np.int32)
        self._pending_reset: set[int] = set()
        self._pending_writes: list[tuple[int, np.ndarray, np.ndarray]] = []
        self._no_words = np.full((B, L), PAD_WORD, np.int32)
        self._words = (config.vocab_size + 31) // 32
        self._free_masks: dict[int, np.ndarray] = {}  # num_rows -> all-ones bitmask (read only)

    # ------------------------------------------------------------------ admission
    def admit(
        self,
        slot: int,
        params: SamplingParams,
        eos_token_ids: Sequence[int] = (),
        bad_words_token_ids: Sequence[Sequence[int]] | None = None,
    ) -> None:
        """Cache a request's sampling rows in `slot` and schedule the slot's reset. Call on
        every admission to a slot (also when a preempted request comes back). The request
        must have passed `SamplerConfig.check_request` (the input processor's validation)."""
        cfg = self.config
        if not 0 <= slot < cfg.max_num_seqs:
            raise ValueError(f"slot {slot} outside [0, {cfg.max_num_seqs}).")
        words = [list(w) for w in (bad_words_token_ids or []) if len(w) > 0]
        greedy = params.temperature < 1e-5
        self._temperature[slot] = 0.0 if greedy else params.temperature
        top_k = params.top_k if 0 < params.top_k < cfg.vocab_size else 0
        self._top_k[slot] = 0 if greedy else top_k
        self._top_p[slot] = 1.0 if greedy else params.top_p
        self._min_p[slot] = 0.0 if greedy else params.min_p
        self._presence[slot] = params.presence_penalty
        self._frequency[slot] = params.frequency_penalty
        self._repetition[slot] = params.repetition_penalty
        self._min_tokens[slot] = params.min_tokens
        self._stop_ids[slot] = -1
        if params.min_tokens > 0:
            stops = list(dict.fromkeys(params.stop_token_ids or []))
            if not params.ignore_eos:
                stops += [int(t) for t in eos_token_ids if int(t) not in stops]
            self._stop_ids[slot, : len(stops)] = stops
        seed = params.seed if params.seed is not None else int(self._rng.integers(0, 2**63))
        self._seed[slot] = seed & _U64
        k = params.logprobs
        self._logprobs[slot] = -1 if k is None else (cfg.vocab_size if k == -1 else k)
        self._pending_reset.add(slot)

        single = [w[0] for w in words if len(w) == 1]
        multi = [w for w in words if len(w) > 1]
        use = bool(params.allowed_token_ids or params.logit_bias or single or multi)
        self._use_rows[slot] = use
        self._pending_writes = [w for w in self._pending_writes if w[0] != slot]
        if use:
            bias = np.zeros(cfg.vocab_size, np.float32)
            if params.allowed_token_ids:
                bias[:] = -np.inf
                bias[np.asarray(params.allowed_token_ids, np.int64)] = 0.0
            for tok, b in (params.logit_bias or {}).items():
                bias[tok] += np.float32(b)
            if single:
                bias[np.asarray(single, np.int64)] = -np.inf
            table = self._no_words.copy()
            for i, w in enumerate(multi):
                table[i, cfg.max_bad_word_len - len(w) :] = w
            self._pending_writes.append((slot, bias, table))

    def take_slot_writes(self) -> list[SlotRowsWrite]:
        """Pending bias/bad-word rows of admitted requests, in batches of `slot_write_batch`
        rows (padding slot = S). Apply each with `write_slot_rows` before the next step."""
        cfg = self.config
        A, S = cfg.slot_write_batch, cfg.max_num_seqs
        out = []
        for i in range(0, len(self._pending_writes), A):
            chunk = self._pending_writes[i : i + A]
            slots = np.full(A, S, np.int32)
            bias = np.zeros((A, cfg.vocab_size), np.float32)
            words = np.full((A, cfg.max_bad_words, cfg.max_bad_word_len), PAD_WORD, np.int32)
            for j, (slot, b, w) in enumerate(chunk):
                slots[j], bias[j], words[j] = slot, b, w
            out.append(SlotRowsWrite(slots=slots, logit_bias=bias, bad_words=words))
        self._pending_writes = []
        return out

    # ------------------------------------------------------------------ per step
    def uniforms_ahead(self, slots: np.ndarray, output_lens: np.ndarray, num_rows: int,
                       num_steps: int) -> np.ndarray:
        """[num_steps, num_rows] the random numbers of rows that sample num_steps tokens in a
        row (multi-step decode): step j of row i draws `row_uniforms(seed, output_lens[i] + j)`,
        what a single step at that output position draws. Padding rows: zeros."""
        n = len(slots)
        out = np.zeros((num_steps, num_rows), np.float32)
        if n:
            ahead = np.asarray(output_lens, np.int64)[None, :] + np.arange(num_steps)[:, None]
            out[:, :n] = row_uniforms(np.broadcast_to(self._seed[np.asarray(slots)], ahead.shape), ahead)
        return out

    def build(
        self,
        slots: Sequence[int] | np.ndarray,
        output_lens: Sequence[int] | np.ndarray,
        num_rows: int,
        token_bitmask: np.ndarray | None = None,
    ) -> SamplingMetadata:
        """Numpy metadata for one step: row i samples for the request in slots[i], which has
        generated output_lens[i] tokens so far. Rows n..num_rows-1 are padding.
        `token_bitmask` ([n, W] int32, or None: all allowed): structured output's rows."""
        S = self.config.max_num_seqs
        n = len(slots)
        if n > num_rows:
            raise ValueError(f"{n} rows do not fit in a bucket of {num_rows}.")
        idx = np.full(num_rows, S, np.int64)
        idx[:n] = slots
        out_len = np.zeros(num_rows, np.int64)
        out_len[:n] = output_lens
        active = out_len < self._min_tokens[idx]
        stop_ids = self._stop_ids[idx]
        stop_ids[~active] = -1
        reset = np.full(num_rows, S, np.int32)
        if self._pending_reset:
            live = [s for s in idx[:n].tolist() if s in self._pending_reset]
            reset[: len(live)] = live
            self._pending_reset.difference_update(live)
        dev_slots = idx.astype(np.int32)
        dev_slots[n:] = 0
        if token_bitmask is None:
            mask = self._free_masks.get(num_rows)
            if mask is None:
                mask = self._free_masks[num_rows] = np.full((num_rows, self._words), -1, np.int32)
                mask.flags.writeable = False
        else:
            mask = np.full((num_rows, self._words), -1, np.int32)
            mask[: len(token_bitmask)] = token_bitmask
        return SamplingMetadata(
            slots=dev_slots,
            temperature=self._temperature[idx],
            top_k=self._top_k[idx],
            top_p=self._top_p[idx],
            min_p=self._min_p[idx],
            presence_penalty=self._presence[idx],
            frequency_penalty=self._frequency[idx],
            repetition_penalty=self._repetition[idx],
            use_slot_rows=self._use_rows[idx],
            stop_ids=stop_ids,
            uniform=row_uniforms(self._seed[idx], out_len),
            logprobs=self._logprobs[idx],
            reset_slots=reset,
            token_bitmask=mask,
        )
