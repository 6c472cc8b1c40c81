"""Request: the engine core's host-side state for one sequence being generated.

A `Request` is created by the engine core from an `EngineRequest` (one per sequence; the input
processor turns a request with `n > 1` into `n` of them) and is then owned by the scheduler: it
moves WAITING → RUNNING (→ PREEMPTED → RUNNING …) → FINISHED_*. vLLM v1's bookkeeping:
`num_computed_tokens` counts the tokens whose KV is in the cache (or will be once the steps
scheduled so far have run) and catches up with `num_tokens` (prompt + output); there are no
prefill or decode phases.

With overlapped steps the scheduler plans step t+1 before step t's sampled tokens are known:
`num_output_placeholders` counts the tokens sampled by steps in flight. Positions past
`num_tokens` hold such a pending token; the step that feeds one reads it on the device
(see runner/model_runner.py).
"""

from __future__ import annotations

import dataclasses
import enum
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from jaxserve.lora_request import LoRARequest
from jaxserve.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED_STOPPED = 3
    FINISHED_LENGTH_CAPPED = 4
    FINISHED_ABORTED = 5

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
}


class RequestFailedError(Exception):
    """A part of an engine step that can name the requests at fault raises this (the runner,
    when it cannot take a request's input while preparing a step): those requests fail with
    `cause`, the step's other requests are recomputed, and the engine keeps serving. Any other
    exception inside a step is unrecoverable (see engine/core.py)."""

    def __init__(self, request_ids: Iterable[str], cause: BaseException):
        self.request_ids = tuple(request_ids)
        self.cause = cause
        super().__init__(f"request(s) {', '.join(self.request_ids)} failed: {cause}")


@dataclasses.dataclass(frozen=True, slots=True)
class EngineRequest:
    """One sequence as the input processor hands it to the engine core: validated and
    tokenized, nothing left to look up."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling_params: SamplingParams  # n == 1; max_tokens resolved; extra EOS ids in stop_token_ids
    eos_token_id: int | None  # the model's primary EOS (stop_reason None when it stops)
    bad_words_token_ids: tuple[tuple[int, ...], ...] = ()
    arrival_time: float = 0.0
    priority: int = 0
    cache_salt: str | None = None
    lora_request: LoRARequest | None = None  # the adapter it runs with (None: the base model)
    # The compiled constraint of sampling_params.structured_outputs (a jaxserve.structured.
    # compiler.CompiledGrammar, shared, never advanced; typed loosely: the core imports no engine)
    grammar: Any = None


def needs_full_prompt_compute(params: SamplingParams) -> bool:
    """True when the prompt must be run through the model in full (never read from the cache).

    Prompt logprobs need the logits at every prompt position. Penalties do not: a request's
    first scheduled step feeds its whole token history, from which the runner rebuilds its
    counts.
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
    # Token id sequences that must not be generated (multi-token ones via the sampler's table).
    bad_words_token_ids: tuple[tuple[int, ...], ...] = ()
    # Never read this request's prompt from the prefix cache (its own full blocks are still
    # cached for others). Forced on when `needs_full_prompt_compute(sampling_params)`.
    skip_prefix_cache: bool = False
    # Mixed into every block hash: requests with different salts never share cached blocks.
    cache_salt: str | None = None
    # The LoRA adapter it runs with (None: the base model); its id keys the block hashes too.
    lora_request: LoRARequest | None = None
    lora_slot: int = 0  # the adapter's device slot while running (the scheduler's; 0: none)

    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_output_placeholders: int = 0  # tokens sampled by steps in flight, not known yet
    num_cached_tokens: int = 0  # prefix-cache hit (tokens) at first scheduling, for metrics
    first_scheduled_time: float | None = None  # time.time() at first scheduling, for metrics
    num_preemptions: int = 0
    # The stop token id (or, set by the output processor, the stop string); None for EOS.
    stop_reason: int | str | None = None
    # Hash chain (SHA-256 digests) over this request's full blocks, filled lazily by the
    # KVCacheManager.
    block_hashes: list[bytes] = field(default_factory=list)
    stop_token_ids: frozenset[int] = frozenset()  # from sampling_params, for the stop check
    # Speculative decoding: draft tokens to check after the last known token (set by the
    # engine's proposer after each step; the scheduler feeds as many as the step has room for).
    spec_token_ids: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.prompt_token_ids = list(self.prompt_token_ids)
        self.stop_token_ids = frozenset(self.sampling_params.stop_token_ids or ())
        if needs_full_prompt_compute(self.sampling_params):
            self.skip_prefix_cache = True

    @classmethod
    def from_engine_request(cls, r: EngineRequest) -> Request:
        return cls(r.request_id, list(r.prompt_token_ids), r.sampling_params, arrival_time=r.arrival_time,
                   priority=r.priority, eos_token_id=r.eos_token_id, bad_words_token_ids=r.bad_words_token_ids,
                   cache_salt=r.cache_salt, lora_request=r.lora_request)

    @property
    def lora_int_id(self) -> int:
        return 0 if self.lora_request is None else self.lora_request.lora_int_id

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

    # ------------------------------------------------------------------ tokens
    @property
    def all_token_ids(self) -> list[int]:
        """Prompt followed by output (a new list)."""
        return self.prompt_token_ids + self.output_token_ids

    def get_token_ids(self, start: int, end: int) -> list[int]:
        """Known tokens at positions [start, end) of prompt + output, without building the whole."""
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
