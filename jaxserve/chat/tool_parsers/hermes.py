"""Hermes / Qwen2.5 / Qwen3 tool calls: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`,
one block per call, after any plain content (vLLM's `hermes` parser)."""

from __future__ import annotations

import json
from typing import Any

from jaxserve.chat.tool_parsers.base import CallSpan, FunctionCallText, Regions, ToolParser
from jaxserve.chat.tool_parsers.json_scan import held_prefix

START, END = "<tool_call>", "</tool_call>"


class HermesToolParser(ToolParser):
    name = "hermes"

    def regions(self, text: str, final: bool) -> Regions:
        first = text.find(START)
        if first < 0:
            return Regions(len(text) if final else len(text) - held_prefix(text, START), [])
        calls = []
        i = first
        while i >= 0:
            start = i + len(START)
            close = text.find(END, start)
            calls.append(CallSpan(start, close if close >= 0 else (len(text) if final else None)))
            if close < 0:
                break
            i = text.find(START, close + len(END))
        return Regions(first, calls)

    def system_prompt(self, tools: list[dict[str, Any]]) -> str:
        sigs = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
        return ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
                "You are provided with function signatures within <tools></tools> XML tags:\n"
                f"<tools>\n{sigs}\n</tools>\n\n"
                "For each function call, return a json object with function name and arguments within "
                "<tool_call></tool_call> XML tags:\n<tool_call>\n"
                '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>')

    def render_calls(self, calls: list[FunctionCallText]) -> str:
        return "\n".join(
            f"{START}\n{json.dumps({'name': c.name, 'arguments': json.loads(c.arguments)}, ensure_ascii=False)}\n{END}"
            for c in calls)
