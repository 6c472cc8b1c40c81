"""The server's input boundary: whatever a client sends, the answer is a 200 or a 4xx in OpenAI's
error envelope, never a 500 and never a dropped connection.

- Property tests of the body parser and the protocol models (pure Python, no model).
- Specific cases found by fuzzing (deep JSON, integers past Python's 4300-digit limit, lone
  UTF-16 surrogates, NaN and Infinity, form-encoded and oddly typed bodies, auth path tricks)
  and a seeded hypothesis fuzz of the routes (>= 2,000 requests), against the live server on
  the default model; it must answer a valid request correctly afterwards.

App settings (trusted chat templates, the body limit, 500s) are in test_app_settings.py.
"""

from __future__ import annotations

import collections
import contextlib
import copy
import json
import math
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jaxserve.server.body import MAX_JSON_DEPTH, parse_json
from jaxserve.server.errors import APIError, error_response, quote
from jaxserve.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from tests.server.conftest import API_KEY, MODEL

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


# ---------------------------------------------------------------------------- the body parser
@settings(max_examples=400, derandomize=True, deadline=None, database=None)
@given(value=nasty)
def test_parse_json_answers_4xx_or_a_value(value: Any) -> None:
    # strings escaped ("\\ud800"), and as raw UTF-8 bytes (a lone surrogate as ED A0 80)
    for body in (dumps(value).encode(), dumps(value, ascii=False).encode("utf-8", "surrogatepass")):
        try:
            parse_json(body)
        except APIError as e:
            assert e.status == 400 and e.message


@settings(max_examples=300, derandomize=True, deadline=None, database=None)
@given(body=st.binary(max_size=64))
def test_parse_json_on_random_bytes(body: bytes) -> None:
    try:
        parse_json(body)
    except APIError as e:
        assert e.status == 400


@pytest.mark.parametrize("depth", [MAX_JSON_DEPTH + 1, 990, 5000, 100_000])
def test_parse_json_refuses_deep_nesting(depth: int) -> None:
    for raw in (deep_list(depth), deep_dict(depth), Raw('{"extra": ' + deep_list(depth).text + "}")):
        with pytest.raises(APIError, match="nested more than") as ei:
            parse_json(raw.text.encode())
        assert ei.value.status == 400
    assert parse_json(deep_list(MAX_JSON_DEPTH).text.encode())  # the limit itself is fine


def test_parse_json_names_the_field_of_a_surrogate() -> None:
    for body in (b'{"messages": [{"role": "user", "content": "a\\ud800"}]}',
                 b'{"messages": [{"role": "user", "content": "a\xed\xa0\x80"}]}'):  # escaped; raw bytes
        with pytest.raises(APIError, match="surrogate") as ei:
            parse_json(body)
        assert ei.value.param == "messages"
    assert parse_json(b'{"prompt": "\\ud83d\\ude00"}') == {"prompt": "\U0001f600"}  # a pair is fine


def test_error_bodies_always_encode() -> None:
    """A message quoting client text with a lone surrogate still renders (as a backslash escape)."""
    r = error_response(404, "The model '\ud800' does not exist.", param="mo\udc00del")
    err = json.loads(r.body)["error"]
    assert err["message"] == "The model '\\ud800' does not exist." and err["param"] == "mo\\udc00del"
    assert quote("x" * 1000).endswith("...") and len(quote("x" * 1000)) == 100


# ---------------------------------------------------------------------------- the protocol models
BASES: dict[type, dict[str, Any]] = {
    CompletionRequest: {"model": MODEL, "prompt": PROMPT, "max_tokens": 1, "temperature": 0},
    ChatCompletionRequest: {"model": MODEL, "messages": CHAT, "max_tokens": 1, "logprobs": True, "top_logprobs": 2},
    TokenizeRequest: {"model": MODEL, "messages": CHAT},
    DetokenizeRequest: {"tokens": [1, 2, 3]},
}


