"""Pydantic models for the OpenAI-compatible surface (requests and responses).

Requests accept unknown fields (clients and benchmarks send extras) and keep them
(`extra="allow"`) so that the handlers can log them and list them in a response header
(server/field_policy.py); fields this server knows but does not implement are refused with
a 400 that names them (the same module's tables). Every float in a request must be finite: NaN
and ±Infinity (which Python's JSON parser accepts) are refused for all of them at once by
`allow_inf_nan=False`. Range checks that OpenAI / vLLM document live here; the rest is checked
by `SamplingParams.validate()` and the engine (context length, vocabulary, grammars), which
raise ValueError → 400. Structured output's fields are in protocol_structured.py, tool
calling's in protocol_tools.py; the chat API's models are in protocol_chat.py, the tokenizer
routes' in protocol_tokenize.py, the Responses API's and embeddings' in their own modules.
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from jaxserve.inputs import Prompt, parse_prompts
from jaxserve.sampling_params import SamplingParams
from jaxserve.server.errors import quote
from jaxserve.server.field_policy import UNIMPLEMENTED, refuse_unimplemented
from jaxserve.server.protocol_structured import StructuredOutputFields

MAX_N = 128
LOGIT_BIAS_LIMIT = 100.0


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


class _Request(BaseModel):
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)


class _Response(BaseModel):
    model_config = ConfigDict(extra="allow")


# ---------------------------------------------------------------------------- errors
class ErrorInfo(_Response):
    message: str
    type: str
    param: str | None = None
    code: int


class ErrorResponse(_Response):
    error: ErrorInfo


# ---------------------------------------------------------------------------- shared
class StreamOptions(_Request):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


class UsageInfo(_Response):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class _SamplingRequest(_Request, StructuredOutputFields):
    """Fields common to completions and chat (OpenAI names, then vLLM extras, then structured
    output's, from StructuredOutputFields)."""

    model: str | None = None
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    n: Annotated[int, Field(ge=1, le=MAX_N)] = 1
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] = 0.0
    frequency_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] = 0.0
    logit_bias: dict[str, float] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # vLLM extras
    top_k: int | None = None
    min_p: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    repetition_penalty: Annotated[float, Field(gt=0.0)] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    min_tokens: Annotated[int, Field(ge=0)] = 0
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    prompt_logprobs: Annotated[int, Field(ge=-1)] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    priority: int = 0
    request_id: str | None = None
    cache_salt: str | None = None
    truncate_prompt_tokens: Annotated[int, Field(ge=-1)] | None = None
    return_token_ids: bool = False
    # beam search (server/serving_beam.py): n beams, the n best returned
    use_beam_search: bool = False
    length_penalty: float = 1.0

    @field_validator("cache_salt")
    @classmethod
    def _salt(cls, v: str | None) -> str | None:
        if v is not None and not v:
            raise ValueError("cache_salt must be a non-empty string (or omitted).")
        return v

    @field_validator("truncate_prompt_tokens")
    @classmethod
    def _truncate(cls, v: int | None) -> int | None:
        if v == 0:
            raise ValueError("truncate_prompt_tokens must be -1 (the context length) or a positive integer.")
        return v

    @field_validator("stop")
    @classmethod
    def _no_empty_stop(cls, v: str | list[str] | None) -> str | list[str] | None:
        items = [v] if isinstance(v, str) else (v or [])
        if any(s == "" for s in items):
            raise ValueError("stop strings must not be empty; remove the empty string from 'stop'.")
        return v

    @field_validator("top_k")
    @classmethod
    def _top_k(cls, v: int | None) -> int | None:
        if v is not None and v < -1:
            raise ValueError("top_k must be -1 or 0 (disabled) or a positive integer.")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        if v is None:
            return v
        for key in v:
            try:
                int(key)
            except ValueError:
                raise ValueError(f"logit_bias keys must be token ids (integers as strings); got {quote(key)}.") from None
        return v

    @model_validator(mode="after")
    def _stream_options_need_stream(self) -> _SamplingRequest:
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options can only be set when stream is true.")
        refuse_unimplemented(self, UNIMPLEMENTED)
        return self

    def _sampling_params(self, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        bias = None
        if self.logit_bias:
            bias = {int(k): max(-LOGIT_BIAS_LIMIT, min(LOGIT_BIAS_LIMIT, float(b))) for k, b in self.logit_bias.items()}
        temperature = 1.0 if self.temperature is None else self.temperature
        return SamplingParams(
            n=1 if self.use_beam_search else self.n,  # beam search: n is the beam width
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            temperature=temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=0 if self.top_k is None else self.top_k,
            min_p=0.0 if self.min_p is None else self.min_p,
            seed=self.seed,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids,
            bad_words=self.bad_words,
            ignore_eos=self.ignore_eos,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            logprobs=logprobs,
            prompt_logprobs=self.prompt_logprobs,
            skip_special_tokens=self.skip_special_tokens,
            spaces_between_special_tokens=self.spaces_between_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            logit_bias=bias,
            allowed_token_ids=self.allowed_token_ids,
            truncate_prompt_tokens=self.truncate_prompt_tokens,
            structured_outputs=self.structured_outputs_params(),
        )

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def ignored_fields(self) -> list[str]:
        from jaxserve.server.field_policy import collect

        return collect(self)

    @property
    def continuous_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage
                    and self.stream_options.continuous_usage_stats)


