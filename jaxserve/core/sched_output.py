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
"""

from __future__ import annotations

from dataclasses import dataclass

from jaxserve.request import Request

PENDING = -1  # a token id sampled by an earlier step that has not reached the host yet


@dataclass(slots=True)  # not frozen: built for every row of every step, and frozen init is slower
class ScheduledRequest:
    request: Request
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
    # per-request runner state (block table row, sampler rows, penalty counts …).
    is_new: bool
    is_resumed: bool  # is_new because of a preemption (the request has output tokens already)
    # Speculative decoding: the last num_draft_tokens of token_ids are drafts (not the request's
    # tokens yet); the step samples at each of them too and keeps the confirmed ones.
    num_draft_tokens: int = 0

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.request.prompt_token_ids)

    @property
    def end_pos(self) -> int:
        """One past the last fed position: the request's num_computed_tokens after the step."""
        return self.start_pos + self.num_scheduled_tokens


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
    # before the step runs (core/lora_slots.py).
    lora_loads: tuple = ()

    @property
    def is_empty(self) -> bool:
        return not self.scheduled

    @property
    def ranks(self) -> tuple[SchedulerOutput]:
        """One rank's output per data-parallel rank: this one alone (see DataParallelOutput)."""
        return (self,)
