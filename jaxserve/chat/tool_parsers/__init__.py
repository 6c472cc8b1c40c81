"""Tool-call parsers by name, as vLLM's `--tool-call-parser NAME`: one module per format."""

from __future__ import annotations

from jaxserve.chat.tool_parsers.base import (
    FunctionCallText,
    ToolCallStream,
    ToolParser,
    parse_required,
    tool_call_id,
)
from jaxserve.chat.tool_parsers.hermes import HermesToolParser
from jaxserve.chat.tool_parsers.llama3_json import Llama3JsonToolParser
from jaxserve.chat.tool_parsers.mistral import MistralToolParser
from jaxserve.chat.tool_parsers.openai import OpenAIToolParser

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    p.name: p for p in (HermesToolParser, Llama3JsonToolParser, MistralToolParser, OpenAIToolParser)
}
# What renders tools and earlier calls for a chat template without a tools section when no
# parser is configured (tool_choice "required" or a named function).
DEFAULT_FORMAT = "hermes"


def get_tool_parser(name: str) -> ToolParser:
    try:
        return TOOL_PARSERS[name]()
    except KeyError:
        raise ValueError(f"unknown tool call parser {name!r}; available: {', '.join(sorted(TOOL_PARSERS))}") from None


__all__ = ["DEFAULT_FORMAT", "TOOL_PARSERS", "FunctionCallText", "ToolCallStream", "ToolParser", "get_tool_parser",
           "parse_required", "tool_call_id"]