def _python(value: Any) -> Any:
    """The value json.loads would give for a generated one (Raw fragments parsed)."""
    if isinstance(value, Raw):
        try:
            return parse_json(b'{"v": ' + value.text.encode() + b"}")["v"]
        except APIError:
            return None
    if isinstance(value, dict):
        return {str(k): _python(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_python(v) for v in value]
    return value


@st.composite
def model_inputs(draw: st.DrawFn) -> tuple[type, dict[str, Any]]:
    model = draw(st.sampled_from(list(BASES)))
    data = copy.deepcopy(BASES[model])
    fields = sorted(model.model_fields) + ["unknown_extra"]
    for _ in range(draw(st.integers(1, 3))):
        field = draw(st.sampled_from(fields))
        if draw(st.integers(0, 9)) == 0:
            data.pop(field, None)
        else:
            data[field] = _python(draw(field_values))
    return model, data


def _floats(value: Any) -> list[float]:
    if isinstance(value, float):
        return [value]
    if isinstance(value, dict):
        value = list(value.values())
    return [x for v in value for x in _floats(v)] if isinstance(value, list) else []


FREE_FORM = frozenset({"chat_template_kwargs", "guided_json", "json_", "schema_", "parameters"})


def _declared(value: Any, skip: frozenset[str] = FREE_FORM) -> Any:
    """A request model's declared fields, recursively, less the free-form JSON ones (template
    arguments, JSON schemas: the grammar compiler refuses what is not JSON). Unknown fields
    are kept only to be listed (X-Ignored-Fields), never used, so their values may be anything
    JSON holds."""
    from pydantic import BaseModel

    if isinstance(value, BaseModel):
        return {k: _declared(getattr(value, k)) for k in type(value).model_fields if k not in skip}
    if isinstance(value, list):
        return [_declared(v) for v in value]
    return value


@settings(max_examples=1500, derandomize=True, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(case=model_inputs())
def test_protocol_models_raise_only_validation_errors(case: tuple[type, dict[str, Any]]) -> None:
    model, data = case
    try:
        request = model.model_validate(data)
    except ValueError:  # pydantic's ValidationError is a ValueError: a 400
        return
    # every number a request model accepted is finite (free-form JSON aside)
    assert all(math.isfinite(x) for x in _floats(_declared(request))), request
    if hasattr(request, "to_sampling_params"):
        with contextlib.suppress(ValueError):  # a 400 as well
            request.to_sampling_params().validate()


FLOAT_SLOTS = [*((CompletionRequest, f) for f in FLOAT_FIELDS), (CompletionRequest, "logit_bias"),
               (ChatCompletionRequest, "temperature"), (ChatCompletionRequest, "logit_bias")]


@settings(max_examples=600, derandomize=True, deadline=None, database=None)
@given(slot=st.sampled_from(FLOAT_SLOTS), value=numbers)
def test_every_float_field_is_finite_or_refused(slot: tuple[type, str], value: float) -> None:
    model, field = slot
    data = {**BASES[model], field: {"30": value} if field == "logit_bias" else value}
    try:
        request = model.model_validate(data)
    except ValueError as e:
        assert math.isfinite(value) or "finite number" in str(e)
        return
    assert all(math.isfinite(x) for x in _floats(_declared(request, frozenset()))), request
    params = request.to_sampling_params()
    assert all(math.isfinite(x) for x in (params.temperature, params.repetition_penalty,
                                          *(params.logit_bias or {}).values()))


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("field", FLOAT_FIELDS + ["logit_bias"])
def test_protocol_models_refuse_non_finite_floats(field: str, value: float) -> None:
    data = {"prompt": PROMPT, field: {"30": value} if field == "logit_bias" else value}
    with pytest.raises(ValueError, match="finite"):
        CompletionRequest.model_validate(data)


# ---------------------------------------------------------------------------- specific cases, live server
def _completion(extra: str) -> str:
    return f'{{"model": "{MODEL}", "prompt": "{PROMPT}", "max_tokens": 1, {extra}}}'


def _chat(extra: str) -> str:
    return f'{{"model": "{MODEL}", "messages": {json.dumps(CHAT)}, "max_tokens": 1, {extra}}}'


DEEP_CASES = [
    ("/v1/completions", deep_list(1000).text),
    ("/v1/completions", deep_dict(5000).text),
    ("/v1/completions", _completion('"extra": ' + deep_list(100_000).text)),
    ("/v1/chat/completions", _chat('"chat_template_kwargs": ' + deep_dict(2000).text)),
    ("/v1/completions", _completion('"extra": ' + deep_list(MAX_JSON_DEPTH + 5).text)),
    ("/tokenize", '{"prompt": "x", "junk": ' + deep_list(3000).text + "}"),
]
HUGE_INT_CASES = (
    [("/v1/completions", _completion(f'"{f}": {HUGE_INT}')) for f in INT_FIELDS]
    + [("/v1/chat/completions", _chat(f'"logprobs": true, "{f}": {HUGE_INT}')) for f in CHAT_INT_FIELDS]
    + [("/v1/completions", _completion(f'"stop_token_ids": [{HUGE_INT}]')),
       ("/v1/completions", f'{{"prompt": [{HUGE_INT}], "max_tokens": 1}}'),
       ("/v1/completions", _completion(f'"logit_bias": {{"{HUGE_INT}": 1}}')),
       ("/detokenize", f'{{"tokens": [{HUGE_INT}]}}')]
)
SURROGATE_CASES = [
    ("/v1/completions", '{"prompt": "\\ud800", "max_tokens": 1}'),
    ("/v1/completions", '{"model": "\\ud800", "prompt": "hi", "max_tokens": 1}'),
    ("/v1/completions", _completion('"stop": ["a\\udfff"]')),
    ("/v1/completions", _completion('"bad_words": ["\\ud800"]')),
    ("/v1/completions", _completion('"request_id": "\\ud800"')),
    ("/v1/completions", _completion('"user": "\\udc00"')),
    ("/v1/completions", _completion('"logit_bias": {"\\ud800": 1}')),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "hi \\ud800"}], "max_tokens": 1}'),
    ("/v1/chat/completions", '{"messages": [{"role": "\\ud800", "content": "hi"}], "max_tokens": 1}'),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "hi", "name": "\\udfff"}], "max_tokens": 1}'),
    ("/v1/chat/completions", ('{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\ud800"}]}], '
                              '"max_tokens": 1}')),
    ("/v1/completions", '{"prompt": "\xed\xa0\x80", "max_tokens": 1}'),  # the surrogate as raw UTF-8 bytes
    ("/tokenize", '{"prompt": "\\ud800"}'),
    ("/tokenize", '{"messages": [{"role": "user", "content": "\\ud800"}]}'),
    ("/detokenize", '{"tokens": [1], "model": "\\ud800"}'),
]
NON_FINITE_CASES = (
    [("/v1/completions", _completion(f'"{f}": {v}')) for f in FLOAT_FIELDS for v in NON_FINITE]
    + [("/v1/completions", _completion(f'"logit_bias": {{"30": {v}}}')) for v in NON_FINITE]
    + [("/v1/chat/completions", _chat(f'"temperature": {v}')) for v in NON_FINITE]
)
ODD_BODIES = [
    ("/v1/completions", "prompt=hi&max_tokens=1", "application/x-www-form-urlencoded"),
    ("/v1/chat/completions", "messages=hi", "application/x-www-form-urlencoded"),
    ("/v1/completions", "--b\r\nContent-Disposition: form-data; name=\"prompt\"\r\n\r\nhi\r\n--b--",
     "multipart/form-data; boundary=b"),
    ("/v1/completions", "1e999", "application/json"),
    ("/v1/completions", '"a string"', "application/json"),
    ("/v1/completions", "[1, 2]", "application/json"),
    ("/v1/completions", "null", "application/json"),
    ("/v1/completions", "", "application/json"),
    ("/v1/completions", "   ", "application/json"),
    ("/v1/completions", '{"prompt": "hi"', "application/json"),
    ("/v1/completions", '{"prompt": "\xff\xfe"}', "application/json"),
    ("/v1/completions", '{"prompt": {"text": "hi"}}', "text/plain"),
    ("/v1/completions", '{"prompt": ["a", 1, [2]], "max_tokens": 1}', "application/json"),
    ("/v1/completions", '{"prompt": "hi", "max_tokens": 1.5}', "application/json"),
    ("/v1/completions", '{"prompt": "hi", "max_tokens": "many", "n": [2]}', "application/json"),
    ("/v1/chat/completions", '{"messages": {"role": "user"}}', "application/json"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": [{"type": "text"}]}]}', "application/json"),
    ("/tokenize", '{"prompt": "a", "messages": []}', "application/json"),
    ("/tokenize", '{"prompt": 5}', "application/json"),
    ("/detokenize", '{"tokens": "abc"}', "application/json"),
    ("/detokenize", '{"tokens": [-1]}', "application/json"),
]


def _raw_bytes(text: str) -> bytes:
    # the cases' text holds "\xed\xa0\x80"-style escapes meant as raw bytes: write them as latin-1
    return text.encode("latin-1") if all(ord(c) < 256 for c in text) else text.encode("utf-8", "surrogatepass")


@pytest.mark.slow
@pytest.mark.parametrize("case", DEEP_CASES + HUGE_INT_CASES + SURROGATE_CASES + NON_FINITE_CASES,
                         ids=lambda c: f"{c[0]}:{c[1][:60]}")
def test_bad_bodies_get_400s(http, case: tuple[str, str]) -> None:
    path, text = case
    r = http.post(path, content=_raw_bytes(text), headers={"Content-Type": "application/json"})
    err = assert_envelope(r, 400)
    if case in NON_FINITE_CASES:
        assert "finite" in err["message"] or "valid number" in err["message"], err
        assert err["param"] in FLOAT_FIELDS + ["logit_bias"], err


@pytest.mark.slow
@pytest.mark.parametrize("case", ODD_BODIES, ids=lambda c: f"{c[0]}:{c[2]}:{c[1][:40]}")
def test_odd_bodies_get_400s(http, case: tuple[str, str, str]) -> None:
    path, text, content_type = case
    r = http.post(path, content=_raw_bytes(text), headers={"Content-Type": content_type})
    assert_envelope(r, 400)


@pytest.mark.slow
def test_unknown_model_with_odd_characters_is_a_404(http) -> None:
    for name in ("nope\u2028", "x" * 10_000, "\U0001f600"):
        r = http.post("/v1/completions", json={"model": name, "prompt": PROMPT, "max_tokens": 1})
        err = assert_envelope(r, 404)
        assert err["param"] == "model" and len(err["message"]) < 500


@pytest.mark.slow
def test_untrusted_chat_templates_are_refused(http) -> None:
    template = "{% for m in messages %}{{ m.content }}{% endfor %}"
    for path, body in (("/v1/chat/completions", {"messages": CHAT, "max_tokens": 1, "chat_template": template}),
                       ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 1,
                                                 "chat_template_kwargs": {"chat_template": template}}),
                       ("/tokenize", {"messages": CHAT, "chat_template": template}),
                       ("/tokenize", {"messages": CHAT, "chat_template_kwargs": {"chat_template": template}})):
        err = assert_envelope(http.post(path, json=body), 400)
        assert "--trust-request-chat-template" in err["message"] and err["param"] == "chat_template"


