"""A step's typed batch (core/sched_output.py's `StepBatch`) packed into the compiled step's inputs.

The runner keeps, per sampling slot, what a request's rows need from one step to the next
(`SlotTable`: its block table, prompt length, log-prob widths, the prompt when its prompt
log-probs are wanted, its adapter's slot), filled from the `NewRequestData` of the step that
(re)admits it. Each step, one data-parallel rank's rows become `RankRows` (arrays over the
rows), and `pack_rank` lays them into a (T, R) bucket through one small helper per thing the
step reads:

    sample_rows        which request each sampling row belongs to (k + 1 rows with k drafts)
    logits_indices     the flat token each sampling row reads its logits at
    token_slots        each token's sampling slot (its request's)
    token_validity     which tokens are real and fold into the sampling state (not drafts)
    output_positions   each sampling row's output position (min_tokens, random streams)
    logprob_rows       the rows whose sampled token's log-probs are read back
    prompt_logprobs    the next prompt token of each token whose prompt log-prob is wanted
    adapter_slots      each token's LoRA adapter slot (the step's only LoRA input)
    rank_metadata      the sampler's rows, in the rank's own slot range
    block_inputs       a decode block's steps, stops and random numbers (multi-step decode)

A feature that changes what the step reads adds a helper here (and a field to the step's
inputs), not an index into the others. Everything is vectorized over the rows except the rows
that want log-probs.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import numpy as np

from jaxserve.core.sched_output import ScheduledRequest
from jaxserve.request import RequestFailedError
from jaxserve.runner.decode_block import BlockInputs
from jaxserve.runner.step_buffers import BufferLayout
from jaxserve.runner.step_inputs import ModelInputs, TokenInfo, pack_rows
from jaxserve.sampling.metadata import SamplingMetadata, SamplingMetadataBuilder

NO_LOGPROBS = -1  # a slot whose request wants no (prompt) log-probs


class LogprobRow(NamedTuple):
    """A sampling row whose token's log-probs are read back (its top k)."""

    row: int
    request_id: str
    k: int


class PromptLogprobRows(NamedTuple):
    """A request's run of tokens whose next prompt token is scored this step."""

    request_id: str
    first_token: int  # its first flat token in the step
    count: int
    first_position: int  # the prompt position of the first scored token
    k: int


