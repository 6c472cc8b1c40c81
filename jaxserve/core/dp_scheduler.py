"""Data parallelism: one scheduler per data-parallel rank behind the Scheduler's interface.

With `data_parallel_size` D the mesh's "data" axis splits the KV pages and the sampling slots
into D ranges; rank r owns pages [r N/D, (r+1) N/D) and slots [r S/D, (r+1) S/D). Each rank has
its own `Scheduler` over its own `KVCacheManager` (page ids local to the rank, its own null
page and prefix cache), a token budget of max_num_batched_tokens / D and max_num_seqs / D
sequences. A request is pinned to a rank for its whole life (preemption included): the rank
whose prefix cache holds the longest prefix of its prompt, else one that already queues the
same prompt (the n samples of a request, which then share its blocks), else the least loaded
(fewest tokens held or queued). Every step schedules each rank; the runner pads them to one
bucket and runs them as one compiled step over [D, ...] inputs split on "data" (tpu-inference's
DP scheduler and sglang-jax's `--dp-size` do the same).
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterable

from jaxserve.core.kv_cache_manager import KVCacheManager
from jaxserve.core.adapter_slots import AdapterSlots
from jaxserve.core.sched_output import ScheduledRequest, SchedulerOutput, StepBatch
from jaxserve.core.scheduler import Scheduler, SchedulerConfig, SchedulerStats
from jaxserve.request import Request, RequestStatus


@dataclasses.dataclass(frozen=True, slots=True)
class DataParallelOutput:
    """One step over every rank: each rank's SchedulerOutput, and the union of what the runner
    must release (its slots are global)."""

    ranks: tuple[SchedulerOutput, ...]
    finished_request_ids: frozenset[str]
    preempted_request_ids: tuple[str, ...]

    @property
    def scheduled(self) -> tuple[ScheduledRequest, ...]:
        return tuple(s for so in self.ranks for s in so.scheduled)

    @property
    def requests(self) -> tuple[Request, ...]:
        """The scheduler's Request of each row, rank after rank (as `scheduled`)."""
        return tuple(r for so in self.ranks for r in so.requests)

    @property
    def is_empty(self) -> bool:
        return all(so.is_empty for so in self.ranks)

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(so.total_num_scheduled_tokens for so in self.ranks)

    @property
    def lora_loads(self) -> tuple:
        """The adapter loads of every rank (their slots are the step's, shared by the ranks)."""
        return tuple(load for so in self.ranks for load in so.lora_loads)

    def batch(self) -> StepBatch:
        """The step as the runner takes it: every rank's rows."""
        return StepBatch(tuple(so.scheduled for so in self.ranks), self.finished_request_ids,
                         self.preempted_request_ids, self.lora_loads)


