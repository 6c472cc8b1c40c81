"""SamplingParams: the per-request generation settings, with vLLM's names, defaults and meanings."""

from __future__ import annotations

import dataclasses
import enum
import json
from typing import Any

_GREEDY_EPS = 1e-5


class SamplingType(enum.IntEnum):
    GREEDY = 0
    RANDOM = 1
    RANDOM_SEED = 2


@dataclasses.dataclass(frozen=True, slots=True)
class StructuredOutputsParams:
    """A constraint on the generated text (vLLM's `StructuredOutputsParams`): exactly one of

    - json: a JSON schema (a dict, or its JSON text): the output is one JSON value valid for it;
    - json_object: True: the output is one JSON object (any keys);
    - regex: the output matches the regular expression (Rust `regex` syntax, anchored);
    - choice: the output is one of these strings;
    - grammar: a context-free grammar, in Lark syntax or llama.cpp's GBNF.

    JSON is written with Python's `json.dumps` layout (", " and ": ", no other whitespace);
    `disable_any_whitespace` writes it compact ("," and ":"). The grammar engine is llguidance
    (see jaxserve/structured/compiler.py): schema features it cannot enforce are refused when
    the request arrives, never ignored.
    """

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False

    def __post_init__(self) -> None:
        kinds = self.kinds()
        if len(kinds) != 1:
            got = ", ".join(kinds) if kinds else "none"
            raise ValueError(
                "structured outputs take exactly one of json, json_object, regex, choice or grammar; "
                f"got {got}."
            )
        if self.json is not None and not isinstance(self.json, (str, dict)):
            raise ValueError("structured outputs: json must be a JSON schema (an object or its JSON text).")
        if self.choice is not None:
            if not isinstance(self.choice, (list, tuple)) or not self.choice or not all(
                isinstance(c, str) for c in self.choice
            ):
                raise ValueError("structured outputs: choice must be a non-empty list of strings.")
            object.__setattr__(self, "choice", list(self.choice))
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"structured outputs: {name} must be a non-empty string.")

    def kinds(self) -> list[str]:
        """The constraints set (one, once validated)."""
        out = [k for k in ("json", "regex", "choice", "grammar") if getattr(self, k) is not None]
        if self.json_object:
            out.append("json_object")
        return out

    @property
    def kind(self) -> str:
        return self.kinds()[0]

    def key(self) -> tuple[str, str, bool]:
        """(kind, the constraint as text, compact): what identifies its compiled grammar."""
        kind = self.kind
        if kind == "json":
            text = self.json if isinstance(self.json, str) else json.dumps(self.json, sort_keys=True)
        elif kind == "choice":
            text = json.dumps(self.choice)
        elif kind == "json_object":
            text = ""
        else:
            text = getattr(self, kind)
        return kind, text, self.disable_any_whitespace


