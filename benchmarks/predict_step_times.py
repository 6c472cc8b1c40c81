"""PREDICTED step times per chip (a roofline model, `jaxserve/tools/step_model.py`; nothing is
measured here): Llama-3-8B- and Llama-3-70B-shaped presets, decode steps of 1/8/64/256
sequences at a 2,048-token context and a 2,048-token prefill, on v5e, v6e, v5p, H100 and H200
meshes that fit, next to the published figures of other JAX servers for the same shapes.

`--validate` checks the model against compiled programs: the same presets cut to 2 layers,
compiled by `jaxserve shard-plan` for v5e:2x4 (XLA's TPU cost analysis: flops and bytes
accessed) and h100:1x8 (flops of the HLO's dots: XLA gives GPU programs compiled without a GPU
no cost analysis), at a decode bucket (64 tokens x 64 sequences) and a prefill bucket (2,048
tokens x 8 sequences); the weights per chip are checked against the plans' placement.

    python benchmarks/predict_step_times.py                  # the table; JSON lines to results/
    python benchmarks/predict_step_times.py --validate       # + compiles (needs libtpu and the
                                                             #   CUDA plugin; ~10 min on 2 cores)
"""

from __future__ import annotations

import argparse
import json
import pathlib
import subprocess
import sys
import tempfile

from jaxserve.tools.chips import CHIPS
from jaxserve.tools.shard_plan import model_config
from jaxserve.tools.step_model import Shapes, fits, layout, predict, step_cost

from results_log import append_results

RESULTS = pathlib.Path(__file__).parent / "results" / "predicted_step_times.jsonl"
CONTEXT, PREFILL = 2048, 2048
DECODE_SEQS = (1, 8, 64, 256)
# Tensor-parallel sizes a chip comes in (TPU slices; GPUs within one 8-GPU host).
MESHES = {
    "v5e": (1, 4, 8, 16),
    "v6e": (1, 4, 8),
    "v5p": (4, 8),
    "h100": (1, 2, 4, 8),
    "h200": (1, 2, 4, 8),
}
# Published figures for the same shapes: (model, chip, chips, decode sequences, context, layouts
# to predict as (KV head copies, quantization), the published value, its unit, the source).
# jax-llm-examples' Llama 3 runs int8 weights ("simple int8 quantization"): 159 tok/s at 85 % of
# v5e's HBM bandwidth is 4.4 GB a step per chip, 70B int8 weights over 16 chips.
ANCHORS = (
    (
        "llama3-70b",
        "v5e",
        16,
        8,
        CONTEXT,
        ((1, None), (2, None), (2, "int8")),
        159.0,
        "tok/s",
        "jax-llm-examples, Llama-3.1-70B, v5e-16 (TP16), batch 8, context 2048: "
        "159 tok/s a sequence, "
        "85.18 % of HBM bandwidth",
    ),
    (
        "llama3-8b",
        "v6e",
        4,
        16,
        CONTEXT,
        ((1, None),),
        9.9,
        "ms",
        "sglang-jax, Llama-3.1-8B, v6e-4 (TP4), 16 concurrent: 9.9 ms per output token",
    ),
)


def smallest_fitting_mesh(hf: dict, chip: str, kv_tokens: int) -> int | None:
    for n in MESHES[chip]:
        if fits(layout(hf, n), CHIPS[chip], kv_tokens):
            return n
    return None


def cells(shapes: Shapes, lay, chip):
    out = {}
    for b in DECODE_SEQS:
        p = predict(
            step_cost(shapes, lay, tokens=b, seqs=b, context=CONTEXT, prefill=False), CHIPS[chip]
        )
        out[f"decode_{b}"] = p
    out["prefill"] = predict(
        step_cost(shapes, lay, tokens=PREFILL, seqs=1, context=0, prefill=True), CHIPS[chip]
    )
    return out