class SlotTable:
    """Per sampling slot, the host state of the request that holds it (the runner's side of a
    request: the scheduler's `Request` is never read). Each data-parallel rank has its own
    range of slots: [r * per, (r + 1) * per)."""

    def __init__(self, max_num_seqs: int, data_parallel_size: int, pages_per_req: int, max_logprobs: int,
                 max_stop_ids: int = 16):
        S, D = max_num_seqs, data_parallel_size
        self.per = S // D
        self.max_logprobs = max_logprobs
        self.free = [list(range((r + 1) * self.per - 1, r * self.per - 1, -1)) for r in range(D)]
        self.slot_of: dict[str, int] = {}
        self.block_table = np.zeros((S, pages_per_req), np.int32)
        self.num_blocks = np.zeros(S, np.int64)
        self.prompt_len = np.zeros(S, np.int64)
        self.logprob_k = np.full(S, NO_LOGPROBS, np.int64)  # top-k width of each sampled token's
        self.prompt_logprob_k = np.full(S, NO_LOGPROBS, np.int64)
        self.prompt_ids: list[np.ndarray | None] = [None] * S  # kept only for prompt log-probs
        self.adapter_slot = np.zeros(S, np.int32)  # the LoRA slot of each slot's request (0: none)
        # Multi-step decode's stops on the device: EOS (unless ignore_eos), then the stop token
        # ids, at most max_stop_ids (-1: none); and min_tokens (runner/decode_block.py).
        self.stop_tokens = np.full((S, max_stop_ids), -1, np.int32)
        self.min_tokens = np.zeros(S, np.int32)

    def width(self, requested: int | None) -> int:
        """The top-k width of a request's `logprobs` / `prompt_logprobs` (-1: all, capped)."""
        if requested is None:
            return NO_LOGPROBS
        return self.max_logprobs if requested < 0 else min(requested, self.max_logprobs)

    def admit(self, s: ScheduledRequest, rank: int, builder: SamplingMetadataBuilder) -> int:
        """Give a (re)admitted row's request a sampling slot of its rank and its rows; returns
        the slot. A request whose parameters the sampler cannot take fails alone."""
        new = s.new
        self.release(s.request_id)
        free = self.free[rank]
        slot = free.pop()
        p = new.sampling_params
        eos = () if new.eos_token_id is None else (new.eos_token_id,)
        try:
            builder.admit(slot, p, eos, new.bad_words_token_ids)
        except Exception as e:  # noqa: BLE001 - this request's parameters: it fails alone
            free.append(slot)
            raise RequestFailedError((s.request_id,), e) from e
        self.slot_of[s.request_id] = slot
        ids = s.new_block_ids
        self.block_table[slot, : len(ids)] = ids
        self.num_blocks[slot] = len(ids)
        self.prompt_len[slot] = new.num_prompt_tokens
        self.logprob_k[slot] = self.width(p.logprobs)
        self.prompt_logprob_k[slot] = self.width(p.prompt_logprobs)
        self.prompt_ids[slot] = (np.asarray(new.prompt_token_ids, np.int32)
                                 if p.prompt_logprobs is not None else None)
        self.adapter_slot[slot] = new.adapter_slot
        stops = [] if new.eos_token_id is None or p.ignore_eos else [new.eos_token_id]
        stops = list(dict.fromkeys([*stops, *(p.stop_token_ids or ())]))[: self.stop_tokens.shape[1]]
        self.stop_tokens[slot] = -1
        self.stop_tokens[slot, : len(stops)] = stops
        self.min_tokens[slot] = p.min_tokens
        return slot

    def extend(self, slot: int, block_ids: tuple[int, ...]) -> None:
        """A running request's new blocks, appended to its block table."""
        nb = self.num_blocks[slot]
        self.block_table[slot, nb : nb + len(block_ids)] = block_ids
        self.num_blocks[slot] = nb + len(block_ids)

    def release(self, request_id: str) -> None:
        slot = self.slot_of.pop(request_id, None)
        if slot is not None:
            self.free[slot // self.per].append(slot)


@dataclasses.dataclass(frozen=True, slots=True)
class RankRows:
    """One rank's rows as arrays over the rows (their requests admitted: slots assigned)."""

    rows: tuple[ScheduledRequest, ...]
    slots: np.ndarray  # [n] int32: each row's sampling slot (global)
    starts: np.ndarray  # [n] int64: the position of each row's first token
    lens: np.ndarray  # [n] int64: tokens fed (drafts included)
    samples: np.ndarray  # [n] bool: the row samples
    drafts: np.ndarray  # [n] int64: draft tokens among the row's last ones
    tokens: np.ndarray  # [total] int32: the rows' tokens one after another (PENDING: in flight)
    num_drafts: int  # drafts over the rows

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)

    @property
    def num_sample_rows(self) -> int:
        """Rows of the request bucket it takes: one per request, one more per draft."""
        return len(self.rows) + self.num_drafts


def rank_rows(rows: tuple[ScheduledRequest, ...], rank: int, table: SlotTable,
              builder: SamplingMetadataBuilder) -> RankRows:
    """One rank's rows, admitting the new requests and extending the others' block tables."""
    n = len(rows)
    slots, starts, lens, samples, drafts, tokens = [0] * n, [0] * n, [0] * n, [False] * n, [0] * n, []
    slot_of = table.slot_of
    for i, s in enumerate(rows):
        if s.is_new:
            slot = table.admit(s, rank, builder)
        else:
            slot = slot_of[s.request_id]
            if s.new_block_ids:
                table.extend(slot, s.new_block_ids)
        slots[i], starts[i], lens[i], samples[i], drafts[i] = (slot, s.start_pos, s.num_scheduled_tokens, s.sample,
                                                               s.num_draft_tokens)
        tokens.extend(s.token_ids)
    return RankRows(rows, np.asarray(slots, np.int32), np.asarray(starts, np.int64), np.asarray(lens, np.int64),
                    np.asarray(samples, np.bool_), np.asarray(drafts, np.int64), np.asarray(tokens, np.int32),
                    sum(drafts))


@dataclasses.dataclass(frozen=True, slots=True)
class SampleRows:
    """The rows of the request bucket that sample: one per request, or k + 1 for a request
    with k drafts (its last k + 1 tokens' logits, each with its own output position)."""

    request: np.ndarray  # [m] the index (in the rank's rows) of each sampling row's request
    first: np.ndarray  # [n] each request's first sampling row
    after: np.ndarray | None  # [m] how many of its request's rows follow it (None: no drafts)


