"""What every tool-call parser shares: where the calls lie in a model's output, the final
extraction, and the streaming of content and tool-call deltas.

A parser (one module per format, see __init__.py) only says where its calls are:
`regions(text, final)` returns how much of the text is plain content and the span of each
call (a JSON object with "name" and "arguments"/"parameters", or an explicit name and the
start of the arguments for formats that write the name outside the JSON). Everything else is
here:

- `extract(text)`: the final (content, calls); if any call does not parse, the whole text is
  content and no call is made (as vLLM's parsers do).
- `ToolCallStream`: per choice, fed the growing text, it returns the content delta and the
  tool-call deltas shaped as the openai SDK's ChatCompletionChunk expects: the first delta of
  a call carries its index, id, type and function name (arguments ""), later ones argument
  text in pieces. The pieces are the model's own text of the arguments value, so their
  concatenation equals the non-streaming `arguments` string.

`tool_choice` "required" and a named function need no parser: their output is constrained to
a JSON array of {"name", "parameters"} objects (vLLM's schema) or to the function's arguments.
"""

from __future__ import annotations

import dataclasses
import json
import uuid
from typing import Any, ClassVar, Literal

from jaxserve.chat.tool_parsers.json_scan import array_elements, scan_object, value_end

ARGUMENT_KEYS = ("arguments", "parameters")


def tool_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex[:24]}"


@dataclasses.dataclass(slots=True)
class FunctionCallText:
    name: str
    arguments: str  # the arguments as JSON text


@dataclasses.dataclass(slots=True)
class CallSpan:
    start: int  # where the call's JSON object (or its arguments, with `name` set) starts
    end: int | None  # one past it; None while open
    name: str | None = None  # set when the format writes the name outside the JSON


@dataclasses.dataclass(slots=True)
class Regions:
    content_end: int  # text[:content_end] is content that may be sent
    calls: list[CallSpan]


class ToolParser:
    """The format of one model family's tool calls (a subclass per format)."""

    name: ClassVar[str] = ""
    # Its markers are special tokens: the request must keep them in the text.
    needs_special_tokens: ClassVar[bool] = False
    # The reasoning parser whose answer it reads, where its calls live apart from the content
    # (gpt-oss's Harmony channels); None: it reads any answer.
    reasoning_parser: ClassVar[str | None] = None

    def regions(self, text: str, final: bool) -> Regions:
        raise NotImplementedError

    # ---- prompts for chat templates without a tools section
    def system_prompt(self, tools: list[dict[str, Any]]) -> str:
        raise NotImplementedError

    def render_calls(self, calls: list[FunctionCallText]) -> str:
        """An assistant turn's tool calls as the model writes them (history)."""
        raise NotImplementedError

    def render_tool_result(self, content: str) -> tuple[str, str]:
        """A tool's answer as a (role, content) turn the template knows."""
        return "user", f"<tool_response>\n{content}\n</tool_response>"

    # ---- final extraction
    def extract(self, text: str) -> tuple[str | None, list[FunctionCallText]]:
        r = self.regions(text, final=True)
        if not r.calls:
            return text, []
        calls = []
        for span in r.calls:
            call = parse_call(text, span)
            if call is None:
                return text, []
            calls.append(call)
        content = text[: r.content_end]
        return (content if content.strip() else None), calls


def _arguments_text(raw: str) -> str | None:
    """The arguments value as JSON text of an object (a JSON string holding one is unwrapped)."""
    try:
        value = json.loads(raw)
    except json.JSONDecodeError:
        return None
    if isinstance(value, str):
        try:
            inner = json.loads(value)
        except json.JSONDecodeError:
            return None
        return value if isinstance(inner, dict) else None
    return raw if isinstance(value, dict) else None


def parse_call(text: str, span: CallSpan) -> FunctionCallText | None:
    """A complete call, or None when it is not one (bad JSON, no name, arguments not an object)."""
    if span.end is None:
        return None
    if span.name is not None:
        args = _arguments_text(text[span.start : span.end].strip())
        return None if args is None else FunctionCallText(span.name, args)
    body = text[: span.end]
    scan = scan_object(body, span.start)
    if scan.end is None:
        return None
    try:
        obj = json.loads(body[scan.start : scan.end])
    except json.JSONDecodeError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    for key in ARGUMENT_KEYS:
        if key in scan.members:
            s, e = scan.members[key]
            args = _arguments_text(body[s:e])
            return None if args is None else FunctionCallText(obj["name"], args)
    return FunctionCallText(obj["name"], "{}")


