"""Settings of the app that need no model: a chat template sent with a request (refused unless
trusted, sandboxed when trusted), the request-body limit, and 500s that name the request id
rather than the exception. The app runs over the engine with a fake runner (no model) and the
default model's tokenizer."""

from __future__ import annotations

import types
from typing import Any

import pytest
from starlette.testclient import TestClient

from jaxserve.engine.async_client import AsyncEngineClient
from jaxserve.server.body import default_max_body_bytes
from tests.engine.fakes import fake_parts
from tests.server.bad_input import CHAT, PROMPT, assert_envelope
from tests.server.conftest import app_config

MAX_MODEL_LEN = 2048


@pytest.fixture(scope="module")
def tokenizer():
    from jaxserve.engine.tokenizer import Tokenizer
    from jaxserve.models.loader import resolve_model

    return Tokenizer.from_pretrained(resolve_model(None))


def _fake_app(tokenizer: Any, fake: dict[str, Any] | None = None, **options: Any) -> tuple[AsyncEngineClient, TestClient]:
    """The app (ServerConfig fields in `options`) over the fake runner (`fake_parts` options in
    `fake`)."""
    from jaxserve.server.app import build_app

    parts = fake_parts(tokenizer=tokenizer, vocab_size=tokenizer.vocab_size, max_model_len=MAX_MODEL_LEN,
                       num_blocks=8 * MAX_MODEL_LEN // 4 + 1, budget=512, **(fake or {}))
    engine = AsyncEngineClient.in_thread(parts)
    client = TestClient(build_app(engine, app_config(**options)), raise_server_exceptions=False)
    return engine, client.__enter__()  # the lifespan starts the engine thread


def test_trusted_chat_template_is_rendered_in_the_sandbox(tokenizer) -> None:
    engine, c = _fake_app(tokenizer, trust_request_chat_template=True)
    template = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
    r = c.post("/tokenize", json={"messages": CHAT, "chat_template": template, "add_special_tokens": False})
    assert r.status_code == 200 and r.json()["tokens"] == tokenizer.encode(f"<user>{CHAT[0]['content']}",
                                                                           add_special_tokens=False)
    r = c.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 1,
                                             "chat_template_kwargs": {"chat_template": template}})
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length"
    assert engine.transport.core.runner.prompts[-1] == tokenizer.encode(f"<user>{CHAT[0]['content']}", add_special_tokens=False)
    # the sandbox still stands between a trusted template and Python's internals
    escape = "{{ ''.__class__.__mro__[1].__subclasses__() }}"
    for path in ("/tokenize", "/v1/chat/completions"):
        err = assert_envelope(c.post(path, json={"messages": CHAT, "max_tokens": 1, "chat_template": escape}), 400)
        assert "unsafe" in err["message"] or "access to attribute" in err["message"], err


def test_untrusted_is_the_default(tokenizer) -> None:
    engine, c = _fake_app(tokenizer)
    r = c.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 1, "chat_template": "{{ 1 }}"})
    assert assert_envelope(r, 400)["param"] == "chat_template" and engine.transport.core.runner.prompts == []
    r = c.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 1})
    assert r.status_code == 200  # the model's own template is always fine


def test_body_limit_fits_the_context(tokenizer) -> None:
    limit = default_max_body_bytes(MAX_MODEL_LEN)
    assert limit == (1 << 20) + 256 * 2048
    assert default_max_body_bytes(128 * 1024) > default_max_body_bytes(2048)
    _, c = _fake_app(tokenizer)
    full_context = list(range(100, 100 + MAX_MODEL_LEN - 1))  # a full-context prompt fits, 8 times
    r = c.post("/v1/completions", json={"prompt": [full_context] * 8, "max_tokens": 1})
    assert r.status_code == 200, r.text[:300]
    err = assert_envelope(c.post("/v1/completions", json={"prompt": "x" * limit, "max_tokens": 1}), 413)
    assert str(limit) in err["message"]
    _, small = _fake_app(tokenizer, max_request_body=1000)  # an explicit limit wins
    assert_envelope(small.post("/v1/completions", json={"prompt": "x" * 1000, "max_tokens": 1}), 413)
    huge_length = {"Content-Length": "9" * 5000, "Content-Type": "application/json"}
    assert small.post("/tokenize", content=b"{}", headers=huge_length).status_code in (400, 413)


def test_500s_name_the_request_id_not_the_exception(tokenizer, monkeypatch) -> None:
    engine, c = _fake_app(tokenizer)
    monkeypatch.setattr(engine.frontend.input_processor, "process", _explode_secretly)
    for path, body in (("/v1/completions", {"prompt": PROMPT, "max_tokens": 1}),
                       ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 1})):
        r = c.post(path, json=body, headers={"X-Request-Id": "req-42"})
        assert r.status_code == 500 and r.headers["x-request-id"] == "req-42"
        err = r.json()["error"]
        assert "req-42" in err["message"] and "secret" not in r.text and "RuntimeError" not in r.text
        assert err["type"] == "InternalServerError" and err["code"] == 500
        r = c.post(path, json=body)  # without X-Request-Id: the generated id is named
        assert r.headers["x-request-id"] in r.json()["error"]["message"]
    monkeypatch.undo()
    for body in ({"prompt": PROMPT, "max_tokens": 1, "stream": True},
                 {"prompt": PROMPT, "max_tokens": 1}):
        engine, c = _fake_app(tokenizer)
        engine.transport.core.runner.explode = True  # the engine dies during the request: in-stream or body error
        r = c.post("/v1/completions", json=body, headers={"X-Request-Id": "req-43"})
        assert "req-43" in r.text and "secret" not in r.text
    # a failure outside the engine (here: the tokenizer) is a 500 with the id as well
    _, c = _fake_app(types.SimpleNamespace(vocab_size=10, encode=_explode))
    r = c.post("/tokenize", json={"prompt": "hi"}, headers={"X-Request-Id": "req-44"})
    assert r.status_code == 500 and "req-44" in r.text and "tokenizer detail" not in r.text
    assert c.get("/health").status_code == 200


