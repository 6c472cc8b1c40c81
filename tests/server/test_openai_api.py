"""The OpenAI-compatible server through the real `openai` SDK (and httpx for raw HTTP details),
against one live uvicorn server on the default model (see conftest.py)."""

from __future__ import annotations

import asyncio
import json
import re
import socket
import time

import httpx
import openai
import pytest

from tests.server.conftest import API_KEY, MODEL

pytestmark = pytest.mark.slow

PROMPT = "The capital of France is"
CHAT = [{"role": "user", "content": "What is the capital of France?"}]


def _metric(text: str, name: str) -> float:
    """A series by its full name (vLLM's `vllm:...`, or jaxserve's own `jaxserve:...`)."""
    m = re.search(rf'^{name}\{{[^}}]*model_name="{MODEL}"[^}}]*\}} (\S+)$', text, re.MULTILINE)
    assert m, f"{name} with model_name label not in /metrics"
    return float(m.group(1))


def _wait_idle(http: httpx.Client, timeout: float = 120.0) -> str:
    """Wait until no request runs or waits (bounded; the requests under test would take far longer)."""
    deadline = time.monotonic() + timeout
    while True:
        text = http.get("/metrics").text
        if _metric(text, "vllm:num_requests_running") == 0 and _metric(text, "vllm:num_requests_waiting") == 0:
            return text
        assert time.monotonic() < deadline, "the engine did not become idle"
        time.sleep(0.1)


# ---------------------------------------------------------------------------- plain endpoints
def test_models_health_version(client, http):
    models = client.models.list()
    ids = [m.id for m in models.data]
    assert ids == [MODEL, "alias"]
    raw = http.get("/v1/models").json()
    assert raw["object"] == "list"
    card = raw["data"][0]
    assert {"id", "object", "created", "owned_by", "root", "max_model_len"} <= set(card)
    assert card["object"] == "model" and card["max_model_len"] == 2048
    h = http.get("/health")
    assert h.status_code == 200 and h.content == b""
    assert http.get("/version").json()["version"]


def test_tokenize_detokenize_info(http):
    r = http.post("/tokenize", json={"prompt": "Hello world"}).json()
    assert r["count"] == len(r["tokens"]) > 0 and r["max_model_len"] == 2048
    back = http.post("/detokenize", json={"tokens": r["tokens"]}).json()
    assert back["prompt"].endswith("Hello world")
    chat = http.post("/tokenize", json={"messages": CHAT}).json()
    assert chat["tokens"][0] == 1 and chat["count"] > r["count"]
    info = http.get("/tokenizer_info").json()
    assert info["eos_token"] == "<|im_end|>" and "chat_template" in info and info["chat_template"]
    assert http.post("/detokenize", json={"tokens": [10**9]}).status_code == 400


# ---------------------------------------------------------------------------- completions
def test_completion_greedy_and_stream_agree(client):
    full = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0)
    assert full.object == "text_completion" and full.id.startswith("cmpl-")
    assert len(full.choices) == 1 and full.choices[0].finish_reason in ("stop", "length")
    assert full.usage.completion_tokens <= 8 and full.usage.total_tokens == full.usage.prompt_tokens + full.usage.completion_tokens
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full.choices[0].text
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == full.choices[0].finish_reason and all(f is None for f in finishes[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert all(c.usage is None for c in chunks[:-1])


def test_completion_token_ids_batch_and_n(client, http):
    ids = http.post("/tokenize", json={"prompt": PROMPT}).json()["tokens"]
    a = client.completions.create(model=MODEL, prompt=ids, max_tokens=5, temperature=0)
    b = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0)
    assert a.choices[0].text == b.choices[0].text
    r = client.completions.create(model="alias", prompt=[PROMPT, "Once upon a time"], n=2, max_tokens=4,
                                  temperature=1.0, seed=7)
    assert r.model == "alias"
    assert sorted(c.index for c in r.choices) == [0, 1, 2, 3]
    n_prompt = len(ids) + http.post("/tokenize", json={"prompt": "Once upon a time"}).json()["count"]
    assert r.usage.prompt_tokens == n_prompt
    assert 0 < r.usage.completion_tokens <= 16
    r2 = client.completions.create(model=MODEL, prompt=[ids, ids[:3]], max_tokens=3, temperature=0)
    assert [c.index for c in r2.choices] == [0, 1]


def test_completion_logprobs_and_echo(client):
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0, logprobs=2)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == r.usage.completion_tokens
    for tok, val, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert tok in top and top[tok] == pytest.approx(val) and 2 <= len(top) <= 3
        assert val == max(top.values())  # greedy: the chosen token is the most likely
    assert "".join(lp.tokens) == r.choices[0].text
    e = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, temperature=0, logprobs=1, echo=True)
    c = e.choices[0]
    assert c.text.startswith(PROMPT)
    assert c.logprobs.token_logprobs[0] is None and c.logprobs.top_logprobs[0] is None
    assert len(c.logprobs.tokens) == e.usage.prompt_tokens + e.usage.completion_tokens
    assert c.logprobs.text_offset[0] == 0


