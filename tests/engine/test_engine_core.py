"""The engine loop on a fake runner (no model, no JAX compilation): outputs, overlapped steps,
stop rules, commands, and the request pipeline's thread split. Runs in seconds."""

from __future__ import annotations

import pytest
from starlette.testclient import TestClient

from jaxserve.engine.llm_engine import LLMEngine
from jaxserve.sampling_params import SamplingParams
from jaxserve.server.app import build_app
from jaxserve.server.config import ServerConfig
from jaxserve.engine.async_client import AsyncEngineClient
from tests.engine.fakes import EOS, CharTokenizer, fake_parts, next_token, prompt_logprob


def expected_tokens(prompt_ids: list[int], n: int) -> list[int]:
    """What the fake model generates for `prompt_ids` alone."""
    out, last = [], prompt_ids[-1]
    for i in range(n):
        last = next_token(last, len(prompt_ids) + i - 1)
        out.append(last)
    return out


def run_all(engine: LLMEngine, requests: dict[str, tuple[str, SamplingParams]]) -> dict:
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params)
    done = {}
    steps = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = [(o.token_ids, o.text, o.finish_reason, o.stop_reason) for o in out.outputs]
        steps += 1
        assert steps < 10_000
    return done


def workload() -> dict[str, tuple[str, SamplingParams]]:
    reqs = {}
    for i in range(24):
        prompt = "".join(chr(33 + (i * 7 + j * 5) % 90) for j in range(3 + (i * 11) % 40))
        params = SamplingParams(max_tokens=1 + (i * 5) % 19, temperature=0.0)
        if i % 5 == 0:
            params = SamplingParams(max_tokens=12, n=2, seed=i)
        if i % 7 == 0:  # a stop string the output reaches (the 7th generated character)
            text = CharTokenizer().decode(expected_tokens(CharTokenizer().encode(prompt), 7))
            params = SamplingParams(max_tokens=20, stop=[text[6]], temperature=0.0)
        reqs[f"r{i}"] = (prompt, params)
    return reqs


@pytest.mark.parametrize("tight", [False, True], ids=["roomy", "preempting"])
def test_overlapped_steps_give_the_outputs_of_plain_steps(tight):
    """24 requests with chunked prefill (budget 16), n = 2, stop strings and (tight) a KV
    cache small enough to preempt: overlapped steps change no token, text or finish reason,
    and every token is what the model gives each request alone."""
    kw = dict(budget=16, num_blocks=40 if tight else 512, max_model_len=64)
    plain = run_all(LLMEngine(fake_parts(async_scheduling=False, **kw)), workload())
    over_engine = LLMEngine(fake_parts(async_scheduling=True, **kw))
    overlapped = run_all(over_engine, workload())
    assert overlapped == plain and len(plain) == 24
    if tight:
        assert over_engine.scheduler.make_stats().num_preemptions > 0
    for rid, (prompt, params) in workload().items():
        ids = CharTokenizer().encode(prompt)
        for toks, _, finish, _ in plain[rid]:
            assert toks == expected_tokens(ids, len(toks))
            assert finish == ("length" if not params.stop else "stop")
    # Nothing leaks: every block free, no request left in the core.
    kv = over_engine.scheduler.kv
    assert kv.get_num_free_blocks() == kv.num_blocks - 1 and not over_engine.scheduler.requests


def test_overlap_keeps_a_step_in_flight():
    """With overlap the first step returns nothing (its tokens are collected by the next one),
    and each later step returns the tokens of the step before."""
    engine = LLMEngine(fake_parts(async_scheduling=True))
    engine.add_request("a", "hello", SamplingParams(max_tokens=3, temperature=0.0))
    assert engine.step() == []  # step 0 launched, nothing collected yet
    lens = []
    while engine.has_unfinished_requests():
        lens += [sum(len(o.token_ids) for o in out.outputs) for out in engine.step()]
    assert lens == [3]  # FINAL_ONLY: one output with the 3 tokens
    assert engine.core.runner.scheduled[1] == ["a"]  # planned before step 0's token arrived