@dataclasses.dataclass(slots=True)
class SamplingParams:
    """How to sample one request. Field names and defaults follow vLLM's `SamplingParams`.

    temperature 0 means greedy. top_k 0 or -1 disables top-k. stop strings are excluded from
    the output text unless include_stop_str_in_output. max_tokens None means "up to the context
    length". logprobs / prompt_logprobs: number of top alternatives to return (0 = the chosen
    token only, -1 = the whole vocabulary for logprobs).
    """

    n: int = 1
    best_of: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    detokenize: bool = True  # False: token ids only, no text (no stop strings then)
    skip_special_tokens: bool = True
    # vLLM's name; it only changes slow tokenizers' decoding, and jaxserve's are fast (no effect).
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    # Keep only the last k prompt tokens (-1: as many as the context holds with one token to
    # generate); None keeps the whole prompt.
    truncate_prompt_tokens: int | None = None
    structured_outputs: StructuredOutputsParams | None = None
    extra_args: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        else:
            self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.logit_bias is not None:
            self.logit_bias = {int(k): float(v) for k, v in self.logit_bias.items()}
        if self.top_k == -1:
            self.top_k = 0
        if self.temperature < _GREEDY_EPS and self.temperature >= 0:
            # Greedy: the other sampling knobs have no effect (as in vLLM).
            self.temperature = 0.0
            self.top_p = 1.0
            self.top_k = 0
            self.min_p = 0.0
        self.validate()

    # ------------------------------------------------------------------ validation
    def validate(self) -> None:
        """Raise ValueError with an actionable message when a field is out of range."""
        if not isinstance(self.n, int) or self.n < 1:
            raise ValueError(f"n must be an integer >= 1, got {self.n!r}.")
        if self.best_of is not None:
            if self.best_of < self.n:
                raise ValueError(f"best_of must be >= n, got best_of={self.best_of}, n={self.n}.")
            if self.best_of != self.n:
                raise ValueError("best_of > n is not supported; request n samples instead.")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise ValueError(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}.")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise ValueError(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}.")
        if not self.repetition_penalty > 0.0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}.")
        if self.temperature < 0.0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}.")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}.")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be -1 (disable), 0 (disable) or a positive integer, got {self.top_k}.")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}.")
        if self.seed is not None and not isinstance(self.seed, int):
            raise ValueError(f"seed must be an integer, got {self.seed!r}.")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}.")
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be >= 0, got {self.min_tokens}.")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})."
            )
        if self.logprobs is not None and self.logprobs < -1:
            raise ValueError(f"logprobs must be >= 0 (or -1 for all), got {self.logprobs}.")
        if self.prompt_logprobs is not None and self.prompt_logprobs < -1:
            raise ValueError(
                f"prompt_logprobs must be >= 0 (or -1 for all), got {self.prompt_logprobs}."
            )
        if any(s == "" for s in self.stop):  # type: ignore[union-attr]
            raise ValueError("stop cannot contain an empty string.")
        if any((not isinstance(t, int)) or t < 0 for t in self.stop_token_ids):  # type: ignore[union-attr]
            raise ValueError("stop_token_ids must be non-negative integers.")
        if self.n > 1 and self.sampling_type == SamplingType.GREEDY:
            raise ValueError("n > 1 needs temperature > 0: greedy samples would all be identical.")
        if self.allowed_token_ids is not None and len(self.allowed_token_ids) == 0:
            raise ValueError("allowed_token_ids must not be empty.")
        if self.stop and not self.detokenize:
            raise ValueError("stop strings need detokenize=True (they are matched on the text).")
        t = self.truncate_prompt_tokens
        if t is not None and (not isinstance(t, int) or isinstance(t, bool) or (t < 1 and t != -1)):
            raise ValueError(f"truncate_prompt_tokens must be -1 or a positive integer, got {t!r}.")
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise ValueError("structured_outputs must be a StructuredOutputsParams.")

    def validate_for_vocab(self, vocab_size: int) -> None:
        """Checks that need the model: token ids must exist in the vocabulary."""
        def check(ids: list[int], what: str) -> None:
            bad = [i for i in ids if not 0 <= i < vocab_size]
            if bad:
                raise ValueError(f"{what} contains token ids outside [0, {vocab_size}): {bad[:5]}.")

        check(list(self.stop_token_ids or []), "stop_token_ids")
        check(list(self.allowed_token_ids or []), "allowed_token_ids")
        check(list((self.logit_bias or {}).keys()), "logit_bias")

    # ------------------------------------------------------------------ derived
    @property
    def sampling_type(self) -> SamplingType:
        if self.temperature < _GREEDY_EPS:
            return SamplingType.GREEDY
        return SamplingType.RANDOM_SEED if self.seed is not None else SamplingType.RANDOM

    def clone(self, **changes: Any) -> SamplingParams:
        return dataclasses.replace(self, **changes)


@dataclasses.dataclass
class BeamSearchParams:
    """vLLM's BeamSearchParams: `beam_width` beams, each up to `max_tokens` new tokens (the
    search: jaxserve/beam_search.py; `LLM.beam_search`)."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.beam_width, bool) or not isinstance(self.beam_width, int) or self.beam_width < 1:
            raise ValueError(f"beam_width must be a positive integer, got {self.beam_width!r}.")
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be a positive integer, got {self.max_tokens!r}.")
        if not self.temperature >= 0.0:
            raise ValueError(f"temperature must be non-negative, got {self.temperature!r}.")
        if self.length_penalty != self.length_penalty:  # NaN
            raise ValueError("length_penalty must be a number, got NaN.")
