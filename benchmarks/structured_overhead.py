"""What structured output costs per decode step, on the default model with 32 requests decoding.

One engine (SmolLM2-135M, the backend's default dtype, 32 sequences), three kinds of phase,
alternated `--rounds` times:

- free: 32 unconstrained requests, overlapped steps (the default);
- free, plain steps: the same without overlap (what a step costs when the host waits for it);
- constrained: 32 requests under a JSON schema that keeps them writing (an array of >= 100
  objects with a bounded string and a bounded integer): each step advances 32 llguidance
  matchers, fills the [32, V/32] bitmask, and runs without overlap.

Each phase adds its requests, runs until all 32 have their first token (the prefill), then
times `--steps` engine steps. After each constrained phase the next step's plan is replayed
on the device back to back, alternately with its twin whose bitmask rows are all ones: the
compiled step's own cost of applying the mask, free of the host's noise. Prints the median step time of each kind, the grammar's host time
per step (advancing the matchers and filling the bitmask; wall time, and the engine thread's
CPU time, which the host's other load does not inflate), and the overhead of constrained over
free steps; also the grammar compiler's start-up (the tokenizer tables) and the compile time of
a typical schema (benchmarks/grammar_engines.py's).

    .venv/bin/python benchmarks/structured_overhead.py [--rounds 3] [--steps 40]

One JSON line goes to benchmarks/results/structured_overhead.jsonl.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import statistics
import sys
import time

from results_log import append_results

HERE = pathlib.Path(__file__).resolve().parent
RESULTS = HERE / "results" / "structured_overhead.jsonl"
sys.path.insert(0, str(HERE))

SCHEMA = {
    "type": "array", "minItems": 100,
    "items": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                               "qty": {"type": "integer", "minimum": 1, "maximum": 99}},
              "required": ["name", "qty"], "additionalProperties": False},
}
TOPICS = ["fruit", "tools", "books", "cities", "animals", "colors", "metals", "planets"]


class CpuTimer:
    """Thread CPU seconds spent in the grammar manager's bitmask (the masks are filled on the
    engine thread on small hosts: see jaxserve/structured/manager.py): a figure the host's
    other load does not inflate, unlike wall time."""

    def __init__(self, manager):
        self.seconds = 0.0
        inner = manager.bitmask

        def timed(so):
            t0 = time.thread_time()
            out = inner(so)
            self.seconds += time.thread_time() - t0
            return out

        manager.bitmask = timed


def phase(engine, kind: str, steps: int, n: int = 32, cpu: CpuTimer | None = None) -> tuple[float, float, float]:
    """Median seconds per step, grammar host seconds (wall, CPU) per step, for one phase."""
    from jaxserve.sampling_params import SamplingParams, StructuredOutputsParams

    tok = engine.tokenizer
    core = engine.core
    core.async_scheduling = kind != "free_plain"  # (constrained steps never overlap anyway)
    so = StructuredOutputsParams(json=SCHEMA) if kind == "constrained" else None
    ids = []
    for i in range(n):
        text = tok.apply_chat_template([{"role": "user", "content": f"List many {TOPICS[i % 8]} with quantities "
                                                                    f"as JSON (list {i})."}])
        rid = engine.add_request(None, tok.encode(text, add_special_tokens=False),
                                 SamplingParams(max_tokens=2000 // 2, temperature=0.7, seed=i, ignore_eos=True,
                                                structured_outputs=so))
        ids.append(rid)
    seqs = engine.output_processor
    while any(not seqs.parents[r].seqs[0].token_ids for r in ids):
        engine.step()
    g0, c0 = core.times.grammar, cpu.seconds if cpu else 0.0
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t0)
    grammar = (core.times.grammar - g0) / steps
    grammar_cpu = ((cpu.seconds if cpu else 0.0) - c0) / steps
    assert len(core.scheduler.running) == n, "a request finished or waited during the timed steps"
    if kind == "constrained":
        replay(core)
    engine.abort_request(ids)
    while engine.has_unfinished_requests():
        engine.step()
    return statistics.median(times), grammar, grammar_cpu


REPLAY: dict[str, list[float]] = {"masked": [], "ones": []}


def replay(core, reps: int = 15) -> None:
    """The device's share: the next constrained step's plan, and its twin whose bitmask rows are
    all ones, launched alternately back to back (the step's own cost of applying the mask)."""
    import dataclasses

    import jax

    so = core.scheduler.schedule()
    plan = core.runner.prepare(so.batch(), core.structured.bitmask(so))
    layout = core.runner.layouts[plan.bucket]
    inputs, meta, tok = layout.unpack_host(plan.buffers)
    assert (meta.token_bitmask != -1).any()
    ones = dataclasses.replace(plan, buffers=layout.pack(
        (inputs, dataclasses.replace(meta, token_bitmask=meta.token_bitmask * 0 - 1), tok)), slot_writes=[])
    plan = dataclasses.replace(plan, slot_writes=[])
    for p in (plan, ones):
        jax.block_until_ready(core.runner.launch(p).out.token_ids)
    for _ in range(reps):
        for name, p in (("masked", plan), ("ones", ones)):
            t0 = time.perf_counter()
            jax.block_until_ready(core.runner.launch(p).out.token_ids)
            REPLAY[name].append(time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--no-save", action="store_true")
    args = ap.parse_args()
    from grammar_engines import TYPICAL

    from jaxserve.config import EngineConfig
    from jaxserve.engine.llm_engine import LLMEngine
    from jaxserve.sampling_params import StructuredOutputsParams

    engine = LLMEngine.from_config(EngineConfig.from_kwargs(
        model=None, dtype=args.dtype, max_num_seqs=32, max_num_batched_tokens=512, token_buckets=(32, 512),
        request_buckets=(32,), show_progress=False, max_model_len=2048))
    compiler = engine.input_processor.grammars
    t0 = time.perf_counter()
    compiler.tokenizer()
    tokenizer_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    compiler.compile(StructuredOutputsParams(json=TYPICAL))
    compile_s = time.perf_counter() - t0
    res: dict[str, list[float]] = {"free": [], "free_plain": [], "constrained": [], "grammar": [],
                                   "grammar_cpu": []}
    cpu = CpuTimer(engine.core.structured)
    for _ in range(args.rounds):
        for kind in ("free", "free_plain", "constrained"):
            step, grammar, grammar_cpu = phase(engine, kind, args.steps, cpu=cpu)
            res[kind].append(step)
            if kind == "constrained":
                res["grammar"].append(grammar)
                res["grammar_cpu"].append(grammar_cpu)
    med = {k: statistics.median(v) for k, v in res.items()}
    row = {
        "bench": "structured_overhead", "requests": 32, "dtype": engine.parts.plan.dtype if engine.parts.plan else None,
        "step_ms_free": round(med["free"] * 1e3, 2), "step_ms_free_plain": round(med["free_plain"] * 1e3, 2),
        "step_ms_constrained": round(med["constrained"] * 1e3, 2),
        "grammar_ms_per_step": round(med["grammar"] * 1e3, 3),
        "grammar_cpu_ms_per_step": round(med["grammar_cpu"] * 1e3, 3),
        "grammar_share_of_constrained_step": round(med["grammar"] / med["constrained"], 4),
        "overhead_vs_free": round(med["constrained"] / med["free"] - 1, 4),
        "overhead_vs_free_plain": round(med["constrained"] / med["free_plain"] - 1, 4),
        "device_ms_masked": round(statistics.median(REPLAY["masked"]) * 1e3, 2),
        "device_ms_all_ones": round(statistics.median(REPLAY["ones"]) * 1e3, 2),
        "grammar_tokenizer_s": round(tokenizer_s, 3), "typical_schema_compile_ms": round(compile_s * 1e3, 2),
        "rounds": args.rounds, "steps": args.steps, "all_runs": {k: [round(x * 1e3, 2) for x in v] for k, v in res.items()},
        "date": datetime.date.today().isoformat(), "cpus": os.cpu_count(), "load": round(os.getloadavg()[0], 2),
        "recompiles": engine.num_compiles_after_warmup,
    }
    print(json.dumps(row))
    if not args.no_save:
        append_results(RESULTS, row)


if __name__ == "__main__":
    main()
