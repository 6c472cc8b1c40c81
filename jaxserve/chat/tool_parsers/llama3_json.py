"""Llama 3.1 / 3.2 / 3.3 JSON tool calls: the whole answer is `{"name": ..., "parameters": {...}}`
(optionally after `<|python_tag|>`), several separated by ";" (vLLM's `llama3_json` parser).
An answer that does not start with "{" is plain content."""

from __future__ import annotations

import json
from typing import Any

from jaxserve.chat.tool_parsers.base import CallSpan, FunctionCallText, Regions, ToolParser
from jaxserve.chat.tool_parsers.json_scan import held_prefix, scan_object

PYTHON_TAG = "<|python_tag|>"


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"

    def regions(self, text: str, final: bool) -> Regions:
        i = 0
        while i < len(text) and text[i] in " \t\r\n":
            i += 1
        if text.startswith(PYTHON_TAG, i):
            i += len(PYTHON_TAG)
        elif not final and held_prefix(text[i:], PYTHON_TAG) == len(text) - i:
            return Regions(0, [])  # whitespace or the start of the tag so far: wait
        rest = text[i:].lstrip()
        if not rest:
            return Regions(len(text) if final else 0, [])
        if not rest.startswith("{"):
            return Regions(len(text), [])
        calls = []
        j = len(text) - len(rest)
        while j < len(text):
            scan = scan_object(text, j)
            calls.append(CallSpan(scan.start, scan.end if scan.end is not None else (len(text) if final else None)))
            if scan.end is None:
                break
            j = scan.end
            while j < len(text) and text[j] in " \t\r\n;":
                j += 1
            if j < len(text) and text[j] != "{":
                break  # something else follows: not part of the calls
        return Regions(0, calls)

    def system_prompt(self, tools: list[dict[str, Any]]) -> str:
        sigs = "\n\n".join(json.dumps(t, ensure_ascii=False, indent=4) for t in tools)
        return ("Given the following functions, please respond with a JSON for a function call with its proper "
                "arguments that best answers the given prompt.\n\n"
                'Respond in the format {"name": function name, "parameters": dictionary of argument name and its '
                "value}. Do not use variables.\n\n" + sigs)

    def render_calls(self, calls: list[FunctionCallText]) -> str:
        return "; ".join(json.dumps({"name": c.name, "parameters": json.loads(c.arguments)}, ensure_ascii=False)
                         for c in calls)