def table(models: list[str]) -> list[dict]:
    rows = []
    for model in models:
        hf = model_config(model)[1]
        shapes = Shapes.from_hf(hf)
        for chip in MESHES:
            # the smallest mesh that holds every cell (256 sequences of 2,048 tokens), else the
            # smallest that holds 8 of them (the cells past it are marked)
            n = smallest_fitting_mesh(hf, chip, max(DECODE_SEQS) * CONTEXT)
            n = n or smallest_fitting_mesh(hf, chip, 8 * CONTEXT)
            if n is None:
                rows.append({"model": model, "chip": chip, "chips": None, "fits": False})
                continue
            lay = layout(hf, n)
            rec = {
                "model": model,
                "chip": chip,
                "chips": n,
                "fits": True,
                "weights_per_chip_gib": round(lay.weight_bytes / 2**30, 2),
                "replicated": list(lay.replicated),
            }
            for name, p in cells(shapes, lay, chip).items():
                b = int(name.split("_")[1]) if name.startswith("decode") else None
                rec[name] = {
                    "ms": round(p.seconds * 1e3, 3),
                    "bound": p.bound,
                    "collective_ms": round(p.collective_s * 1e3, 3),
                    "fits": b is None or fits(lay, CHIPS[chip], b * CONTEXT),
                }
            rows.append(rec)
    return rows


def anchors() -> list[dict]:
    out = []
    for model, chip, n, seqs, context, layouts, value, unit, source in ANCHORS:
        hf = model_config(model)[1]
        shapes = Shapes.from_hf(hf)
        for kv_copies, quantization in layouts:
            lay = layout(hf, n, kv_head_copies=kv_copies, quantization=quantization)
            p = predict(
                step_cost(shapes, lay, tokens=seqs, seqs=seqs, context=context, prefill=False),
                CHIPS[chip],
            )
            model_value = 1 / p.seconds if unit == "tok/s" else p.seconds * 1e3
            out.append(
                {
                    "anchor": source,
                    "model": model,
                    "chip": chip,
                    "chips": n,
                    "seqs": seqs,
                    "context": context,
                    "kv_head_copies": kv_copies,
                    "weights": quantization or "bfloat16",
                    "weights_per_chip_gib": round(lay.weight_bytes / 2**30, 2),
                    "fits": fits(lay, CHIPS[chip], seqs * context),
                    "published": value,
                    "unit": unit,
                    "predicted": round(model_value, 2),
                    "published_over_predicted": round(value / model_value, 3),
                    "memory_ms": round(p.memory_s * 1e3, 3),
                    "collective_ms": round(p.collective_s * 1e3, 3),
                }
            )
    return out