def test_extra_eos_ids_stop_generation_and_ignore_eos_does_not():
    """An id of the model's generation config (besides the primary EOS) ends a request, with
    that id as stop_reason (vLLM's semantics); ignore_eos lets it run on."""
    ids = CharTokenizer().encode("abc")
    gen = expected_tokens(ids, 6)
    stop_at = gen[3]
    engine = LLMEngine(fake_parts(extra_eos=(stop_at,)))
    done = run_all(engine, {"a": ("abc", SamplingParams(max_tokens=6, temperature=0.0)),
                            "b": ("abc", SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))})
    (toks, _, finish, reason), = done["a"]
    assert toks == gen[: gen.index(stop_at) + 1] and finish == "stop" and reason == stop_at
    (toks, _, finish, _), = done["b"]
    assert toks == gen and finish == "length"


def test_stop_string_finishes_the_request_in_the_core_too():
    engine = LLMEngine(fake_parts())
    ids = CharTokenizer().encode("xyz")
    text = CharTokenizer().decode(expected_tokens(ids, 10))
    stop = text[4:6]
    done = run_all(engine, {"a": ("xyz", SamplingParams(max_tokens=10, stop=[stop], temperature=0.0))})
    (toks, out_text, finish, reason), = done["a"]
    assert (out_text, finish, reason) == (text[: text.index(stop)], "stop", stop)
    assert not engine.scheduler.requests  # aborted in the core once the stop string showed


def test_validation_happens_before_anything_is_queued():
    engine = LLMEngine(fake_parts(max_model_len=32))
    with pytest.raises(ValueError, match="context length"):
        engine.add_request("a", "x" * 40, SamplingParams(max_tokens=4))
    with pytest.raises(ValueError, match="max_tokens"):
        engine.add_request("a", "x" * 20, SamplingParams(max_tokens=20))
    with pytest.raises(ValueError, match="logprobs"):
        engine.add_request("a", "hi", SamplingParams(logprobs=6))
    assert not engine.has_unfinished_requests() and not engine.output_processor.has("a")
    engine.add_request("a", "hi", SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("a", "hi", SamplingParams(max_tokens=2))


# ---------------------------------------------------------------------------- the server's engine
@pytest.fixture()
def served():
    parts = fake_parts()
    engine = AsyncEngineClient.in_thread(parts)
    with TestClient(build_app(engine, ServerConfig(shutdown_grace=1, enable_sleep_mode=True))) as client:
        yield parts, engine, client


def test_a_multi_prompt_completion_is_scheduled_in_one_step(served):
    parts, _, client = served
    r = client.post("/v1/completions", json={"prompt": ["one", "two", "three", "four"], "max_tokens": 3,
                                              "temperature": 0})
    assert r.status_code == 200, r.text
    assert [c["index"] for c in r.json()["choices"]] == [0, 1, 2, 3]
    first = parts.core.runner.scheduled[0]
    assert len(first) == 4  # all four prompts in the first step
    # A bad prompt among them: 400, and nothing of the request is queued.
    r = client.post("/v1/completions", json={"prompt": ["ok", "x" * 500], "max_tokens": 3})
    assert r.status_code == 400 and "context length" in r.json()["error"]["message"]
    assert len(parts.core.runner.scheduled) == 3  # no step ran for it


def test_detokenizing_runs_off_the_engine_thread(served):
    parts, _, client = served
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                   "max_tokens": 5, "temperature": 0, "stream": True})
    assert r.status_code == 200
    assert parts.tokenizer.decode_threads and "jaxserve-engine" not in parts.tokenizer.decode_threads


def test_commands_reach_the_engine_thread(served):
    parts, engine, client = served
    assert client.post("/v1/completions", json={"prompt": "abc", "max_tokens": 2}).status_code == 200
    assert client.post("/reset_prefix_cache").status_code == 200
    assert client.get("/is_sleeping").json() == {"is_sleeping": False}
    assert client.post("/sleep").status_code == 200
    assert client.get("/is_sleeping").json() == {"is_sleeping": True}
    r = client.post("/v1/completions", json={"prompt": "abc", "max_tokens": 2})
    assert r.status_code == 503 and "sleeping" in r.json()["error"]["message"]
    assert client.post("/sleep?level=2").status_code == 400
    assert client.post("/wake_up").status_code == 200
    assert client.post("/v1/completions", json={"prompt": "abc", "max_tokens": 2}).status_code == 200
    metrics = client.get("/metrics").text
    assert "jaxserve:engine_steps_total" in metrics and "vllm:engine_sleep_state" in metrics


