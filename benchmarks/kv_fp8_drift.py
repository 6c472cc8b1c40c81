"""The fp8 KV cache's drift on the default model (SmolLM2-135M-Instruct) against the golden
float32 data, per attention implementation, with the scales measured at start-up (what the
engine does) and with every scale 1.0 (what it did before, as vLLM does without checkpoint
scales).

Each golden case's prompt plus its golden completion is scored by teacher forcing (prompt
log-probs, one engine step of all cases): the drift is |logprob(fp8 cache) - logprob(golden)|
over every scored token (worst and mean, nats). The weights stay float32; only the cache is
fp8, in pages of 32 tokens (what the Pallas TPU kernel needs for one-byte pages, so every
implementation reads the same pages). One JSON line per (implementation, scales) goes to
benchmarks/results/kv_fp8_drift.jsonl.

    python benchmarks/kv_fp8_drift.py [--impls reference cpu tpu-interpret ...]
                                      [--scales measured one] [--cases N]

Implementations: "reference" (pure JAX), "cpu" (the native CPU kernel), and the Pallas kernels
run by their interpreters on this host: "tpu-interpret", "gpu-interpret" (Triton),
"gpu-mosaic-interpret" (which takes 16-bit queries only, so it is run with bfloat16 weights
and its drift includes theirs).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import pathlib
import sys
import time

import numpy as np

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from offline_throughput import environment
from results_log import append_results  # noqa: E402

RESULTS = HERE / "results" / "kv_fp8_drift.jsonl"
IMPLS = ("reference", "cpu", "tpu-interpret", "gpu-interpret", "gpu-mosaic-interpret")
BF16_ONLY = {"gpu-mosaic-interpret"}  # the Mosaic GPU kernels need 16-bit queries


@contextlib.contextmanager
def fp8_scales(mode: str):
    """"measured": the engine's own scales; "one": fp8 left unmeasured (every scale 1.0)."""
    from jaxserve.pallas_kernels.kv_quant import FP8_DTYPE
    from jaxserve.runner import kv_scales

    if mode == "measured":
        yield
        return
    headroom = kv_scales.HEADROOM.pop(FP8_DTYPE)  # a dtype without a headroom takes 1.0
    try:
        yield
    finally:
        kv_scales.HEADROOM[FP8_DTYPE] = headroom


def evaluate(impl: str, scales: str, cases: list[dict], compile_cache: str | None) -> dict:
    from jaxserve import LLM, SamplingParams

    scored = [c["prompt_token_ids"] + c["completion_token_ids"] for c in cases]
    tokens = sum(map(len, scored))
    bucket = 1 << (tokens - 1).bit_length()
    dtype = "bfloat16" if impl in BF16_ONLY else "float32"
    t0 = time.perf_counter()
    with fp8_scales(scales):
        llm = LLM(None, dtype=dtype, kv_cache_dtype="fp8", attention_impl=impl, page_size=32,
                  max_num_seqs=8, max_num_batched_tokens=bucket, max_model_len=512,
                  token_buckets=(bucket,), request_buckets=(8,), show_progress=False,
                  **({"compilation_cache_dir": compile_cache} if compile_cache else {}))
    layer0 = (llm.engine.runner.recipe.kv_scales or [(None, None)])[0]  # None: 1.0
    t1 = time.perf_counter()
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
    outs = llm.generate(scored, params, use_tqdm=False)
    t2 = time.perf_counter()
    drift = []
    for case, out, ids in zip(cases, outs, scored):
        want = list(case["prompt_logprobs"]) + [s["logprob"] for s in case["steps"]]
        drift += [abs(out.prompt_logprobs[j][ids[j]].logprob - want[j - 1]) for j in range(1, len(ids))]
    kv = llm.engine.runner.kv
    del llm
    return {"attention_impl": impl, "scales": scales, "weights_dtype": dtype,
            "kv_cache_dtype": str(kv.k[0].dtype), "page_size": 32,
            "layer0_k_scale": layer0[0] and list(layer0[0]), "layer0_v_scale": layer0[1] and list(layer0[1]),
            "drift_max": float(np.max(drift)), "drift_mean": float(np.mean(drift)),
            "scored_tokens": len(drift), "cases": len(cases),
            "start_s": round(t1 - t0, 1), "score_s": round(t2 - t1, 1)}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--impls", nargs="+", default=list(IMPLS), choices=IMPLS)
    p.add_argument("--scales", nargs="+", default=["one", "measured"], choices=["one", "measured"])
    p.add_argument("--cases", type=int, default=None, help="the first N golden cases (default: all)")
    p.add_argument("--compilation-cache-dir", default=None)
    p.add_argument("--results", default=str(RESULTS))
    args = p.parse_args(argv)
    golden = json.loads((HERE.parent / "tests" / "data" / "smollm2_public.json").read_text())
    cases = golden["cases"][: args.cases]
    env = environment()
    print(f"{env['host']['cpu']}, jax {env['versions']['jax']}, git {str(env['git_sha'])[:10]}")
    print(f"{'implementation':22} {'scales':9} {'worst':>8} {'mean':>8} {'start s':>8} {'score s':>8}")
    for impl in args.impls:
        for scales in args.scales:
            try:
                row = evaluate(impl, scales, cases, args.compilation_cache_dir)
            except ValueError as e:  # a kernel that cannot take the model's shapes
                row = {"attention_impl": impl, "scales": scales, "not_run": str(e).splitlines()[0]}
            stamp = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
            if args.results:
                append_results(args.results, {"benchmark": "kv_fp8_drift", **row, **env, "timestamp": stamp})
            if "not_run" in row:
                print(f"{impl:22} {scales:9} not run: {row['not_run']}", flush=True)
                break
            print(f"{impl:22} {scales:9} {row['drift_max']:8.4f} {row['drift_mean']:8.4f} "
                  f"{row['start_s']:8.1f} {row['score_s']:8.1f}", flush=True)


if __name__ == "__main__":
    main()
