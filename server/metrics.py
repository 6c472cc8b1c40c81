"""Prometheus metrics under vLLM's names, types, buckets and labels; one CollectorRegistry per app.

Every series vLLM's server has (vLLM 0.32, `vllm/v1/metrics/loggers.py`) that jaxserve can
fill is served as `vllm:<name>` with the labels `model_name` and `engine` ("0": one engine
core), so vLLM's dashboards, autoscaling recipes and load-aware routers read jaxserve
unchanged; series vLLM does not have (compilations, the engine's health, free KV blocks) are
`jaxserve:<name>`. docs/metrics.md maps each vLLM series to its source here, or says why it is
not filled.

Gauges and engine-cumulative counters are read from the engine's latest stats snapshot at scrape
time (metrics_engine.EngineCollector); per-request series are fed by the output processor, on the
event loop, through the StatsListener interface (this module).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

from jaxserve.engine.client import EngineClient, StatsListener
from jaxserve.outputs import RequestOutput
from jaxserve.server.metrics_engine import ENGINE_INDEX, LABELS, EngineCollector

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# vLLM's bucket families (vllm/v1/metrics/buckets.py), their default boundaries.
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                           60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
TIME_TO_FIRST_TOKEN_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                               2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
INTER_TOKEN_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
                               2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
REQUEST_PARAMS_N_BUCKETS = (1, 2, 5, 10, 20)
# finish reasons jaxserve produces (vLLM also has "error" and "repetition": see docs/metrics.md)
FINISH_REASONS = ("stop", "length", "abort")
# Requests whose outputs are being counted, at most (the oldest are forgotten past it): a
# request the engine failed is never reported finished, so its entry would otherwise stay.
MAX_TRACKED_REQUESTS = 65536


def request_tokens_buckets(max_model_len: int) -> list[int]:
    """vLLM's `build_1_2_5_buckets(max_model_len)`: 1, 2, 5, 10, 20, 50, ... up to the context."""
    out, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_model_len:
                return out
            out.append(m * scale)
        scale *= 10