def test_engine_death_fails_requests_and_health(served):
    parts, _, client = served
    assert client.get("/health").status_code == 200
    parts.core.runner.explode = True
    with client.stream("POST", "/v1/chat/completions",
                       json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "stream": True}) as s:
        assert s.status_code == 200
        lines = [ln for ln in s.iter_lines() if ln.startswith("data: ")]
    assert lines[-1] == "data: [DONE]" and '"code":500' in lines[-2].replace(" ", "")
    assert client.get("/health").status_code == 503
    r = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 3})
    assert r.status_code == 503 and r.json()["error"]["type"] == "ServiceUnavailableError"


def test_stop_token_eos_is_not_in_the_text(served):
    _, _, client = served
    r = client.post("/v1/completions", json={"prompt": "abc", "max_tokens": 4, "temperature": 0,
                                              "logprobs": 2, "echo": False})
    body = r.json()
    assert r.status_code == 200 and len(body["choices"][0]["logprobs"]["tokens"]) == 4
    assert body["usage"]["completion_tokens"] == 4 and EOS == 0


def test_detokenize_false_returns_token_ids_only():
    engine = LLMEngine(fake_parts())
    done = run_all(engine, {"a": ("abc", SamplingParams(max_tokens=4, temperature=0.0, detokenize=False))})
    (toks, text, finish, _), = done["a"]
    assert len(toks) == 4 and text == "" and finish == "length"
    with pytest.raises(ValueError, match="detokenize"):
        SamplingParams(stop=["x"], detokenize=False)


ENDINGS = ["length", "stop_token", "extra_eos", "stop_string", "abort_after_prompt"]


@pytest.mark.parametrize("async_scheduling", [True, False], ids=["overlapped", "plain"])
@pytest.mark.parametrize("budget", [64, 4], ids=["whole", "chunked"])
@pytest.mark.parametrize("ending", ENDINGS)
def test_prompt_logprobs_reach_the_client_however_the_request_ends(ending, budget, async_scheduling):
    """Every prompt position's log-prob reaches the output, also when the request ends in the
    step that ends its prompt (max_tokens=1, a stop token or EOS as the first token, a stop
    string in the first token) or is aborted after its prompt, whole or in chunks."""
    prompt = "The capital of France"
    ids = CharTokenizer().encode(prompt)
    first = expected_tokens(ids, 1)[0]
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
    extra_eos = ()
    if ending == "stop_token":
        params = params.clone(max_tokens=8, stop_token_ids=[first])
    elif ending == "extra_eos":
        params, extra_eos = params.clone(max_tokens=8), (first,)
    elif ending == "stop_string":
        params = params.clone(max_tokens=8, stop=[CharTokenizer().decode([first])])
    elif ending == "abort_after_prompt":
        params = params.clone(max_tokens=8)
    engine = LLMEngine(fake_parts(async_scheduling=async_scheduling, budget=budget, extra_eos=extra_eos))
    engine.add_request("a", prompt, params)
    final = None
    while final is None:
        outs = engine.step()
        final = next((o for o in outs if o.finished), None)
        if ending == "abort_after_prompt" and engine.core.scheduler.get_request("a").num_output_tokens:
            (final,) = engine.abort_request("a")
    assert final.outputs[0].finish_reason == {"length": "length", "abort_after_prompt": "abort"}.get(ending, "stop")
    plp = final.prompt_logprobs
    assert plp[0] is None and len(plp) == len(ids)
    for pos in range(1, len(ids)):
        assert list(plp[pos]) == [ids[pos]], pos  # prompt_logprobs=0: the prompt token alone
        assert plp[pos][ids[pos]].logprob == pytest.approx(prompt_logprob(pos)), pos
