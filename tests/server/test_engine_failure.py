"""AsyncEngine and the app over a stub engine (no JAX): engine death → 500s, in-stream errors and
/health 503; validation errors from the engine → 400; no model needed, so this runs in seconds."""

from __future__ import annotations

import json
import types

import pytest
from starlette.testclient import TestClient

from jaxserve.core.scheduler import SchedulerStats
from jaxserve.outputs import CompletionOutput, RequestOutput
from jaxserve.server.app import build_app
from jaxserve.server.async_engine import AsyncEngine


class _Tok:
    vocab_size = 100
    eos_token_id = 0

    def encode(self, text, add_special_tokens=True):
        return [ord(c) % 100 for c in text]

    def decode(self, ids, skip_special_tokens=False):
        return "".join(chr(97 + i % 26) for i in ids)

    def apply_chat_template(self, messages, add_generation_prompt=True, **kw):
        return "".join(m["content"] for m in messages)


class StubEngine:
    """Each step emits one token 'x' per request; a request finishes after max_tokens steps."""

    model_name = "stub"
    max_model_len = 64
    model_path = "stub"

    def __init__(self):
        self.tokenizer = _Tok()
        self.arch = types.SimpleNamespace(vocab_size=100)
        self.runner = types.SimpleNamespace(counter=types.SimpleNamespace(num_compiles=1, recompiles=0,
                                                                          compile_seconds=0.0), compile_seconds=0.0)
        self.reqs: dict[str, list] = {}
        self.explode = False
        self.scheduler = types.SimpleNamespace(make_stats=self._stats, get_request=lambda rid: None)
        self.output_processor = types.SimpleNamespace(child_ids=lambda rid: [rid])

    def _stats(self):
        return SchedulerStats(len(self.reqs), 0, 0.0, 10, 0, 0, 0)

    def add_request(self, rid, prompt, params, **kw):
        if len(prompt) + (params.max_tokens or 0) > self.max_model_len:
            raise ValueError("prompt plus max_tokens exceeds the context length")
        self.reqs[rid] = [list(prompt), params.max_tokens or 1, 0]

    def abort_request(self, rid):
        self.reqs.pop(rid, None)
        return []

    def has_unfinished_requests(self):
        return bool(self.reqs)

    def step(self):
        if self.explode:
            raise RuntimeError("boom")
        outs = []
        for rid, st in list(self.reqs.items()):
            st[2] += 1
            done = st[2] >= st[1]
            outs.append(RequestOutput(rid, None, st[0], [CompletionOutput(0, "x", [23], finish_reason="length" if done else None)],
                                      finished=done))
            if done:
                del self.reqs[rid]
        return outs


@pytest.fixture()
def stub():
    eng = StubEngine()
    app = build_app(AsyncEngine(eng), shutdown_grace_seconds=1)
    with TestClient(app) as c:
        yield eng, c


def test_stub_ok_then_engine_death(stub):
    eng, c = stub
    r = c.post("/v1/completions", json={"model": "stub", "prompt": "hi", "max_tokens": 3})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == "xxx" and r.json()["usage"]["completion_tokens"] == 3
    r = c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 100})
    assert r.status_code == 400 and "context" in r.json()["error"]["message"]
    assert c.get("/health").status_code == 200

    eng.explode = True
    with c.stream("POST", "/v1/chat/completions",
                  json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "stream": True}) as s:
        assert s.status_code == 200
        lines = [ln for ln in s.iter_lines() if ln.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    assert json.loads(lines[-2][6:])["error"]["code"] == 500
    assert c.get("/health").status_code == 503
    r = c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 3})
    assert r.status_code == 500 and r.json()["error"]["type"] == "InternalServerError"


def test_stub_inflight_nonstream_gets_500(stub):
    eng, c = stub
    eng.explode = True
    r = c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 3})
    assert r.status_code == 500
    assert c.get("/health").status_code == 503
