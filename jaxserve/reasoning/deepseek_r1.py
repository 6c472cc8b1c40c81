"""DeepSeek-R1's reasoning (vLLM's `deepseek_r1`): the R1 chat template ends the prompt with
`<think>\\n`, so the model writes its reasoning and then `</think>`; everything it writes before
`</think>` is reasoning even with no `<think>` in the output, and an output without `</think>`
is all reasoning."""

from __future__ import annotations

from jaxserve.reasoning.base import ReasoningParser


class DeepSeekR1ReasoningParser(ReasoningParser):
    name = "deepseek_r1"