# ---------------------------------------------------------------------------- streaming
@dataclasses.dataclass(slots=True)
class _CallState:
    id: str
    name: str | None = None
    args_sent: int = 0


class ToolCallStream:
    """One choice's stream. mode "auto": the parser's format; "required": a JSON array of
    {"name", "parameters"}; "named": the whole output is the arguments of `function_name`.
    `max_calls` (parallel_tool_calls false: 1) drops the calls after the first ones."""

    def __init__(self, mode: Literal["auto", "required", "named"], parser: ToolParser | None = None,
                 function_name: str | None = None, max_calls: int | None = None):
        if mode == "auto" and parser is None:
            raise ValueError("auto tool choice needs a parser")
        self.mode = mode
        self.parser = parser
        self.function_name = function_name
        self.max_calls = max_calls
        self.content_sent = 0
        self.calls: list[_CallState] = []

    @property
    def called(self) -> bool:
        return any(c.name is not None for c in self.calls)

    def _regions(self, text: str, final: bool) -> Regions:
        if self.mode == "named":
            return Regions(0, [CallSpan(0, value_end(text, 0) if text.strip() else None, self.function_name)])
        if self.mode == "required":
            spans, _ = array_elements(text, 0)
            return Regions(0, [CallSpan(s, e) for s, e in spans])
        assert self.parser is not None
        return self.parser.regions(text, final)

    def update(self, text: str, final: bool = False) -> tuple[str, list[dict[str, Any]]]:
        """The content delta and tool-call deltas since the last call, for the text so far."""
        r = self._regions(text, final)
        content = text[self.content_sent : r.content_end] if r.content_end > self.content_sent else ""
        self.content_sent = max(self.content_sent, r.content_end)
        deltas: list[dict[str, Any]] = []
        spans = r.calls if self.max_calls is None else r.calls[: self.max_calls]
        for i, span in enumerate(spans):
            if i == len(self.calls):
                self.calls.append(_CallState(tool_call_id()))
            st = self.calls[i]
            name, args = self._name_and_args(text, span, final)
            if st.name is None:
                if name is None:
                    continue  # nothing is sent before the name
                st.name = name
                deltas.append({"index": i, "id": st.id, "type": "function",
                               "function": {"name": name, "arguments": ""}})
            if args is not None and len(args) > st.args_sent:
                piece = args[st.args_sent :]
                st.args_sent = len(args)
                if deltas and deltas[-1]["index"] == i and deltas[-1]["function"]["arguments"] == "":
                    deltas[-1]["function"]["arguments"] = piece
                else:
                    deltas.append({"index": i, "function": {"arguments": piece}})
        return content, deltas

    def _name_and_args(self, text: str, span: CallSpan, final: bool) -> tuple[str | None, str | None]:
        body = text if span.end is None else text[: span.end]
        if span.name is not None:
            s = span.start
            while s < len(body) and body[s] in " \t\r\n":
                s += 1
            if s == len(body):
                return span.name, None
            end = value_end(body, s)
            return span.name, body[s:end] if end is not None else body[s:].rstrip()
        scan = scan_object(body, span.start)
        name = None
        if "name" in scan.members:
            s, e = scan.members["name"]
            if e is not None:
                try:
                    value = json.loads(body[s:e])
                except json.JSONDecodeError:
                    value = None
                name = value if isinstance(value, str) else None
        for key in ARGUMENT_KEYS:
            if key in scan.members:
                s, e = scan.members[key]
                return name, body[s:e] if e is not None else body[s:].rstrip()
        return name, None


def parse_required(text: str) -> list[FunctionCallText] | None:
    """tool_choice "required"'s output (a JSON array of {"name", "parameters"}), or None."""
    spans, end = array_elements(text, 0)
    if end is None or not spans:
        return None
    calls = []
    for s, e in spans:
        call = parse_call(text, CallSpan(s, e))
        if call is None:
            return None
        calls.append(call)
    return calls
