"""Scanning JSON text that may still be growing (a model's output mid-stream).

The tool-call parsers need to know, for a prefix of a JSON object, which top-level keys are
there and where their values start and end, without waiting for the object to close: the
function name can be sent as soon as its string closes and the arguments in pieces as they
come. These scanners walk the text once, tracking strings, escapes and nesting; they never
raise on malformed or truncated input (what is not there yet is reported as open).
"""

from __future__ import annotations

import dataclasses

_SPACE = " \t\r\n"


@dataclasses.dataclass(slots=True)
class ObjectScan:
    """A JSON object's top-level members in text[start:]: key -> (value start, value end or
    None while the value is still open); `end` is one past the closing brace (None: open)."""

    start: int
    members: dict[str, tuple[int, int | None]]
    end: int | None


def _skip_space(text: str, i: int) -> int:
    while i < len(text) and text[i] in _SPACE:
        i += 1
    return i


def _string_end(text: str, i: int) -> int | None:
    """text[i] is a quote: one past the closing quote, or None while the string is open."""
    j = i + 1
    while j < len(text):
        c = text[j]
        if c == "\\":
            j += 2
            continue
        if c == '"':
            return j + 1
        j += 1
    return None


def value_end(text: str, i: int) -> int | None:
    """One past the JSON value starting at text[i] (after any space), None while it is open.
    A bare scalar (number, true, null) ends at the first delimiter after it."""
    i = _skip_space(text, i)
    if i >= len(text):
        return None
    c = text[i]
    if c == '"':
        return _string_end(text, i)
    if c in "{[":
        depth = 0
        j = i
        while j < len(text):
            c = text[j]
            if c == '"':
                e = _string_end(text, j)
                if e is None:
                    return None
                j = e
                continue
            if c in "{[":
                depth += 1
            elif c in "}]":
                depth -= 1
                if depth == 0:
                    return j + 1
            j += 1
        return None
    j = i
    while j < len(text) and text[j] not in ",}] \t\r\n":
        j += 1
    return j if j < len(text) else None


def scan_object(text: str, start: int) -> ObjectScan:
    """The members of the object whose "{" is at text[start] (after any space)."""
    i = _skip_space(text, start)
    members: dict[str, tuple[int, int | None]] = {}
    if i >= len(text) or text[i] != "{":
        return ObjectScan(i, members, None)
    obj_start = i
    i += 1
    while True:
        i = _skip_space(text, i)
        if i >= len(text):
            return ObjectScan(obj_start, members, None)
        if text[i] == "}":
            return ObjectScan(obj_start, members, i + 1)
        if text[i] == ",":
            i += 1
            continue
        if text[i] != '"':
            return ObjectScan(obj_start, members, None)  # not JSON: leave it open
        kend = _string_end(text, i)
        if kend is None:
            return ObjectScan(obj_start, members, None)
        key = text[i + 1 : kend - 1]
        i = _skip_space(text, kend)
        if i >= len(text) or text[i] != ":":
            return ObjectScan(obj_start, members, None)
        vstart = _skip_space(text, i + 1)
        if vstart >= len(text):
            return ObjectScan(obj_start, members, None)
        vend = value_end(text, vstart)
        members.setdefault(key, (vstart, vend))
        if vend is None:
            return ObjectScan(obj_start, members, None)
        i = vend


def array_elements(text: str, start: int) -> tuple[list[tuple[int, int | None]], int | None]:
    """The elements of the array whose "[" is at text[start] (after any space): their spans
    (end None for the open one) and one past the closing bracket (None while open)."""
    i = _skip_space(text, start)
    spans: list[tuple[int, int | None]] = []
    if i >= len(text) or text[i] != "[":
        return spans, None
    i += 1
    while True:
        i = _skip_space(text, i)
        if i >= len(text):
            return spans, None
        if text[i] == "]":
            return spans, i + 1
        if text[i] == ",":
            i += 1
            continue
        end = value_end(text, i)
        spans.append((i, end))
        if end is None:
            return spans, None
        i = end


def held_prefix(text: str, marker: str) -> int:
    """How many characters at the end of `text` could be the start of `marker` (to hold back
    while streaming, until it is clear whether the marker follows)."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0
