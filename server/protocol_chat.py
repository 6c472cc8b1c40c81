"""Pydantic models of the chat completions API: the messages, the request (with its tool
choice and reasoning effort), the response and its stream chunks, chat log-probs, and the keys
a parsed reasoning goes out under. The shared base and the sampling fields are protocol.py's."""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from pydantic import Field, model_serializer, model_validator

from jaxserve.sampling_params import SamplingParams
from jaxserve.server.errors import quote
from jaxserve.server.field_policy import CHAT_UNIMPLEMENTED, refuse_unimplemented
from jaxserve.server.protocol import UsageInfo, _Request, _Response, _SamplingRequest
from jaxserve.server.protocol_tools import ChatTool, NamedToolChoice, ToolCall, ToolChoice


class ChatContentPart(_Request):
    type: str
    text: str | None = None


class ChatMessage(_Request):
    role: str
    content: str | list[ChatContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant turn's calls (history)
    tool_call_id: str | None = None  # a tool turn: the call it answers
    # An assistant turn's reasoning (history), under DeepSeek's name or vLLM's current one: the
    # template gets it as both (Qwen3's shows the current turn's reasoning_content).
    reasoning_content: str | None = None
    reasoning: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        parts = []
        for part in self.content:
            if part.type != "text" or part.text is None:
                raise ValueError(f"unsupported content part type {part.type!r}; only 'text' parts are supported.")
            parts.append(part.text)
        return "\n".join(parts)


class ChatCompletionRequest(_SamplingRequest):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0)] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    echo: bool = False
    best_of: int | None = None
    tools: list[ChatTool] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool = True
    # passed to the chat template as `reasoning_effort` (and, unless chat_template_kwargs set it,
    # `enable_thinking`: false for "none"), as vLLM does
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = (
        None)

    @model_validator(mode="after")
    def _checks(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and self.top_logprobs > 0 and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs set to true.")
        if self.continue_final_message and self.add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt cannot both be true.")
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError("best_of is not supported (only best_of == n); request n samples instead.")
        refuse_unimplemented(self, CHAT_UNIMPLEMENTED)
        choice = self.tool_choice
        if choice is not None and choice != "none" and not self.tools:
            raise ValueError("tool_choice needs tools: send the tools the model may call.")
        if isinstance(choice, NamedToolChoice) and choice.function.name not in {
                t.function.name for t in self.tools or []}:
            raise ValueError(f"tool_choice names the function {quote(choice.function.name)}, which is not "
                             "among the tools.")
        if self.tools and self.effective_tool_choice not in ("none", "auto") and self.structured_sources():
            raise ValueError("tool_choice 'required' or a named function cannot be combined with "
                             f"{self.structured_sources()[0]}: the tool call is itself structured output.")
        return self

    @property
    def effective_tool_choice(self) -> str | NamedToolChoice:
        """'none' without tools; 'auto' when tools come without a tool_choice (OpenAI's default)."""
        if not self.tools:
            return "none"
        return self.tool_choice if self.tool_choice is not None else "auto"

    def to_sampling_params(self) -> SamplingParams:
        max_tokens = self.max_completion_tokens or self.max_tokens  # None = rest of the context
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return self._sampling_params(max_tokens, logprobs)


class ChatLogProb(_Response):
    token: str
    logprob: float = -9999.0
    bytes: list[int] | None = None


class ChatLogProbsContent(ChatLogProb):
    top_logprobs: list[ChatLogProb] = Field(default_factory=list)


class ChatCompletionLogProbs(_Response):
    content: list[ChatLogProbsContent] | None = None


# The keys a response's reasoning goes out under (with --reasoning-parser): DeepSeek's, which
# most clients read, and vLLM's current name for it.
REASONING_KEYS = ("reasoning_content", "reasoning")


def _with_reasoning(data: dict[str, Any], reasoning: str | None) -> dict[str, Any]:
    data.pop("reasoning_content", None)
    return {**data, **dict.fromkeys(REASONING_KEYS, reasoning)}


class ChatResponseMessage(_Response):
    role: str = "assistant"
    content: str | None = None
    tool_calls: list[ToolCall] = Field(default_factory=list)
    reasoning_content: str | None = None  # with a reasoning parser only (else no such key)

    @model_serializer(mode="wrap")
    def _reasoning_when_parsed(self, handler: Any) -> dict[str, Any]:
        data = handler(self)
        if "reasoning_content" not in self.model_fields_set:
            data.pop("reasoning_content", None)
            return data
        return _with_reasoning(data, self.reasoning_content)


class ChatCompletionResponseChoice(_Response):
    index: int
    message: ChatResponseMessage
    logprobs: ChatCompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None  # with return_token_ids


class ChatCompletionResponse(_Response):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionResponseChoice]
    usage: UsageInfo
    prompt_logprobs: list[dict[str, Any] | None] | None = None
    prompt_token_ids: list[int] | None = None  # with return_token_ids


class DeltaMessage(_Response):
    role: str | None = None
    content: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # index, id/type/function name first, then arguments
    reasoning_content: str | None = None  # with a reasoning parser

    @model_serializer(mode="wrap")
    def _drop_none(self, handler: Any) -> dict[str, Any]:
        data = {k: v for k, v in handler(self).items() if v is not None}
        if self.reasoning_content is None:
            return data
        return _with_reasoning(data, self.reasoning_content)


class ChatCompletionStreamChoice(_Response):
    index: int
    delta: DeltaMessage
    logprobs: ChatCompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None  # with return_token_ids


class ChatCompletionStreamResponse(_Response):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatCompletionStreamChoice]
    usage: UsageInfo | None = None
    prompt_token_ids: list[int] | None = None  # first chunk, with return_token_ids