def rank_config(config: SchedulerConfig, data_parallel_size: int) -> SchedulerConfig:
    """One rank's share of the step limits."""
    D = data_parallel_size
    for name in ("max_num_seqs", "max_num_batched_tokens"):
        if getattr(config, name) % D:
            raise ValueError(f"{name} ({getattr(config, name)}) must be a multiple of data_parallel_size ({D}): "
                             "each data-parallel rank gets an equal share")
    return dataclasses.replace(config, max_num_seqs=config.max_num_seqs // D,
                               max_num_batched_tokens=config.max_num_batched_tokens // D)


class DataParallelScheduler:
    def __init__(self, config: SchedulerConfig, kv_managers: list[KVCacheManager],
                 adapters: AdapterSlots | None = None):
        """adapters: the LoRA adapters' device slots, shared by every rank (the step holds one
        set of slots that each rank's tokens read, so at most max_loras adapters run in a step
        over all ranks)."""
        self.config = config
        share = rank_config(config, len(kv_managers))
        adapters = AdapterSlots() if adapters is None else adapters
        self.ranks = [Scheduler(share, kv, adapters) for kv in kv_managers]
        self.rank_of: dict[str, int] = {}

    @property
    def data_parallel_size(self) -> int:
        return len(self.ranks)

    # ------------------------------------------------------------------ requests
    def add_request(self, request: Request) -> None:
        rid = request.request_id
        if rid in self.rank_of:
            raise ValueError(f"A request with id {rid!r} is already being processed.")
        rank = self._assign(request)
        self.ranks[rank].add_request(request)
        self.rank_of[rid] = rank

    def _assign(self, request: Request) -> int:
        prompt = request.prompt_token_ids
        best = []
        for r, sched in enumerate(self.ranks):
            _, hit = sched.kv.get_computed_blocks(request)
            same = any(w.prompt_token_ids == prompt for w in sched.waiting)
            load = sum(q.num_tokens + q.num_output_placeholders for q in sched.requests.values())
            best.append((-hit, not same, load, r))
        return min(best)[3]

    def finish_requests(self, request_ids: str | Iterable[str], status: RequestStatus) -> list[Request]:
        if isinstance(request_ids, str):
            request_ids = (request_ids,)
        done = []
        for rid in request_ids:
            rank = self.rank_of.get(rid)
            if rank is not None:
                done += self.ranks[rank].finish_requests(rid, status)
                self.rank_of.pop(rid, None)
        return done

    def abort_requests(self, request_ids: str | Iterable[str]) -> list[Request]:
        return self.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)

    def get_request(self, request_id: str) -> Request | None:
        rank = self.rank_of.get(request_id)
        return None if rank is None else self.ranks[rank].get_request(request_id)

    def has_unfinished_requests(self) -> bool:
        return any(s.has_unfinished_requests() for s in self.ranks)

    @property
    def requests(self) -> dict[str, Request]:
        return {rid: r for s in self.ranks for rid, r in s.requests.items()}

    @property
    def running(self) -> list[Request]:
        return [r for s in self.ranks for r in s.running]

    @property
    def num_preemptions(self) -> int:
        return sum(s.num_preemptions for s in self.ranks)

    @property
    def cache_tokens(self) -> int:
        """Tokens the KV caches of every rank hold."""
        return sum(s.cache_tokens for s in self.ranks)

    def reset_prefix_cache(self) -> bool:
        return all([s.reset_prefix_cache() for s in self.ranks])

    # ------------------------------------------------------------------ one step
    def schedule_block(self, num_steps: int, /) -> None:
        """No decode blocks with data parallelism (the plan gives K = 1): a block is one rank's."""
        return None

    def schedule(self) -> DataParallelOutput:
        ranks = tuple(s.schedule() for s in self.ranks)
        return DataParallelOutput(ranks, frozenset().union(*(so.finished_request_ids for so in ranks)),
                                  tuple(rid for so in ranks for rid in so.preempted_request_ids))

    def update_from_output(self, scheduler_output: DataParallelOutput,
                           sampled_token_ids: dict[str, list[int]]) -> list[tuple[Request, int]]:
        updated = []
        for sched, so in zip(self.ranks, scheduler_output.ranks):
            updated += sched.update_from_output(so, sampled_token_ids)
        for req, _ in updated:
            if req.is_finished:
                self.rank_of.pop(req.request_id, None)
        return updated

    def discard_step(self, scheduler_output: DataParallelOutput) -> list[str]:
        return [rid for sched, so in zip(self.ranks, scheduler_output.ranks) for rid in sched.discard_step(so)]

    def make_stats(self) -> SchedulerStats:
        stats = [s.make_stats() for s in self.ranks]
        return SchedulerStats(
            num_running=sum(s.num_running for s in stats),
            num_waiting=sum(s.num_waiting for s in stats),
            kv_cache_usage=sum(s.kv_cache_usage for s in stats) / len(stats),
            num_free_blocks=sum(s.num_free_blocks for s in stats),
            prefix_cache_queries=sum(s.prefix_cache_queries for s in stats),
            prefix_cache_hits=sum(s.prefix_cache_hits for s in stats),
            num_preemptions=sum(s.num_preemptions for s in stats),
            spec_num_drafts=sum(s.spec_num_drafts for s in stats),
            spec_num_draft_tokens=sum(s.spec_num_draft_tokens for s in stats),
            spec_num_accepted_tokens=sum(s.spec_num_accepted_tokens for s in stats),
            spec_num_accepted_per_pos=tuple(map(sum, itertools.zip_longest(
                *(s.spec_num_accepted_per_pos for s in stats), fillvalue=0))),
            running_lora_adapters=stats[0].running_lora_adapters,  # the shared table's
            waiting_lora_adapters=tuple(sorted({n for s in stats for n in s.waiting_lora_adapters})),
        )