def sample_rows(r: RankRows) -> SampleRows:
    if not r.num_drafts:
        each = np.arange(len(r.rows))
        return SampleRows(each, each, None)
    per_req = 1 + r.drafts
    first = np.cumsum(per_req) - per_req
    request = np.repeat(np.arange(len(r.rows)), per_req)
    return SampleRows(request, first, (first + r.drafts)[request] - np.arange(len(request)))


def logits_indices(inputs: ModelInputs, rows: SampleRows, R: int) -> ModelInputs:
    """Each sampling row reads the logits of its own token: a row's last token, or with drafts
    the token `after` rows before it."""
    if rows.after is None:
        return inputs
    out = np.zeros(R, np.int32)
    out[: len(rows.request)] = inputs.logits_indices[rows.request] - rows.after
    return dataclasses.replace(inputs, logits_indices=out)


def token_slots(r: RankRows, T: int, offset: int) -> np.ndarray:
    """[T] each token's sampling slot (global); padding takes the rank's first slot."""
    out = np.full(T, offset, np.int32)
    out[: r.num_tokens] = np.repeat(r.slots, r.lens)
    return out


def token_validity(r: RankRows, inputs: ModelInputs, rows: SampleRows, T: int) -> np.ndarray:
    """[T] the tokens folded into the sampling state: the real ones, not padding, and not
    drafts (a drafting request never reads the state)."""
    valid = np.zeros(T, np.bool_)
    total = r.num_tokens
    if rows.after is None:
        valid[:total] = True
        return valid
    from_end = np.repeat(r.starts + r.lens, r.lens) - inputs.positions[:total]  # 1 = a row's last
    valid[:total] = from_end > np.repeat(r.drafts, r.lens)
    return valid


def output_positions(r: RankRows, rows: SampleRows, table: SlotTable) -> np.ndarray:
    """Each sampling row's output position: the outputs its request has before its token."""
    out = r.starts + r.lens - table.prompt_len[r.slots]
    return out if rows.after is None else out[rows.request] - rows.after


def logprob_rows(r: RankRows, rows: SampleRows, table: SlotTable) -> list[LogprobRow]:
    """The sampling rows whose token's log-probs are read back: every row of a request that
    asked (with drafts, each of its rows; collect keeps the accepted ones)."""
    out = []
    for i in np.flatnonzero(r.samples & (table.logprob_k[r.slots] != NO_LOGPROBS)).tolist():
        rid, k, first = r.rows[i].request_id, int(table.logprob_k[r.slots[i]]), int(rows.first[i])
        out += [LogprobRow(row, rid, k) for row in range(first, first + 1 + int(r.drafts[i]))]
    return out


def prompt_logprobs(r: RankRows, table: SlotTable, T: int) -> tuple[np.ndarray, list[PromptLogprobRows]]:
    """([T] the next prompt token of each token whose prompt log-prob is wanted, else -1;
    the runs of tokens scored), for the requests that asked."""
    nxt = np.full(T, -1, np.int32)
    out: list[PromptLogprobRows] = []
    wanted = np.flatnonzero(table.prompt_logprob_k[r.slots] != NO_LOGPROBS).tolist()
    if not wanted:
        return nxt, out
    starts = np.cumsum(r.lens) - r.lens  # each row's first flat token
    for i in wanted:
        slot, start, lo = int(r.slots[i]), int(r.starts[i]), int(starts[i])
        pos = start + np.arange(int(r.lens[i]))
        count = int((pos + 1 < table.prompt_len[slot]).sum())  # the leading positions of the row
        if count:
            nxt[lo : lo + count] = table.prompt_ids[slot][pos[:count] + 1]
            out.append(PromptLogprobRows(r.rows[i].request_id, lo, count, start + 1,
                                         int(table.prompt_logprob_k[slot])))
    return nxt, out


def adapter_slots(r: RankRows, table: SlotTable, T: int, lora: bool) -> np.ndarray | None:
    """[T] each token's LoRA adapter slot (0: none); None without LoRA (the step takes no such
    input)."""
    if not lora:
        return None
    out = np.zeros(T, np.int32)
    out[: r.num_tokens] = np.repeat(table.adapter_slot[r.slots], r.lens)
    return out


