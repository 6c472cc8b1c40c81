"""User-facing outputs, shaped like vLLM's RequestOutput / CompletionOutput."""

from __future__ import annotations

import dataclasses
import enum

# One position's log-probs: {token_id: Logprob}, the chosen token included.
LogprobsDict = dict[int, "Logprob"]


@dataclasses.dataclass(slots=True)
class SampleLogprobs:
    """The engine's log-probs of one token (sampled, or a prompt token): its raw log-prob, its
    1-based rank and the top-k alternatives, most likely first. The output processor turns
    them into one `LogprobsDict` (the form clients read)."""

    logprob: float
    rank: int
    top_ids: list[int]
    top_logprobs: list[float]


@dataclasses.dataclass(slots=True)
class Logprob:
    logprob: float
    rank: int | None = None  # 1-based rank in the model's distribution
    decoded_token: str | None = None


class OutputKind(enum.IntEnum):
    """What each RequestOutput carries (vLLM's RequestOutputKind)."""

    CUMULATIVE = 0  # everything so far
    DELTA = 1  # only what is new since the previous output (streaming)
    FINAL_ONLY = 2  # one output, when the request finishes (offline generate)


@dataclasses.dataclass(slots=True)
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[LogprobsDict] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None  # the stop string or stop token id; None for EOS

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclasses.dataclass(slots=True)
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None


@dataclasses.dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    prompt_logprobs: list[LogprobsDict | None] | None = None
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = None


@dataclasses.dataclass(slots=True)
class EmbeddingOutput:
    """One prompt's embedding (vLLM's EmbeddingOutput)."""

    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclasses.dataclass(slots=True)
class EmbeddingRequestOutput:
    """What `LLM.embed` returns per prompt (vLLM's EmbeddingRequestOutput)."""

    request_id: str
    outputs: EmbeddingOutput
    prompt_token_ids: list[int]
    finished: bool = True
