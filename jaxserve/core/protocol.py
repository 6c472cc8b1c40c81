"""What the engine core needs of a scheduler: `StepScheduler`.

Two schedulers implement it: `Scheduler` (one KV cache) and `DataParallelScheduler` (one
`Scheduler` per data-parallel rank, each over its own pages). The engine core is typed against
this protocol, so either can drive it and a third (or a test's) is checked against the same
surface.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from jaxserve.config import SchedulerConfig
from jaxserve.request import Request, RequestStatus

if TYPE_CHECKING:
    from jaxserve.core.sched_output import ScheduledRequest, StepBatch
    from jaxserve.core.scheduler import SchedulerStats


@runtime_checkable
class ScheduledStep(Protocol):
    """One step's plan as the engine core reads it (`SchedulerOutput`, or one per rank in
    `DataParallelOutput`); a frozen dataclass (the core adds releases with
    `dataclasses.replace`)."""

    @property
    def scheduled(self) -> tuple[ScheduledRequest, ...]: ...

    @property
    def finished_request_ids(self) -> frozenset[str]: ...

    @property
    def preempted_request_ids(self) -> tuple[str, ...]: ...

    @property
    def is_empty(self) -> bool: ...

    @property
    def lora_loads(self) -> tuple: ...  # (slot, adapter) pairs the runner writes before the step

    @property
    def requests(self) -> tuple[Request, ...]: ...  # the scheduler's Request of each row

    def batch(self) -> StepBatch: ...  # the step as the runner takes it (no live Request)


@runtime_checkable
class StepScheduler(Protocol):
    """Admits requests, plans each step within the token budget and KV pages, and takes the
    step's sampled tokens back."""

    config: SchedulerConfig

    @property
    def requests(self) -> Mapping[str, Request]: ...  # every unfinished request

    @property
    def cache_tokens(self) -> int: ...  # tokens the KV cache holds

    def add_request(self, request: Request) -> None: ...

    def get_request(self, request_id: str) -> Request | None: ...

    def has_unfinished_requests(self) -> bool: ...

    def finish_requests(self, request_ids: str | Iterable[str], status: RequestStatus) -> list[Request]: ...

    def abort_requests(self, request_ids: str | Iterable[str]) -> list[Request]: ...

    def schedule(self) -> ScheduledStep: ...

    # A decode block of up to num_steps steps, or None for an ordinary step (multi-step decode).
    def schedule_block(self, num_steps: int, /) -> ScheduledStep | None: ...

    def update_from_output(self, scheduler_output: ScheduledStep, sampled_token_ids: dict[str, list[int]], /
                           ) -> list[tuple[Request, int]]: ...

    def discard_step(self, scheduler_output: ScheduledStep, /) -> list[str]: ...

    def reset_prefix_cache(self) -> bool: ...

    def make_stats(self) -> SchedulerStats: ...