TEMPLATE_PARAMETERS = ["tokenize", "return_dict", "padding", "truncation", "max_length", "return_tensors",
                       "tokenizer_kwargs", "tools", "documents", "conversation", "return_assistant_tokens_mask",
                       "sanitize_control_tokens", "add_generation_prompt", "continue_final_message", "messages"]


@pytest.mark.slow
@pytest.mark.parametrize("key", TEMPLATE_PARAMETERS)
def test_chat_template_kwargs_cannot_break_rendering(http, key: str) -> None:
    """chat_template_kwargs reach apply_chat_template as keyword arguments: its own parameters
    among them get a 200 or a 400, whatever their value."""
    for value in (True, "x", 5, {"a": 1}, [1], None):
        for path in ("/v1/chat/completions", "/tokenize"):
            r = http.post(path, json={"messages": CHAT, "max_tokens": 1, "chat_template_kwargs": {key: value}})
            assert r.status_code < 500, (key, value, r.text[:300])
            if r.status_code != 200:
                assert_envelope(r, 400)


PUBLIC = ["/health", "/version", "/metrics"]
PROTECTED = [("GET", "/v1/models"), ("POST", "/v1/completions"), ("POST", "/v1/chat/completions"),
             ("POST", "/tokenize"), ("POST", "/detokenize"), ("GET", "/tokenizer_info"),
             ("GET", "/v1//models"), ("GET", "/V1/models"), ("GET", "/v1/models/"), ("GET", "/v1%2fmodels"),
             ("GET", "/%76%31/models"), ("GET", "/v1/../v1/models"), ("POST", "//tokenize"), ("POST", "/Tokenize"),
             ("POST", "/tokenize/"), ("POST", "/tokenize%2f"), ("GET", "/health/../tokenizer_info"),
             ("GET", "/health/"), ("GET", "/HEALTH"), ("GET", "/nothing"), ("GET", "/")]


