"""What the engine core sends its frontend: each step's outputs per request and a stats snapshot
(small, picklable, no JAX: the frontend may run in another process, see core_process.py)."""

from __future__ import annotations

import dataclasses

from jaxserve.core.scheduler import SchedulerStats
from jaxserve.outputs import SampleLogprobs


class EngineSleepingError(RuntimeError):
    """The engine is asleep (its device memory is freed) and takes no requests until woken."""


@dataclasses.dataclass(slots=True)
class EngineCoreOutput:
    """What one step produced for one request."""

    request_id: str
    new_token_ids: list[int]
    logprobs: list[SampleLogprobs] | None = None  # one per new token, when asked
    # (first position, log-probs of the prompt token at each following position)
    prompt_logprobs: tuple[int, list[SampleLogprobs]] | None = None
    finish_reason: str | None = None  # "stop" | "length"; "abort" with `error`
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    first_scheduled_time: float | None = None  # time.time() when the request was first scheduled
    error: BaseException | None = None  # the request failed (it is finished in the core)


@dataclasses.dataclass(frozen=True, slots=True)
class EngineStats:
    """A snapshot for metrics, taken on the engine's thread."""

    scheduler: SchedulerStats
    num_compiles: int
    recompiles: int  # compilations after warm-up (should stay 0)
    compile_seconds: float
    num_steps: int
    is_sleeping: bool


