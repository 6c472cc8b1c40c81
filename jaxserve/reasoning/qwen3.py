"""Qwen3's reasoning (vLLM's `qwen3`): the model writes `<think>` (or, with the newer templates,
finds it in the prompt), its reasoning, then `</think>` and the answer. As in vLLM's current
parser, a `<think>` in the output is dropped and an output without `</think>` is all reasoning
(thinking is on by default). With `chat_template_kwargs={"enable_thinking": false}` the template
closes reasoning in the prompt (`<think>\\n\\n</think>\\n\\n`), `reasoning_ended` sees it, and the
whole output is content.

vLLM's parser also ends reasoning at a `<tool_call>` followed by `<function=` (Qwen3.5's
tool-call format, which models of that family may write without closing `</think>`); jaxserve
has no parser for that tool-call format, so this one does not."""

from __future__ import annotations

from jaxserve.reasoning.base import ReasoningParser


class Qwen3ReasoningParser(ReasoningParser):
    name = "qwen3"