class ServerMetrics(StatsListener):
    def __init__(self, model_name: str, max_model_len: int):
        self.model_name = model_name
        self.registry = CollectorRegistry(auto_describe=True)
        values = (model_name, ENGINE_INDEX)
        token_buckets = request_tokens_buckets(max_model_len)

        def counter(name: str, doc: str) -> Counter:
            return Counter(f"vllm:{name}", doc, LABELS, registry=self.registry).labels(*values)

        def histogram(name: str, doc: str, buckets) -> Histogram:
            return Histogram(f"vllm:{name}", doc, LABELS, buckets=buckets, registry=self.registry).labels(*values)

        self.prompt_tokens = counter("prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = counter("generation_tokens", "Number of generation tokens processed.")
        self.prompt_tokens_cached = counter("prompt_tokens_cached",
                                            "Number of cached prompt tokens (local + external).")
        by_source = Counter("vllm:prompt_tokens_by_source", "Number of prompt tokens by source.",
                            [*LABELS, "source"], registry=self.registry)
        self.prompt_computed = by_source.labels(*values, "local_compute")
        self.prompt_cache_hit = by_source.labels(*values, "local_cache_hit")
        by_source.labels(*values, "external_kv_transfer")  # no KV connector: stays 0
        self.request_success = Counter("vllm:request_success", "Count of successfully processed requests.",
                                       [*LABELS, "finished_reason"], registry=self.registry)
        for reason in FINISH_REASONS:
            self.request_success.labels(*values, reason)
        self.request_prompt_tokens = histogram("request_prompt_tokens", "Number of prefill tokens processed.",
                                               token_buckets)
        self.request_generation_tokens = histogram("request_generation_tokens",
                                                   "Number of generation tokens processed.", token_buckets)
        self.request_prefill_kv_computed = histogram(
            "request_prefill_kv_computed_tokens",
            "Histogram of new KV tokens computed during prefill (excluding cached tokens).", token_buckets)
        self.max_generation_tokens = histogram("request_max_num_generation_tokens",
                                               "Histogram of maximum number of requested generation tokens.",
                                               token_buckets)
        self.params_n = histogram("request_params_n", "Histogram of the n request parameter.",
                                  REQUEST_PARAMS_N_BUCKETS)
        self.ttft = histogram("time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                              TIME_TO_FIRST_TOKEN_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                             INTER_TOKEN_LATENCY_BUCKETS)
        self.tpot = histogram("request_time_per_output_token_seconds",
                              "Histogram of time_per_output_token_seconds per request.",
                              INTER_TOKEN_LATENCY_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
                             REQUEST_LATENCY_BUCKETS)
        self.queue = histogram("request_queue_time_seconds",
                               "Histogram of time spent in WAITING phase for request.", REQUEST_LATENCY_BUCKETS)
        self.inference = histogram("request_inference_time_seconds",
                                   "Histogram of time spent in RUNNING phase for request.", REQUEST_LATENCY_BUCKETS)
        self.prefill = histogram("request_prefill_time_seconds",
                                 "Histogram of time spent in PREFILL phase for request.", REQUEST_LATENCY_BUCKETS)
        self.decode = histogram("request_decode_time_seconds",
                                "Histogram of time spent in DECODE phase for request.", REQUEST_LATENCY_BUCKETS)
        # request id -> {sample index: tokens generated so far}, while the request runs
        self._generated: dict[str, dict[int, int]] = {}

    def attach(self, engine: EngineClient) -> None:
        self.registry.register(EngineCollector(engine, self.model_name))

    # StatsListener (called by the output processor, on the event loop). The server's outputs
    # are DELTA ones: each carries only the tokens that are new since the last.
    def on_scheduled(self, queue_seconds: float) -> None:
        self.queue.observe(queue_seconds)

    def on_first_token(self, ttft_seconds: float) -> None:
        self.ttft.observe(ttft_seconds)

    def on_tokens(self, itl_seconds: float) -> None:
        self.itl.observe(itl_seconds)

    def on_output(self, out: RequestOutput) -> None:
        generated = self._generated.get(out.request_id)
        if generated is None:
            if len(self._generated) >= MAX_TRACKED_REQUESTS:
                del self._generated[next(iter(self._generated))]
            generated = self._generated[out.request_id] = {}
        total = 0
        for o in out.outputs:
            n = len(o.token_ids)
            before = generated.get(o.index, 0)
            generated[o.index] = before + n
            total += n
            if n and not before:  # this sample's prompt is prefilled: counted as vLLM does, per sample
                self._count_prompt(out)
            if o.finish_reason is not None:
                self.request_success.labels(self.model_name, ENGINE_INDEX, o.finish_reason).inc()
        if total:
            self.generation_tokens.inc(total)

    def _count_prompt(self, out: RequestOutput) -> None:
        prompt = len(out.prompt_token_ids)
        cached = min(out.num_cached_tokens, prompt)
        self.prompt_tokens.inc(prompt)
        self.prompt_tokens_cached.inc(cached)
        self.prompt_cache_hit.inc(cached)
        self.prompt_computed.inc(prompt - cached)

    def on_finished(self, out: RequestOutput, e2e_seconds: float) -> None:
        generated = self._generated.pop(out.request_id, None) or {o.index: len(o.token_ids) for o in out.outputs}
        prompt = len(out.prompt_token_ids)
        for tokens in generated.values():  # per sample, as vLLM counts its child requests
            self.request_prompt_tokens.observe(prompt)
            self.request_generation_tokens.observe(tokens)
            self.request_prefill_kv_computed.observe(prompt - min(out.num_cached_tokens, prompt))
        most = max(generated.values(), default=0)
        self.max_generation_tokens.observe(most)
        self.params_n.observe(max(1, len(generated)))
        self.e2e.observe(e2e_seconds)
        m = out.metrics
        if m is None or m.first_scheduled_time is None or m.first_token_time is None:
            return  # never scheduled, or no token: no prefill or decode phase to time
        last = m.last_token_time if m.last_token_time is not None else m.first_token_time
        self.prefill.observe(max(0.0, m.first_token_time - m.first_scheduled_time))
        self.decode.observe(max(0.0, last - m.first_token_time))
        self.inference.observe(max(0.0, last - m.first_scheduled_time))
        self.tpot.observe((last - m.first_token_time) / (most - 1) if most > 1 else 0.0)

    def render(self) -> bytes:
        return generate_latest(self.registry)
