"""Grammar compilation for structured output, with llguidance (frontend side).

`GrammarCompiler.compile(params)` turns a request's `StructuredOutputsParams` into a
`CompiledGrammar`: an llguidance matcher in its initial state, shared by every request with
the same constraint (cached by (kind, text, layout), least recently used dropped first).
Each sequence then gets its own `GrammarMatcher` (a copy, microseconds) on the engine core's
side, which advances it with the accepted tokens and asks it for the next step's bitmask.

Compilation runs where requests are validated: the caller's thread for `LLM.generate`, a
worker thread in the server; llguidance releases the GIL while it builds a grammar. Whatever
the engine cannot enforce (an unsupported schema keyword, a bad regex, a grammar that does not
parse) is a ValueError naming the problem: HTTP 400, never a silently unconstrained request.

The tokenizer's side (llguidance's token trie over the byte forms of the 49,152 tokens of the
default model: about 1 s on a 2-core host) is built once per compiler, on the first
constrained request, so that a server that never sees one never pays for it.
"""

from __future__ import annotations

import collections
import json
import logging
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np

from jaxserve.sampling_params import StructuredOutputsParams

logger = logging.getLogger(__name__)

# JSON layouts: Python's json.dumps (the default) and compact (disable_any_whitespace).
_LAYOUTS = {
    False: {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "},
    True: {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"},
}
CACHE_SIZE = 256


def bitmask_words(vocab_size: int) -> int:
    """int32 words per bitmask row: one bit per token id."""
    return (vocab_size + 31) // 32


class CompiledGrammar:
    """A compiled constraint: the matcher in its initial state (never advanced itself)."""

    __slots__ = ("key", "_initial")

    def __init__(self, key: tuple[str, str, bool], initial: Any):
        self.key = key
        self._initial = initial

    def matcher(self) -> GrammarMatcher:
        return GrammarMatcher(self._initial.deep_copy())


class GrammarMatcher:
    """One sequence's grammar state. `num_tokens`: the output tokens accepted so far."""

    __slots__ = ("ll", "num_tokens", "failed")

    def __init__(self, ll_matcher: Any):
        self.ll = ll_matcher
        self.num_tokens = 0
        self.failed = False  # a token was refused: the request fails (StructuredOutputManager.bitmask)

    def accept(self, token: int) -> bool:
        self.num_tokens += 1
        if self.failed:
            return False
        if self.ll.is_stopped():
            return True  # only end-of-sequence ids were allowed (ignore_eos feeds them on)
        if not self.ll.consume_token(int(token)):
            self.failed = True
            logger.warning("structured output: token %d was refused by the grammar (%s)", token, self.error())
            return False
        return True

    def fill(self, row: np.ndarray) -> None:
        """Write the allowed next tokens into `row` ([W] int32, C-contiguous)."""
        if self.failed:
            row[:] = -1
        else:
            self.ll.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)

    def error(self) -> str:
        """llguidance's error, first line (empty when there is none)."""
        return (self.ll.get_error() or "").splitlines()[0][:200] if self.ll.get_error() else ""

    @property
    def is_terminated(self) -> bool:
        return self.ll.is_stopped()


class GrammarCompiler:
    """Compiles constraints for one tokenizer; thread-safe."""

    def __init__(self, hf_tokenizer: Any, vocab_size: int, eos_token_ids: Sequence[int],
                 cache_size: int = CACHE_SIZE):
        self._hf = hf_tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = [int(t) for t in dict.fromkeys(eos_token_ids)]
        self._cache: collections.OrderedDict[tuple, CompiledGrammar] = collections.OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()
        self._tok_lock = threading.Lock()
        self._ll_tokenizer: Any = None

    # ------------------------------------------------------------------ tokenizer
    def tokenizer(self) -> Any:
        """llguidance's view of the tokenizer (built on first use)."""
        with self._tok_lock:
            if self._ll_tokenizer is None:
                self._ll_tokenizer = self._build_tokenizer()
            return self._ll_tokenizer

    def _build_tokenizer(self) -> Any:
        import llguidance

        backend = getattr(self._hf, "backend_tokenizer", None)
        if backend is None:
            raise ValueError("structured output needs a fast (Rust) tokenizer; this model's tokenizer is not one.")
        if not self.eos_token_ids:
            raise ValueError("structured output needs the model's end-of-sequence token; none is configured.")
        import copy

        backend = copy.copy(backend)
        backend.no_padding()
        backend.no_truncation()
        return llguidance.LLTokenizer(backend.to_str(), n_vocab=self.vocab_size, eos_token=self.eos_token_ids)

    # ------------------------------------------------------------------ compile
    def compile(self, params: StructuredOutputsParams) -> CompiledGrammar:
        key = params.key()
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                return hit
        compiled = CompiledGrammar(key, self._compile(params))
        with self._lock:
            self._cache[key] = compiled
            self._cache.move_to_end(key)
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return compiled

    def _compile(self, params: StructuredOutputsParams) -> Any:
        import llguidance

        kind = params.kind
        what = {"json": "JSON schema", "json_object": "JSON object constraint", "regex": "regex",
                "choice": "choice list", "grammar": "grammar"}[kind]
        tok = self.tokenizer()
        try:
            grammar = _grammar_text(llguidance, params)
            matcher = llguidance.LLMatcher(tok, grammar, log_level=0)
        except (ValueError, TypeError, RuntimeError) as e:  # llguidance's errors for what it cannot read
            raise ValueError(f"the {what} cannot be used for structured output: {_summary([str(e)])}") from None
        if matcher.is_error():
            raise ValueError(f"the {what} cannot be used for structured output: {_summary([matcher.get_error()])}")
        return matcher


def _grammar_text(llguidance: Any, params: StructuredOutputsParams) -> str:
    kind = params.kind
    layout = _LAYOUTS[params.disable_any_whitespace]
    if kind in ("json", "json_object"):
        schema = {"type": "object"} if kind == "json_object" else params.json
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as e:
                raise ValueError(f"the schema is not valid JSON ({e})") from None
        if not isinstance(schema, (dict, bool)):
            raise ValueError("a JSON schema must be an object (or true/false)")
        return llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema), overrides=layout)
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(params.regex)
    if kind == "choice":
        return llguidance.grammar_from("choice", json.dumps(params.choice))
    # Lark, or GBNF (llama.cpp's, as vLLM's `grammar` accepts) converted to Lark
    return llguidance.grammar_from("grammar", params.grammar)


def _summary(messages: Sequence[str]) -> str:
    text = "; ".join(m.strip() for m in messages if m and m.strip()) or "unknown error"
    return text if len(text) <= 500 else text[:497] + "..."