def rank_metadata(builder: SamplingMetadataBuilder, row_slots: np.ndarray, out_pos: np.ndarray, R: int,
                  token_bitmask: np.ndarray | None, rows: SampleRows, offset: int, per: int,
                  num_slots: int) -> SamplingMetadata:
    """The sampler's rows (a structured-output bitmask row repeated over a request's draft
    rows); with data parallelism in the rank's own slot range (the sentinel for "none" is the
    range's size)."""
    if token_bitmask is not None and rows.after is not None:
        token_bitmask = np.repeat(token_bitmask, np.bincount(rows.request, minlength=len(token_bitmask)), axis=0)
    meta = builder.build(row_slots, out_pos, R, token_bitmask)
    if per == num_slots:
        return meta
    live = np.arange(R) < len(row_slots)
    return dataclasses.replace(
        meta, slots=np.where(live, meta.slots - offset, 0).astype(np.int32),
        reset_slots=np.where(meta.reset_slots == num_slots, per, meta.reset_slots - offset).astype(np.int32))


@dataclasses.dataclass(slots=True)
class PackedRank:
    """One rank's step inputs and what `collect` reads back, rows and tokens within the rank."""

    buffers: tuple[np.ndarray, ...]  # (ModelInputs, SamplingMetadata, TokenInfo), packed
    sample_ids: list[str]  # the request of each row that samples, in row order
    sample_rows: np.ndarray  # [n] int: those rows
    logprob_rows: list[LogprobRow]
    prompt_logprob_rows: list[PromptLogprobRows]


def pack_rank(r: RankRows, T: int, R: int, *, rank: int, table: SlotTable, builder: SamplingMetadataBuilder,
              layout: BufferLayout, page_size: int, lora: bool,
              token_bitmask: np.ndarray | None = None, num_steps: int = 1, drafting: bool = False) -> PackedRank:
    """One rank's rows packed into a (T, R) bucket. Slots are the rank's own in the step (it
    sees its range of the sampling state). `num_steps` > 1: a decode block of that many steps
    (T = R, one token per row), its `BlockInputs` packed after the step's. `drafting`:
    a draft head's step, its `DraftInputs` packed after the step's (jaxserve/runner/draft_head_step.py)."""
    per, offset = table.per, rank * table.per
    rows = sample_rows(r)
    inputs = logits_indices(pack_rows(r.tokens, r.starts, r.lens, table.block_table[r.slots], num_tokens=T,
                                      num_reqs=R, page_size=page_size), rows, R)
    slots = token_slots(r, T, offset)
    valid = token_validity(r, inputs, rows, T)
    row_slots = r.slots[rows.request]
    sampling = np.flatnonzero(r.samples[rows.request])
    sample_slots = np.full(R, per, np.int32)
    sample_slots[sampling] = row_slots[sampling] - offset
    next_prompt, prompt_rows = prompt_logprobs(r, table, T)
    tok = TokenInfo(slots=slots - offset, is_prompt=valid & (inputs.positions < table.prompt_len[slots]),
                    valid=valid, next_prompt_token=next_prompt, sample_slots=sample_slots,
                    lora_slots=adapter_slots(r, table, T, lora))
    out_pos = output_positions(r, rows, table)
    meta = rank_metadata(builder, row_slots, out_pos, R, token_bitmask, rows, offset, per, len(table.prompt_len))
    sample_ids = [r.rows[i].request_id for i in rows.request[sampling].tolist()]
    tree = (inputs, meta, tok) if num_steps == 1 else (inputs, meta, tok,
                                                       block_inputs(r, table, builder, out_pos, R, num_steps))
    if drafting:
        from jaxserve.runner.draft_head_step import draft_inputs

        tree += (draft_inputs(r.rows, r.tokens, r.lens, r.samples, r.drafts, table.num_blocks[r.slots], T, R),)
    return PackedRank(layout.pack(tree), sample_ids, sampling, logprob_rows(r, rows, table), prompt_rows)


def block_inputs(r: RankRows, table: SlotTable, builder: SamplingMetadataBuilder, out_pos: np.ndarray, R: int,
                 K: int) -> BlockInputs:
    """A decode block's own inputs (runner/decode_block.py): each row's steps (its
    ScheduledRequest's `num_steps`), stop tokens, min_tokens, first output position, and the
    random numbers of its K draws."""
    n = len(r.rows)
    steps = np.zeros(R, np.int32)
    steps[:n] = [s.num_steps for s in r.rows]
    stops = np.full((R, table.stop_tokens.shape[1]), -1, np.int32)
    stops[:n] = table.stop_tokens[r.slots]
    min_tokens = np.zeros(R, np.int32)
    min_tokens[:n] = table.min_tokens[r.slots]
    first = np.zeros(R, np.int32)
    first[:n] = out_pos
    return BlockInputs(steps=steps, stop_tokens=stops, min_tokens=min_tokens, output_pos=first,
                       uniforms=builder.uniforms_ahead(r.slots, out_pos, R, K))
