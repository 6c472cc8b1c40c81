"""A reasoning model's output split into its reasoning and its answer, for models that write their
reasoning between a start and an end marker (`<think>` ... `</think>`), as vLLM's
`--reasoning-parser` does.

One rule, the same whole or streamed (`ReasoningParser.extract`, `ReasoningStream.update`):

- everything before the first end marker is reasoning; everything after it is the answer
  (content), verbatim (the newlines the model writes after the marker stay in the content, as
  in vLLM);
- a start marker before the end marker is dropped (templates that put `<think>` in the prompt
  leave the model to write only `</think>`; older ones let it write both);
- without an end marker the whole output is reasoning (generation stopped while reasoning:
  finish_reason "length");
- empty parts are None.

Where the prompt has already closed reasoning (Qwen3's template with enable_thinking false ends
the prompt with `<think>\\n\\n</think>\\n\\n`), there is no reasoning: `reasoning_ended(prompt
token ids)` tells, by vLLM's rule (the last marker token of the prompt is the end marker), and
the caller then takes the whole output as content. The engine's structured output uses the same
rule and the end marker's token id (jaxserve/structured/manager.py).

The markers are tokens of the model's vocabulary (added, not special: they survive
`skip_special_tokens`); the parser resolves their ids once, from the tokenizer.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar


def held_suffix(text: str, markers: Sequence[str]) -> int:
    """How many characters at the end of `text` could be the beginning of one of `markers` (held
    back while streaming until it is clear whether the marker follows)."""
    for n in range(min(max(len(m) for m in markers) - 1, len(text)), 0, -1):
        tail = text[-n:]
        if any(len(m) > n and m.startswith(tail) for m in markers):
            return n
    return 0


def _vocab(tokenizer: Any) -> dict[str, int]:
    """The token -> id map of the engine's Tokenizer or of an HF tokenizer (added tokens in it)."""
    hf = getattr(tokenizer, "hf_tokenizer", tokenizer)
    get_vocab = getattr(hf, "get_vocab", None)
    if get_vocab is None:
        raise TypeError(f"a reasoning parser needs a tokenizer with a vocabulary, got "
                        f"{type(tokenizer).__name__}")
    return get_vocab()


class ReasoningParser:
    """The reasoning format of one model family (a subclass per `--reasoning-parser` name)."""

    name: ClassVar[str] = ""
    aliases: ClassVar[tuple[str, ...]] = ()  # other names it goes by (vLLM's, where they differ)
    start_marker: ClassVar[str] = "<think>"
    end_marker: ClassVar[str] = "</think>"
    # Its markers are special tokens: requests keep them in the text (skip_special_tokens false).
    needs_special_tokens: ClassVar[bool] = False

    def __init__(self, tokenizer: Any):
        """`tokenizer`: the engine's Tokenizer (jaxserve/engine/tokenizer.py) or an HF tokenizer.
        ValueError when a marker is not one token of its vocabulary (the model does not write
        this format)."""
        vocab = _vocab(tokenizer)
        missing = [m for m in (self.start_marker, self.end_marker) if m not in vocab]
        if missing:
            raise ValueError(
                f"the reasoning parser {self.name!r} needs the tokens {' and '.join(missing)} in "
                "the model's vocabulary, and this tokenizer has no such token; this model does not "
                "write that reasoning format (leave --reasoning-parser unset, or pick the model's "
                "own).")
        self.start_token_id: int = vocab[self.start_marker]
        self.end_token_id: int = vocab[self.end_marker]

    def extract(self, text: str, with_calls: bool = False) -> tuple[str | None, str | None]:
        """(reasoning, content) of a whole output; None where there is none. `with_calls`: the
        request's tool calls are parsed from the content (formats whose calls are apart from
        the content, gpt_oss's, then keep them in it for the tool-call parser)."""
        end = text.find(self.end_marker)
        start = text.find(self.start_marker)
        if start >= 0 and (end < 0 or start < end):
            before, text = text[:start], text[start + len(self.start_marker):]
            end = text.find(self.end_marker)
        else:
            before = ""
        if end < 0:
            return (before + text) or None, None
        return (before + text[:end]) or None, text[end + len(self.end_marker):] or None

    def streamer(self, with_calls: bool = False) -> ReasoningStream:
        """A stream splitter for one choice (`with_calls` as for `extract`)."""
        return ReasoningStream(self.start_marker, self.end_marker)

    def answer_start(self, ids: Sequence[int], start: int = 0) -> int | None:
        """Where the answer starts among output token ids `ids` (one past the end marker), None
        while still reasoning; searched from `start` (the ids before it were searched)."""
        seq = ids if isinstance(ids, list) else list(ids)
        try:
            return seq.index(self.end_token_id, min(start, len(seq))) + 1
        except ValueError:
            return None

    def reasoning_tokens(self, ids: Sequence[int]) -> int:
        """How many of the output token ids `ids` are reasoning (markers not counted)."""
        end = self.answer_start(ids)
        body = ids[: len(ids) if end is None else end - 1]
        return sum(1 for t in body if t != self.start_token_id)

    def reasoning_ended(self, prompt_token_ids: Sequence[int]) -> bool:
        """Whether the prompt already closed reasoning: its last marker token is the end marker
        (vLLM's `is_reasoning_end`). Then the output has no reasoning and structured output
        applies from the first token."""
        start, end = self.start_token_id, self.end_token_id
        for t in reversed(prompt_token_ids):
            if t == end:
                return True
            if t == start:
                return False
        return False


class ReasoningStream:
    """One choice's output, split as it streams: `update(delta)` returns (reasoning delta,
    content delta). Text that may be the beginning of a marker is held back until it resolves (or
    `final`), so the deltas add up to `ReasoningParser.extract` of the whole text, whatever the
    chunking."""

    def __init__(self, start_marker: str, end_marker: str):
        self.start_marker = start_marker
        self.end_marker = end_marker
        self._held = ""  # text not yet given out (a possible marker prefix)
        self._start_seen = False
        self.ended = False  # the end marker has been seen: the rest is content

    def update(self, delta: str, final: bool = False) -> tuple[str, str]:
        text = self._held + delta
        self._held = ""
        if self.ended:
            return "", text
        reasoning = ""
        if not self._start_seen:
            start, end = text.find(self.start_marker), text.find(self.end_marker)
            if start >= 0 and (end < 0 or start < end):
                self._start_seen = True
                reasoning, text = text[:start], text[start + len(self.start_marker):]
        end = text.find(self.end_marker)
        if end >= 0:
            self.ended = True
            return reasoning + text[:end], text[end + len(self.end_marker):]
        markers = (self.end_marker,) if self._start_seen else (self.start_marker, self.end_marker)
        hold = 0 if final else held_suffix(text, markers)
        if hold:
            text, self._held = text[:-hold], text[-hold:]
        return reasoning + text, ""
