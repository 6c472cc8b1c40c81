"""/metrics under vLLM's names, types, buckets and labels (vLLM 0.32's vllm/v1/metrics/loggers.py),
read by vLLM's own example Grafana dashboard: every PromQL expression of it is evaluated over two
scrapes of the live server taken around a few requests (tests/server/promql.py)."""

from __future__ import annotations

import math
import pathlib
import time

import pytest

from tests.server.conftest import MODEL
from tests.server.promql import Evaluator, Scrape

pytestmark = pytest.mark.slow

DASHBOARD = pathlib.Path(__file__).parent / "data" / "vllm_grafana_exprs.txt"
EXPRESSIONS = [line for line in DASHBOARD.read_text().splitlines() if line.strip() and not line.startswith("#")]
VARIABLES = {"$model_name": MODEL, "$__rate_interval": "1m"}

# vLLM 0.32's series that jaxserve fills (docs/metrics.md lists the others and why not), by type;
# the speculative-decoding counters are declared only with --speculative-config, as in vLLM
# (tests/server/test_spec_decode_server.py).
VLLM_SERIES = {
    "gauge": ["num_requests_running", "num_requests_waiting", "num_requests_waiting_by_reason",
              "engine_sleep_state", "kv_cache_usage_perc", "lora_requests_info"],
    "counter": ["prefix_cache_queries", "prefix_cache_hits", "external_prefix_cache_queries",
                "external_prefix_cache_hits", "mm_cache_queries", "mm_cache_hits", "num_preemptions",
                "prompt_tokens", "prompt_tokens_by_source", "prompt_tokens_cached",
                "prompt_tokens_cached_by_source", "generation_tokens", "request_success", "admission_rejections"],
    "histogram": ["request_prompt_tokens", "request_generation_tokens", "request_max_num_generation_tokens",
                  "request_params_n", "time_to_first_token_seconds", "inter_token_latency_seconds",
                  "request_time_per_output_token_seconds", "e2e_request_latency_seconds",
                  "request_queue_time_seconds", "request_inference_time_seconds", "request_prefill_time_seconds",
                  "request_decode_time_seconds", "request_prefill_kv_computed_tokens"],
}
# vLLM's bucket boundaries (vllm/v1/metrics/buckets.py)
TTFT = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
        80.0, 160.0, 640.0, 2560.0]
ITL = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0]
LATENCY = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0,
           960.0, 1920.0, 7680.0]
TOKENS_2048 = [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000]  # build_1_2_5_buckets(max_model_len=2048)
BUCKETS = {"time_to_first_token_seconds": TTFT, "inter_token_latency_seconds": ITL,
           "request_time_per_output_token_seconds": ITL, "e2e_request_latency_seconds": LATENCY,
           "request_queue_time_seconds": LATENCY, "request_inference_time_seconds": LATENCY,
           "request_prefill_time_seconds": LATENCY, "request_decode_time_seconds": LATENCY,
           "request_prompt_tokens": TOKENS_2048, "request_generation_tokens": TOKENS_2048,
           "request_max_num_generation_tokens": TOKENS_2048, "request_prefill_kv_computed_tokens": TOKENS_2048,
           "request_params_n": [1, 2, 5, 10, 20]}


def _scrape(http) -> Scrape:
    return Scrape.parse(http.get("/metrics").text, time.monotonic())


def _wait_idle(http) -> None:
    deadline = time.monotonic() + 120
    while True:
        s = _scrape(http)
        busy = [v for name in ("vllm:num_requests_running", "vllm:num_requests_waiting") for _, v in s.samples[name]]
        if not any(busy):
            return
        assert time.monotonic() < deadline, "the engine did not become idle"
        time.sleep(0.05)


