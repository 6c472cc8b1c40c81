"""Tool calling on the chat API (OpenAI's shapes): the tools a request offers, its tool_choice,
the calls an assistant message made (in a later turn's history, and in responses) and the
streamed tool-call deltas.

tool_choice "required" and a named function are enforced with structured output (vLLM's
schemas): `required_schema` is an array of {"name", "parameters"} objects, one per call
(at most one without parallel_tool_calls); a named function's output is its arguments.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator


class _Model(BaseModel):
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)


class FunctionDefinition(_Model):
    name: str = Field(min_length=1, max_length=256)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ChatTool(_Model):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(_Model):
    name: str


class NamedToolChoice(_Model):
    type: Literal["function"] = "function"
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class FunctionCall(_Model):
    name: str
    arguments: str  # JSON text, as OpenAI sends it

    @field_validator("arguments", mode="before")
    @classmethod
    def _text(cls, v: Any) -> Any:
        return json.dumps(v, ensure_ascii=False) if isinstance(v, dict) else v


class ToolCall(_Model):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


def tool_dicts(tools: list[ChatTool]) -> list[dict[str, Any]]:
    """The tools as chat templates take them (transformers' JSON-schema form)."""
    out = []
    for t in tools:
        fn: dict[str, Any] = {"name": t.function.name}
        if t.function.description is not None:
            fn["description"] = t.function.description
        fn["parameters"] = t.function.parameters or {"type": "object", "properties": {}}
        out.append({"type": "function", "function": fn})
    return out


def parameters_schema(tool: ChatTool) -> dict[str, Any]:
    return tool.function.parameters or {"type": "object", "properties": {}}


def required_schema(tools: list[ChatTool], parallel: bool = True) -> dict[str, Any]:
    """vLLM's schema for tool_choice "required": a JSON array of {"name", "parameters"}; the
    tools' $defs are hoisted to the top (where their "#/$defs/..." references point)."""
    defs: dict[str, Any] = {}
    items = []
    for t in tools:
        params = dict(parameters_schema(t))
        for k, v in params.pop("$defs", {}).items():
            if k in defs and defs[k] != v:
                raise ValueError(f"tools define '$defs/{k}' differently; tool_choice 'required' cannot combine them.")
            defs[k] = v
        items.append({"properties": {"name": {"type": "string", "enum": [t.function.name]}, "parameters": params},
                      "required": ["name", "parameters"], "additionalProperties": False})
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": items}}
    if not parallel:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return schema
