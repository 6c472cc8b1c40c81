"""Reasoning parsers by name, as vLLM's `--reasoning-parser NAME`: the one owner of the reasoning
formats (base.py: the rule; one module per model family). Pure Python: the server, the engine's
structured output and the configuration import it without JAX."""

from __future__ import annotations

from jaxserve.reasoning.base import ReasoningParser, ReasoningStream
from jaxserve.reasoning.deepseek_r1 import DeepSeekR1ReasoningParser
from jaxserve.reasoning.gpt_oss import GptOssReasoningParser
from jaxserve.reasoning.qwen3 import Qwen3ReasoningParser

REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    name: p for p in (DeepSeekR1ReasoningParser, GptOssReasoningParser, Qwen3ReasoningParser)
    for name in (p.name, *p.aliases)
}
# The names `--reasoning-parser` takes.
REASONING_PARSER_NAMES = tuple(sorted(REASONING_PARSERS))


def get_reasoning_parser(name: str) -> type[ReasoningParser]:
    """The parser class of `name`; ValueError naming the known ones."""
    try:
        return REASONING_PARSERS[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown reasoning parser {name!r}; available: "
                         f"{', '.join(REASONING_PARSER_NAMES)}") from None


__all__ = ["REASONING_PARSERS", "REASONING_PARSER_NAMES", "ReasoningParser", "ReasoningStream",
           "get_reasoning_parser"]
