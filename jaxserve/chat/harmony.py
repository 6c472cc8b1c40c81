"""OpenAI's Harmony format (the gpt-oss models' chat format): its markers, and a completion read
back into its messages and into the three things the server returns — the reasoning (the
`analysis` channel), the answer (the `final` channel and the `commentary` preambles) and the
function calls (messages to `functions.NAME`).

A message is `<|start|>{header}<|message|>{content}<|end|>`; the header is the author's role
(`assistant`, or a tool's name for its results) with an optional ` to={recipient}`, then
`<|channel|>{channel}` (which may carry the recipient too) and an optional content type
(`<|constrain|>json`, or a bare word). The model's last message ends with `<|return|>` (done) or
`<|call|>` (it called a function) instead of `<|end|>`: both are stop tokens of the model, so the
engine stops there and the completion may or may not show them. The prompt ends with
`<|start|>assistant`, so a completion begins with the first message's header, e.g.
`<|channel|>analysis<|message|>…<|end|>` then
`<|start|>assistant<|channel|>final<|message|>…<|return|>`.

The reading works on the decoded text (the markers are special tokens: the request keeps them
with skip_special_tokens false), the same whole (`parse_completion`; `final` false: a message
still being written is open, and the end of its content that may be the start of a marker is
held back) or streamed (`HarmonyStreamReader`, one pass over the text). Text outside messages
is dropped; a completion that starts with content rather than a header continues a final
message the prompt opened.
"""

from __future__ import annotations

import dataclasses
import json

START, END, MESSAGE = "<|start|>", "<|end|>", "<|message|>"
CHANNEL, CONSTRAIN, RETURN, CALL = "<|channel|>", "<|constrain|>", "<|return|>", "<|call|>"
MARKERS = (START, END, MESSAGE, CHANNEL, CONSTRAIN, RETURN, CALL)
# What ends a message's content (a new `<|start|>` too, where the model skipped the end).
ENDS = (END, RETURN, CALL, START)
FUNCTIONS = "functions."


@dataclasses.dataclass(slots=True)
class HarmonyMessage:
    """One message of a completion: its header's parts and its content so far."""

    role: str
    channel: str | None
    recipient: str | None
    content_type: str | None
    content: str
    closed: bool  # its end marker was read (else the completion stopped inside it)

    @property
    def function(self) -> str | None:
        """The function it calls (a message to `functions.NAME`), else None."""
        r = self.recipient
        return r[len(FUNCTIONS):] if r is not None and r.startswith(FUNCTIONS) else None

    @property
    def visible(self) -> bool:
        """Shown to the user: the final channel, and commentary that calls nothing (a preamble)."""
        if self.recipient is not None:
            return False
        return self.channel in ("final", "commentary", None)


def held_marker(text: str) -> int:
    """How many characters at the end of `text` could be the beginning of a marker (a marker has
    one "<", its first character: only the last "<" can begin one)."""
    at = text.rfind("<", max(0, len(text) - max(map(len, MARKERS)) + 1))
    tail = text[at:] if at >= 0 else ""
    return len(tail) if tail and any(m.startswith(tail) and m != tail for m in MARKERS) else 0


def parse_header(text: str) -> tuple[str, str | None, str | None, str | None]:
    """(role, channel, recipient, content type) of a header (the text before `<|message|>`)."""
    text, _, constrain = text.partition(CONSTRAIN)
    role_part, has_channel, channel_part = text.partition(CHANNEL)
    role, recipient, content_type = "assistant", None, constrain.strip() or None
    for i, word in enumerate(role_part.split()):
        if word.startswith("to="):
            recipient = word[3:]
        elif i == 0:
            role = word
    channel = None
    if has_channel:
        words = channel_part.split()
        for i, word in enumerate(words):
            if word.startswith("to="):
                recipient = word[3:]
            elif i == 0:
                channel = word
            elif content_type is None:
                content_type = word  # "commentary json" without <|constrain|>
    return role, channel, recipient, content_type


def _headerless(text: str) -> bool:
    """Whether a completion starts inside a message's content (the prompt wrote the header)
    rather than with a header (`<|channel|>…`, or ` to=…` before it). Undecided text (spaces,
    a beginning of either) is taken as a header still being written."""
    s = text.lstrip()
    return bool(s) and not any(s.startswith(p) or p.startswith(s) for p in ("<|", "to="))


def parse_completion(text: str, final: bool = True) -> list[HarmonyMessage]:
    """The messages of a completion (the text after the prompt's `<|start|>assistant`), in order.
    A message counts once its header is complete; the last one may be open. With `final` false
    an open message's content leaves out a possible marker beginning at its end."""
    messages: list[HarmonyMessage] = []
    at = 0  # where the next header starts (the first follows the prompt's `<|start|>assistant`)
    header: tuple[str, str | None, str | None, str | None] | None = None
    opened = False  # the next header follows a `<|start|>` (all but the first)
    if _headerless(text):
        header, body = ("assistant", "final", None, None), 0
    while True:
        if header is None:
            if opened:
                s = text.find(START, at)
                if s < 0:
                    break
                at = s + len(START)
            body = text.find(MESSAGE, at)
            if body < 0:
                break  # the header is still being written (or the output stopped inside it)
            restart = text.find(START, at, body)
            if restart >= 0:  # a header broken off by a new message: read that one
                at, opened = restart, True
                continue
            header = parse_header(text[at:body])
            body += len(MESSAGE)
        ends = [(i, m) for m in ENDS if (i := text.find(m, body)) >= 0]
        if ends:
            end, marker = min(ends)
            messages.append(HarmonyMessage(*header, text[body:end], closed=marker != START))
            at, header, opened = (end if marker == START else end + len(marker)), None, True
            continue
        content = text[body:]
        if not final:
            content = content[: len(content) - held_marker(content)]
        messages.append(HarmonyMessage(*header, content, closed=False))
        break
    return messages