def _explode(*args: Any, **kwargs: Any) -> list[int]:
    raise RuntimeError("tokenizer detail")


def _explode_secretly(*args: Any, **kwargs: Any) -> Any:
    raise RuntimeError("secret detail")


def test_operator_chat_template_and_request_logging(tokenizer, caplog) -> None:
    template = "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"
    engine, c = _fake_app(tokenizer, chat_template=template)  # requests are logged by default
    with caplog.at_level("INFO", logger="jaxserve.server.request_checks"):
        r = c.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 2, "temperature": 0})
    assert r.status_code == 200
    assert engine.transport.core.runner.prompts[-1] == tokenizer.encode(f"[user] {CHAT[0]['content']}\n", add_special_tokens=False)
    assert c.get("/tokenizer_info").json()["chat_template"] == template
    lines = [rec.getMessage() for rec in caplog.records if "Received request chatcmpl-" in rec.getMessage()]
    assert lines and "max_tokens=2" in lines[0] and "temperature=0.0" in lines[0] and CHAT[0]["content"] not in lines[0]
    _, quiet = _fake_app(tokenizer, disable_log_requests=True)  # no request lines
    caplog.clear()
    with caplog.at_level("INFO", logger="jaxserve.server.request_checks"):
        quiet.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 1})
    assert not [rec for rec in caplog.records if "Received request" in rec.getMessage()]


def test_the_app_takes_its_options_from_the_server_config(tokenizer) -> None:
    """build_app's options are the ServerConfig's fields, read where they apply: the served
    names, the API keys, CORS, the request-id header and the optional route groups, each set
    against its default."""
    origin = "https://ui.example"
    _, c = _fake_app(tokenizer, served_model_name=("a", "b"), api_key=("k",), allowed_origins=(origin,),
                     disable_request_id_header=True, enable_sleep_mode=True,
                     allow_runtime_lora_updating=True)
    assert_envelope(c.get("/v1/models"), 401)
    auth = {"Authorization": "Bearer k"}
    r = c.get("/v1/models", headers={**auth, "Origin": origin})
    assert [m["id"] for m in r.json()["data"]] == ["a", "b"]
    assert r.headers["access-control-allow-origin"] == origin and "x-request-id" not in r.headers
    assert c.get("/is_sleeping", headers=auth).json() == {"is_sleeping": False}
    adapter = {"lora_name": "x", "lora_path": "/no/such/adapter"}
    err = assert_envelope(c.post("/v1/load_lora_adapter", headers=auth, json=adapter), 400)
    assert "LoRA" in err["message"] or "lora" in err["message"], err  # the route is there; LoRA is off
    engine, plain = _fake_app(tokenizer)  # the defaults: none of it
    r = plain.get("/v1/models", headers={"Origin": origin})
    assert [m["id"] for m in r.json()["data"]] == [engine.model_name]
    assert "x-request-id" in r.headers and "access-control-allow-origin" not in r.headers
    assert_envelope(plain.get("/is_sleeping"), 404)
    assert_envelope(plain.post("/v1/load_lora_adapter", json=adapter), 404)


def test_priority_needs_the_priority_policy(tokenizer) -> None:
    _, fcfs = _fake_app(tokenizer)
    err = assert_envelope(fcfs.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 1, "priority": 3}), 400)
    assert "--scheduling-policy priority" in err["message"] and err["param"] == "priority"
    assert fcfs.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 1, "priority": 0}).status_code == 200


def test_priority_policy_orders_waiting_requests(tokenizer) -> None:
    """One sequence at a time: while a runs, b (priority 5) and c (priority -1) wait; c goes first."""
    import asyncio

    from jaxserve.sampling_params import SamplingParams

    async def run() -> list[str]:
        parts = fake_parts(tokenizer=tokenizer, vocab_size=tokenizer.vocab_size, max_model_len=256, max_num_seqs=1,
                           step_seconds=0.002, policy="priority")
        engine = AsyncEngineClient.in_thread(parts)
        engine.start()
        done: list[str] = []

        async def drain(stream) -> None:
            while not (await stream.queue.get()).finished:
                pass
            done.append(stream.request_id)

        a = await engine.add_request("a", PROMPT, SamplingParams(max_tokens=30, ignore_eos=True))
        await a.queue.get()  # a runs
        b = await engine.add_request("b", PROMPT, SamplingParams(max_tokens=3, ignore_eos=True), priority=5)
        c = await engine.add_request("c", PROMPT, SamplingParams(max_tokens=3, ignore_eos=True), priority=-1)
        await asyncio.gather(drain(a), drain(b), drain(c))
        engine.shutdown()
        return done

    assert asyncio.run(run()) == ["a", "c", "b"]
    _, prio = _fake_app(tokenizer, {"policy": "priority"})
    assert prio.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 1, "priority": 3}).status_code == 200

