"""Back-pressure and deadlines on the fake engine, through the real app: a full waiting queue
refuses with 503 + Retry-After, a request past --request-timeout is aborted (504, or an error
event in a stream) with its KV freed, and after any mix of completions, cancellations, client
timeouts, engine errors, deadline aborts and refusals nothing is left: no request, no block
held, every gauge at idle."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import httpx
import pytest
from starlette.testclient import TestClient

from jaxserve.server.app import build_app
from jaxserve.server.config import ServerConfig
from jaxserve.sampling_params import SamplingParams
from jaxserve.engine.async_client import RETRY_AFTER_SECONDS, AsyncEngineClient, EngineOverloadedError, default_max_waiting
from jaxserve.server.cli import build_parser
from tests.engine.fakes import fake_parts
from tests.engine.test_engine_faults import POISON, assert_idle
from tests.engine.test_serving_failures import sse_events
from tests.live_server import LiveServer, free_port
from tests.load_mix import KINDS, gauges, run_mix, wait_idle


def _wait_for(cond, timeout: float = 10.0) -> None:
    t0 = time.monotonic()
    while not cond():
        assert time.monotonic() - t0 < timeout, "timed out"
        time.sleep(0.01)


def test_the_default_waiting_limit_comes_from_the_kv_cache():
    # four full-context sequences' worth of cache tokens per ... sequence of the limit
    assert default_max_waiting(46576, 2048, 32) == 4 * 46576 // 2048 == 90
    assert default_max_waiting(4096, 2048, 32) == 32  # never under one full batch
    parts = fake_parts(num_blocks=257, block_size=4, max_model_len=128, max_num_seqs=8)
    assert AsyncEngineClient.in_thread(parts).max_waiting_requests == 4 * 256 * 4 // 128
    assert AsyncEngineClient.in_thread(parts, max_waiting_requests=3).max_waiting_requests == 3
    with pytest.raises(ValueError):
        AsyncEngineClient.in_thread(parts, max_waiting_requests=0)
    args = build_parser().parse_args(["serve", "--max-waiting-requests", "5", "--request-timeout", "2.5"])
    assert (args.max_waiting_requests, args.request_timeout) == (5, 2.5)
    for bad in (["--max-waiting-requests", "0"], ["--request-timeout", "0"], ["--request-timeout", "nan"]):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["serve", *bad])


def test_what_free_slots_will_take_does_not_count_as_waiting():
    """The count the limit applies to, with the engine thread not started (nothing is taken):
    of the sequences sent to an idle engine, those beyond its free running slots wait; n = 2
    counts two; a request is taken whole while the count is under the limit."""
    engine = AsyncEngineClient.in_thread(fake_parts(max_num_seqs=4), max_waiting_requests=2)
    params = SamplingParams(max_tokens=2)

    async def send() -> list[str]:
        outcomes = []
        for i, n in enumerate((1, 2, 1, 2, 1, 1)):
            try:
                await engine.add_request(f"r{i}", "hi", params.clone(n=n, seed=i))
                outcomes.append(f"{engine.num_waiting}")
            except EngineOverloadedError:
                outcomes.append("refused")
        return outcomes

    # 1 + 2 + 1 fill the four slots; then 2 wait, which reaches the limit
    assert asyncio.run(send()) == ["0", "0", "0", "2", "refused", "refused"]
    assert engine.num_refused == 2


def test_a_full_waiting_queue_refuses_with_503_and_retry_after():
    parts = fake_parts(max_num_seqs=1)
    runner = parts.core.runner
    engine = AsyncEngineClient.in_thread(parts, max_waiting_requests=2)
    results: dict[str, httpx.Response] = {}
    with LiveServer(build_app(engine, ServerConfig()), free_port()) as srv:
        def post(name: str) -> None:
            results[name] = httpx.post(srv.base_url + "/v1/completions", timeout=30,
                                       json={"prompt": name * 3, "max_tokens": 4, "temperature": 0})

        runner.gate.clear()  # the engine will hold in its first collect: what comes next waits
        threads = [threading.Thread(target=post, args=("a",))]
        threads[0].start()
        _wait_for(lambda: runner.scheduled)
        threads += [threading.Thread(target=post, args=(x,)) for x in "bc"]
        for t in threads[1:]:
            t.start()
        _wait_for(lambda: engine.num_waiting == 2)  # sent, not yet taken by the held engine
        r = httpx.post(srv.base_url + "/v1/completions", json={"prompt": "d", "max_tokens": 4})
        assert r.status_code == 503 and r.headers["retry-after"] == str(RETRY_AFTER_SECONDS)
        err = r.json()["error"]
        assert (err["type"], err["code"]) == ("ServiceUnavailableError", 503) and "capacity" in err["message"]
        r = httpx.post(srv.base_url + "/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "d"}], "max_tokens": 4, "stream": True})
        assert r.status_code == 503 and "retry-after" in r.headers  # before any stream starts
        runner.gate.set()
        for t in threads:
            t.join(30)
        assert [results[x].status_code for x in "abc"] == [200, 200, 200]
        wait_idle(srv.base_url, parts.core.scheduler.kv.num_blocks)
        assert engine.num_waiting == 0
        r = httpx.post(srv.base_url + "/v1/completions", json={"prompt": "e", "max_tokens": 4})
        assert r.status_code == 200
        g = gauges(httpx.get(srv.base_url + "/metrics").text)
        assert g["admission_rejections_total[max_num_queued_reqs]"] == 2 and g["max_waiting_requests"] == 2
    assert_idle(parts.core)


@pytest.fixture()
def slow_served():
    """The fake engine at 20 ms a step, with a 0.3 s request timeout."""
    parts = fake_parts(step_seconds=0.02, max_num_seqs=2)
    engine = AsyncEngineClient.in_thread(parts)
    with TestClient(build_app(engine, ServerConfig(request_timeout=0.3))) as client:
        yield parts, engine, client


def test_a_request_past_its_deadline_is_aborted_with_a_504(slow_served):
    parts, engine, client = slow_served
    t0 = time.monotonic()
    r = client.post("/v1/completions", json={"prompt": "abc", "max_tokens": 100})
    assert r.status_code == 504 and time.monotonic() - t0 < 3
    err = r.json()["error"]
    assert (err["type"], err["code"]) == ("TimeoutError", 504) and "request timeout of 0.3 s" in err["message"]
    # streaming: the chunks so far, then an error event and [DONE]
    with client.stream("POST", "/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "hi"}], "max_tokens": 100, "stream": True}) as s:
        assert s.status_code == 200
        events = sse_events(s)
    assert events[-1] == "[DONE]" and json.loads(events[-2])["error"]["code"] == 504
    assert any("choices" in json.loads(e) for e in events[:-2])  # it had started
    # a request that fits the deadline is untouched
    assert client.post("/v1/completions", json={"prompt": "abc", "max_tokens": 3}).status_code == 200
    _wait_for(lambda: engine.stats.scheduler.num_running == 0 and not parts.core.has_work())
    assert engine.num_in_flight == 0
    assert_idle(parts.core)


def test_a_stream_past_its_deadline_is_aborted_before_its_client_hears_of_it():
    parts = fake_parts(step_seconds=0.02)
    engine = AsyncEngineClient.in_thread(parts)
    with LiveServer(build_app(engine, ServerConfig(request_timeout=0.3)), free_port()) as srv:
        with httpx.stream("POST", srv.base_url + "/v1/completions", timeout=30,
                          json={"prompt": "abc", "max_tokens": 100, "stream": True}) as r:
            for line in r.iter_lines():
                if '"error"' in line:
                    assert json.loads(line[6:])["error"]["code"] == 504
                    assert engine.num_in_flight == 0  # aborted already (the KV: at the engine's next turn)
                    break
            else:
                raise AssertionError("no error event")
        _wait_for(lambda: not parts.core.has_work())
    assert_idle(parts.core)


def test_a_request_that_waits_past_its_deadline_leaves_the_queue(slow_served):
    parts, engine, client = slow_served
    parts.core.runner.gate.clear()  # nothing is scheduled after the first step: the rest waits

    async def burst() -> list[int]:
        transport = httpx.ASGITransport(app=client.app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as c:
            rs = await asyncio.gather(*(c.post("/v1/completions", json={"prompt": f"p{i}", "max_tokens": 2})
                                        for i in range(4)))
        return [r.status_code for r in rs]

    statuses = client.portal.call(burst)
    assert statuses == [504] * 4
    parts.core.runner.gate.set()
    _wait_for(lambda: not parts.core.has_work() and engine.stats.scheduler.num_waiting == 0)
    assert_idle(parts.core)


def test_nothing_leaks_after_a_mixed_load():
    """48 requests at once (every kind of KINDS) against an engine that serves 8 at a time, 10 ms
    a step, with a queue of 24 and a 3 s deadline: every request ends as its kind should (or is
    refused), and then the engine is idle."""
    parts = fake_parts(step_seconds=0.01, max_num_seqs=8, max_model_len=512, num_blocks=512)
    parts.core.runner.reject_token = parts.tokenizer.encode(POISON)[0]
    engine = AsyncEngineClient.in_thread(parts, max_waiting_requests=24)
    kinds = [KINDS[i % len(KINDS)] for i in range(48)]
    with LiveServer(build_app(engine, ServerConfig(request_timeout=3.0)), free_port()) as srv:
        def prompt(i: int) -> str:
            return (POISON if kinds[i] == "engine_error" else "") + f"prompt number {i} " * (1 + i % 3)

        outcomes = asyncio.run(run_mix(srv.base_url, kinds, prompt, max_tokens=12, long_tokens=450))
        took = wait_idle(srv.base_url, parts.core.scheduler.kv.num_blocks)
        g = gauges(httpx.get(srv.base_url + "/metrics").text)
    allowed = {"completion": {"200"}, "chat": {"200"}, "chat_stream": {"200"}, "completion_stream": {"200"},
               "cancel": {"cancelled"}, "client_timeout": {"cancelled"}, "invalid": {"400"},
               "engine_error": {"400"}, "deadline": {"stream-504"}}
    refused = 0
    for (kind, outcome), count in outcomes.items():
        if outcome == "503":
            refused += count
        else:
            assert outcome in allowed[kind], (kind, outcome)
    # (a client that gave up within 50 ms may have been refused too)
    assert 0 < refused <= g["admission_rejections_total[max_num_queued_reqs]"] <= refused + kinds.count("client_timeout")
    assert took < 2.0
    assert engine.num_in_flight == 0 and engine.num_waiting == 0
    assert_idle(parts.core)
