"""Scheduler: continuous batching with vLLM v1's rule.

There is no prefill phase and no decode phase. Each request's `num_computed_tokens` catches up
with its `num_tokens` (prompt + output). Every step spends a token budget
(`max_num_batched_tokens`) on the running requests first, in order, then admits waiting ones
while fewer than `max_num_seqs` run. A prompt longer than the remaining budget is computed in
chunks over several steps (chunked prefill); only the step that reaches the end of a request's
known tokens samples a token.

When the KV cache cannot hold a running request's next tokens, the scheduler preempts the last
running request (the newest under "fcfs", the lowest-priority under "priority") by recompute:
its blocks are freed (they stay in the prefix cache until evicted), `num_computed_tokens`
goes back to 0 and it re-enters the waiting queue at the position its key gives it (ahead of
every request that arrived after it). No request is admitted in a step that preempted one.

Step protocol (one engine step):
    out = scheduler.schedule()          # advances num_computed_tokens of the scheduled requests
    sampled = runner.execute(out)       # {request_id: [token]} for the rows with `sample`
    updated = scheduler.update_from_output(out, sampled)   # [(request, new tokens)]
`num_computed_tokens` is advanced in `schedule()` (as in vLLM v1), so a scheduled request
already counts its step's tokens as computed, and a row that samples adds a placeholder for
its token (`Request.num_output_placeholders`); `update_from_output` replaces it by the sampled
token and applies the stop conditions the scheduler owns (max_tokens, EOS, stop_token_ids,
max_model_len). Stop strings belong to the output processor, which calls `finish_requests`.

Overlapped steps (vLLM v1's async scheduling) call schedule() for step t+1 before
update_from_output() of step t: a request whose last token is still pending is scheduled to
feed it (`PENDING` in its token ids) unless that token may be its last (max_tokens or
max_model_len reached). A request finished by a token that arrives late has had one more step
computed for nothing; its output is dropped. Nothing is resumed while a token of it is pending.

Multi-step decode: `schedule_block(K)` plans a decode block instead of a step when every
running request only decodes and nothing waits that could be admitted: each row feeds its last
token and decodes up to K tokens on the device (as many placeholders; their KV slots allocated
ahead), and `update_from_output` takes them in order up to the first stop. It returns None,
changing nothing, whenever the block would not be exact (see its doc); the engine core then
calls schedule().
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import logging
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from jaxserve.config import SchedulerConfig
from jaxserve.core.kv_cache_manager import KVCacheManager
from jaxserve.core.adapter_slots import AdapterSlots
from jaxserve.core.sched_output import PENDING, NewRequestData, ScheduledRequest, SchedulerOutput
from jaxserve.request import Request, RequestStatus

logger = logging.getLogger(__name__)

SortKey = tuple[int | float, ...]


@dataclass(frozen=True, slots=True)
class SchedulerStats:
    num_running: int
    num_waiting: int
    kv_cache_usage: float  # fraction of allocatable blocks in use
    num_free_blocks: int
    prefix_cache_queries: int  # tokens looked up in the prefix cache (cumulative)
    prefix_cache_hits: int  # of which found (cumulative)
    num_preemptions: int  # cumulative
    # Speculative decoding (cumulative): steps of a request that fed drafts, drafts fed, and
    # drafts accepted (vLLM's spec_decode_num_drafts / _num_draft_tokens / _num_accepted_tokens).
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    # [j]: steps whose drafts were accepted at least up to position j (vLLM's
    # spec_decode_num_accepted_tokens_per_pos); as long as the most drafts ever accepted
    spec_num_accepted_per_pos: tuple[int, ...] = ()
    # LoRA adapters of the running and of the waiting requests (vLLM's lora_requests_info)
    running_lora_adapters: tuple[str, ...] = ()
    waiting_lora_adapters: tuple[str, ...] = ()

    @property
    def prefix_cache_hit_rate(self) -> float:
        if not self.prefix_cache_queries:
            return 0.0
        return self.prefix_cache_hits / self.prefix_cache_queries


class _WaitingQueue:
    """Waiting (and preempted) requests, smallest key first."""

    def __init__(self) -> None:
        self._heap: list[tuple[SortKey, Request]] = []  # keys are unique: Request never compared

    def push(self, key: SortKey, request: Request) -> None:
        heapq.heappush(self._heap, (key, request))

    def peek(self) -> Request:
        return self._heap[0][1]

    def pop(self) -> Request:
        return heapq.heappop(self._heap)[1]

    def remove(self, request: Request) -> None:
        self._heap = [e for e in self._heap if e[1] is not request]
        heapq.heapify(self._heap)

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self) -> Iterator[Request]:
        """In scheduling order."""
        return (r for _, r in sorted(self._heap, key=lambda e: e[0]))


class Scheduler:
    def __init__(self, scheduler_config: SchedulerConfig, kv_cache_manager: KVCacheManager,
                 adapters: AdapterSlots | None = None) -> None:
        """adapters: which LoRA adapter holds which device slot (None: no slots, LoRA off; see
        core/adapter_slots.py); with data parallelism every rank's scheduler shares one,
        since the slots are the step's, not a rank's."""
        self.config = scheduler_config
        self.kv = kv_cache_manager
        self.adapters = AdapterSlots() if adapters is None else adapters
        # Positions past a decoding request's fed tokens that a step may write KV at (an EAGLE-3
        # head's chained drafts: k - 1); their pages are reserved as far as they are free.
        self.num_lookahead_tokens = 0
        if self.kv.max_model_len not in (None, scheduler_config.max_model_len):
            raise ValueError(
                f"KVCacheManager.max_model_len ({self.kv.max_model_len}) differs from "
                f"SchedulerConfig.max_model_len ({scheduler_config.max_model_len})."
            )
        if scheduler_config.max_num_batched_tokens is None:
            raise ValueError("SchedulerConfig.max_num_batched_tokens is unresolved (None: the engine's backend "
                             "chooses it); give the scheduler a number.")
        capacity = (self.kv.num_blocks - 1) * self.kv.block_size
        if capacity < scheduler_config.max_model_len:
            raise ValueError(
                f"The KV cache holds {capacity} tokens, fewer than max_model_len="
                f"{scheduler_config.max_model_len}: a long request could never run."
            )
        self.requests: dict[str, Request] = {}  # every unfinished request
        self.waiting = _WaitingQueue()
        # Ordered by scheduling key: served first to last, preempted last to first.
        self.running: list[Request] = []
        self._keys: dict[str, SortKey] = {}
        self._seq = itertools.count()
        self._finished_ids: set[str] = set()  # since the last schedule()
        self.num_preemptions = 0
        self.spec_num_drafts = self.spec_num_draft_tokens = self.spec_num_accepted_tokens = 0
        self.spec_num_accepted_per_pos: list[int] = []

    # ------------------------------------------------------------------ requests in and out
    def add_request(self, request: Request) -> None:
        """Queue a new request. Raises ValueError for a prompt that can never run."""
        rid = request.request_id
        if rid in self.requests:
            raise ValueError(f"A request with id {rid!r} is already being processed.")
        if request.num_prompt_tokens == 0:
            raise ValueError("The prompt must contain at least one token.")
        if request.num_prompt_tokens > self.config.max_model_len:
            raise ValueError(
                f"The prompt has {request.num_prompt_tokens} tokens, more than the model's "
                f"maximum context length ({self.config.max_model_len}); shorten it."
            )
        self.adapters.check(request)
        if request.status != RequestStatus.WAITING or request.num_computed_tokens:
            raise ValueError(f"Request {rid!r} has already been scheduled once.")
        seq = next(self._seq)
        if self.config.policy == "priority":
            self._keys[rid] = (request.priority, request.arrival_time, seq)
        else:
            self._keys[rid] = (seq,)
        self.requests[rid] = request
        self.waiting.push(self._keys[rid], request)

    def finish_requests(
        self, request_ids: str | Iterable[str], status: RequestStatus
    ) -> list[Request]:
        """Finish requests from any state (unknown or finished ids are ignored): they leave
        the queues and free their blocks. For the output processor (stop strings) and aborts."""
        if not status.is_finished:
            raise ValueError(f"{status!r} is not a finished status.")
        if isinstance(request_ids, str):
            request_ids = (request_ids,)
        done = []
        for rid in request_ids:
            req = self.requests.get(rid)
            if req is not None:
                self._finish(req, status)
                done.append(req)
        return done

    def abort_requests(self, request_ids: str | Iterable[str]) -> list[Request]:
        return self.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)

    def discard_step(self, scheduler_output: SchedulerOutput) -> list[str]:
        """Undo a scheduled step that will not run (the runner could not prepare it): the blocks
        it was to fill leave the prefix cache (they hold no KV), its rows drop the placeholders
        they took, and its unfinished requests are preempted (their blocks are freed; they are
        recomputed later). Returns the preempted ids."""
        kv = self.kv
        kv.pool.uncache([b for s in scheduler_output.scheduled
                         for b in kv.get_block_ids(s.request_id)[s.start_pos // kv.block_size:]])
        preempted = []
        for s, req in zip(scheduler_output.scheduled, scheduler_output.requests):
            if s.sample:
                req.num_output_placeholders -= s.num_steps
            if req.status == RequestStatus.RUNNING:
                self.running.remove(req)
                self._preempt(req)
                preempted.append(req.request_id)
        self.adapters.discard_loads(scheduler_output.lora_loads)
        return preempted

    def get_request(self, request_id: str) -> Request | None:
        return self.requests.get(request_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    @property
    def cache_tokens(self) -> int:
        """Tokens the KV cache holds (its blocks but the null one)."""
        return (self.kv.num_blocks - 1) * self.kv.block_size

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block (False while some request holds blocks)."""
        return self.kv.reset_prefix_cache()

    # ------------------------------------------------------------------ one step
    def schedule(self) -> SchedulerOutput:
        cfg = self.config
        budget = cfg.max_num_batched_tokens
        scheduled: list[ScheduledRequest] = []
        requests: list[Request] = []  # the Request of each row
        preempted: list[str] = []
        # A step samples on at most max_num_seqs rows (the largest request bucket): one per
        # request, and one per draft token. Drafts take the rows that neither the running
        # requests nor the waiting ones that could be admitted need.
        free_seqs = cfg.max_num_seqs - len(self.running)
        spare_rows = free_seqs - min(len(self.waiting), free_seqs)

        # 1. Running requests, in order. The last one is the preemption victim.
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = self._num_new_tokens(req, budget)
            if n == 0:  # nothing to compute until its sampled token arrives
                i += 1
                continue
            k = self._num_drafts(req, n, budget, spare_rows) if req.spec_token_ids else 0
            ahead = max(0, min(self.num_lookahead_tokens, self.config.max_model_len - req.num_computed_tokens - n - k))
            new_blocks = self.kv.allocate_slots(req, n + k + ahead, num_draft_tokens=k, num_lookahead_tokens=ahead)
            if new_blocks is None and (k or ahead):
                k = 0
                new_blocks = self.kv.allocate_slots(req, n)
            while new_blocks is None:
                victim = self.running.pop()
                self._preempt(victim)
                preempted.append(victim.request_id)
                if victim is req:
                    break
                new_blocks = self.kv.allocate_slots(req, n)
            if new_blocks is not None:
                scheduled.append(self._advance(req, n, new_blocks, is_new=False, resumed=False, num_drafts=k))
                requests.append(req)
                budget -= n + k
                spare_rows -= k
                i += 1

        # 2. Waiting requests, in key order; head-of-line blocking keeps the order fair. A
        # request whose adapter can get no device slot (every slot's adapter is running) steps
        # aside for this step, as in vLLM: later requests of the base model or of an adapter
        # in a slot go first, and it keeps its place for the next step.
        no_slot: list[Request] = []
        while (
            not preempted and self.waiting and budget > 0
            and len(self.running) < cfg.max_num_seqs
        ):
            req = self.waiting.peek()
            if req.num_output_placeholders:  # preempted while its last token was in flight
                break
            if not self.adapters.can_admit(req):
                no_slot.append(self.waiting.pop())
                continue
            hits, num_hit = self.kv.get_computed_blocks(req)
            n = req.num_tokens - num_hit
            if not cfg.enable_chunked_prefill and n > budget:
                break
            n = min(n, budget)
            if self.kv.allocate_slots(req, n, hits) is None:
                break
            self.waiting.pop()
            self.adapters.admit(req)
            resumed = req.status == RequestStatus.PREEMPTED
            if not resumed:
                req.num_cached_tokens = num_hit
                req.first_scheduled_time = time.time()
            req.num_computed_tokens = num_hit
            req.status = RequestStatus.RUNNING
            bisect.insort(self.running, req, key=lambda r: self._keys[r.request_id])
            table = self.kv.get_block_ids(req.request_id)
            scheduled.append(self._advance(req, n, table, is_new=True, resumed=resumed))
            requests.append(req)
            budget -= n
        for req in no_slot:
            self.waiting.push(self._keys[req.request_id], req)

        finished_ids = frozenset(self._finished_ids)
        self._finished_ids.clear()
        return SchedulerOutput(
            scheduled=tuple(scheduled),
            total_num_scheduled_tokens=cfg.max_num_batched_tokens - budget,
            finished_request_ids=finished_ids,
            preempted_request_ids=tuple(preempted),
            lora_loads=self.adapters.take_loads(),
            requests=tuple(requests),
        )

    def schedule_block(self, num_steps: int) -> SchedulerOutput | None:
        """A decode block (multi-step decode, runner/decode_block.py): every running request
        that has a token to feed decodes up to `num_steps` tokens in one dispatch, each fed back
        on the device. Returns None, having changed nothing, unless the block is exact and
        worth it:
        - no waiting request could be admitted now (it would wait for the whole block);
        - every such request feeds just its last token: no prefill chunk (a prompt's, or a
          resumed request's recompute), no drafts;
        - one of them may decode more than one token (the length limits below);
        - the token budget holds a row per request, and the free blocks hold all their tokens
          (a block never preempts: the ordinary step that follows a refusal does).
        Each row decodes min(num_steps, what max_tokens and max_model_len leave after its
        pending tokens) tokens; their KV slots are allocated now. EOS and stop tokens end a
        row on the device, and `update_from_output` trims what follows them."""
        cfg = self.config
        if self.waiting and len(self.running) < cfg.max_num_seqs:
            return None
        rows: list[tuple[Request, int]] = []
        need = 0
        for req in self.running:
            n = self._num_new_tokens(req, cfg.max_model_len)  # all it has to feed, whatever the budget
            if n == 0:  # its pending token may be its last
                continue
            if n != 1 or req.spec_token_ids:
                return None
            k = self._block_steps(req, num_steps)
            need += self.kv.num_new_blocks(req, k)
            rows.append((req, k))
        if (not rows or max(k for _, k in rows) < 2 or len(rows) > cfg.max_num_batched_tokens
                or need > self.kv.get_num_free_blocks()):
            return None
        scheduled = []
        for req, k in rows:
            new_blocks = self.kv.allocate_slots(req, k, num_lookahead_tokens=k - 1)
            assert new_blocks is not None, "the free blocks were counted"
            scheduled.append(self._advance(req, 1, new_blocks, is_new=False, resumed=False, num_steps=k))
        finished_ids = frozenset(self._finished_ids)
        self._finished_ids.clear()
        return SchedulerOutput(scheduled=tuple(scheduled), total_num_scheduled_tokens=len(scheduled),
                               finished_request_ids=finished_ids, preempted_request_ids=(),
                               lora_loads=self.adapters.take_loads(), requests=tuple(req for req, _ in rows),
                               num_steps=num_steps)

    def _block_steps(self, req: Request, num_steps: int) -> int:
        """The tokens a decode block may sample for `req`: up to `num_steps`, within max_tokens
        and max_model_len after its pending tokens (>= 1 when it has a token to feed)."""
        pending = req.num_output_placeholders
        k = min(num_steps, self.config.max_model_len - req.num_tokens - pending)
        max_tokens = req.sampling_params.max_tokens
        if max_tokens is not None:
            k = min(k, max_tokens - req.num_output_tokens - pending)
        return k

    def update_from_output(
        self, scheduler_output: SchedulerOutput, sampled_token_ids: dict[str, list[int]]
    ) -> list[tuple[Request, int]]:
        """Apply one step's sampled tokens. Returns (request, number of tokens taken) for each
        row that took tokens, in batch order; finished requests (freed already) are among them
        with a finished status.

        `sampled_token_ids` must hold a non-empty list (normally one token) for every scheduled
        row with `sample` set; tokens for other rows are ignored (a partial prefill chunk
        samples nothing). Rows whose request was finished or aborted since `schedule()` are
        skipped; a request preempted since still takes its token.
        """
        updated = []
        for s, req in zip(scheduler_output.scheduled, scheduler_output.requests):
            if not s.sample:
                continue
            req.num_output_placeholders -= s.num_steps
            if req.status >= RequestStatus.FINISHED_STOPPED:
                continue
            tokens = sampled_token_ids.get(req.request_id)
            if not tokens:
                raise RuntimeError(f"The runner returned no token for request {req.request_id!r}.")
            if s.num_draft_tokens:
                # tokens: the accepted drafts and one more. The rejected drafts' KV is void:
                # their positions are computed again (overwritten) by later steps.
                accepted = len(tokens) - 1
                self.spec_num_drafts += 1
                self.spec_num_draft_tokens += s.num_draft_tokens
                self.spec_num_accepted_tokens += accepted
                per_pos = self.spec_num_accepted_per_pos
                per_pos.extend([0] * (accepted - len(per_pos)))
                for j in range(accepted):
                    per_pos[j] += 1
                if req.status == RequestStatus.RUNNING:
                    req.num_computed_tokens -= s.num_draft_tokens - accepted
            taken = 0
            for token in tokens:
                req.output_token_ids.append(token)
                taken += 1
                status = self._check_stop(req, token)
                if status is not None:
                    self._finish(req, status)
                    break
            updated.append((req, taken))
        return updated

    # ------------------------------------------------------------------ metrics
    def make_stats(self) -> SchedulerStats:
        return SchedulerStats(
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            kv_cache_usage=self.kv.usage,
            num_free_blocks=self.kv.get_num_free_blocks(),
            prefix_cache_queries=self.kv.prefix_cache_queries,
            prefix_cache_hits=self.kv.prefix_cache_hits,
            num_preemptions=self.num_preemptions,
            spec_num_drafts=self.spec_num_drafts,
            spec_num_draft_tokens=self.spec_num_draft_tokens,
            spec_num_accepted_tokens=self.spec_num_accepted_tokens,
            spec_num_accepted_per_pos=tuple(self.spec_num_accepted_per_pos),
            running_lora_adapters=tuple(self.adapters.running_names()),
            waiting_lora_adapters=self.adapters.waiting_names(self.waiting),
        )

    # ------------------------------------------------------------------ internals
    def _num_new_tokens(self, req: Request, budget: int) -> int:
        pending = req.num_output_placeholders
        num_tokens = len(req.prompt_token_ids) + len(req.output_token_ids)
        if pending:
            # Feeding a pending token samples the one after it: not when the pending one
            # may be the last (it finishes the request when it arrives).
            max_tokens = req.sampling_params.max_tokens
            if (num_tokens + pending >= self.config.max_model_len
                    or max_tokens is not None and len(req.output_token_ids) + pending >= max_tokens):
                return 0
        n = num_tokens + pending - req.num_computed_tokens
        return max(0, min(n, budget, self.config.max_model_len - req.num_computed_tokens))

    def _num_drafts(self, req: Request, n: int, budget: int, spare_rows: int) -> int:
        """How many of the request's drafts this step feeds: only after its last known token
        (n == 1, nothing pending), within the token budget, the spare rows, max_model_len and
        what max_tokens still allows (the step emits up to drafts + 1 tokens)."""
        if n != 1 or req.num_output_placeholders or req.num_computed_tokens != req.num_tokens - 1:
            return 0
        k = min(len(req.spec_token_ids), spare_rows, budget - 1,
                self.config.max_model_len - req.num_tokens)
        max_tokens = req.sampling_params.max_tokens
        if max_tokens is not None:
            k = min(k, max_tokens - req.num_output_tokens - 1)
        return max(k, 0)

    def _advance(self, req: Request, n: int, block_ids: list[int], *, is_new: bool,
                 resumed: bool, num_drafts: int = 0, num_steps: int = 1) -> ScheduledRequest:
        """Describe one scheduled request and count its tokens (and drafts, or a decode
        block's later steps) as computed."""
        start = req.num_computed_tokens
        end = start + n
        known = len(req.prompt_token_ids) + len(req.output_token_ids)
        if end <= known:
            tokens = tuple(req.get_token_ids(start, end))
        elif start >= known:
            tokens = (PENDING,) * n
        else:
            tokens = (*req.get_token_ids(start, known), *(PENDING,) * (end - known))
        sample = end == known + req.num_output_placeholders
        if sample:
            req.num_output_placeholders += num_steps
        if num_drafts:
            tokens += tuple(req.spec_token_ids[:num_drafts])
        req.spec_token_ids = []  # used (or outdated once this step's tokens arrive)
        req.num_computed_tokens = end + num_drafts + num_steps - 1
        next_token = req.get_token_ids(end, end + 1)[0] if not sample and end < known else -1
        return ScheduledRequest(req.request_id, tokens, start, n + num_drafts, tuple(block_ids), sample, is_new,
                                resumed, num_drafts, NewRequestData.of(req) if is_new else None, num_steps,
                                next_token)

    def _preempt(self, req: Request) -> None:
        logger.debug("Preempting %s (%d tokens) by recompute", req.request_id, req.num_tokens)
        self.kv.free(req)
        self.adapters.release(req.request_id)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.spec_token_ids = []
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.push(self._keys[req.request_id], req)

    def _check_stop(self, req: Request, token: int) -> RequestStatus | None:
        params = req.sampling_params
        if req.num_output_tokens >= params.min_tokens:
            if token == req.eos_token_id and not params.ignore_eos:
                req.stop_reason = None
                return RequestStatus.FINISHED_STOPPED
            if token in req.stop_token_ids:
                req.stop_reason = token
                return RequestStatus.FINISHED_STOPPED
        if req.num_tokens >= self.config.max_model_len:
            return RequestStatus.FINISHED_LENGTH_CAPPED
        if params.max_tokens is not None and req.num_output_tokens >= params.max_tokens:
            return RequestStatus.FINISHED_LENGTH_CAPPED
        return None

    def _finish(self, req: Request, status: RequestStatus) -> None:
        if req.status == RequestStatus.RUNNING:
            self.running.remove(req)
        else:
            self.waiting.remove(req)
        req.status = status
        self.kv.free(req)
        self.adapters.release(req.request_id)
        rid = req.request_id
        del self.requests[rid]
        del self._keys[rid]
        self._finished_ids.add(rid)
