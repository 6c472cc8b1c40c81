"""int8 weights and quantized KV caches (fp8, int8) against the golden float32 data of the
default model (SmolLM2-135M-Instruct): log-prob drift and greedy agreement, next to bfloat16
weights, plus weight bytes per device and KV-cache bytes per page.

For each golden case the prompt plus the golden completion is scored by teacher forcing
(prompt log-probs): the drift is |logprob(int8) - logprob(golden)| over every scored token
(max and mean). Greedy agreement: the fraction of golden completion tokens generated
identically before the first divergence, and the fraction of cases matched in full. Weight
bytes come from the live device buffers of the model's parameters (device 0).
One JSON line per variant goes to benchmarks/results/int8_quality.jsonl.

    python benchmarks/int8_quality.py [--variants float32 bfloat16 int8 kv-fp8 kv-int8]
"""

from __future__ import annotations

import argparse
import datetime
import json
import pathlib
import sys

import numpy as np

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from offline_throughput import environment

from results_log import append_results  # noqa: E402

RESULTS = HERE / "results" / "int8_quality.jsonl"
# variant -> (weights dtype, quantization, KV-cache dtype)
VARIANTS = {"float32": ("float32", None, "auto"), "bfloat16": ("bfloat16", None, "auto"),
            "int8": ("float32", "int8", "auto"), "int8-bf16": ("bfloat16", "int8", "auto"),
            "fp8": ("float32", "fp8", "auto"), "int4": ("float32", "int4", "auto"),
            "kv-bf16": ("float32", None, "bfloat16"), "kv-fp8": ("float32", None, "fp8"),
            "kv-int8": ("float32", None, "int8")}


def weight_bytes(engine) -> int:
    """Bytes of the model's parameters held on the first device (live buffers)."""
    import jax

    dev = jax.devices()[0]
    total = 0
    for leaf in engine.runner.params:
        for shard in getattr(leaf, "addressable_shards", []):
            if shard.device == dev:
                total += shard.data.nbytes
    return total


def evaluate(variant: str, golden: dict, compile_cache: str | None) -> dict:
    from jaxserve import LLM, SamplingParams

    dtype, quant, kv_dtype = VARIANTS[variant]
    llm = LLM(None, dtype=dtype, quantization=quant, kv_cache_dtype=kv_dtype, max_num_seqs=8,
              max_num_batched_tokens=512, token_buckets=(16, 512), request_buckets=(8,),
              show_progress=False,
              **({"compilation_cache_dir": compile_cache} if compile_cache else {}))
    cases = golden["cases"]
    scored = [c["prompt_token_ids"] + c["completion_token_ids"] for c in cases]
    outs = llm.generate(scored, SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0), use_tqdm=False)
    drift = []
    for case, out, ids in zip(cases, outs, scored):
        want = list(case["prompt_logprobs"]) + [s["logprob"] for s in case["steps"]]
        for j in range(1, len(ids)):
            drift.append(abs(out.prompt_logprobs[j][ids[j]].logprob - want[j - 1]))
    gen = llm.generate([c["prompt_token_ids"] for c in cases],
                       [SamplingParams(temperature=0.0, max_tokens=len(c["completion_token_ids"]), ignore_eos=True)
                        for c in cases], use_tqdm=False)
    agree, total, full = 0, 0, 0
    for case, out in zip(cases, gen):
        want, got = case["completion_token_ids"], out.outputs[0].token_ids
        n = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), len(want))
        agree, total, full = agree + n, total + len(want), full + (n == len(want))
    kv = llm.engine.runner.kv
    page_bytes = sum(a.nbytes for a in (*kv.k, *kv.v)) // kv.num_pages
    return {"variant": variant, "dtype": dtype, "quantization": quant,
            "kv_cache_dtype": str(kv.k[0].dtype),
            "kv_bytes_per_page": page_bytes, "weight_bytes_device0": weight_bytes(llm.engine),
            "logprob_drift_max": float(np.max(drift)), "logprob_drift_mean": float(np.mean(drift)),
            "scored_tokens": len(drift), "greedy_prefix_agreement": agree / total,
            "greedy_cases_identical": f"{full}/{len(cases)}"}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--variants", nargs="+", default=["float32", "bfloat16", "int8"], choices=sorted(VARIANTS))
    p.add_argument("--compilation-cache-dir", default=None)
    p.add_argument("--results", default=str(RESULTS))
    args = p.parse_args(argv)
    golden = json.loads((HERE.parent / "tests" / "data" / "smollm2_public.json").read_text())
    env = environment()
    rows = [evaluate(v, golden, args.compilation_cache_dir) for v in args.variants]
    stamp = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    if args.results:
        append_results(args.results, [{"benchmark": "int8_quality", **row, **env,
                                       "timestamp": stamp} for row in rows])
    print(f"\n{env['host']['cpu']}, jax {env['versions']['jax']}, git {str(env['git_sha'])[:10]}")
    print(f"{'variant':10} {'weights MiB':>12} {'KV B/page':>10} {'drift max':>10} {'drift mean':>11} {'greedy agree':>13} {'identical':>10}")
    for r in rows:
        print(f"{r['variant']:10} {r['weight_bytes_device0'] / 2**20:12.1f} {r['kv_bytes_per_page']:10d} "
              f"{r['logprob_drift_max']:10.4f} "
              f"{r['logprob_drift_mean']:11.5f} {r['greedy_prefix_agreement']:13.3f} {r['greedy_cases_identical']:>10}")


if __name__ == "__main__":
    main()