def call_arguments(message: HarmonyMessage) -> str | None:
    """A function call's arguments as the model wrote them (stripped), or None when it is not a
    call that can be made: an open message counts only when its content is complete JSON (the
    completion stopped at `<|call|>` without showing it)."""
    args = message.content.strip()
    if message.closed:
        return args
    try:
        json.loads(args)
    except json.JSONDecodeError:
        return None
    return args


def render_call(name: str, arguments: str, closed: bool = True) -> str:
    """A function call as the model writes it (the assistant's message to `functions.NAME` on
    the commentary channel, JSON arguments)."""
    return (f"{START}assistant{CHANNEL}commentary to={FUNCTIONS}{name} {CONSTRAIN}json{MESSAGE}"
            f"{arguments}{CALL if closed else ''}")


def reasoning_text(messages: list[HarmonyMessage]) -> str:
    """The analysis channel's messages (calls aside), one per line."""
    return "\n".join(m.content for m in messages
                     if m.channel == "analysis" and m.function is None)


def answer_text(messages: list[HarmonyMessage], with_calls: bool) -> str:
    """The visible messages, one per line; with `with_calls`, each function call in its place in
    Harmony's form (for the tool-call parser `openai`, which reads them from this text)."""
    out, after_text = [], False
    for m in messages:
        if m.function is not None:
            if with_calls:
                out.append(render_call(m.function, m.content, m.closed))
                after_text = False
        elif m.visible:
            out.append(("\n" if after_text else "") + m.content)
            after_text = True
    return "".join(out)


class HarmonyStreamReader:
    """A completion read as it streams, in one pass: `feed(delta, final)` returns what the
    delta adds to `reasoning_text` and to `answer_text` of the completion so far (what
    `parse_completion` gives, read again, but without reading the text again: a long completion
    costs its length once). Text that may begin a marker waits in the buffer."""

    def __init__(self, with_calls: bool):
        self.with_calls = with_calls
        self._buf = ""
        self._state = "start"  # start | header | body | between (after a message's end)
        self._kind: str | None = None  # the open message's view: reasoning | answer | call | None
        self._function: str | None = None
        self._reasonings = 0  # analysis messages so far (one per line)
        self._after_text = False  # the answer's last part is a visible message

    def _open(self, header: tuple[str, str | None, str | None, str | None]) -> tuple[str, str]:
        """A message's header is complete: what it adds to the views."""
        m = HarmonyMessage(*header, content="", closed=False)
        self._function = m.function
        if m.function is not None:
            self._kind = "call" if self.with_calls else None
            if self.with_calls:
                self._after_text = False
                return "", render_call(m.function, "", closed=False)
            return "", ""
        if m.channel == "analysis":
            self._kind = "reasoning"
            self._reasonings += 1
            return ("\n" if self._reasonings > 1 else ""), ""
        if m.visible:
            self._kind = "answer"
            prefix = "\n" if self._after_text else ""
            self._after_text = True
            return "", prefix
        self._kind = None
        return "", ""

    def _content(self, text: str) -> tuple[str, str]:
        if self._kind == "reasoning":
            return text, ""
        if self._kind in ("answer", "call"):
            return "", text
        return "", ""

    def feed(self, delta: str, final: bool = False) -> tuple[str, str]:
        buf = self._buf + delta
        reasoning, answer = [], []

        def add(r: str, a: str) -> None:
            reasoning.append(r)
            answer.append(a)

        while True:
            if self._state == "start":
                if _headerless(buf):
                    self._state = "body"
                    add(*self._open(("assistant", "final", None, None)))
                    continue
                s = buf.lstrip()
                if not (s.startswith("<|") or s.startswith("to=")):
                    break  # undecided (nothing yet, or the beginning of either)
                self._state = "header"
                continue
            if self._state == "between":
                s = buf.find(START)
                if s < 0:
                    buf = buf[len(buf) - held_marker(buf):]
                    break
                buf, self._state = buf[s + len(START):], "header"
                continue
            if self._state == "header":
                body = buf.find(MESSAGE)
                if body < 0:
                    break
                restart = buf.rfind(START, 0, body)
                head = buf[restart + len(START) if restart >= 0 else 0:body]
                buf, self._state = buf[body + len(MESSAGE):], "body"
                add(*self._open(parse_header(head)))
                continue
            # body
            ends = [(i, m) for m in ENDS if (i := buf.find(m)) >= 0]
            if ends:
                end, marker = min(ends)
                add(*self._content(buf[:end]))
                if self._kind == "call" and marker != START:
                    add("", CALL)
                buf = buf[end + len(marker):]
                self._state = "header" if marker == START else "between"
                continue
            keep = 0 if final else held_marker(buf)
            add(*self._content(buf[: len(buf) - keep]))
            buf = buf[len(buf) - keep:]
            break
        self._buf = buf
        return "".join(reasoning), "".join(answer)