@pytest.mark.slow
def test_every_route_but_the_public_ones_needs_the_key(live_server) -> None:
    with httpx.Client(base_url=live_server.base_url, timeout=60) as anon:
        for path in PUBLIC:
            assert anon.get(path).status_code == 200, path
        for method, path in PROTECTED:
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"X-API-Key": "wrong"},
                            {"Authorization": API_KEY}):
                r = anon.request(method, path, headers=headers, json={"prompt": "hi", "tokens": [1]})
                assert_envelope(r, 401)
        keyed = {"Authorization": f"Bearer {API_KEY}"}
        assert anon.post("/tokenize", json={"prompt": "hi"}, headers=keyed).status_code == 200
        assert anon.post("/tokenize", json={"prompt": "hi"}, headers={"X-API-Key": API_KEY}).status_code == 200
        assert anon.get("/tokenizer_info", headers=keyed).status_code == 200


@pytest.mark.slow
def test_models_show_the_model_name_not_a_path(http) -> None:
    card = http.get("/v1/models").json()["data"][0]
    assert card["root"] == MODEL and "/" not in json.dumps(card)


# ---------------------------------------------------------------------------- the fuzz, live server
BASE_BODIES: dict[str, list[dict[str, Any]]] = {
    "/v1/completions": [
        {"model": MODEL, "prompt": PROMPT, "max_tokens": 1, "temperature": 0},
        {"prompt": [504, 3575, 282, 4649, 314], "max_tokens": 1, "logprobs": 2, "echo": True},
        {"model": "alias", "prompt": [PROMPT, "Once"], "max_tokens": 1, "stream": True, "temperature": 0.5,
         "stream_options": {"include_usage": True}},
    ],
    "/v1/chat/completions": [
        {"model": MODEL, "messages": CHAT, "max_tokens": 1, "temperature": 0},
        {"messages": [{"role": "system", "content": "Be brief."},
                      {"role": "user", "content": [{"type": "text", "text": "Hi"}]}],
         "max_completion_tokens": 1, "logprobs": True, "top_logprobs": 2, "stream": True},
    ],
    "/tokenize": [{"model": MODEL, "prompt": PROMPT, "return_token_strs": True}, {"messages": CHAT}],
    "/detokenize": [{"model": MODEL, "tokens": [504, 3575, 282]}],
}
FIELDS = {
    "/v1/completions": sorted(CompletionRequest.model_fields),
    "/v1/chat/completions": sorted(ChatCompletionRequest.model_fields),
    "/tokenize": sorted(TokenizeRequest.model_fields),
    "/detokenize": sorted(DetokenizeRequest.model_fields),
}
ODD_PATHS = [("GET", "/v1/completions"), ("PUT", "/tokenize"), ("DELETE", "/v1/models"), ("GET", "/v1/nothing"),
             ("GET", "/v1//models"), ("POST", "/v1/models"), ("GET", "/tokenizer_info"), ("GET", "/v1/models"),
             ("GET", "/health"), ("GET", "/version"), ("GET", "/metrics")]