def test_extra_body_vllm_fields(client):
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0.8, seed=1,
                                  extra_body={"ignore_eos": True, "min_tokens": 12, "top_k": 20, "min_p": 0.05,
                                              "repetition_penalty": 1.1, "skip_special_tokens": False,
                                              "unknown_field": 1},
                                  presence_penalty=0.5, frequency_penalty=0.5, logit_bias={"30": 5}, user="u")
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 12
    first = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0)
    # stop_token_ids: stop on whatever greedy produces first
    tok = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1, temperature=0, logprobs=0)
    assert tok.choices[0].text == first.choices[0].text[: len(tok.choices[0].text)]
    # a stop string cuts the text and is reported as stop_reason
    text = first.choices[0].text
    if len(text.strip()) > 1:
        stop = text.strip()[-1]
        s = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0, stop=[stop])
        assert s.choices[0].finish_reason == "stop" and getattr(s.choices[0], "stop_reason", None) == stop
        assert stop not in s.choices[0].text
    # allowed_token_ids: only those tokens can come out
    a = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0,
                                  extra_body={"allowed_token_ids": [30], "ignore_eos": True, "prompt_logprobs": 1})
    assert a.choices[0].text == "..."
    plp = getattr(a.choices[0], "prompt_logprobs", None)
    assert plp is not None and plp[0] is None and len(plp) == a.usage.prompt_tokens
    assert all(len(d) in (1, 2) for d in plp[1:])


def _golden_plp(case) -> list[float]:
    return case["prompt_logprobs"]  # position j >= 1 of the prompt: want[j - 1]


@pytest.mark.parametrize("k", [0, 1, 5])
def test_prompt_logprobs_with_max_tokens_1_match_golden(http, golden, k):
    """vLLM's prompt_logprobs at max_tokens=1 (the request ends in the step that ends its
    prompt): every position is there, the prompt token first (alone for k = 0), equal to
    transformers' log-probs; the 279-token case runs in chunks (the server's budget is 128)."""
    cases = golden["cases"]
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": [c["prompt_token_ids"] for c in cases],
                                           "max_tokens": 1, "temperature": 0, "prompt_logprobs": k})
    assert r.status_code == 200, r.text
    for case, choice in zip(cases, sorted(r.json()["choices"], key=lambda c: c["index"])):
        ids, plp, want = case["prompt_token_ids"], choice["prompt_logprobs"], _golden_plp(case)
        assert choice["finish_reason"] == "length" and plp[0] is None and len(plp) == len(ids)
        for j in range(1, len(ids)):
            entry = plp[j]
            assert list(entry)[0] == str(ids[j]) and len(entry) in (max(k, 1), k + 1), (case["name"], j, entry)
            assert entry[str(ids[j])]["logprob"] == pytest.approx(want[j - 1], abs=1e-3), (case["name"], j)


