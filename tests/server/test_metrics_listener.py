"""ServerMetrics as the output processor's listener, fed DELTA outputs by hand (no engine): what
each vLLM series counts per request and per sample, and that requests the engine failed (never
reported finished) do not accumulate."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from jaxserve.outputs import CompletionOutput, RequestMetrics, RequestOutput
from jaxserve.server import metrics as metrics_module
from jaxserve.server.metrics import ServerMetrics, request_tokens_buckets


def _samples(m: ServerMetrics) -> dict[tuple[str, tuple], float]:
    out = {}
    for family in text_string_to_metric_families(m.render().decode()):
        for s in family.samples:
            extra = tuple(sorted((k, v) for k, v in s.labels.items() if k not in ("model_name", "engine")))
            assert s.labels.get("model_name") == "m" and s.labels.get("engine") == "0"
            out[(s.name, extra)] = s.value
    return out


def _out(rid: str, deltas: dict[int, int], finish: dict[int, str] | None = None, *, prompt: int = 10,
         cached: int = 0, metrics: RequestMetrics | None = None) -> RequestOutput:
    finish = finish or {}
    outs = [CompletionOutput(i, "x" * n, list(range(n)), finish_reason=finish.get(i)) for i, n in deltas.items()]
    return RequestOutput(rid, None, list(range(prompt)), outs, finished=bool(finish), num_cached_tokens=cached,
                         metrics=metrics)


def test_request_tokens_buckets_are_vllms():
    assert request_tokens_buckets(100) == [1, 2, 5, 10, 20, 50, 100]
    assert request_tokens_buckets(2048) == [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000]


def test_counts_per_sample_and_timings_per_request():
    m = ServerMetrics("m", max_model_len=2048)
    t = RequestMetrics(arrival_time=100.0, first_scheduled_time=100.5, first_token_time=101.0,
                       last_token_time=104.0, finished_time=104.0)
    # n = 2, prompt of 10 tokens of which 4 cached: sample 0 makes 1 + 3 tokens, sample 1 makes 1 + 1
    m.on_output(_out("a", {0: 1, 1: 1}, cached=4, metrics=t))
    m.on_output(_out("a", {0: 3}, cached=4, metrics=t))
    last = _out("a", {1: 1, 0: 0}, {0: "length", 1: "stop"}, cached=4, metrics=t)
    m.on_output(last)
    m.on_finished(last, e2e_seconds=4.0)
    s = _samples(m)
    assert s[("vllm:generation_tokens_total", ())] == 6
    assert s[("vllm:prompt_tokens_total", ())] == 20  # per sample, as vLLM's child requests
    assert s[("vllm:prompt_tokens_cached_total", ())] == 8
    assert s[("vllm:prompt_tokens_by_source_total", (("source", "local_compute"),))] == 12
    assert s[("vllm:prompt_tokens_by_source_total", (("source", "local_cache_hit"),))] == 8
    assert s[("vllm:request_success_total", (("finished_reason", "length"),))] == 1
    assert s[("vllm:request_success_total", (("finished_reason", "stop"),))] == 1
    assert s[("vllm:request_generation_tokens_count", ())] == 2
    assert s[("vllm:request_generation_tokens_sum", ())] == 6
    assert s[("vllm:request_generation_tokens_bucket", (("le", "2.0"),))] == 1
    assert s[("vllm:request_prompt_tokens_sum", ())] == 20
    assert s[("vllm:request_prefill_kv_computed_tokens_sum", ())] == 12
    assert s[("vllm:request_max_num_generation_tokens_sum", ())] == 4
    assert s[("vllm:request_params_n_sum", ())] == 2
    assert s[("vllm:request_params_n_bucket", (("le", "1.0"),))] == 0
    assert s[("vllm:e2e_request_latency_seconds_sum", ())] == 4.0
    assert s[("vllm:request_prefill_time_seconds_sum", ())] == 0.5
    assert s[("vllm:request_decode_time_seconds_sum", ())] == 3.0
    assert s[("vllm:request_inference_time_seconds_sum", ())] == 3.5
    assert s[("vllm:request_time_per_output_token_seconds_sum", ())] == 1.0  # 3 s over 4 - 1 tokens
    assert m._generated == {}


def test_an_abort_before_any_token_counts_no_prompt_and_no_phases():
    m = ServerMetrics("m", max_model_len=2048)
    out = _out("b", {0: 0}, {0: "abort"}, metrics=RequestMetrics(arrival_time=1.0))
    m.on_output(out)
    m.on_finished(out, e2e_seconds=0.2)
    s = _samples(m)
    assert s[("vllm:request_success_total", (("finished_reason", "abort"),))] == 1
    assert s[("vllm:prompt_tokens_total", ())] == 0
    assert s[("vllm:e2e_request_latency_seconds_count", ())] == 1
    assert s[("vllm:request_prefill_time_seconds_count", ())] == 0
    assert s[("vllm:request_generation_tokens_sum", ())] == 0


def test_requests_never_finished_do_not_accumulate(monkeypatch):
    monkeypatch.setattr(metrics_module, "MAX_TRACKED_REQUESTS", 3)
    m = ServerMetrics("m", max_model_len=2048)
    for i in range(10):  # outputs, then the engine failed them: on_finished never comes
        m.on_output(_out(f"r{i}", {0: 1}))
    assert list(m._generated) == ["r7", "r8", "r9"]
