"""Time the jitted sampler at R=32 rows, V=49152 (the default model's vocabulary).

One executable per implementation serves every case below (the parameters travel as arrays):
the JAX steps, and on the CPU (when the kernels build) the native kernel for steps 5-7
(SamplerConfig.native, what the engine uses there). Cases and implementations run
interleaved, in rounds, and the table reports the median and the minimum per call. Also times
the host-side metadata build (per step) and the compile, and prompt logprobs (top 5) over
--prompt-rows rows of logits (a prefill step's worth). Prints a table and appends one JSON
line to benchmarks/results/sampling.jsonl.

    .venv/bin/python benchmarks/sampling_benchmark.py [--rows 32] [--rounds 20]

Context: one model step at 32 decode rows takes ~30-40 ms on the development CPU; the target
for the sampler is <= 10 % of that. The machine's load average is recorded with the figures:
other processes on a 2-core machine inflate them.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import platform
import subprocess
import time

import jaxserve  # noqa: F401 - before jax: pins JAX to the CPU on a host without accelerators
import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.backends.cpu import kernels as cpu_kernels

from jaxserve.sampling import (
    SamplerConfig,
    SamplingMetadataBuilder,
    init_sampling_state,
    penalty_slots,
    prompt_logprobs,
    sample,
    update_state_from_tokens,
    write_slot_rows,
)
from jaxserve.sampling_params import SamplingParams

from results_log import append_results

RESULTS = os.path.join(os.path.dirname(__file__), "results", "sampling.jsonl")

CASES = {
    "greedy": {"temperature": 0.0},
    "greedy+logprobs5": {"temperature": 0.0, "logprobs": 5},
    "temperature": {"temperature": 0.8},
    "top_k50+top_p0.9": {"temperature": 0.8, "top_k": 50, "top_p": 0.9},
    "penalties(greedy)": {"temperature": 0.0, "presence_penalty": 0.5, "frequency_penalty": 0.5,
                              "repetition_penalty": 1.1},
    "all_features": {"temperature": 0.8, "top_k": 50, "top_p": 0.9, "min_p": 0.05, "presence_penalty": 0.5,
                         "frequency_penalty": 0.5, "repetition_penalty": 1.1,
                         "logit_bias": {100: 2.0, 200: -3.0}, "logprobs": 5},
    "top_p0.95": {"temperature": 1.0, "top_p": 0.95},  # nucleus wider than the candidates
    "wide_nucleus(top_p0.95,flat)": {"temperature": 1.0, "top_p": 0.95},  # bisection fallback
}


def git_sha() -> str:
    try:
        return subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], text=True,
                                       stderr=subprocess.DEVNULL).strip()
    except Exception:  # noqa: BLE001 - no commit yet
        return "none"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--topk-candidates", type=int, default=64)
    ap.add_argument("--prompt-rows", type=int, default=512)
    args = ap.parse_args()
    R, V, S = args.rows, args.vocab, args.max_num_seqs
    cfg = SamplerConfig(max_num_seqs=S, vocab_size=V, max_logprobs=20,
                        topk_candidates=args.topk_candidates)
    impls = {"jax": cfg}
    if jax.default_backend() == "cpu" and cpu_kernels.available():
        impls["native"] = dataclasses.replace(cfg, native="cpu")
    rng = np.random.default_rng(0)
    # LM-like logits: a few strong candidates over a long tail; and a flat row for the
    # wide-nucleus case.
    peaky = rng.standard_normal((R, V)).astype(np.float32) * 2.0
    peaky[np.arange(R)[:, None], rng.integers(0, V, (R, 20))] += rng.uniform(4, 10, (R, 20))
    flat = (rng.standard_normal((R, V)) * 0.5).astype(np.float32)

    fns = {name: jax.jit(functools.partial(sample, config=c)) for name, c in impls.items()}
    plp_fns = {name: jax.jit(functools.partial(prompt_logprobs, k_max=5, native=c.native))
               for name, c in impls.items()}
    plp_logits = jnp.asarray(rng.standard_normal((args.prompt_rows, V)).astype(np.float32) * 2.0)
    plp_next = jnp.asarray(rng.integers(0, V, args.prompt_rows).astype(np.int32))
    update = jax.jit(update_state_from_tokens, donate_argnums=0)
    write = jax.jit(write_slot_rows, donate_argnums=0)

    inputs, build_us = {}, {}
    for name, kw in CASES.items():
        b = SamplingMetadataBuilder(cfg, seed=0)
        slots = rng.permutation(S)[:R]
        for s in slots:
            b.admit(int(s), SamplingParams(**kw), eos_token_ids=(0,))
        state = init_sampling_state(cfg)
        for w in b.take_slot_writes():
            state = write(state, w)
        out_lens = rng.integers(0, 200, R)
        meta = b.build(slots, out_lens, R)
        T = 2048  # history: prompt and output tokens of every row
        tok_slots = np.repeat(slots, T // R).astype(np.int32)
        state = update(state, tok_slots, rng.integers(0, V, T).astype(np.int32),
                       np.tile(np.arange(T // R) < 40, R), np.ones(T, bool), meta.reset_slots,
                       penalty_slots(meta))
        t0 = time.perf_counter()
        for _ in range(200):
            b.build(slots, out_lens, R)
        build_us[name] = (time.perf_counter() - t0) / 200 * 1e6
        logits = jnp.asarray(flat if "flat" in name else peaky)
        inputs[name] = (logits, jax.device_put(meta), state)

    # Reference under the same load: the LM head of the default model at R rows
    # ([R, 576] x [576, V], float32), one part of every step.
    hidden = jnp.asarray(rng.standard_normal((R, 576)).astype(np.float32))
    head = jnp.asarray(rng.standard_normal((576, V)).astype(np.float32) * 0.05)
    lm_head = jax.jit(lambda h, w: h @ w)
    jax.block_until_ready(lm_head(hidden, head))

    t0 = time.perf_counter()
    jax.block_until_ready(fns["jax"](*inputs["greedy"]))
    compile_s = time.perf_counter() - t0
    for f in fns.values():
        for a in inputs.values():  # warm every branch
            jax.block_until_ready(f(*a))
    times = {f"{k} [{i}]": [] for k in CASES for i in fns}
    times["(reference) lm_head matmul"] = []
    for impl, f in plp_fns.items():
        jax.block_until_ready(f(plp_logits, plp_next))
        times[f"prompt_logprobs5 x{args.prompt_rows} [{impl}]"] = []
    for _ in range(args.rounds):
        for impl, f in plp_fns.items():
            t = time.perf_counter()
            jax.block_until_ready(f(plp_logits, plp_next))
            times[f"prompt_logprobs5 x{args.prompt_rows} [{impl}]"].append(time.perf_counter() - t)
        for _ in range(3):
            t = time.perf_counter()
            jax.block_until_ready(lm_head(hidden, head))
            times["(reference) lm_head matmul"].append(time.perf_counter() - t)
        for name, a in inputs.items():
            for impl, f in fns.items():
                for _ in range(3):
                    t = time.perf_counter()
                    jax.block_until_ready(f(*a))
                    times[f"{name} [{impl}]"].append(time.perf_counter() - t)
    for f in fns.values():
        assert f._cache_size() == 1, "a parameter mix recompiled the sampler"

    load = os.getloadavg()[0]
    figures = {
        k: {"median_ms": 1e3 * float(np.median(v)), "min_ms": 1e3 * float(np.min(v)),
            "build_us": build_us.get(k.split(" [")[0], 0.0)}
        for k, v in times.items()
    }
    print(f"sampler R={R} V={V} S={S} K={cfg.topk_candidates} on {jax.devices()[0].platform} "
          f"(load average {load:.1f}; compile {compile_s:.1f} s)")
    print(f"{'case [implementation]':39s} {'median ms':>10s} {'min ms':>8s} {'build us':>9s}")
    for k, v in figures.items():
        print(f"{k:39s} {v['median_ms']:10.2f} {v['min_ms']:8.2f} {v['build_us']:9.1f}")
    record = {
        "bench": "sampling",
        "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "git_sha": git_sha(),
        "jax": jax.__version__,
        "numpy": np.__version__,
        "python": platform.python_version(),
        "device": str(jax.devices()[0]),
        "cpu_count": os.cpu_count(),
        "load_average_1m": load,
        "config": {"rows": R, "vocab": V, "max_num_seqs": S, "max_logprobs": cfg.max_logprobs,
                   "topk_candidates": cfg.topk_candidates, "rounds": args.rounds},
        "compile_s": compile_s,
        "figures": figures,
    }
    append_results(RESULTS, record)


if __name__ == "__main__":
    main()
