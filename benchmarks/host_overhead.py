"""Host time per engine step, and how much of it overlapped steps hide.

1. Null model (default): the real engine core (scheduler, runner, sampler, output processor)
   over a model whose compiled step costs almost nothing (one layer of nothing, a 32-token
   vocabulary, a fixed greedy token), with R = 1, 8, 64 and 256 requests all decoding, for each
   multi-step decode K (`--decode-steps`, default 1 2 4 8: K decode steps per device call,
   runner/decode_block.py). Prints host milliseconds per token and per engine step (the thread's CPU time, so that other load on the machine counts
   less): schedule, prepare (packing the numpy inputs), launch (the JAX dispatch; XLA:CPU runs
   the null model's tiny program inline, so this includes its execution), update (scheduler
   update and engine outputs), and the frontend's output processing (detokenizing) separately,
   which the server runs on its event loop.
2. `--real`: the default model (SmolLM2-135M) decoding R = 32 requests: the device time of a
   decode step (the same compiled step replayed back to back on fixed inputs) against the
   engine's end-to-end step time, with overlapped steps on and off.

    .venv/bin/python benchmarks/host_overhead.py [--requests 1 8 64 256] [--decode-steps 1 2 4 8]
        [--no-overlap-off] [--real]

One JSON line per configuration goes to benchmarks/results/host_overhead.jsonl.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import os
import pathlib
import statistics
import sys
import time

from results_log import append_results

HERE = pathlib.Path(__file__).resolve().parent
RESULTS = HERE / "results" / "host_overhead.jsonl"
PARTS = ("schedule", "prepare", "launch", "update")
MAX_LEN = 1024  # the null model's context: room for --steps blocks of 8 tokens


def null_parts(num_requests: int, async_scheduling: bool, decode_steps: int = 1):
    """EngineParts over the null model, sized for `num_requests` decoding at once."""
    import jax.numpy as jnp
    from flax import nnx

    from jaxserve.backends import select_backend
    from jaxserve.core.kv_cache_manager import KVCacheManager
    from jaxserve.core.scheduler import Scheduler, SchedulerConfig
    from jaxserve.engine.core import EngineCore
    from jaxserve.engine.input_processor import ModelInfo
    from jaxserve.engine.setup import EngineParts
    from jaxserve.models.arch_config import ArchConfig
    from jaxserve.models.sharding import single_device_mesh
    from jaxserve.backends import DevicePlan
    from jaxserve.models.sharding import DEFAULT_RULES
    from jaxserve.runner.model_runner import ModelRunner
    from jaxserve.runner.recipe import StepRecipe
    from jaxserve.sampling.config import SamplerConfig

    V = 32
    cfg = ArchConfig("Null", vocab_size=V, hidden_size=8, intermediate_size=8, num_layers=1, num_heads=1,
                     num_kv_heads=1, head_dim=8, max_position_embeddings=4096)

    class NullModel(nnx.Module):
        """The runner's model contract at no cost: the logits always pick token 30 (a plain
        character, so that the frontend detokenizes real text)."""

        layer_features = frozenset({"null"})  # no backend fuses it
        product_specs = ({}, {}, ("", ""))

        def __init__(self):
            self.config = cfg
            self.bias = nnx.Param(jnp.zeros((V,), jnp.float32).at[30].set(1.0))

        def __call__(self, input_ids, positions, kv, md, layer_impl=None, lora=None):
            return jnp.zeros((input_ids.shape[0], 1), jnp.float32), kv

        def compute_logits(self, hidden):
            return hidden + self.bias[...][None, :]

    R = num_requests
    max_len, page = MAX_LEN, 16
    sc = SchedulerConfig(max_num_seqs=R, max_num_batched_tokens=max(R, 64), max_model_len=max_len,
                         async_scheduling=async_scheduling)
    pages = R * (max_len // page) + 1
    sampler = SamplerConfig(max_num_seqs=R, vocab_size=V, max_logprobs=4, max_bad_words=1, max_bad_word_len=1,
                            topk_candidates=V)
    backend = select_backend()
    plan = DevicePlan(dtype="float32", kv_dtype="float32", attention_impl="reference", matmul_impl="xla",
                      native_sampling=None, moe_impl=backend.moe_impl)
    recipe = StepRecipe(arch={}, platform=backend.platform, plan=dataclasses.asdict(plan), attention_impl="auto",
                        rules=dict(DEFAULT_RULES), mesh_shape=(1, 1), target={}, num_pages=pages, page_size=page,
                        max_model_len=max_len, sampler_config=sampler, token_buckets=(max(R, 64),),
                        request_buckets=(R,), num_decode_steps=decode_steps)
    runner = ModelRunner(NullModel(), recipe, backend=backend, mesh=single_device_mesh(), show_progress=False)
    core = EngineCore(Scheduler(sc, KVCacheManager(page, pages, True, max_len)), runner,
                      async_scheduling=async_scheduling, num_decode_steps=decode_steps)
    info = ModelInfo("null", V, max_len, None, (), sampler, {})
    parts = EngineParts(_null_tokenizer(V), info, core)
    gc.collect()
    gc.freeze()  # as build_engine does
    return parts


def _null_tokenizer(vocab: int):
    """The default model's tokenizer (the null model's ids are a few of its tokens)."""
    from jaxserve.engine.tokenizer import Tokenizer
    from jaxserve.models.loader import resolve_model

    return Tokenizer.from_pretrained(resolve_model(None))


def measure_null(num_requests: int, steps: int, async_scheduling: bool, decode_steps: int = 1) -> dict:
    from jaxserve.engine.core import HostTimes
    from jaxserve.engine.llm_engine import LLMEngine
    from jaxserve.outputs import OutputKind
    from jaxserve.sampling_params import SamplingParams

    engine = LLMEngine(null_parts(num_requests, async_scheduling, decode_steps))
    params = SamplingParams(max_tokens=MAX_LEN - 64, temperature=0.0, ignore_eos=True)
    for i in range(num_requests):
        engine.add_request(f"r{i}", [17 + i % 14, 20, 21, 22], params, output_kind=OutputKind.DELTA)
    running = engine.scheduler.running
    while len(running) < num_requests or any(r.num_output_tokens < 2 for r in running):
        engine.step()  # until everyone is admitted and decoding
    core, op = engine.core, engine.output_processor
    core.times = HostTimes()
    frontend, tokens, blocks = [], 0, core.num_blocks
    t0 = time.perf_counter()
    for _ in range(steps):
        outs = core.step()
        tokens += sum(len(o.new_token_ids) for o in outs)
        t = time.thread_time()
        op.process(outs)
        frontend.append(time.thread_time() - t)
    wall = time.perf_counter() - t0
    times = core.times
    if any(r.is_finished for r in engine.scheduler.running) or len(engine.scheduler.running) < num_requests:
        raise RuntimeError("a request finished while measuring: raise MAX_LEN or lower --steps")
    per_step = {k: 1e3 * getattr(times, k) / times.steps for k in (*PARTS, "collect")}
    host = sum(per_step[k] for k in PARTS)
    per_token = 1e3 * sum(getattr(times, k) for k in PARTS) / tokens
    return {"requests": num_requests, "async_scheduling": async_scheduling, "decode_steps": decode_steps,
            "steps": steps, "blocks": core.num_blocks - blocks, "tokens": tokens,
            "host_ms": host, **{f"{k}_ms": v for k, v in per_step.items()},
            "host_ms_per_token": per_token, "host_us_per_token": 1e3 * per_token,
            "frontend_output_ms": 1e3 * statistics.fmean(frontend),
            "frontend_us_per_token": 1e6 * sum(frontend) / tokens,
            "wall_step_ms": 1e3 * wall / steps, "wall_us_per_token": 1e6 * wall / tokens}


def measure_real(num_requests: int, steps: int) -> list[dict]:
    """Device time of a decode step (replayed) vs the engine's step time, overlap on and off."""
    import jax

    from jaxserve import LLM, SamplingParams
    from jaxserve.outputs import OutputKind

    rows = []
    for overlap in (True, False):
        llm = LLM(None, max_num_seqs=num_requests, show_progress=False, async_scheduling=overlap,
                  enable_prefix_caching=False)
        engine = llm.engine
        params = SamplingParams(max_tokens=steps + 40, temperature=0.0, ignore_eos=True)
        for i in range(num_requests):
            engine.add_request(f"r{i}", [100 + i, 200, 300, 400, 500, 600, 700, 800], params,
                               output_kind=OutputKind.DELTA)
        for _ in range(6):
            engine.step()
        core = engine.core
        t0 = time.perf_counter()
        for _ in range(steps):
            engine.step()
        step_ms = 1e3 * (time.perf_counter() - t0) / steps
        # The device alone: the current decode step's plan, launched back to back.
        plan = core.runner.prepare(core.scheduler.schedule().batch())
        jax.block_until_ready(core.runner.launch(plan).out.token_ids)
        t0 = time.perf_counter()
        for _ in range(steps):
            out = core.runner.launch(plan).out
        jax.block_until_ready(out.token_ids)
        device_ms = 1e3 * (time.perf_counter() - t0) / steps
        rows.append({"requests": num_requests, "async_scheduling": overlap, "steps": steps, "model": "default",
                     "dtype": engine.parts.plan.dtype, "step_ms": step_ms, "device_ms": device_ms,
                     "step_over_device": step_ms / device_ms})
        print(f"real model, {num_requests} requests, overlap {'on ' if overlap else 'off'}: step {step_ms:.1f} ms, "
              f"device {device_ms:.1f} ms ({step_ms / device_ms:.3f}x)", flush=True)
        del llm, engine, core
    return rows


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, nargs="+", default=[1, 8, 64, 256])
    p.add_argument("--decode-steps", type=int, nargs="+", default=[1, 2, 4, 8],
                   help="multi-step decode's K values to measure (decode steps per device call)")
    p.add_argument("--steps", type=int, default=50, help="engine steps measured (a block is one)")
    p.add_argument("--no-overlap-off", action="store_true", help="measure overlapped steps only")
    p.add_argument("--real", action="store_true", help="also time the default model at 32 requests")
    p.add_argument("--results", default=str(RESULTS), help="JSONL file to append to ('' = none)")
    args = p.parse_args(argv)
    sys.path.insert(0, str(HERE))
    from offline_throughput import environment

    env = environment()
    rows = []
    print(f"{'requests':>8} {'K':>2} {'overlap':>7} {'host us/tok':>11} {'wall us/tok':>11} {'host ms':>8} "
          f"{'schedule':>8} {'prepare':>8} {'launch':>7} {'update':>7} {'frontend':>8}")
    for R in args.requests:
        for K in args.decode_steps:
            for overlap in (True,) if args.no_overlap_off else (True, False):
                r = measure_null(R, args.steps, overlap, K)
                rows.append({"benchmark": "host_overhead", "kind": "null_model", **r})
                print(f"{R:>8} {K:>2} {'on' if overlap else 'off':>7} {r['host_us_per_token']:11.1f} "
                      f"{r['wall_us_per_token']:11.1f} {r['host_ms']:8.2f} {r['schedule_ms']:8.2f} "
                      f"{r['prepare_ms']:8.2f} {r['launch_ms']:7.2f} {r['update_ms']:7.2f} "
                      f"{r['frontend_output_ms']:8.2f}", flush=True)
    if args.real:
        rows += [{"benchmark": "host_overhead", "kind": "real_model", **r} for r in measure_real(32, args.steps)]
    stamp = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    if args.results:
        load_avg = os.getloadavg()
        append_results(args.results, [{**row, **env, "load_avg": load_avg, "timestamp": stamp}
                                      for row in rows])


if __name__ == "__main__":
    main()