MAX_CHEAP_LIMIT = 2048  # the live server's context: larger max_tokens are refused, smaller ones cost steps


def _cheap(path: str, body: Any) -> Any:
    """Keep generation short: a valid max_tokens / n that would run many steps becomes 1 / 2, and
    a chat request without a limit gets one (the rest of the context would be its default)."""
    if path not in GENERATION_PATHS or not isinstance(body, dict):
        return body
    for key in ("max_tokens", "max_completion_tokens", "min_tokens"):
        v = body.get(key)
        if isinstance(v, (int, float)) and not isinstance(v, bool) and 1 < v < MAX_CHEAP_LIMIT:
            body[key] = 1
    if isinstance(body.get("n"), int) and 2 < body["n"] <= 128:
        body["n"] = 2
    if body.get("max_tokens") is None and body.get("max_completion_tokens") is None:
        body["max_tokens"] = 1
    return body


@st.composite
def mutated_body(draw: st.DrawFn, path: str) -> tuple[bytes, str]:
    """(body bytes, content type): a valid body with 1-3 fields changed, a message changed, or
    a body that is not a JSON object at all."""
    kind = draw(st.sampled_from(["fields"] * 6 + ["message"] * 2 + ["body"]))
    if kind == "body":
        choice = draw(st.sampled_from(["form", "value", "truncated", "bytes", "raw-surrogate"]))
        if choice == "form":
            return b"prompt=hi&max_tokens=1&messages=x", "application/x-www-form-urlencoded"
        if choice == "value":
            return dumps(draw(nasty)).encode("utf-8", "surrogatepass"), "application/json"
        if choice == "bytes":
            return draw(st.binary(max_size=64)), draw(st.sampled_from(["application/json", "text/plain", ""]))
        text = dumps(draw(st.sampled_from(BASE_BODIES[path])))
        if choice == "truncated":
            return text[: draw(st.integers(0, len(text) - 1))].encode(), "application/json"
        return text.replace('"tokens"', '"\xed\xa0\x80"').replace(PROMPT, "x\udc80").encode(
            "utf-8", "surrogatepass"), "application/json"
    body = copy.deepcopy(draw(st.sampled_from(BASE_BODIES[path])))
    if kind == "message" and "messages" in body:
        i = draw(st.integers(0, len(body["messages"]) - 1))
        key = draw(st.sampled_from(["role", "content", "name", "extra", "(message)", "(part)"]))
        value = draw(nasty)
        if key == "(message)":
            body["messages"][i] = value
        elif key == "(part)":
            body["messages"][i]["content"] = [{"type": draw(st.sampled_from(["text", "image_url", ""])), "text": value}]
        else:
            body["messages"][i][key] = value
    else:
        for _ in range(draw(st.integers(1, 3))):
            field = draw(st.sampled_from(FIELDS[path] + ["unknown_extra"]))
            if draw(st.integers(0, 7)) == 0:
                body.pop(field, None)
            else:
                body[field] = draw(field_values)
    return dumps(_cheap(path, body)).encode("utf-8", "surrogatepass"), "application/json"