def test_echo_logprobs_with_max_tokens_1_match_golden(http, golden):
    """lm-eval's log-likelihood request (echo, logprobs=1, max_tokens=1): token_logprobs holds
    null and then every prompt token's log-prob, equal to transformers', then the new token's."""
    cases = golden["cases"]
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": [c["prompt_token_ids"] for c in cases],
                                           "max_tokens": 1, "temperature": 0, "logprobs": 1, "echo": True})
    assert r.status_code == 200, r.text
    for case, choice in zip(cases, sorted(r.json()["choices"], key=lambda c: c["index"])):
        lp, n = choice["logprobs"], len(case["prompt_token_ids"])
        assert len(lp["token_logprobs"]) == n + 1 and lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        assert lp["token_logprobs"][1:n] == pytest.approx(_golden_plp(case), abs=1e-3), case["name"]
        for tok, val, top in zip(lp["tokens"][1:], lp["token_logprobs"][1:], lp["top_logprobs"][1:]):
            assert top[tok] == pytest.approx(val) and 1 <= len(top) <= 2


def test_lm_eval_loglikelihood_request_replayed(http, golden, data_dir):
    """A request body recorded from lm-eval's `local-completions` model (loglikelihood: the
    context and continuation token ids batched, echo, logprobs 1, max_tokens 1), scored the
    way lm-eval scores it (the continuation's token log-probs summed, greedy if each is the
    top one): equal to transformers' log-likelihoods."""
    recorded = json.loads((data_dir / "lm_eval_loglikelihood.json").read_text())
    body = dict(recorded["body"], model=MODEL)
    r = http.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    choices = sorted(r.json()["choices"], key=lambda c: c["index"])
    assert len(choices) == len(body["prompt"]) == len(recorded["items"])
    by_ids = {tuple(c["prompt_token_ids"]): c for c in golden["cases"]}
    for choice, item, ids in zip(choices, recorded["items"], body["prompt"]):
        ctxlen = item["ctxlen"]
        token_lps = choice["logprobs"]["token_logprobs"][ctxlen:-1]  # as lm-eval parses it
        top = choice["logprobs"]["top_logprobs"][ctxlen:-1]
        loglikelihood = sum(token_lps)
        is_greedy = all(t == max(d.values()) for t, d in zip(token_lps, top))
        case = by_ids[tuple(ids)]
        want = sum(case["prompt_logprobs"][ctxlen - 1:])
        assert loglikelihood == pytest.approx(want, abs=1e-3 * len(token_lps)), case["name"]
        assert is_greedy == item["is_greedy"], case["name"]


# ---------------------------------------------------------------------------- chat
def test_chat_and_stream(client):
    full = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=10, temperature=0)
    assert full.object == "chat.completion" and full.choices[0].message.role == "assistant"
    assert full.choices[0].message.content
    parts = [{"role": "user", "content": [{"type": "text", "text": CHAT[0]["content"]}]}]
    same = client.chat.completions.create(model=MODEL, messages=parts, max_completion_tokens=10, temperature=0)
    assert same.choices[0].message.content == full.choices[0].message.content
    chunks = list(client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=10, temperature=0, stream=True,
                                                 stream_options={"include_usage": True}))
    assert chunks[0].object == "chat.completion.chunk"
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[0].choices[0].delta.content == ""
    body = [c for c in chunks if c.choices]
    assert all(c.choices[0].delta.role is None for c in body[1:])
    assert "".join(c.choices[0].delta.content or "" for c in body) == full.choices[0].message.content
    assert body[-1].choices[0].finish_reason == full.choices[0].finish_reason
    assert all(c.choices[0].finish_reason is None for c in body[:-1])
    assert len(body) == full.usage.completion_tokens + 1  # role chunk + one chunk per token step
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == full.usage.completion_tokens


def test_chat_default_max_tokens_and_logprobs(client):
    r = client.chat.completions.create(model=MODEL, messages=CHAT, temperature=0, logprobs=True, top_logprobs=3)
    c = r.choices[0]
    assert c.finish_reason == "stop"  # default max_tokens = rest of the context: EOS ends it
    content = c.logprobs.content
    assert len(content) == r.usage.completion_tokens
    for item in content:
        assert len(item.top_logprobs) == 3 and item.top_logprobs[0].logprob >= item.top_logprobs[-1].logprob
        assert item.token == item.top_logprobs[0].token and item.bytes == list(item.token.encode())