def test_grafana_dashboard_expressions(client, http):
    _wait_idle(http)
    before = _scrape(http)
    # Work for every panel: requests cut by max_tokens (several tokens each: inter-token
    # latencies), streamed and not, chat and completions, and a prefix-cache hit.
    prompt = "The capital of France is Paris. " * 8  # several full KV blocks: the second one hits
    for _ in range(2):
        client.completions.create(model=MODEL, prompt=prompt, max_tokens=5, temperature=0,
                                  extra_body={"ignore_eos": True})
    stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                            max_tokens=4, temperature=0, stream=True,
                                            extra_body={"ignore_eos": True})
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=3, temperature=1, seed=1, n=2,
                              extra_body={"ignore_eos": True})
    _wait_idle(http)
    after = _scrape(http)
    assert after.time > before.time

    ev = Evaluator(before, after, VARIABLES)
    for expr in EXPRESSIONS:
        vec = ev.evaluate(expr)
        assert vec, f"no series: {expr}"
        assert all(math.isfinite(v) for v in vec.values()), (expr, vec)
    assert len(EXPRESSIONS) == 27
    referenced = {name for name, _ in ev.selectors}
    assert referenced and all(n.startswith("vllm:") for n in referenced), referenced

    # the figures say what happened between the scrapes
    def one(expr: str) -> dict[str, float]:
        return {",".join(v for _, v in sorted(k)): x for k, x in ev.evaluate(expr).items()}

    finished = one('sum by(finished_reason) (increase(vllm:request_success_total{model_name="$model_name"}[1m]))')
    assert finished["length"] == 5 and finished["abort"] == 0  # 2 completions, the chat, 2 samples (n = 2)
    lengths = one('sum by(le) (increase(vllm:request_generation_tokens_bucket{model_name="$model_name"}[1m]))')
    assert (lengths["2.0"], lengths["5.0"]) == (0, 5)  # 5, 5, 4, 3, 3 tokens
    assert one('increase(vllm:generation_tokens_total{model_name="$model_name"}[1m])')[f"0,{MODEL}"] == 20
    assert one('sum by(le) (increase(vllm:request_params_n_bucket{model_name="$model_name"}[1m]))')["1.0"] == 3
    assert one('sum(increase(vllm:request_max_num_generation_tokens_sum{model_name="$model_name"}[1m]))')[""] == 17
    p50 = one('histogram_quantile(0.5, sum by(le) (rate(vllm:time_to_first_token_seconds_bucket'
              '{model_name="$model_name"}[1m])))')[""]
    assert 0 < p50 <= 2560
    hits = one('increase(vllm:prefix_cache_hits_total{model_name="$model_name"}[1m])')[f"0,{MODEL}"]
    cached = one('increase(vllm:prompt_tokens_cached_total{model_name="$model_name"}[1m])')[f"0,{MODEL}"]
    assert hits > 0 and cached > 0  # the second identical prompt

    # Grafana's template variable: label_values(model_name)
    names = {labels["model_name"] for name, rows in after.samples.items() if name.startswith("vllm:")
             for labels, _ in rows if "model_name" in labels}
    assert names == {MODEL}


def test_series_types_buckets_and_labels(http):
    text = http.get("/metrics").text
    from prometheus_client.parser import text_string_to_metric_families

    # (prometheus_client writes each counter's and histogram's creation time as a gauge family
    # `<name>_created`, in vLLM's /metrics as here: left out)
    parsed = {f.name: f for f in text_string_to_metric_families(text)}
    families = {n: f for n, f in parsed.items() if not (n.endswith("_created") and n.removesuffix("_created") in parsed)}
    for kind, names in VLLM_SERIES.items():
        for name in names:
            assert f"vllm:{name}" in families, f"vllm:{name} missing"
            assert families[f"vllm:{name}"].type == kind, (name, families[f"vllm:{name}"].type)
    served = {n for n in families if n.startswith("vllm:")}
    assert served == {f"vllm:{n}" for names in VLLM_SERIES.values() for n in names}  # no name of our own
    assert all(n.startswith(("vllm:", "jaxserve:")) for n in families), sorted(families)
    assert {"jaxserve:recompiles", "jaxserve:compiles", "jaxserve:compile_seconds", "jaxserve:engine_steps",
            "jaxserve:num_free_kv_blocks"} <= set(families)

    for name in served:
        for sample in families[name].samples:
            if name == "vllm:lora_requests_info":  # vLLM's labels for it, values before LoRA exists
                assert sample.labels == {"max_lora": "0", "waiting_lora_adapters": "", "running_lora_adapters": ""}
            elif name == "vllm:admission_rejections":  # vLLM labels it without the engine
                assert set(sample.labels) == {"model_name", "reason"} and sample.labels["model_name"] == MODEL
            else:
                assert sample.labels["model_name"] == MODEL and sample.labels["engine"] == "0", sample
    for name, bounds in BUCKETS.items():
        les = [s.labels["le"] for s in families[f"vllm:{name}"].samples if s.name.endswith("_bucket")]
        assert [float(x) for x in les] == [*bounds, math.inf], name
    reasons = {s.labels["finished_reason"] for s in families["vllm:request_success"].samples}
    assert {"stop", "length", "abort"} <= reasons
    sleep = {s.labels["sleep_state"]: s.value for s in families["vllm:engine_sleep_state"].samples}
    assert sleep == {"awake": 1.0, "weights_offloaded": 0.0, "discard_all": 0.0}
    sources = {s.labels["source"] for s in families["vllm:prompt_tokens_by_source"].samples if s.name.endswith("_total")}
    assert sources == {"local_compute", "local_cache_hit", "external_kv_transfer"}
