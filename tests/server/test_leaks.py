"""Nothing leaks on the real server (the default model): after a mix of completions and chat,
streaming and not, n = 2 with logprobs, streams dropped mid-way, clients that give up,
invalid bodies, requests the engine fails and requests past their deadline, every KV block is
free with no reference held, nothing runs or waits, and greedy output is what it was before."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from jaxserve.sampling.config import SamplerConfig
from tests.load_mix import KINDS, run_mix, wait_idle
from tests.server.conftest import API_KEY

pytestmark = pytest.mark.slow

HEADERS = {"Authorization": f"Bearer {API_KEY}"}
PROBE = {"prompt": "The capital of France is", "max_tokens": 12, "temperature": 0}


def test_nothing_leaks_after_a_mixed_load(live_server, http, monkeypatch):
    engine = live_server.engine
    before = http.post("/v1/completions", json=PROBE).json()["choices"][0]["text"]
    # Parameters the frontend would refuse reach the engine, whose runner fails them alone.
    monkeypatch.setattr(SamplerConfig, "check_request", lambda *args, **kwargs: None)
    bad = {"min_tokens": 2, "stop_token_ids": list(range(3, 4 + engine.info.sampler_config.max_stop_ids))}
    kinds = [k for k in KINDS if k != "deadline"] * 2

    def prompt(i: int) -> str:
        return f"Write a short note about the number {i}." + " And more." * (i % 3)

    outcomes = asyncio.run(run_mix(live_server.base_url, kinds, prompt, max_tokens=8, headers=HEADERS,
                                   bad_params=bad))
    want = {"completion": "200", "chat": "200", "chat_stream": "200", "completion_stream": "200",
            "cancel": "cancelled", "client_timeout": "cancelled", "invalid": "400", "engine_error": "400"}
    assert dict(outcomes) == {(k, v): 2 for k, v in want.items()}
    # Requests past a 1 s deadline (the server's setting, changed for this test).
    state = live_server.app.state.server
    monkeypatch.setattr(state, "config", dataclasses.replace(state.config, request_timeout=1.0))
    outcomes = asyncio.run(run_mix(live_server.base_url, ["deadline"] * 2, prompt, headers=HEADERS,
                                   long_tokens=1500))
    assert dict(outcomes) == {("deadline", "stream-504"): 2}
    monkeypatch.undo()
    kv = engine.transport.core.scheduler.kv
    wait_idle(live_server.base_url, kv.num_blocks, headers=HEADERS, timeout=30)
    assert all(b.ref_cnt == 0 for b in kv.pool.blocks)
    assert engine.num_in_flight == 0 and engine.num_waiting == 0
    assert http.post("/v1/completions", json=PROBE).json()["choices"][0]["text"] == before