def test_golden_chat_cases(client, golden):
    cases = [c for c in golden["cases"] if "messages" in c]
    assert cases
    for case in cases:
        r = client.chat.completions.create(
            model=MODEL, messages=case["messages"], temperature=0, max_tokens=len(case["completion_token_ids"]),
            extra_body={"ignore_eos": True, "skip_special_tokens": False})
        assert r.usage.prompt_tokens == len(case["prompt_token_ids"]), case["name"]
        assert r.choices[0].message.content == case["completion_text"], case["name"]


# ---------------------------------------------------------------------------- errors
BAD = [
    dict(prompt=PROMPT, temperature=3.0),
    dict(prompt=PROMPT, top_p=0.0),
    dict(prompt=PROMPT, max_tokens=0),
    dict(prompt=PROMPT, max_tokens="many"),
    dict(prompt=PROMPT, frequency_penalty=5),
    dict(prompt=""),
    dict(prompt=[]),
    dict(prompt=PROMPT, n=2, temperature=0),
    dict(prompt=PROMPT, stream_options={"include_usage": True}),
    dict(prompt=PROMPT, stop=[""]),
    dict(prompt=PROMPT, max_tokens=5000),
    dict(prompt="hello " * 3000, max_tokens=1),
    dict(prompt=[10**9]),
    dict(prompt=PROMPT, logprobs=50),
    dict(prompt=PROMPT, logit_bias={"x": 1}),
    dict(prompt=PROMPT, extra_body={"top_k": -5}),
    dict(prompt=PROMPT, extra_body={"stop_token_ids": [10**9]}),
    dict(prompt=PROMPT, extra_body={"min_tokens": 10}, max_tokens=5),
]


@pytest.mark.parametrize("kwargs", BAD, ids=[str(i) for i in range(len(BAD))])
def test_completion_bad_requests(client, kwargs):
    kwargs = dict(kwargs)
    with pytest.raises(openai.BadRequestError) as ei:
        client.completions.create(model=MODEL, **kwargs)
    err = ei.value.body
    assert set(err) >= {"message", "type", "param", "code"} and err["code"] == 400 and err["message"]


def test_chat_bad_requests(client):
    for kw in (dict(messages=[]), dict(messages=CHAT, top_logprobs=3), dict(messages=CHAT, n=3, temperature=0),
               dict(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]),
               dict(messages=CHAT, max_completion_tokens=4000)):
        with pytest.raises(openai.BadRequestError):
            client.chat.completions.create(model=MODEL, **kw)


def test_unknown_model_and_auth(client, live_server):
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt=PROMPT, max_tokens=1)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=CHAT, max_tokens=1)
    bad = openai.OpenAI(base_url=live_server.base_url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    with pytest.raises(openai.AuthenticationError):
        bad.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1)
    r = httpx.get(live_server.base_url + "/v1/models", headers={"X-Request-Id": "abc"})
    assert r.status_code == 401 and r.headers["x-request-id"] == "abc" and r.json()["error"]["code"] == 401
    # /health and /metrics stay public (see test_fuzz.py for every other route)
    assert httpx.get(live_server.base_url + "/health").status_code == 200
    assert httpx.get(live_server.base_url + "/metrics").status_code == 200


