"""Request: the engine's host-side state for one sequence being generated.

A `Request` is created by the engine (one per sequence; a request with `n > 1` becomes `n`
requests) and is then owned by the scheduler: it moves WAITING → RUNNING (→ PREEMPTED →
RUNNING …) → FINISHED_*. vLLM v1's bookkeeping: `num_computed_tokens` counts the tokens whose
KV is in the cache (or will be once the step scheduled last has run) and catches up with
`num_tokens` (prompt + output); there are no prefill or decode phases.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from jaxserve.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED_STOPPED = 3
    FINISHED_LENGTH_CAPPED = 4
    FINISHED_ABORTED = 5
    FINISHED_IGNORED = 6

    @property
    def is_finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> str | None:
        """OpenAI-style finish reason ("stop", "length", "abort"), None while unfinished."""
        return _FINISH_REASONS.get(self)


_FINISH_REASONS: dict[RequestStatus, str] = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH_CAPPED: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    # vLLM's "ignored" (prompt too long) is reported as a length stop.
    RequestStatus.FINISHED_IGNORED: "length",
}


def needs_full_prompt_compute(params: SamplingParams) -> bool:
    """True when the prompt must be run through the model in full (never read from the cache).

    Prompt logprobs need the logits at every prompt position. Penalties do not: a request's
    first scheduled step carries its whole token history (`ScheduledRequest.all_token_ids`),
    from which the runner builds its counts.
    """
    return params.prompt_logprobs is not None


@dataclass(slots=True, eq=False)
class Request:
    """One sequence. Equality is identity; `output_token_ids` is append-only (use
    `append_output_token_ids`)."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float = field(default_factory=time.time)
    priority: int = 0  # lower is scheduled sooner (vLLM convention); used by policy="priority"
    eos_token_id: int | None = None
    # Never read this request's prompt from the prefix cache (its own full blocks are still
    # cached for others). Forced on when `needs_full_prompt_compute(sampling_params)`.
    skip_prefix_cache: bool = False
    # Mixed into every block hash: requests with different salts never share cached blocks.
    cache_salt: str | None = None

    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prefix-cache hit (tokens) at first scheduling, for metrics
    num_preemptions: int = 0
    # The stop token id (or, set by the output processor, the stop string); None for EOS.
    stop_reason: int | str | None = None
    # Hash chain (SHA-256 digests) over this request's full blocks, filled lazily by the
    # KVCacheManager.
    block_hashes: list[bytes] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.prompt_token_ids = list(self.prompt_token_ids)
        if needs_full_prompt_compute(self.sampling_params):
            self.skip_prefix_cache = True

    # ------------------------------------------------------------------ sizes
    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def max_tokens(self) -> int | None:
        return self.sampling_params.max_tokens

    # ------------------------------------------------------------------ tokens
    @property
    def all_token_ids(self) -> list[int]:
        """Prompt followed by output (a new list)."""
        return self.prompt_token_ids + self.output_token_ids

    def get_token_ids(self, start: int, end: int) -> list[int]:
        """Tokens at positions [start, end) of prompt + output, without building the whole."""
        p = len(self.prompt_token_ids)
        if end <= p:
            return self.prompt_token_ids[start:end]
        if start >= p:
            return self.output_token_ids[start - p : end - p]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - p]

    def append_output_token_ids(self, token_ids: int | list[int]) -> None:
        if isinstance(token_ids, int):
            self.output_token_ids.append(token_ids)
        else:
            self.output_token_ids.extend(token_ids)

    # ------------------------------------------------------------------ status
    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    def get_finished_reason(self) -> str | None:
        return self.status.finish_reason
