"""SchedulerOutput: everything the model runner needs for one step, and nothing more.

One step feeds, for each scheduled request in batch order, the tokens at positions
[start_pos, start_pos + num_scheduled_tokens) — a prefill chunk, a whole prompt, a recompute
after preemption or the one token sampled last step, all alike — and writes their KV into the
request's blocks. When `sample` is set, the logits at the last fed position produce one new
token, reported back through `Scheduler.update_from_output`; with speculative decoding the
last fed tokens may be drafts, and the positions from the last known token on each sample
one (jaxserve/spec_decode/).

A token the scheduler does not know yet (sampled by a step still in flight) is `PENDING` in
`token_ids`; the runner reads it on the device from the request's slot.

The runner receives a `StepBatch` (`SchedulerOutput.batch()`): typed rows and, for a request
(re)admitted, a `NewRequestData` snapshot of it; the scheduler's `Request` objects stay on the
scheduler's side of the step (`SchedulerOutput.requests`).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from jaxserve.lora_request import LoRARequest
from jaxserve.request import Request
from jaxserve.sampling_params import SamplingParams

PENDING = -1  # a token id sampled by an earlier step that has not reached the host yet


@dataclass(frozen=True, slots=True)
class NewRequestData:
    """What the runner keeps of a request from the step that (re)admits it: a snapshot of the
    scheduler's `Request` (vLLM's NewRequestData), which the runner never sees."""

    prompt_token_ids: tuple[int, ...]
    sampling_params: SamplingParams
    eos_token_id: int | None
    bad_words_token_ids: tuple[tuple[int, ...], ...]
    adapter_slot: int = 0  # its LoRA adapter's device slot (0: the base model)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @classmethod
    def of(cls, request: Request) -> NewRequestData:
        return cls(tuple(request.prompt_token_ids), request.sampling_params, request.eos_token_id,
                   request.bad_words_token_ids, request.lora_slot)


@dataclass(slots=True)  # not frozen: built for every row of every step, and frozen init is slower
class ScheduledRequest:
    """One row of a step, as the runner reads it (no live `Request`)."""

    request_id: str
    # Tokens to feed this step, for positions start_pos … start_pos + num_scheduled_tokens - 1;
    # PENDING where the token was sampled by a step still in flight.
    token_ids: tuple[int, ...]
    start_pos: int  # = the request's num_computed_tokens before this step; KV exists below it
    num_scheduled_tokens: int  # = len(token_ids) > 0
    # The blocks appended to the request's block table this step (its whole table when
    # is_new). Position p is slot p % block_size of table[p // block_size].
    new_block_ids: tuple[int, ...]
    # This step reaches the end of the request's tokens: sample one token from the logits at
    # the last fed position. False for a prefill chunk that is not the last one.
    sample: bool
    # First step since the request was added or resumed after preemption: (re)build any
    # per-request runner state (block table row, sampler rows, penalty counts …) from `new`.
    is_new: bool
    is_resumed: bool  # is_new because of a preemption (the request has output tokens already)
    # Speculative decoding: the last num_draft_tokens of token_ids are drafts (not the request's
    # tokens yet); the step samples at each of them too and keeps the confirmed ones.
    num_draft_tokens: int = 0
    new: NewRequestData | None = None  # set when is_new: what the runner keeps of the request
    # Multi-step decode (a decode block, runner/decode_block.py): the row feeds its one token
    # and decodes up to num_steps tokens on the device, each fed back as the next input; its
    # KV grows by num_steps positions (allocated before the block). 1: an ordinary row.
    num_steps: int = 1
    # A prefill chunk that samples nothing: the token after its last one (an EAGLE-3 head's
    # input at that position, jaxserve/runner/draft_head_step.py); -1 otherwise.
    next_token_id: int = -1

    @property
    def end_pos(self) -> int:
        """One past the last fed position: the request's num_computed_tokens after the step."""
        return self.start_pos + self.num_scheduled_tokens + self.num_steps - 1

    @property
    def draft_token_ids(self) -> tuple[int, ...]:
        return self.token_ids[self.num_scheduled_tokens - self.num_draft_tokens:] if self.num_draft_tokens else ()


@dataclass(frozen=True, slots=True)
class StepBatch:
    """One step as the scheduler hands it to the runner: each data-parallel rank's rows (typed
    snapshots), the requests whose runner state ends, the adapters to write into their slots.
    Nothing in it is the scheduler's own state."""

    ranks: tuple[tuple[ScheduledRequest, ...], ...]  # one per data-parallel rank, in batch order
    # Requests finished or aborted since the previous step, and preempted ones: their runner
    # state (sampling slot, block table row) is void.
    finished_request_ids: frozenset[str]
    preempted_request_ids: tuple[str, ...]
    # LoRA adapters given a device slot this step: (slot, LoRARequest), written before it runs.
    adapter_loads: tuple[tuple[int, LoRARequest], ...] = ()
    # Multi-step decode: the step is a decode block of this many steps (every row feeds one
    # token; each decodes its own num_steps <= it); 1: an ordinary step.
    num_steps: int = 1

    @property
    def rows(self) -> Iterator[ScheduledRequest]:
        """Every rank's rows, rank after rank (the order of a step's bitmask rows)."""
        return (s for rank in self.ranks for s in rank)

    @property
    def is_empty(self) -> bool:
        return not any(self.ranks)


@dataclass(frozen=True, slots=True)
class SchedulerOutput:
    # Requests in batch order: the running ones first, then those admitted this step.
    scheduled: tuple[ScheduledRequest, ...]
    total_num_scheduled_tokens: int
    # Requests that finished or were aborted since the previous schedule() (including any
    # that were scheduled in the previous step): the runner drops their per-request state.
    # Delivered even when nothing is scheduled — the engine must still pass them on.
    finished_request_ids: frozenset[str]
    # Requests preempted (by recompute) in this step: their per-request runner state is void;
    # they come back later with is_new and is_resumed set.
    preempted_request_ids: tuple[str, ...]
    # LoRA adapters given a device slot this step: (slot, LoRARequest), for the runner to write
    # before the step runs (core/adapter_slots.py).
    lora_loads: tuple = ()
    # The scheduler's own Request of each row, in row order: for update_from_output,
    # discard_step and the engine core (outputs, grammars); the runner gets `batch()`.
    requests: tuple[Request, ...] = ()
    num_steps: int = 1  # a decode block of this many steps (Scheduler.schedule_block); 1: a step

    @property
    def is_empty(self) -> bool:
        return not self.scheduled

    @property
    def ranks(self) -> tuple[SchedulerOutput]:
        """One rank's output per data-parallel rank: this one alone (see DataParallelOutput)."""
        return (self,)

    def batch(self) -> StepBatch:
        """The step as the runner takes it."""
        return StepBatch((self.scheduled,), self.finished_request_ids, self.preempted_request_ids, self.lora_loads,
                         self.num_steps)
