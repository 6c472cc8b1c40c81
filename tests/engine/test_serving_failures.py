"""Failures inside an engine step, as the server reports them: a request the engine could not
take is a 400 (an error event in a stream) and the server keeps serving; anything else kills
the engine: /health answers 503, in-flight requests get a 500, new ones a 503, and the
dead-engine callbacks run (the CLI's exit policy: tests/server/test_engine_failure_exit.py)."""

from __future__ import annotations

import json

import pytest
from starlette.testclient import TestClient

from jaxserve.server.app import build_app
from jaxserve.server.config import ServerConfig
from jaxserve.engine.async_client import AsyncEngineClient
from tests.engine.fakes import fake_parts
from tests.engine.test_engine_faults import POISON, POISON_ID, assert_idle


@pytest.fixture()
def served():
    parts = fake_parts()
    engine = AsyncEngineClient.in_thread(parts)
    with TestClient(build_app(engine, ServerConfig(shutdown_grace=1))) as client:
        yield parts, engine, client


def sse_events(response) -> list[str]:
    return [ln[6:] for ln in response.iter_lines() if ln.startswith("data: ")]


def test_the_server_reports_a_rejected_request_and_keeps_serving(served):
    parts, engine, client = served
    parts.core.runner.reject_token = POISON_ID
    r = client.post("/v1/completions", json={"prompt": "abc" + POISON, "max_tokens": 3})
    assert r.status_code == 400 and "cannot take token" in r.json()["error"]["message"]
    with client.stream("POST", "/v1/chat/completions", json={
            "messages": [{"role": "user", "content": POISON}], "max_tokens": 3, "stream": True}) as s:
        assert s.status_code == 200
        events = sse_events(s)
    assert events[-1] == "[DONE]" and json.loads(events[-2])["error"]["code"] == 400
    # n = 2: both samples go (one failed, the other is aborted)
    r = client.post("/v1/completions", json={"prompt": POISON, "max_tokens": 3, "n": 2})
    assert r.status_code == 400
    r = client.post("/v1/completions", json={"prompt": "abc", "max_tokens": 3, "n": 2, "seed": 1})
    assert r.status_code == 200 and len(r.json()["choices"]) == 2
    assert client.get("/health").status_code == 200
    assert engine.num_in_flight == 0
    assert_idle(parts.core)


def test_engine_death_fails_requests_health_and_runs_the_callbacks(served):
    parts, engine, client = served
    died: list[BaseException] = []
    engine.add_dead_callback(died.append)
    assert client.get("/health").status_code == 200
    parts.core.runner.explode = True
    with client.stream("POST", "/v1/chat/completions",
                       json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "stream": True}) as s:
        assert s.status_code == 200
        events = sse_events(s)
    assert events[-1] == "[DONE]" and json.loads(events[-2])["error"]["code"] == 500
    assert client.get("/health").status_code == 503
    r = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 3})
    assert r.status_code == 503 and r.json()["error"]["type"] == "ServiceUnavailableError"
    assert "restarted" in r.json()["error"]["message"]
    assert len(died) == 1 and "boom" in repr(died[0])


def test_an_output_processor_failure_is_fatal_too(served, monkeypatch):
    """The frontend's per-request state is unknown after it raised: the engine stops."""
    parts, engine, client = served
    died: list[BaseException] = []
    engine.add_dead_callback(died.append)

    def broken(outputs):
        raise RuntimeError("detokenizer failure")

    monkeypatch.setattr(engine.frontend.output_processor, "process", broken)
    r = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 3})
    assert r.status_code == 500 and "request id" in r.json()["error"]["message"]
    assert client.get("/health").status_code == 503 and len(died) == 1
    engine.transport._thread.join(5)
    assert not engine.transport._thread.is_alive()
