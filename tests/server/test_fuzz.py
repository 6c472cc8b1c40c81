"""The live server's input boundary: whatever a client sends, the answer is a 200 or a 4xx in
OpenAI's error envelope, never a 500 and never a dropped connection. Specific cases found by
fuzzing (deep JSON, integers past Python's 4300-digit limit, lone UTF-16 surrogates, NaN and
Infinity, form-encoded and oddly typed bodies, auth path tricks) and a seeded hypothesis fuzz of
the routes (>= 2,000 requests), against the live server on the default model; it must answer a
valid request correctly afterwards. The parser and protocol models alone: test_input_boundary.py.
App settings (trusted chat templates, the body limit, 500s) are in test_app_settings.py.
"""

from __future__ import annotations

import collections
import copy
import json
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jaxserve.server.body import MAX_JSON_DEPTH
from jaxserve.server.protocol import CompletionRequest
from jaxserve.server.protocol_chat import ChatCompletionRequest
from jaxserve.server.protocol_tokenize import DetokenizeRequest, TokenizeRequest
from tests.server.bad_input import (
    CHAT,
    CHAT_INT_FIELDS,
    FLOAT_FIELDS,
    GENERATION_PATHS,
    HUGE_INT,
    INT_FIELDS,
    NON_FINITE,
    PROMPT,
    assert_envelope,
    deep_dict,
    deep_list,
    dumps,
    field_values,
    nasty,
)
from tests.server.conftest import API_KEY, MODEL





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


PUBLIC = ["/health", "/version", "/metrics", "/", "/playground/playground.js", "/playground/playground.css"]
# (httpx sends a path that starts with "//" as "/", the playground's public page: spellings that
# start so cannot be tested through it)
PROTECTED = [("GET", "/v1/models"), ("POST", "/v1/completions"), ("POST", "/v1/chat/completions"),
             ("POST", "/tokenize"), ("POST", "/detokenize"), ("GET", "/tokenizer_info"),
             ("GET", "/v1//models"), ("GET", "/V1/models"), ("GET", "/v1/models/"), ("GET", "/v1%2fmodels"),
             ("GET", "/%76%31/models"), ("GET", "/v1/../v1/models"), ("POST", "/tokenize//"), ("POST", "/Tokenize"),
             ("POST", "/tokenize/"), ("POST", "/tokenize%2f"), ("GET", "/health/../tokenizer_info"),
             ("GET", "/health/"), ("GET", "/HEALTH"), ("GET", "/nothing"), ("GET", "/playground/"),
             ("GET", "/playground/other.js"), ("GET", "/index.html")]


@pytest.mark.slow
def test_every_route_but_the_public_ones_needs_the_key(live_server) -> None:
    with httpx.Client(base_url=live_server.base_url, timeout=60) as anon:
        for path in PUBLIC:
            assert anon.get(path).status_code == 200, path
        for method, path in PROTECTED:
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"X-API-Key": "wrong"},
                            {"Authorization": API_KEY}):
                r = anon.request(method, path, headers=headers, json={"prompt": "hi", "tokens": [1]})
                assert r.status_code == 401, (method, path, r.status_code)
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


_compiles: list[str] = []  # XLA compilations anywhere in the process while the fuzz runs
_counting = False


def _on_compile(event: str, duration: float, **kwargs) -> None:
    if _counting and event == "/jax/core/compile/backend_compile_duration":
        _compiles.append(kwargs.get("fun_name", "?"))


@pytest.mark.slow
def test_fuzz_routes_never_answer_5xx(live_server) -> None:
    """... and nothing compiles meanwhile, on any thread: a request's latency never includes a
    compilation (benchmarks/fuzz_latency.py measures small requests' latency during the fuzz)."""
    global _counting
    import jax

    keyed = {"Authorization": f"Bearer {API_KEY}"}
    statuses: collections.Counter[int] = collections.Counter()
    jax.monitoring.register_event_duration_secs_listener(_on_compile)
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

        _counting = True
        try:
            run()
        finally:
            _counting = False
        assert not _compiles, _compiles
        assert sum(statuses.values()) >= FUZZ_EXAMPLES, statuses
        # both sides of the boundary were exercised: many refusals, and real generations
        assert statuses[200] >= 100 and statuses[400] >= FUZZ_EXAMPLES // 4 and statuses[401] > 0, statuses
        assert c.get("/health").status_code == 200
        again = c.post("/v1/completions", headers=keyed,
                       json={"model": MODEL, "prompt": PROMPT, "max_tokens": 4, "temperature": 0}).json()
        assert again["choices"][0]["text"] == reference["choices"][0]["text"]