def test_raw_http_errors(http):
    r = http.post("/v1/completions", content=b"{not json", headers={"Content-Type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["code"] == 400
    r = http.post("/v1/completions", json=[1, 2])
    assert r.status_code == 400
    r = http.post("/v1/chat/completions", json={"model": MODEL, "messages": "hi"})
    assert r.status_code == 400 and r.json()["error"]["type"] == "BadRequestError"
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": "x" * (2 << 20)})
    assert r.status_code in (400, 413) and "error" in r.json()
    r = http.get("/v1/nothing")
    assert r.status_code == 404 and "error" in r.json()
    assert http.get("/health").status_code == 200  # still alive after all that


# ---------------------------------------------------------------------------- disconnects, load
def test_disconnects_free_the_kv_cache(live_server, http):
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 1500, "temperature": 0, "ignore_eos": True}
    for _ in range(2):  # streaming: drop after two chunks
        with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            got = 0
            for line in lines:
                if line.startswith("data: "):
                    got += 1
                    if got == 2:
                        break
    # non-streaming: send the request on a raw socket, wait until it runs, then hang up
    payload = json.dumps({**body, "model": MODEL}).encode()
    raw = (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {API_KEY}\r\n"
           f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n\r\n").encode() + payload
    with socket.create_connection(("127.0.0.1", live_server.port)) as s:
        s.sendall(raw)
        deadline = time.monotonic() + 120
        while _metric(http.get("/metrics").text, "vllm:num_requests_running") == 0:
            assert time.monotonic() < deadline
            time.sleep(0.05)
    text = _wait_idle(http)
    assert _metric(text, "vllm:kv_cache_usage_perc") == 0.0
    assert _metric(text, "vllm:num_requests_running") == 0.0
    scheduler = live_server.engine.transport.core.scheduler
    assert live_server.engine.stats.scheduler.num_free_blocks == scheduler.make_stats().num_free_blocks
    # No leak: every block is free again (cached blocks stay evictable in the free queue).
    assert scheduler.kv.get_num_free_blocks() == scheduler.kv.num_blocks - 1
    assert all(b.ref_cnt == 0 for b in scheduler.kv.pool.blocks)


def test_64_concurrent_streams(live_server, http):
    prompts = ["The capital of France is", "Once upon a time", "def fib(n):", "Water boils at"]
    client = openai.OpenAI(base_url=live_server.base_url + "/v1", api_key=API_KEY, max_retries=0, timeout=300)
    ref = {p: client.completions.create(model=MODEL, prompt=p, max_tokens=6, temperature=0).choices[0].text
           for p in prompts}

    async def one(ac: openai.AsyncOpenAI, p: str) -> tuple[str, str, str | None]:
        stream = await ac.completions.create(model=MODEL, prompt=p, max_tokens=6, temperature=0, stream=True)
        text, finish = "", None
        async for chunk in stream:
            text += chunk.choices[0].text
            finish = chunk.choices[0].finish_reason or finish
        return p, text, finish

    async def run() -> list:
        # 64 at once pass the server's default waiting limit: the client retries the refused
        # ones after their Retry-After, as the SDK does by itself
        async with openai.AsyncOpenAI(base_url=live_server.base_url + "/v1", api_key=API_KEY, max_retries=20,
                                      timeout=600, http_client=None) as ac:
            return await asyncio.gather(*(one(ac, prompts[i % 4]) for i in range(64)))

    results = asyncio.run(run())
    assert len(results) == 64
    for p, text, finish in results:
        assert finish in ("stop", "length") and text == ref[p]
    text = _wait_idle(http)
    assert _metric(text, "jaxserve:recompiles_total") == 0
    assert _metric(text, "vllm:kv_cache_usage_perc") == 0.0


def test_metrics_series(http):
    # vLLM's names for what vLLM has (test_vllm_metrics.py checks them against vLLM's dashboard),
    # jaxserve's prefix for its own
    text = http.get("/metrics").text
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "prefix_cache_queries_total",
                 "prefix_cache_hits_total", "num_preemptions_total", "prompt_tokens_total",
                 "generation_tokens_total"):
        _metric(text, f"vllm:{name}")
    for name in ("compile_seconds_total", "recompiles_total", "num_free_kv_blocks"):
        _metric(text, f"jaxserve:{name}")
    assert "jaxserve:num_requests_running" not in text
    assert _metric(text, "vllm:generation_tokens_total") > 0
    for name in ("time_to_first_token_seconds", "inter_token_latency_seconds", "e2e_request_latency_seconds",
                 "request_queue_time_seconds"):
        assert _metric(text, f"vllm:{name}_count") > 0
    assert re.search(r'^vllm:request_success_total\{[^}]*finished_reason="length"[^}]*\} [1-9]', text,
                     re.MULTILINE)