@st.composite
def fuzz_requests(draw: st.DrawFn) -> tuple[str, str, bytes, dict[str, str]]:
    auth = draw(st.sampled_from(["key"] * 12 + ["none", "wrong"]))
    headers = {"Authorization": f"Bearer {API_KEY}"} if auth == "key" else (
        {"Authorization": "Bearer nope"} if auth == "wrong" else {})
    if draw(st.integers(0, 19)) == 0:
        method, path = draw(st.sampled_from(ODD_PATHS))
        return method, path, b"", headers
    path = draw(st.sampled_from(list(BASE_BODIES)))
    body, content_type = draw(mutated_body(path))
    if content_type:
        headers["Content-Type"] = content_type
    return "POST", path, body, headers


def _check_fuzz_response(r: httpx.Response, method: str, path: str, authorized: bool) -> None:
    assert r.status_code < 500, (method, path, r.status_code, r.text[:300])
    if not authorized and path not in PUBLIC:
        assert_envelope(r, 401)
        return
    if r.status_code >= 400:
        assert_envelope(r)
        return
    if r.headers.get("content-type", "").startswith("text/event-stream"):
        events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
        assert events and events[-1] == "[DONE]", r.text[-300:]
        for event in events[:-1]:
            assert "error" not in json.loads(event), event
    elif path != "/metrics" and r.content:
        json.loads(r.content)


FUZZ_EXAMPLES = 2000


@pytest.mark.slow
def test_fuzz_routes_never_answer_5xx(live_server) -> None:
    keyed = {"Authorization": f"Bearer {API_KEY}"}
    statuses: collections.Counter[int] = collections.Counter()
    with httpx.Client(base_url=live_server.base_url, timeout=120) as c:
        reference = c.post("/v1/completions", headers=keyed,
                           json={"model": MODEL, "prompt": PROMPT, "max_tokens": 4, "temperature": 0}).json()

        @settings(max_examples=FUZZ_EXAMPLES, derandomize=True, deadline=None, database=None,
                  suppress_health_check=list(HealthCheck))
        @given(case=fuzz_requests())
        def run(case: tuple[str, str, bytes, dict[str, str]]) -> None:
            method, path, body, headers = case
            r = c.request(method, path, content=body or None, headers=headers)
            statuses[r.status_code] += 1
            _check_fuzz_response(r, method, path, headers.get("Authorization") == keyed["Authorization"])

        run()
        assert sum(statuses.values()) >= FUZZ_EXAMPLES, statuses
        # both sides of the boundary were exercised: many refusals, and real generations
        assert statuses[200] >= 100 and statuses[400] >= FUZZ_EXAMPLES // 4 and statuses[401] > 0, statuses
        assert c.get("/health").status_code == 200
        again = c.post("/v1/completions", headers=keyed,
                       json={"model": MODEL, "prompt": PROMPT, "max_tokens": 4, "temperature": 0}).json()
        assert again["choices"][0]["text"] == reference["choices"][0]["text"]
