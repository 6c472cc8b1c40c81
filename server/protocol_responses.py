"""Pydantic models of the Responses API (`POST /v1/responses`, OpenAI's shapes and vLLM's extras).

A request is read here and handed on as the chat request it amounts to (`ResponsesRequest.
chat_body`): `instructions` become the system message, the input items the conversation,
`max_output_tokens` / `temperature` / `top_p` and vLLM's extras the sampling settings, `text.
format` the structured output and the function tools the chat tools, so that sampling, tool
calling and structured output follow the chat route's rules (server/serving_chat.py).

As on the other routes, nothing is dropped without a word: unknown fields are accepted and
listed in `X-Ignored-Fields` (with the known options this server accepts and has nothing to
apply to: `include` values other than output logprobs, `text.verbosity`, reasoning summaries),
and what it knows but cannot do is a 400 naming it (`RESPONSES_UNIMPLEMENTED`,
and the validators below: non-function tools, non-text content, item types it cannot render).
"""

from __future__ import annotations

import json
import time
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from jaxserve.server.errors import quote
from jaxserve.server.field_policy import UNIMPLEMENTED, collect, refuse_unimplemented
from jaxserve.server.protocol_structured import StructuredOutputsRequest
from jaxserve.server.responses_output import OutputItem, OutputMessage

MAX_TOP_LOGPROBS = 20
MAX_METADATA_KEYS, MAX_METADATA_KEY_CHARS, MAX_METADATA_VALUE_CHARS = 16, 64, 512
LOGPROBS_INCLUDE = "message.output_text.logprobs"

# Fields of OpenAI's or vLLM's Responses request that this server knows but does not implement
# (a 400 naming them unless neutral): the completions/chat table but `store`, which is
# implemented here, and the Responses API's own.
RESPONSES_UNIMPLEMENTED: dict[str, tuple[Any, str]] = {
    **{k: v for k, v in UNIMPLEMENTED.items() if k != "store"},
    "prompt": (lambda v: v is None, "prompt templates (stored prompts) are not supported"),
    "conversation": (lambda v: v is None, "conversations are not supported; continue one with "
                                          "previous_response_id"),
    "previous_response": (lambda v: v is None, "previous_response (stateless multi-turn with "
                                               "encrypted reasoning) is not supported; use "
                                               "previous_response_id"),
    "previous_input_messages": (lambda v: not v, "previous_input_messages (Harmony messages) are "
                                                 "not supported; use previous_response_id or "
                                                 "input items"),
    "enable_response_messages": (lambda v: not v, "enable_response_messages is not supported"),
    "mm_processor_kwargs": (lambda v: v is None, "multimodal inputs are not supported"),
}


class _Model(BaseModel):
    model_config = ConfigDict(extra="allow", allow_inf_nan=False, populate_by_name=True)


# ---------------------------------------------------------------------------- input items
TEXT_PART_TYPES = ("input_text", "output_text", "refusal", "reasoning_text", "summary_text")


class ContentPart(_Model):
    """A text part of an input message (input_text; output_text and refusal when a previous
    answer is sent back; reasoning_text / summary_text in reasoning items)."""

    type: str
    text: str | None = None
    refusal: str | None = None
    annotations: list[Any] | None = None  # on output_text parts sent back; not rendered
    logprobs: list[Any] | None = None

    @model_validator(mode="after")
    def _text_only(self) -> ContentPart:
        if self.type not in TEXT_PART_TYPES:
            raise ValueError(f"content part type {quote(self.type)} is not supported: this server "
                             f"serves text; send {', '.join(TEXT_PART_TYPES[:3])} parts.")
        if self.type == "refusal" and self.refusal is None:
            raise ValueError("a refusal part needs 'refusal' (its text).")
        if self.type != "refusal" and self.text is None:
            raise ValueError(f"a {self.type} part needs 'text'.")
        return self

    @property
    def value(self) -> str:
        return self.refusal if self.type == "refusal" else self.text  # type: ignore[return-value]


def _text(content: str | list[ContentPart] | None) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "\n".join(p.value for p in content)


