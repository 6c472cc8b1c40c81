"""Prometheus metrics (prefix `jaxserve:`, vLLM's meanings), one CollectorRegistry per app.

Gauges and engine-cumulative counters are read from the engine's latest stats snapshot at scrape
time (a custom collector); request histograms and token counters are fed by the output
processor, on the event loop, through the StatsListener interface.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from jaxserve.engine.output_processor import StatsListener
from jaxserve.outputs import RequestOutput
from jaxserve.server.async_engine import AsyncEngine

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                10.0, 20.0, 40.0, 80.0)
_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                    60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)


class _EngineCollector(Collector):
    def __init__(self, engine: AsyncEngine, model_name: str):
        self.engine = engine
        self.model_name = model_name

    def collect(self) -> Iterator:
        stats = self.engine.stats
        s = stats.scheduler
        labels = ["model_name"]
        value = [self.model_name]

        def gauge(name: str, doc: str, v: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(f"jaxserve:{name}", doc, labels=labels)
            g.add_metric(value, v)
            return g

        def counter(name: str, doc: str, v: float) -> CounterMetricFamily:
            c = CounterMetricFamily(f"jaxserve:{name}", doc, labels=labels)
            c.add_metric(value, v)
            return c

        yield gauge("num_requests_running", "Number of requests in model execution batches.", s.num_running)
        yield gauge("num_requests_waiting", "Number of requests waiting to be processed.", s.num_waiting)
        yield gauge("kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", s.kv_cache_usage)
        yield gauge("num_free_kv_blocks", "Number of free KV-cache blocks.", s.num_free_blocks)
        yield gauge("engine_healthy", "1 while the engine loop is alive.", 1.0 if self.engine.is_alive else 0.0)
        yield gauge("engine_sleeping", "1 while the engine sleeps (device memory freed).",
                    1.0 if stats.is_sleeping else 0.0)
        yield counter("prefix_cache_queries", "Prefix-cache queries, in tokens.", s.prefix_cache_queries)
        yield counter("prefix_cache_hits", "Prefix-cache hits, in tokens.", s.prefix_cache_hits)
        yield counter("num_preemptions", "Cumulative number of preemptions.", s.num_preemptions)
        yield counter("spec_decode_num_drafts", "Speculative decoding: request steps that fed drafts.",
                      s.spec_num_drafts)
        yield counter("spec_decode_num_draft_tokens", "Speculative decoding: draft tokens fed.",
                      s.spec_num_draft_tokens)
        yield counter("spec_decode_num_accepted_tokens", "Speculative decoding: draft tokens accepted.",
                      s.spec_num_accepted_tokens)
        yield counter("compile_seconds", "Seconds spent compiling step executables.", stats.compile_seconds)
        yield counter("recompiles", "Compilations after warm-up (should stay 0).", float(stats.recompiles))
        yield counter("compiles", "Step executables compiled, warm-up included.", float(stats.num_compiles))
        yield counter("engine_steps", "Engine steps run.", float(stats.num_steps))
        yield counter("requests_refused", "Requests refused (503) because the waiting queue was full.",
                      float(self.engine.num_refused))
        yield gauge("max_waiting_requests", "The waiting-queue limit, in sequences.",
                    float(self.engine.max_waiting_requests))


class ServerMetrics(StatsListener):
    def __init__(self, model_name: str):
        self.model_name = model_name
        self.registry = CollectorRegistry(auto_describe=True)
        r, lbl = self.registry, ["model_name"]
        self.prompt_tokens = Counter("jaxserve:prompt_tokens", "Prefill tokens processed.", lbl, registry=r)
        self.generation_tokens = Counter("jaxserve:generation_tokens", "Generation tokens processed.", lbl, registry=r)
        self.request_success = Counter("jaxserve:request_success", "Finished requests.",
                                       ["model_name", "finished_reason"], registry=r)
        self.ttft = Histogram("jaxserve:time_to_first_token_seconds", "Time to first token in seconds.",
                              lbl, buckets=_TTFT_BUCKETS, registry=r)
        self.itl = Histogram("jaxserve:inter_token_latency_seconds", "Inter-token latency in seconds.",
                             lbl, buckets=_ITL_BUCKETS, registry=r)
        self.e2e = Histogram("jaxserve:e2e_request_latency_seconds", "End-to-end request latency in seconds.",
                             lbl, buckets=_LATENCY_BUCKETS, registry=r)
        self.queue = Histogram("jaxserve:request_queue_time_seconds", "Time spent waiting before being scheduled.",
                               lbl, buckets=_LATENCY_BUCKETS, registry=r)
        # children, bound once
        self._prompt = self.prompt_tokens.labels(model_name)
        self._gen = self.generation_tokens.labels(model_name)
        self._ttft = self.ttft.labels(model_name)
        self._itl = self.itl.labels(model_name)
        self._e2e = self.e2e.labels(model_name)
        self._queue = self.queue.labels(model_name)
        for reason in ("stop", "length", "abort"):
            self.request_success.labels(model_name, reason)

    def attach(self, engine: AsyncEngine) -> None:
        self.registry.register(_EngineCollector(engine, self.model_name))

    # StatsListener (called by the output processor, on the event loop)
    def on_scheduled(self, queue_seconds: float) -> None:
        self._queue.observe(queue_seconds)

    def on_first_token(self, ttft_seconds: float) -> None:
        self._ttft.observe(ttft_seconds)

    def on_tokens(self, itl_seconds: float) -> None:
        self._itl.observe(itl_seconds)

    def on_output(self, out: RequestOutput) -> None:
        n = 0
        for o in out.outputs:
            n += len(o.token_ids)
            if o.finish_reason is not None:
                self.request_success.labels(self.model_name, o.finish_reason).inc()
        if n:
            self._gen.inc(n)

    def on_finished(self, out: RequestOutput, e2e_seconds: float) -> None:
        self._e2e.observe(e2e_seconds)
        self._prompt.inc(len(out.prompt_token_ids))

    def render(self) -> bytes:
        return generate_latest(self.registry)
