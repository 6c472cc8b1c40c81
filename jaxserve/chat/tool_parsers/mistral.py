"""Mistral tool calls: `[TOOL_CALLS]` then a JSON array of {"name", "arguments"} objects, or
(newer tokenizers) `[TOOL_CALLS]name[ARGS]{...}` per call (vLLM's `mistral` parser).
`[TOOL_CALLS]` is a special token: requests keep special tokens in the text."""

from __future__ import annotations

import json
from typing import Any

from jaxserve.chat.tool_parsers.base import CallSpan, FunctionCallText, Regions, ToolParser
from jaxserve.chat.tool_parsers.json_scan import array_elements, held_prefix, scan_object, value_end

START, ARGS = "[TOOL_CALLS]", "[ARGS]"


class MistralToolParser(ToolParser):
    name = "mistral"
    needs_special_tokens = True

    def regions(self, text: str, final: bool) -> Regions:
        first = text.find(START)
        if first < 0:
            return Regions(len(text) if final else len(text) - held_prefix(text, START), [])
        calls: list[CallSpan] = []
        i = first
        while i >= 0:
            j = i + len(START)
            while j < len(text) and text[j] in " \t\r\n":
                j += 1
            if j == len(text):
                break
            if text[j] == "[":
                spans, _ = array_elements(text, j)
                calls += [CallSpan(s, e if e is not None or not final else len(text)) for s, e in spans]
                break
            if text[j] == "{":
                scan = scan_object(text, j)
                calls.append(CallSpan(scan.start, scan.end if scan.end is not None or not final else len(text)))
                break
            a = text.find(ARGS, j)
            if a < 0:
                break  # the name is still being written
            s = a + len(ARGS)
            end = value_end(text, s)
            calls.append(CallSpan(s, end if end is not None or not final else len(text), name=text[j:a].strip()))
            if end is None:
                break
            i = text.find(START, end)
        return Regions(first, calls)

    def system_prompt(self, tools: list[dict[str, Any]]) -> str:
        return (f"[AVAILABLE_TOOLS] {json.dumps(tools, ensure_ascii=False)}[/AVAILABLE_TOOLS]\n"
                "To call tools, answer with [TOOL_CALLS] followed by a JSON array of objects with the "
                'function "name" and its "arguments".')

    def render_calls(self, calls: list[FunctionCallText]) -> str:
        return START + json.dumps([{"name": c.name, "arguments": json.loads(c.arguments)} for c in calls],
                                  ensure_ascii=False)

    def render_tool_result(self, content: str) -> tuple[str, str]:
        return "user", f"[TOOL_RESULTS] {content}[/TOOL_RESULTS]"
