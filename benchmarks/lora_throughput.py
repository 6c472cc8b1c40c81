"""Offline throughput with LoRA adapters: 32 requests with 0, 1, 4 and 8 distinct adapters in the
batch, and the cost of the LoRA path when no adapter is active.

The model is the bundled default (SmolLM2-135M) unless `--model` names another; the adapters are
random PEFT adapters of rank `--rank` on all seven targets (q/k/v/o, gate/up/down), written to a
temporary folder from a fixed seed (no download). Two engines: one without LoRA (the base line)
and one with `--enable-lora --max-loras 8 --max-lora-rank RANK`; each case generates
`--output-len` greedy tokens (ignore_eos) for 32 prompts of `--prompt-len` random tokens, once to
warm and `--repeats` times measured (the median reported). The ratio "lora path, no adapter" /
"no lora" is the price of the LoRA path on the base model (the issue's goal: within 5 %).

    .venv/bin/python benchmarks/lora_throughput.py [--rank 16] [--output-len 32] [--repeats 3]

One JSON line per run goes to benchmarks/results/lora_throughput.jsonl. The machine may be
shared: check the load average in the JSON line before trusting a figure.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import platform
import statistics
import subprocess
import tempfile
import time

import numpy as np

from results_log import append_results

RESULTS = pathlib.Path(__file__).parent / "results" / "lora_throughput.jsonl"
MODULES = {
    "q_proj": "self_attn",
    "k_proj": "self_attn",
    "v_proj": "self_attn",
    "o_proj": "self_attn",
    "gate_proj": "mlp",
    "up_proj": "mlp",
    "down_proj": "mlp",
}


def write_adapter(path: pathlib.Path, cfg: dict, rank: int, seed: int) -> None:
    """A random PEFT LoRA adapter for the model of HF config `cfg` (update ~1 % of the weights')."""
    from safetensors.numpy import save_file

    E, F = cfg["hidden_size"], cfg["intermediate_size"]
    Hq, Hkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    D = cfg.get("head_dim") or E // Hq
    dims = {
        "q_proj": (E, Hq * D),
        "k_proj": (E, Hkv * D),
        "v_proj": (E, Hkv * D),
        "o_proj": (Hq * D, E),
        "gate_proj": (E, F),
        "up_proj": (E, F),
        "down_proj": (F, E),
    }
    rng = np.random.default_rng(seed)
    tensors = {}
    for i in range(cfg["num_hidden_layers"]):
        for m, block in MODULES.items():
            n_in, n_out = dims[m]
            key = f"base_model.model.model.layers.{i}.{block}.{m}"
            tensors[f"{key}.lora_A.weight"] = (
                rng.standard_normal((rank, n_in)) / np.sqrt(n_in)
            ).astype(np.float32)
            tensors[f"{key}.lora_B.weight"] = (0.01 * rng.standard_normal((n_out, rank))).astype(
                np.float32
            )
    path.mkdir(parents=True)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    (path / "adapter_config.json").write_text(
        json.dumps(
            {
                "peft_type": "LORA",
                "r": rank,
                "lora_alpha": 2 * rank,
                "target_modules": list(MODULES),
            }
        )
    )


def run_case(llm, prompts, params, loras, repeats: int) -> dict:
    llm.generate(prompts, params, use_tqdm=False, lora_request=loras)  # warm (adapters loaded)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False, lora_request=loras)
        times.append(time.perf_counter() - t0)
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    wall = statistics.median(times)
    return {
        "wall_s": round(wall, 3),
        "output_tok_s": round(tokens / wall, 1),
        "times": [round(t, 3) for t in times],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dtype", default="float32")
    args = ap.parse_args()

    from jaxserve import LLM, LoRARequest, SamplingParams
    from jaxserve.models.loader import resolve_model

    model = str(resolve_model(args.model))
    cfg = json.loads((pathlib.Path(model) / "config.json").read_text())
    rng = np.random.default_rng(0)
    prompts = [
        rng.integers(10, cfg["vocab_size"] - 200, args.prompt_len).tolist()
        for _ in range(args.requests)
    ]
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    n = args.requests
    engine = dict(
        dtype=args.dtype,
        max_num_seqs=n,
        max_model_len=args.prompt_len + args.output_len + 16,
        token_buckets=(n, 512),
        request_buckets=(n,),
        enable_prefix_caching=False,
        show_progress=False,
    )
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        adapters = []
        for i in range(8):
            write_adapter(pathlib.Path(tmp) / f"a{i}", cfg, args.rank, seed=i)
            adapters.append(LoRARequest(f"a{i}", i + 1, str(pathlib.Path(tmp) / f"a{i}")))
        llm = LLM(model, **engine)
        results["no lora"] = run_case(llm, prompts, params, None, args.repeats)
        del llm
        llm = LLM(model, enable_lora=True, max_loras=8, max_lora_rank=args.rank, **engine)
        for k in (0, 1, 4, 8):
            loras = [adapters[i % k] for i in range(n)] if k else None
            results[f"{k} adapters"] = run_case(llm, prompts, params, loras, args.repeats)
        recompiles = llm.engine.num_compiles_after_warmup
    base = results["no lora"]["output_tok_s"]
    print(f"{'case':<14}{'output tok/s':>14}{'vs no lora':>12}")
    for name, r in results.items():
        print(f"{name:<14}{r['output_tok_s']:>14.1f}{r['output_tok_s'] / base:>12.3f}")
    record = {
        "time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "host": platform.node(),
        "git_sha": subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                                  cwd=pathlib.Path(__file__).parent).stdout.strip() or None,
        "load_avg": os.getloadavg(),
        "model": cfg.get("architectures"),
        "dtype": args.dtype,
        "rank": args.rank,
        "requests": n,
        "prompt_len": args.prompt_len,
        "output_len": args.output_len,
        "recompiles": recompiles,
        "results": results,
        "lora_path_cost": round(1 - results["0 adapters"]["output_tok_s"] / base, 4),
    }
    append_results(RESULTS, record)


if __name__ == "__main__":
    main()