# ---------------------------------------------------------------------------- completions
class CompletionRequest(_SamplingRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: Annotated[int, Field(ge=1)] | None = 16
    echo: bool = False
    logprobs: Annotated[int, Field(ge=0)] | None = None
    suffix: str | None = None
    best_of: int | None = None
    add_special_tokens: bool = True

    @field_validator("prompt")
    @classmethod
    def _prompt_not_empty(cls, v: Any) -> Any:
        if isinstance(v, str):
            if v == "":
                raise ValueError("prompt must not be empty.")
        elif len(v) == 0:
            raise ValueError("prompt must not be empty.")
        elif isinstance(v[0], list) and any(len(p) == 0 for p in v):
            raise ValueError("prompt must not contain an empty token list.")
        elif isinstance(v[0], str) and any(p == "" for p in v):
            raise ValueError("prompt must not contain an empty string.")
        return v

    @model_validator(mode="after")
    def _checks(self) -> CompletionRequest:
        if self.suffix:
            raise ValueError("suffix is not supported.")
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError("best_of is not supported (only best_of == n); request n samples instead.")
        return self

    def prompts(self) -> list[Prompt]:
        """The prompts, one completion each (read as every prompt is: jaxserve.inputs)."""
        return parse_prompts(self.prompt)

    def to_sampling_params(self) -> SamplingParams:
        params = self._sampling_params(self.max_tokens, self.logprobs)
        if self.echo and self.logprobs is not None and params.prompt_logprobs is None:
            params = params.clone(prompt_logprobs=self.logprobs)
        return params


class CompletionLogProbs(_Response):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionResponseChoice(_Response):
    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: list[dict[str, Any] | None] | None = None
    prompt_token_ids: list[int] | None = None  # with return_token_ids
    token_ids: list[int] | None = None


class CompletionResponse(_Response):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionResponseChoice]
    usage: UsageInfo


class CompletionStreamChoice(_Response):
    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_token_ids: list[int] | None = None  # a choice's first chunk, with return_token_ids
    token_ids: list[int] | None = None


class CompletionStreamResponse(_Response):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionStreamChoice]
    usage: UsageInfo | None = None


# ---------------------------------------------------------------------------- models, LoRA adapters
class ModelCard(_Response):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "jaxserve"
    root: str | None = None
    parent: str | None = None
    max_model_len: int | None = None


class ModelList(_Response):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class LoadLoRAAdapterRequest(_Request):
    lora_name: str | None = None
    lora_path: str | None = None


class UnloadLoRAAdapterRequest(_Request):
    lora_name: str | None = None
    lora_int_id: int | None = None
