"""The series read from the engine's latest stats snapshot at scrape time: vLLM's scheduler
gauges and engine counters (`vllm:`), and jaxserve's own (`jaxserve:`)."""

from __future__ import annotations

import time
from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from jaxserve.engine.client import EngineClient

LABELS = ["model_name", "engine"]
ENGINE_INDEX = "0"  # one engine core (vLLM labels each data-parallel engine core; here the
#                     data-parallel ranks share one core and one compiled step)
ADMISSION_REASONS = ("max_num_queued_reqs", "max_num_queued_tokens")
CACHE_HIT_SOURCES = ("device", "host", "p2p", "disk", "external_unspecified")


class EngineCollector(Collector):
    def __init__(self, engine: EngineClient, model_name: str):
        self.engine = engine
        self.values = [model_name, ENGINE_INDEX]
        self.model_name = model_name

    def _gauge(self, name: str, doc: str, v: float) -> GaugeMetricFamily:
        g = GaugeMetricFamily(name, doc, labels=LABELS)
        g.add_metric(self.values, v)
        return g

    def _counter(self, name: str, doc: str, v: float) -> CounterMetricFamily:
        c = CounterMetricFamily(name, doc, labels=LABELS)
        c.add_metric(self.values, v)
        return c

    def collect(self) -> Iterator[Metric]:
        stats = self.engine.stats
        yield from self._vllm(stats)
        yield from self._jaxserve(stats)

    def _vllm(self, stats) -> Iterator[Metric]:
        s, gauge, counter = stats.scheduler, self._gauge, self._counter
        yield gauge("vllm:num_requests_running", "Number of requests in model execution batches.", s.num_running)
        yield gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.", s.num_waiting)
        by_reason = GaugeMetricFamily(
            "vllm:num_requests_waiting_by_reason",
            "Number of waiting requests by reason ('capacity': waiting for scheduling capacity; "
            "'deferred': never here, jaxserve defers no request).", labels=[*LABELS, "reason"])
        by_reason.add_metric([*self.values, "capacity"], s.num_waiting)
        by_reason.add_metric([*self.values, "deferred"], 0.0)
        yield by_reason
        sleep = GaugeMetricFamily(
            "vllm:engine_sleep_state",
            "Engine sleep state; awake = 1 while awake; weights_offloaded = 1 while asleep (sleep "
            "level 1: the KV cache dropped, weights on the host); discard_all: level 2, never here.",
            labels=[*LABELS, "sleep_state"])
        sleep.add_metric([*self.values, "awake"], 0.0 if stats.is_sleeping else 1.0)
        sleep.add_metric([*self.values, "weights_offloaded"], 1.0 if stats.is_sleeping else 0.0)
        sleep.add_metric([*self.values, "discard_all"], 0.0)
        yield sleep
        yield gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", s.kv_cache_usage)
        yield counter("vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.",
                      s.prefix_cache_queries)
        yield counter("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.",
                      s.prefix_cache_hits)
        yield counter("vllm:external_prefix_cache_queries",
                      "External prefix cache queries (none: jaxserve has no KV connector).", 0.0)
        yield counter("vllm:external_prefix_cache_hits",
                      "External prefix cache hits (none: jaxserve has no KV connector).", 0.0)
        cached = CounterMetricFamily(
            "vllm:prompt_tokens_cached_by_source",
            "Prefix-cache hit tokens by the cache tier that supplied them (here only the device's).",
            labels=[*LABELS, "source"])
        for source in CACHE_HIT_SOURCES:
            cached.add_metric([*self.values, source], s.prefix_cache_hits if source == "device" else 0.0)
        yield cached
        yield counter("vllm:mm_cache_queries", "Multi-modal cache queries (none: text models only).", 0.0)
        yield counter("vllm:mm_cache_hits", "Multi-modal cache hits (none: text models only).", 0.0)
        yield counter("vllm:num_preemptions", "Cumulative number of preemption from the engine.", s.num_preemptions)
        yield from self._spec_decode(s)
        rejections = CounterMetricFamily("vllm:admission_rejections",
                                         "Number of admission attempts rejected by a queue limit, by reason.",
                                         labels=["model_name", "reason"])
        for reason in ADMISSION_REASONS:  # --max-waiting-requests is a limit on queued sequences
            refused = self.engine.num_refused if reason == "max_num_queued_reqs" else 0
            rejections.add_metric([self.model_name, reason], float(refused))
        yield rejections
        lora = GaugeMetricFamily("vllm:lora_requests_info", "Running stats on lora requests.",
                                 labels=["max_lora", "waiting_lora_adapters", "running_lora_adapters"])
        lora.add_metric([str(self.engine.info.max_loras), ",".join(s.waiting_lora_adapters),
                         ",".join(s.running_lora_adapters)], time.time())
        yield lora

    def _spec_decode(self, s) -> Iterator[Metric]:
        """vLLM's speculative-decoding counters, declared (as there) only with speculative
        decoding on: `vllm bench serve` and vLLM's dashboards read the acceptance rate
        (accepted / draft tokens), the mean acceptance length (1 + accepted / drafts) and the
        per-position rates (accepted_per_pos{position} / drafts) from them."""
        k = self.engine.info.num_speculative_tokens
        if not k:
            return
        counter = self._counter
        yield counter("vllm:spec_decode_num_drafts", "Number of spec decoding drafts.", s.spec_num_drafts)
        yield counter("vllm:spec_decode_num_draft_tokens", "Number of draft tokens.", s.spec_num_draft_tokens)
        yield counter("vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens.",
                      s.spec_num_accepted_tokens)
        per_pos = CounterMetricFamily("vllm:spec_decode_num_accepted_tokens_per_pos",
                                      "Accepted tokens per draft position.", labels=[*LABELS, "position"])
        counts = list(s.spec_num_accepted_per_pos)
        for pos in range(k):
            per_pos.add_metric([*self.values, str(pos)], float(counts[pos] if pos < len(counts) else 0))
        yield per_pos

    def _jaxserve(self, stats) -> Iterator[Metric]:
        s, gauge, counter = stats.scheduler, self._gauge, self._counter
        yield gauge("jaxserve:num_free_kv_blocks", "Number of free KV-cache blocks.", s.num_free_blocks)
        yield gauge("jaxserve:engine_healthy", "1 while the engine loop is alive.",
                    1.0 if self.engine.is_alive else 0.0)
        yield gauge("jaxserve:max_waiting_requests", "The waiting-queue limit, in sequences.",
                    float(self.engine.max_waiting_requests))
        yield counter("jaxserve:compile_seconds", "Seconds spent compiling step executables.", stats.compile_seconds)
        yield counter("jaxserve:recompiles", "Compilations after warm-up (should stay 0).", float(stats.recompiles))
        yield counter("jaxserve:compiles", "Step executables compiled, warm-up included.", float(stats.num_compiles))
        yield counter("jaxserve:engine_steps", "Engine steps run.", float(stats.num_steps))
