"""What the input-boundary tests send: JSON text Python's json module cannot write (Raw
fragments: huge integers, lone surrogates, deep nesting), hypothesis strategies of nasty values,
and the check that an answer is a 4xx in OpenAI's error envelope."""

from __future__ import annotations

import json
import math
from typing import Any

import httpx
from hypothesis import strategies as st

PROMPT = "The capital of France is"
CHAT = [{"role": "user", "content": "What is the capital of France?"}]
INT_FIELDS = ["max_tokens", "seed", "n", "top_k", "logprobs", "min_tokens", "best_of", "priority",
              "prompt_logprobs"]
CHAT_INT_FIELDS = ["max_completion_tokens", "top_logprobs"]
FLOAT_FIELDS = ["temperature", "top_p", "presence_penalty", "frequency_penalty", "repetition_penalty", "min_p"]
NON_FINITE = ["NaN", "Infinity", "-Infinity", "1e999", "-1e999"]
HUGE_INT = "9" * 4301
GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions")


def assert_envelope(r: httpx.Response, status: int | None = None) -> dict:
    """A 4xx (or exactly `status`) in OpenAI's error envelope; returns the error object."""
    if status is not None:
        assert r.status_code == status, r.text[:300]
    assert 400 <= r.status_code < 500, r.text[:300]
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert err["code"] == r.status_code and isinstance(err["message"], str) and err["message"]
    assert isinstance(err["type"], str) and err["type"]
    return err


# ---------------------------------------------------------------------------- JSON text a client can send
class Raw:
    """A JSON fragment written as is: Python's json module cannot write everything a client can
    send (integers over 4300 digits, lone surrogates as raw bytes, deep nesting)."""

    def __init__(self, text: str):
        self.text = text

    def __repr__(self) -> str:
        return f"Raw({self.text[:40]!r}{'...' if len(self.text) > 40 else ''}, {len(self.text)} chars)"


def dumps(value: Any, ascii: bool = True) -> str:
    """JSON text of `value`, with Raw fragments spliced in; NaN and ±inf as Python writes them.
    With `ascii` False, non-ASCII characters (lone surrogates too) are written as themselves."""
    if isinstance(value, Raw):
        return value.text
    if isinstance(value, dict):
        return "{" + ",".join(f"{json.dumps(str(k), ensure_ascii=ascii)}:{dumps(v, ascii)}"
                              for k, v in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ",".join(dumps(v, ascii) for v in value) + "]"
    return json.dumps(value, ensure_ascii=ascii)


def deep_list(depth: int) -> Raw:
    return Raw("[" * depth + "]" * depth)


def deep_dict(depth: int) -> Raw:
    return Raw('{"a":' * depth + "1" + "}" * depth)


RAW_FRAGMENTS = [*NON_FINITE, HUGE_INT, "-" + "9" * 5000, "1" + "0" * 400, "1.5e308", "-0", "0.0", "1e-400",
                 '"\\ud800"', '"x\\udfffy"', '"\\ud83d\\ude00"', '"\\u0000"', '"\\udc00\\ud800"', '{"\\ud800": 1}',
                 "[]", "{}", '""', "true", "null"]


def _with_surrogate(parts: tuple[str, int, str]) -> str:
    return parts[0] + chr(parts[1]) + parts[2]


scalars = st.one_of(
    st.none(), st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12),
    st.tuples(st.text(max_size=4), st.integers(0xD800, 0xDFFF), st.text(max_size=4)).map(_with_surrogate),
)
nasty = st.one_of(
    scalars,
    st.sampled_from(RAW_FRAGMENTS).map(Raw),
    st.integers(1, 3000).map(deep_list),
    st.integers(1, 3000).map(deep_dict),
    st.recursive(scalars, lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=6), c, max_size=4),
                 max_leaves=8),
)
# values a field is more likely to take as valid: small numbers, the non-finite ones, token-id maps
numbers = st.one_of(st.sampled_from([math.nan, math.inf, -math.inf, 0, 1, -1, 0.5, 2.0, 100.0]),
                    st.floats(allow_nan=True, allow_infinity=True), st.integers(-3, 3))
token_maps = st.dictionaries(st.integers(-5, 60_000).map(str), numbers, min_size=1, max_size=3)
field_values = st.one_of(nasty, numbers, token_maps)