ITEM_TYPES = ("message", "function_call", "function_call_output", "reasoning")


class InputItem(_Model):
    """One input item: a message (OpenAI's easy form without `type` too), a function call (an
    earlier answer's), a function call's output, or a reasoning item (an earlier answer's
    reasoning: the assistant turn's `reasoning`, which the template shows or not)."""

    type: str = "message"
    id: str | None = None
    status: str | None = None
    # message
    role: Literal["user", "assistant", "system", "developer"] | None = None
    content: str | list[ContentPart] | None = None
    # function_call, function_call_output
    call_id: str | None = None
    name: str | None = None
    arguments: str | None = None
    output: str | list[ContentPart] | None = None
    # reasoning
    summary: list[ContentPart] | None = None
    encrypted_content: str | None = None

    @model_validator(mode="after")
    def _check(self) -> InputItem:
        kind = self.type
        if kind not in ITEM_TYPES:
            hint = (" (send the items themselves, or previous_response_id)"
                    if kind == "item_reference" else "")
            raise ValueError(f"input item type {quote(kind)} is not supported{hint}; this server "
                             f"takes {', '.join(ITEM_TYPES)} items.")
        if kind == "message" and (self.role is None or self.content is None):
            raise ValueError("a message item needs 'role' and 'content'.")
        if kind == "function_call":
            if not (self.call_id and self.name and self.arguments is not None):
                raise ValueError("a function_call item needs 'call_id', 'name' and 'arguments'.")
            try:
                json.loads(self.arguments)
            except json.JSONDecodeError:
                raise ValueError(f"function_call {quote(self.name)}: 'arguments' must be JSON "
                                 f"text; got {quote(self.arguments)}.") from None
        if kind == "function_call_output" and (not self.call_id or self.output is None):
            raise ValueError("a function_call_output item needs 'call_id' and 'output'.")
        if kind == "reasoning" and self.encrypted_content is not None:
            raise ValueError("encrypted reasoning content is not supported; send reasoning items "
                             "with their 'content' (or leave them out).")
        return self

    @property
    def text(self) -> str:
        return _text(self.content)

    @property
    def output_text(self) -> str:
        return _text(self.output)

    @property
    def reasoning_text(self) -> str:
        """A reasoning item's text: its content, else its summary."""
        return _text(self.content) or _text(self.summary)


# ---------------------------------------------------------------------- tools, text, reasoning
class FunctionTool(_Model):
    """A function tool in the Responses shape (flat: name, parameters, ...)."""

    type: str
    name: Annotated[str, Field(min_length=1, max_length=256)] | None = None
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    @model_validator(mode="after")
    def _function_only(self) -> FunctionTool:
        if self.type != "function":
            raise ValueError(f"tool type {quote(self.type)} is not supported; only 'function' "
                             "tools are (built-in tools such as web search, file search or MCP "
                             "are not).")
        if self.name is None:
            raise ValueError("a function tool needs 'name'.")
        return self

    def chat_tool(self) -> dict[str, Any]:
        fields = (("name", self.name), ("description", self.description),
                  ("parameters", self.parameters), ("strict", self.strict))
        fn = {k: v for k, v in fields if v is not None}
        return {"type": "function", "function": fn}


class FunctionToolChoice(_Model):
    type: Literal["function"]
    name: str


ToolChoice = Literal["none", "auto", "required"] | FunctionToolChoice


class TextFormat(_Model):
    type: Literal["text", "json_schema", "json_object"]
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | bool | None = Field(default=None, alias="schema")
    strict: bool | None = None

    @model_validator(mode="after")
    def _schema(self) -> TextFormat:
        if self.type == "json_schema" and self.schema_ is None:
            raise ValueError("text.format of type 'json_schema' needs 'schema' (the JSON schema).")
        return self


class TextConfig(_Model):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None  # no effect here (listed as ignored)


class ReasoningConfig(_Model):
    effort: str | None = None  # the chat route's reasoning_effort (for the template), as vLLM
    summary: str | None = None  # no summaries are written (listed as ignored)
    generate_summary: str | None = None