def validate() -> list[dict]:
    """Compile 2-layer cuts of the presets and compare with the model's per-chip figures."""
    out = []
    with tempfile.TemporaryDirectory() as tmp:
        for model in ("llama3-8b", "llama3-70b"):
            hf = {**model_config(model)[1], "num_hidden_layers": 2}
            path = pathlib.Path(tmp) / model / "config.json"
            path.parent.mkdir()
            path.write_text(json.dumps(hf))
            jsonl = pathlib.Path(tmp) / f"{model}.jsonl"
            subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "jaxserve.server.cli",
                    "shard-plan",
                    str(path),
                    "--topology",
                    "v5e:2x4,h100:1x8",
                    "--mesh",
                    "1x8",
                    "--buckets",
                    "64x64,2048x8",
                    "--max-model-len",
                    "2048",
                    "--json",
                    str(jsonl),
                ],
                check=False,
            )
            shapes = Shapes.from_hf(hf)
            lay = layout(hf, 8)
            for line in jsonl.read_text().splitlines() if jsonl.exists() else []:
                rec = json.loads(line)
                if rec.get("error") or not rec.get("cost"):
                    out.append(
                        {"model": model, "target": rec.get("target"), "error": rec.get("error")}
                    )
                    continue
                T, R = rec["bucket"]
                prefill = T > R
                # The compiled step at its bucket: T tokens, R sequences, logits for R rows; the
                # attention kernel is a custom call, outside both XLA's and the HLO's flop counts;
                # both count the sampler's prompt-logprob branch (a lax.cond computing the logits
                # of every token, taken only when a request asks) as if it ran.
                cost = step_cost(
                    shapes, lay, tokens=T, seqs=R, context=0 if prefill else 1, prefill=prefill
                )
                attention = (
                    4
                    * ((T // R) * (T // R + 1) / 2 * R if prefill else R)
                    * lay.local_q_heads
                    * shapes.head_dim
                    * shapes.layers
                )
                c = rec["cost"]
                model_flops = cost.flops - attention + 2 * T * lay.lm_head_params
                out.append(
                    {
                        "model": f"{model} (2 layers)",
                        "target": rec["target"],
                        "bucket": rec["bucket"],
                        "source": c.get("source"),
                        "compiled_flops": c["flops"],
                        "model_flops": model_flops,
                        "flops_ratio": round(c["flops"] / model_flops, 3),
                        "compiled_bytes_accessed": c.get("bytes_accessed") or None,
                        "model_bytes_without_kv": cost.weight_bytes + cost.activation_bytes,
                        "bytes_ratio": round(
                            c["bytes_accessed"] / (cost.weight_bytes + cost.activation_bytes), 3
                        )
                        if c.get("bytes_accessed")
                        else None,
                        "plan_params_per_chip": rec["params"]["per_device"],
                        "model_weights_per_chip": lay.weight_bytes,
                    }
                )
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", default=["llama3-8b", "llama3-70b"])
    p.add_argument("--validate", action="store_true", help="also compile 2-layer cuts and compare")
    p.add_argument("--out", default=str(RESULTS))
    args = p.parse_args()
    sha = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False
    ).stdout.strip()
    head = {"bench": "predict_step_times", "git_sha": sha, "predicted": True, "context": CONTEXT}
    rows = table(args.models)
    print(
        f"PREDICTED (roofline model), context {CONTEXT}; ms a step (tok/s a sequence = 1000 / ms)"
    )
    print(
        f"{'model':11} {'chip':5} {'chips':>5} {'W/chip GiB':>10} "
        + " ".join(f"{'decode ' + str(b):>12}" for b in DECODE_SEQS)
        + f" {'prefill 2048':>13}"
    )
    append_results(args.out, [{**head, **r} for r in rows])
    for r in rows:
        if not r["fits"]:
            print(
                f"{r['model']:11} {r['chip']:5}   does not fit on "
                f"{max(MESHES[r['chip']])} chips"
            )
            continue
        cellsx = [
            f"{r[f'decode_{b}']['ms']:>10.2f}{'' if r[f'decode_{b}']['fits'] else '*':2}"
            for b in DECODE_SEQS
        ]
        print(
            f"{r['model']:11} {r['chip']:5} {r['chips']:>5} {r['weights_per_chip_gib']:>10} "
            + " ".join(cellsx)
            + f" {r['prefill']['ms']:>11.2f}{r['prefill']['bound'][0]:>2}"
        )
    print(
        "(* the KV cache of that many 2,048-token sequences does not fit on the mesh; "
        "a prefill's c/m: compute / memory bound)"
    )
    for a in anchors():
        append_results(args.out, {**head, **a})
        print(
            f"anchor: {a['anchor']}\n    predicted with {a['weights']} weights, KV head copies "
            f"{a['kv_head_copies']}: {a['predicted']} {a['unit']} (published / predicted "
            f"{a['published_over_predicted']}; fits: {a['fits']}, "
            f"weights {a['weights_per_chip_gib']} GiB "
            f"per chip, collectives {a['collective_ms']} ms)"
        )
    if args.validate:
        for v in validate():
            append_results(args.out, {**head, "validation": True, **v})
            print("validate:", json.dumps(v))
    return 0


if __name__ == "__main__":
    sys.exit(main())
