"""A conversation's messages given as OpenAI's dicts (as `LLM.chat` takes them), read into the
shape the template renderer reads (template.py): the same attributes as the server's
`ChatMessage` model, which it reads as they are."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

_KEYS = frozenset({"role", "content", "name", "tool_calls", "tool_call_id", "reasoning_content", "reasoning"})


@dataclasses.dataclass(frozen=True, slots=True)
class Function:
    name: str
    arguments: str


@dataclasses.dataclass(frozen=True, slots=True)
class ToolCallTurn:
    """One call of an assistant turn (history)."""

    id: str
    function: Function


@dataclasses.dataclass(frozen=True, slots=True)
class TextPart:
    type: str
    text: str | None


@dataclasses.dataclass(frozen=True, slots=True)
class ChatTurn:
    """One message of a conversation."""

    role: str
    content: str | tuple[TextPart, ...] | None = None
    name: str | None = None
    tool_calls: tuple[ToolCallTurn, ...] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None

    def text(self) -> str:
        """The content as one string (text parts joined by newlines); ValueError for parts
        other than text."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        for part in self.content:
            if part.type != "text" or part.text is None:
                raise ValueError(f"unsupported content part type {part.type!r}; only 'text' parts are supported.")
        return "\n".join(part.text for part in self.content)  # type: ignore[misc]


def _str(value: Any, where: str, optional: bool = True) -> str | None:
    if value is None and optional:
        return None
    if not isinstance(value, str):
        raise ValueError(f"{where} must be a string, got {type(value).__name__}.")
    return value


def _call(c: Any, where: str) -> ToolCallTurn:
    if not isinstance(c, Mapping) or not isinstance(c.get("function"), Mapping):
        raise ValueError(f"{where} must be {{'id', 'type': 'function', 'function': {{'name', 'arguments'}}}}.")
    f = c["function"]
    args = f.get("arguments", "")
    if not isinstance(args, str):
        import json

        args = json.dumps(args)
    return ToolCallTurn(_str(c.get("id", ""), f"{where}.id"), Function(_str(f.get("name"), f"{where}.function.name",
                                                                              optional=False), args))


def turn_from_dict(m: Any, i: int) -> ChatTurn:
    """Message `i` of a conversation; TypeError when it is not a dict, ValueError naming the
    field that is wrong."""
    where = f"message {i}"
    if not isinstance(m, Mapping):
        raise TypeError(f"{where} must be a dict with 'role' and 'content', got {type(m).__name__}.")
    unknown = sorted(str(k) for k in m if k not in _KEYS)
    if unknown:
        raise ValueError(f"{where} has unknown key(s) {', '.join(map(repr, unknown))}.")
    role = _str(m.get("role"), f"{where}.role", optional=False)
    content = m.get("content")
    if isinstance(content, list):
        parts = []
        for j, p in enumerate(content):
            if not isinstance(p, Mapping) or not isinstance(p.get("type"), str):
                raise ValueError(f"{where}.content[{j}] must be a dict with a 'type'.")
            parts.append(TextPart(p["type"], p.get("text")))
        content = tuple(parts)
    elif content is not None and not isinstance(content, str):
        raise ValueError(f"{where}.content must be a string or a list of parts, got {type(content).__name__}.")
    calls = m.get("tool_calls")
    if calls is not None:
        if not isinstance(calls, list):
            raise ValueError(f"{where}.tool_calls must be a list.")
        calls = tuple(_call(c, f"{where}.tool_calls[{j}]") for j, c in enumerate(calls))
    return ChatTurn(role, content, _str(m.get("name"), f"{where}.name"), calls,
                    _str(m.get("tool_call_id"), f"{where}.tool_call_id"),
                    _str(m.get("reasoning_content"), f"{where}.reasoning_content"),
                    _str(m.get("reasoning"), f"{where}.reasoning"))


def turns_from_dicts(messages: Any) -> list[ChatTurn]:
    """A conversation (a list of message dicts) as turns."""
    if isinstance(messages, (str, bytes, Mapping)) or not isinstance(messages, (list, tuple)):
        raise TypeError(f"a conversation is a list of message dicts, got {type(messages).__name__}.")
    return [turn_from_dict(m, i) for i, m in enumerate(messages)]
