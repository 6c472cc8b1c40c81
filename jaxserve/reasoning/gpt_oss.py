"""gpt-oss's reasoning (vLLM's `openai_gptoss`, here also `gpt_oss`): the model writes Harmony
messages (jaxserve/chat/harmony.py), its reasoning on the `analysis` channel, its answer on the
`final` channel (and preambles on `commentary`), its function calls as messages to
`functions.NAME`. The reasoning is the analysis messages one per line, the answer the visible
messages one per line (vLLM's rule); the calls stay in the answer, in Harmony's form, only when
the request's tool calls are parsed (`with_calls`: tool_choice "auto" with the tool-call parser
`openai`, which reads them from there), and are dropped otherwise.

The markers are special tokens, so requests keep them in the text (`needs_special_tokens`). The
prompt never closes the reasoning (every completion says its channels); structured output
applies from the first token after the final channel's header (`answer_start`).

The openai-harmony package parses the same format, but it reads token ids of the real o200k
vocabulary and loads that vocabulary over the network (no Python package ships it): this parser
reads the decoded text, which any tokenizer with the markers gives.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from jaxserve.chat import harmony
from jaxserve.reasoning.base import ReasoningParser, _vocab


class GptOssReasoningParser(ReasoningParser):
    name = "gpt_oss"
    aliases = ("openai_gptoss",)
    needs_special_tokens = True
    start_marker = harmony.CHANNEL
    end_marker = harmony.MESSAGE

    def __init__(self, tokenizer: Any):
        vocab = _vocab(tokenizer)
        missing = [m for m in harmony.MARKERS if m not in vocab]
        if missing:
            raise ValueError(
                f"the reasoning parser {self.name!r} needs Harmony's special tokens "
                f"{', '.join(missing)} in the model's vocabulary, and this tokenizer has no such "
                "token; this model does not write the Harmony format (leave --reasoning-parser "
                "unset, or pick the model's own).")
        super().__init__(tokenizer)
        # The final channel's header as the tokenizer writes it (the answer follows it).
        hf = getattr(tokenizer, "hf_tokenizer", tokenizer)
        self.final_header_ids: list[int] = list(hf.encode(
            f"{harmony.CHANNEL}final{harmony.MESSAGE}", add_special_tokens=False))

    def extract(self, text: str, with_calls: bool = False) -> tuple[str | None, str | None]:
        messages = harmony.parse_completion(text, final=True)
        return (harmony.reasoning_text(messages) or None,
                harmony.answer_text(messages, with_calls) or None)

    def streamer(self, with_calls: bool = False) -> HarmonyStream:
        return HarmonyStream(with_calls)

    def reasoning_ended(self, prompt_token_ids: Sequence[int]) -> bool:
        return False

    def answer_start(self, ids: Sequence[int], start: int = 0) -> int | None:
        header = self.final_header_ids
        n = len(header)
        for i in range(max(0, start - n + 1), len(ids) - n + 1):
            if list(ids[i:i + n]) == header:
                return i + n
        return None

    def reasoning_tokens(self, ids: Sequence[int]) -> int:
        at = self.answer_start(ids)
        return len(ids) if at is None else at - len(self.final_header_ids)


class HarmonyStream:
    """One choice's Harmony completion as it streams: `update(delta)` returns (reasoning delta,
    answer delta), which add up to `extract` of the whole text in any chunking."""

    def __init__(self, with_calls: bool):
        self._reader = harmony.HarmonyStreamReader(with_calls)

    def update(self, delta: str, final: bool = False) -> tuple[str, str]:
        return self._reader.feed(delta, final)