# ---------------------------------------------------------------------------- the request
class ResponsesRequest(_Model):
    # OpenAI's fields
    model: str | None = None
    input: str | list[InputItem]
    instructions: str | None = None
    max_output_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    stream: bool = False
    store: bool = True
    background: bool = False
    previous_response_id: str | None = None
    tools: list[FunctionTool] = Field(default_factory=list)
    tool_choice: ToolChoice = "auto"
    parallel_tool_calls: bool | None = True
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    include: list[str] | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    truncation: Literal["auto", "disabled"] | None = "disabled"
    metadata: dict[str, str] | None = None
    user: str | None = None
    # vLLM's extras (those of its ResponsesRequest that the chat route takes too)
    request_id: str | None = None
    priority: int = 0
    cache_salt: str | None = None
    top_k: int | None = None
    repetition_penalty: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logit_bias: dict[str, float] | None = None
    structured_outputs: StructuredOutputsRequest | None = None

    @field_validator("input")
    @classmethod
    def _input_not_empty(cls, v: str | list[InputItem]) -> str | list[InputItem]:
        if (isinstance(v, str) and not v) or (isinstance(v, list) and not v):
            raise ValueError("input must not be empty: send a string or a list of input items.")
        return v

    @field_validator("tool_choice", mode="before")
    @classmethod
    def _tool_choice(cls, v: Any) -> Any:
        if isinstance(v, dict) and v.get("type") != "function":
            raise ValueError(f"tool_choice type {quote(v.get('type'))} is not supported; send "
                             "'none', 'auto', 'required' or {'type': 'function', 'name': ...}.")
        return v

    @field_validator("metadata")
    @classmethod
    def _metadata(cls, v: dict[str, str] | None) -> dict[str, str] | None:
        if v is not None and (len(v) > MAX_METADATA_KEYS or any(
                len(k) > MAX_METADATA_KEY_CHARS or len(x) > MAX_METADATA_VALUE_CHARS
                for k, x in v.items())):
            raise ValueError(f"metadata holds at most {MAX_METADATA_KEYS} pairs, keys of at most "
                             f"{MAX_METADATA_KEY_CHARS} characters and values of at most "
                             f"{MAX_METADATA_VALUE_CHARS}.")
        return v

    @model_validator(mode="after")
    def _checks(self) -> ResponsesRequest:
        refuse_unimplemented(self, RESPONSES_UNIMPLEMENTED)
        if self.text_format is not None and self.structured_outputs is not None:
            raise ValueError("set either text.format or structured_outputs, not both.")
        forced = self.tool_choice == "required" or isinstance(self.tool_choice, FunctionToolChoice)
        if forced and not self.tools:
            raise ValueError("tool_choice needs tools: send the tools the model may call.")
        if isinstance(self.tool_choice, FunctionToolChoice) and self.tool_choice.name not in {
                t.name for t in self.tools}:
            raise ValueError(f"tool_choice names the function {quote(self.tool_choice.name)}, "
                             "which is not among the tools.")
        if forced and (self.text_format is not None or self.structured_outputs is not None):
            raise ValueError("tool_choice 'required' or a named function cannot be combined with "
                             "text.format or structured_outputs: the tool call is itself "
                             "structured output.")
        if self.background and not self.store:
            raise ValueError("background responses must be stored: background needs store true.")
        return self

    # ------------------------------------------------------------------ derived
    @property
    def text_format(self) -> TextFormat | None:
        """The structured-output format of `text.format` (None for plain text)."""
        fmt = self.text.format if self.text is not None else None
        return fmt if fmt is not None and fmt.type != "text" else None

    @property
    def logprobs(self) -> bool:
        return LOGPROBS_INCLUDE in (self.include or [])

    @property
    def ignored_fields(self) -> list[str]:
        """Unknown fields, and known ones set that this server accepts without effect."""
        names = collect(self)  # OpenAI's service_tier, prompt_cache_key, ... among them
        names += [f"include[{x}]" for x in self.include or [] if x != LOGPROBS_INCLUDE]
        if self.text is not None and self.text.verbosity is not None:
            names.append("text.verbosity")
        if self.reasoning is not None:
            names += [f"reasoning.{n}" for n in ("summary", "generate_summary")
                      if getattr(self.reasoning, n) is not None]
        return list(dict.fromkeys(names))

    def chat_body(self, messages: list[dict[str, Any]]) -> dict[str, Any]:
        """The chat completions request (as JSON) that this request amounts to, for `messages`
        (the whole conversation): only the fields the client set, so that the model's default
        sampling settings apply to the others as on the chat route."""
        sent = self.model_fields_set
        body: dict[str, Any] = {"model": self.model, "messages": messages}
        for name in ("temperature", "top_p", "top_k", "seed", "stop", "repetition_penalty",
                     "ignore_eos", "skip_special_tokens", "include_stop_str_in_output",
                     "logit_bias", "priority", "cache_salt", "user"):
            if name in sent:
                body[name] = getattr(self, name)
        if self.max_output_tokens is not None:
            body["max_completion_tokens"] = self.max_output_tokens
        if self.truncation == "auto":
            body["truncate_prompt_tokens"] = -1  # vLLM's: what fits
        if self.logprobs:
            body.update(logprobs=True, top_logprobs=self.top_logprobs or 0)
        fmt = self.text_format
        if fmt is not None and fmt.type == "json_object":
            body["response_format"] = {"type": "json_object"}
        elif fmt is not None:
            body["response_format"] = {"type": "json_schema", "json_schema": {
                "name": fmt.name, "description": fmt.description, "schema": fmt.schema_,
                "strict": fmt.strict}}
        if self.structured_outputs is not None:
            body["structured_outputs"] = self.structured_outputs.model_dump(by_alias=True,
                                                                            exclude_unset=True)
        if self.tools:
            body["tools"] = [t.chat_tool() for t in self.tools]
            choice = self.tool_choice
            body["tool_choice"] = ({"type": "function", "function": {"name": choice.name}}
                                   if isinstance(choice, FunctionToolChoice) else choice)
            body["parallel_tool_calls"] = self.parallel_tool_calls is not False
        if self.reasoning is not None and self.reasoning.effort is not None:
            body["reasoning_effort"] = self.reasoning.effort  # the template's, as on the chat route
        return body


