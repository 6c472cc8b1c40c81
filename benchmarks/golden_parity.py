"""Golden parity of the default model on this machine's backend: greedy completions of
transformers' float32 golden cases (tests/data/smollm2_public.json) through `LLM.generate` in
float32, all cases in one batch, with the backend's own attention ("auto": the Triton kernel
on a GPU, Hopper included, since the Mosaic GPU kernels take 16-bit and one-byte caches only;
the Mosaic kernel on a TPU, the native kernel on a CPU). A case matches when its
tokens equal the golden ones, or first differ right after a golden step whose top-2
log-probs are within 1e-3 (a float32 near-tie) on the second of those tokens; the largest
log-prob difference at the golden token over the matched steps is reported too. One JSON line.

    python benchmarks/golden_parity.py [--cases N] [--max-tokens N] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import tempfile
import time

from results_log import append_results

HERE = pathlib.Path(__file__).resolve().parent
GOLDEN = HERE.parent / "tests" / "data" / "smollm2_public.json"
NEAR_TIE = 1e-3


def compare(case: dict, token_ids: list[int], logprobs, max_tokens: int) -> dict:
    want = case["completion_token_ids"][:max_tokens]
    diff, status = 0.0, "exact"
    for i, (a, b) in enumerate(zip(token_ids, want)):
        if a != b:
            top = case["steps"][i]["top5"]
            tie = top[0][1] - top[1][1] < NEAR_TIE and a == top[1][0]
            status = f"near-tie at step {i}" if tie else f"diverged at step {i} ({a} != {b})"
            break
        lp = logprobs[i].get(b) if logprobs else None
        if lp is not None:
            diff = max(diff, abs(lp.logprob - case["steps"][i]["logprob"]))
    if status == "exact" and len(token_ids) != len(want):
        status = f"length {len(token_ids)} != {len(want)}"
    return {"name": case["name"], "status": status, "max_logprob_diff": round(diff, 6)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--cases", type=int, default=None, help="the first N golden cases (default: all)"
    )
    p.add_argument(
        "--max-tokens", type=int, default=None, help="at most N tokens of each completion"
    )
    p.add_argument(
        "--token-budget",
        type=int,
        default=512,
        help="tokens per step, the one token bucket above 16 (16: one bucket, prompts chunked)",
    )
    p.add_argument("--out", default=None, help="append the JSON line here too")
    args = p.parse_args()

    import jax

    from jaxserve import LLM, SamplingParams

    jax.config.update("jax_default_matmul_precision", "highest")  # float32 products, no TF32
    golden = json.loads(GOLDEN.read_text())
    cases = golden["cases"][: args.cases]
    limit = args.max_tokens or max(len(c["completion_token_ids"]) for c in cases)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as cache:
        llm = LLM(
            dtype="float32",
            max_num_seqs=8,
            max_model_len=1024,
            max_num_batched_tokens=args.token_budget,
            token_buckets=tuple(sorted({16, args.token_budget})),
            request_buckets=(8,),
            compilation_cache_dir=cache,
            show_progress=False,
        )
        start_s = time.perf_counter() - t0
        params = [
            SamplingParams(
                temperature=0.0,
                ignore_eos=True,
                logprobs=1,
                max_tokens=min(limit, len(c["completion_token_ids"])),
            )
            for c in cases
        ]
        t1 = time.perf_counter()
        outs = llm.generate([c["prompt_token_ids"] for c in cases], params, use_tqdm=False)
        gen_s = time.perf_counter() - t1
        plan = llm.engine.parts.plan
    results = [
        compare(c, o.outputs[0].token_ids, o.outputs[0].logprobs, limit)
        for c, o in zip(cases, outs)
    ]
    ok = all(r["status"] == "exact" or r["status"].startswith("near-tie") for r in results)
    rec = {
        "bench": "golden_parity",
        "backend": jax.default_backend(),
        "device": jax.devices()[0].device_kind,
        "jax": jax.__version__,
        "attention": getattr(plan, "attention_impl", None),
        "ok": ok,
        "cases": results,
        "startup_s": round(start_s, 2),
        "generate_s": round(gen_s, 2),
    }
    line = json.dumps(rec)
    print(line)
    if args.out:
        append_results(args.out, rec)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
