"""MoE step time: grouped expert computation against every expert on every token.

A tiny but real-shaped Mixtral-style model with random weights (default: 4 layers, hidden
1024, 16 query / 4 KV heads, 8 experts of intermediate 1024, top-2, vocab 8192) runs decode
steps (`--decode-tokens`: n requests x 1 token, 128 tokens of context each; default 32) and
one prefill step (32 requests x 16 tokens) through the paged model forward (embedding to
logits), with each MoE implementation of layers/moe.py: "tiled-or-dense" (the CPU backend's
plan: dense for small steps of bfloat16 experts, see `DENSE_MAX_EXTRA_ROWS`), "tiled" (the
grouped products in tiles), "ragged" (jax.lax.ragged_dot: native on TPU/GPU, a masked dense product
on XLA:CPU) and "dense" (every expert on every token). The implementations alternate within each repetition
(the machine may be shared); the table shows medians and the ratio to "dense".
One JSON line per (step, tokens, impl) goes to benchmarks/results/moe.jsonl.

    python benchmarks/moe_benchmark.py [--dtype bfloat16] [--reps 7] [--decode-tokens 32 64 128]
        [--impls tiled-or-dense tiled dense] [--steps decode prefill]
"""

from __future__ import annotations

import argparse
import datetime
import os
import pathlib
import statistics
import sys
import time

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from offline_throughput import environment

from results_log import append_results  # noqa: E402

RESULTS = HERE / "results" / "moe.jsonl"


def build(args):
    import jax
    import jax.numpy as jnp
    from flax import nnx
    from jaxserve.models.arch_config import ArchConfig
    from jaxserve.models.sharding import single_device_mesh
    from jaxserve.models.weights import create_model

    from jaxserve.runner.kv_cache import allocate_kv_cache

    cfg = ArchConfig.from_hf(dict(
        architectures=["MixtralForCausalLM"], vocab_size=args.vocab, hidden_size=args.hidden,
        intermediate_size=args.expert_size, num_hidden_layers=args.layers, num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads, num_local_experts=args.experts, num_experts_per_tok=args.top_k,
        max_position_embeddings=4096, rope_theta=1e6, tie_word_embeddings=False))
    dtype = jnp.dtype(args.dtype)
    kv = allocate_kv_cache(cfg, args.pages, 16, dtype, single_device_mesh())
    fwds = {}
    for impl in args.impls:  # the same weights (seed 0), built with each implementation
        graphdef, state = nnx.split(create_model(cfg, dtype=dtype, seed=0, moe_impl=impl))

        def fwd(state, kv, inputs, graphdef=graphdef):
            m = nnx.merge(graphdef, state)
            h, kv = m(inputs.input_ids, inputs.positions, kv, inputs.md)
            return m.compute_logits(h[inputs.logits_indices]), kv

        fwds[impl] = (jax.jit(fwd, donate_argnums=1), state)
    return cfg, kv, fwds


def step_inputs(kind: str, args, n: int):
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxserve.runner.step_inputs import StepRequest, pack_step

    rng = np.random.default_rng(0)
    reqs = []
    per = args.context // 16 + 2
    for r in range(n):
        blocks = [1 + r * per + i for i in range(per)]
        if kind == "decode":
            reqs.append(StepRequest(token_ids=[int(rng.integers(args.vocab))], start_pos=args.context, block_ids=blocks))
        else:
            reqs.append(StepRequest(token_ids=rng.integers(args.vocab, size=args.prefill_len).tolist(), start_pos=0,
                                    block_ids=blocks))
    tokens = n if kind == "decode" else n * args.prefill_len
    inputs = pack_step(reqs, num_tokens=tokens, num_reqs=n, pages_per_req=per, page_size=16)
    return jax.tree.map(jnp.asarray, inputs), tokens


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    p.add_argument("--impls", nargs="+", default=["tiled-or-dense", "tiled", "ragged", "dense"])
    p.add_argument("--steps", nargs="+", default=["decode", "prefill"], choices=["decode", "prefill"])
    p.add_argument("--decode-tokens", type=int, nargs="+", default=[32],
                   help="decode steps of this many requests (one token each)")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--expert-size", type=int, default=1024)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--requests", type=int, default=32, help="requests of the prefill step")
    p.add_argument("--context", type=int, default=128)
    p.add_argument("--prefill-len", type=int, default=16)
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--results", default=str(RESULTS))
    args = p.parse_args(argv)
    args.pages = 1 + max(args.requests, *args.decode_tokens) * (args.context // 16 + 2)
    import jax

    _, kv, fwds = build(args)
    env = environment()
    rows = []
    steps = [("decode", n) for n in args.decode_tokens if "decode" in args.steps]
    steps += [("prefill", args.requests)] if "prefill" in args.steps else []
    for kind, n in steps:
        inputs, tokens = step_inputs(kind, args, n)
        times = {impl: [] for impl in args.impls}
        for impl, (f, state) in fwds.items():  # compile and warm up
            logits, kv = f(state, kv, inputs)
            jax.block_until_ready(logits)
        for _ in range(args.reps):
            for impl, (f, state) in fwds.items():
                t0 = time.perf_counter()
                logits, kv = f(state, kv, inputs)
                jax.block_until_ready(logits)
                times[impl].append(time.perf_counter() - t0)
        for impl in args.impls:
            rows.append({"benchmark": "moe_step", "step": kind, "impl": impl, "tokens": tokens, "requests": n,
                         "median_ms": 1e3 * statistics.median(times[impl]), "all_ms": [1e3 * t for t in times[impl]],
                         "config": {k: v for k, v in vars(args).items() if k not in ("results", "impls")},
                         "load_avg": os.getloadavg(), **env})
    stamp = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    if args.results:
        append_results(args.results, [{**row, "timestamp": stamp} for row in rows])
    print(f"\n{env['host']['cpu']} ({env['host']['cpu_count']} cores), {env['device']}, jax "
          f"{env['versions']['jax']}, git {str(env['git_sha'])[:10]}, {args.dtype}, {args.experts} experts top-{args.top_k}")
    print(f"{'step':8} {'tokens':>6} {'impl':>7} {'median ms':>10} {'vs dense':>9}")
    for kind, n in steps:
        mine = [r for r in rows if r["step"] == kind and r["requests"] == n]
        base = next((r["median_ms"] for r in mine if r["impl"] == "dense"), None)
        for r in mine:
            ratio = f"{base / r['median_ms']:.2f}x" if base else "-"
            print(f"{kind:8} {r['tokens']:6d} {r['impl']:>7} {r['median_ms']:10.1f} {ratio:>9}")


if __name__ == "__main__":
    main()