# ---------------------------------------------------------------------------- the response
class InputTokensDetails(_Model):
    cached_tokens: int = 0


class OutputTokensDetails(_Model):
    reasoning_tokens: int = 0


class ResponseUsage(_Model):
    input_tokens: int
    input_tokens_details: InputTokensDetails = Field(default_factory=InputTokensDetails)
    output_tokens: int
    output_tokens_details: OutputTokensDetails = Field(default_factory=OutputTokensDetails)
    total_tokens: int


class ResponsesResponse(_Model):
    id: str
    object: Literal["response"] = "response"
    created_at: int = Field(default_factory=lambda: int(time.time()))
    status: Literal["completed", "failed", "in_progress", "cancelled", "queued", "incomplete"]
    error: dict[str, Any] | None = None
    incomplete_details: dict[str, Any] | None = None
    instructions: str | None = None
    metadata: dict[str, str] | None = None
    model: str
    output: list[OutputItem] = Field(default_factory=list)
    parallel_tool_calls: bool = True
    temperature: float | None = None
    top_p: float | None = None
    tool_choice: Any = "auto"
    tools: list[dict[str, Any]] = Field(default_factory=list)
    background: bool = False
    max_output_tokens: int | None = None
    previous_response_id: str | None = None
    reasoning: dict[str, Any] | None = None
    store: bool = True
    text: dict[str, Any] = Field(default_factory=lambda: {"format": {"type": "text"}})
    top_logprobs: int | None = None
    truncation: str | None = "disabled"
    usage: ResponseUsage | None = None
    user: str | None = None

    @property
    def output_text(self) -> str:
        return "".join(item.text for item in self.output if isinstance(item, OutputMessage))
