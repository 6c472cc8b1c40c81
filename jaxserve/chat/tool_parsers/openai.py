"""gpt-oss's function calls (vLLM's `openai` parser): Harmony messages from the assistant to
`functions.NAME` on the commentary channel, JSON arguments, ending in `<|call|>`
(jaxserve/chat/harmony.py). The reasoning parser `gpt_oss` reads the completion's channels and
hands this parser the answer: the visible text, then the calls in Harmony's form; so this parser
needs that reasoning parser (the server refuses it alone).

As vLLM's, a call's arguments are its message's text; a call the completion stopped inside
(no `<|call|>`, arguments not yet complete JSON) is not made."""

from __future__ import annotations

import json
from typing import Any

from jaxserve.chat import harmony
from jaxserve.chat.tool_parsers.base import CallSpan, FunctionCallText, Regions, ToolParser
from jaxserve.chat.tool_parsers.json_scan import held_prefix


def _schema_type(schema: Any) -> str:
    """A JSON schema as Harmony's TypeScript-like type."""
    if not isinstance(schema, dict):
        return "any"
    if "enum" in schema:
        return " | ".join(json.dumps(v) for v in schema["enum"])
    for key in ("anyOf", "oneOf"):
        if key in schema:
            return " | ".join(_schema_type(s) for s in schema[key])
    kind = schema.get("type")
    if isinstance(kind, list):
        return " | ".join(_schema_type({**schema, "type": k}) for k in kind)
    if kind == "array":
        return f"{_schema_type(schema.get('items'))}[]"
    if kind == "object" and "properties" in schema:
        return "{\n" + _fields(schema) + "}"
    return {"string": "string", "number": "number", "integer": "number", "boolean": "boolean",
            "null": "null", "object": "object"}.get(kind, "any")


def _fields(schema: dict[str, Any]) -> str:
    required = set(schema.get("required") or ())
    lines = []
    for name, prop in schema.get("properties", {}).items():
        prop = prop if isinstance(prop, dict) else {}
        if prop.get("description"):
            lines.append(f"// {prop['description']}\n")
        default = f" // default: {prop['default']}" if "default" in prop else ""
        optional = "" if name in required else "?"
        lines.append(f"{name}{optional}: {_schema_type(prop)},{default}\n")
    return "".join(lines)


def tools_namespace(tools: list[dict[str, Any]]) -> str:
    """The developer message's tools section: the functions as TypeScript-like types in the
    `functions` namespace (Harmony's format)."""
    out = ["# Tools\n\n## functions\n\nnamespace functions {\n\n"]
    for tool in tools:
        fn = tool.get("function", tool)
        if fn.get("description"):
            out.append(f"// {fn['description']}\n")
        params = fn.get("parameters") or {}
        if params.get("properties"):
            out.append(f"type {fn['name']} = (_: {{\n{_fields(params)}}}) => any;\n\n")
        else:
            out.append(f"type {fn['name']} = () => any;\n\n")
    out.append("} // namespace functions")
    return "".join(out)


class OpenAIToolParser(ToolParser):
    name = "openai"
    needs_special_tokens = True
    reasoning_parser = "gpt_oss"  # the reasoning parser that writes this parser's input

    def regions(self, text: str, final: bool) -> Regions:
        first = text.find(harmony.START)
        if first < 0:
            return Regions(len(text) if final else len(text) - held_prefix(text, harmony.START), [])
        calls = []
        at = first
        while at >= 0:
            head = at + len(harmony.START)
            body = text.find(harmony.MESSAGE, head)
            if body < 0:
                break
            _, _, recipient, _ = harmony.parse_header(text[head:body])
            body += len(harmony.MESSAGE)
            ends = [i for m in (harmony.CALL, harmony.END, harmony.START)
                    if (i := text.find(m, body)) >= 0]
            end = min(ends) if ends else None
            if recipient is not None and recipient.startswith(harmony.FUNCTIONS):
                calls.append(CallSpan(body, end if end is not None or not final else len(text),
                                      recipient[len(harmony.FUNCTIONS):]))
            at = text.find(harmony.START, end) if end is not None else -1
        return Regions(first, calls)

    def extract(self, text: str) -> tuple[str | None, list[FunctionCallText]]:
        r = self.regions(text, final=True)
        calls = []
        for span in r.calls:
            closed = text.startswith((harmony.CALL, harmony.END), span.end)
            message = harmony.HarmonyMessage("assistant", "commentary",
                                             harmony.FUNCTIONS + span.name, "json",
                                             text[span.start:span.end], closed)
            args = harmony.call_arguments(message)
            if args is not None:
                calls.append(FunctionCallText(span.name, args))
        content = text[: r.content_end]
        return (content if content.strip() else None), calls

    def system_prompt(self, tools: list[dict[str, Any]]) -> str:
        return tools_namespace(tools)

    def render_calls(self, calls: list[FunctionCallText]) -> str:
        return "".join(harmony.render_call(c.name, c.arguments) for c in calls)
