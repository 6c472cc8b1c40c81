"""Speculative decoding's PREDICTED accelerator speed-up, from the compiled step programs and the
acceptance measured on the CPU: nothing runs on a chip, nothing here is a measured time.

    .venv/bin/python benchmarks/spec_decode_predicted.py [--preset smollm2-135m] [--layers 0]
        [--context 1024] [--concurrency 1,4,16] [--topology v6e:1x1,h100:1x1] [--k 3]
        [--methods none,ngram,eagle3,draft_model] [--draft-layers 4]
        [--acceptance benchmarks/results/spec_decode.jsonl]

For each target (TPU targets through libtpu's compile-only topologies, GPU targets through
JAX's CUDA plugin; step_anatomy.py's `step_records`: the server's own step, `plan_recipe` +
`abstract_step` + `lower_bucket`, abstract weights) and each c concurrent sequences, the decode
step of each method is compiled:

  none         the plain step: one token and one sampling row per sequence, bucket (c, c);
  ngram        the plain step verifying k drafts (the n-gram proposer drafts on the host):
               k + 1 tokens and rows per sequence, bucket (c (k + 1), c (k + 1));
  eagle3       the step with an EAGLE-3 head verifying k drafts and drafting the next k (the
               head's pass over the step's tokens and k - 1 chained), same bucket; the head is
               abstract: a config in the speculators layout of the target's shape (one decoder
               layer like the target's, `--draft-vocab` draft tokens), no weights;
  draft_model  the step with a draft model verifying k drafts and drafting k: a random model of
               the target's shape cut to `--draft-layers` layers (same vocabulary; its KV pages
               are the target's per layer), abstract too.

Every step is compiled for one server: max_num_seqs = max(c) (k + 1) (as the CPU benchmark
runs, so that every request may draft), a KV cache of max_num_seqs x context tokens, and every
sequence at `--context` tokens of context.

Per step: `bytes_moved` (step_anatomy.py's walk of the optimized HLO: the plain sampling path,
per device) and the PREDICTED step time t = bytes_moved / the chip's HBM bandwidth
(jaxserve/tools/chips.py): a roofline from the compiled program, not measured; XLA's own cost
analysis ("bytes accessed") is recorded beside it where the compiler gives one (TPU).

Per method and c, with tau the mean acceptance length measured on the CPU
(spec_decode_benchmark.py --eagle3, workload "chat": accepted drafts per verifying step + 1,
the last line of each (method, c) in `--acceptance`; read, not re-run) and f the share of a
request's steps that verified drafts there (verifying steps / (output tokens - accepted
drafts): n-gram finds a draft in few chat steps, EAGLE-3 in nearly all):

  predicted_speedup        = ((1 + f (tau - 1)) / (f t_method + (1 - f) t_none)) / (1 / t_none):
                             tokens a sequence gains per second over plain decoding's, a step
                             that verifies nothing costed as the plain step (for EAGLE-3 and a
                             draft model, whose drafter runs in every step, a slight
                             overestimate); `predicted_speedup_every_step_verifying`: f = 1;
  break_even_acceptance    = t_method / t_none: the acceptance length at which the speed-up is
                             1.0, whatever f (above k + 1 the method cannot pay for its step);
  *_without_cache_copies   the same with each step's `cache_copy_bytes` (step_anatomy.py: kernels
                           that copy or rewrite a whole cache-sized array) taken out of its bytes.

One JSON line per (target, method, c) to benchmarks/results/spec_decode_predicted.jsonl.
Compiled HLO is cached as step_anatomy.py caches it ($JAXSERVE_STEP_ANATOMY_CACHE).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import tempfile
import time

HERE = pathlib.Path(__file__).resolve().parent
RESULTS = HERE / "results" / "spec_decode_predicted.jsonl"
ACCEPTANCE = HERE / "results" / "spec_decode.jsonl"
sys.path.insert(0, str(HERE))
from results_log import append_results  # noqa: E402

METHODS = ("none", "ngram", "eagle3", "draft_model")
PREDICTED = "roofline: bytes_moved of the compiled step / the chip's HBM bandwidth; not measured"


# ------------------------------------------------------------------------------ the arithmetic
def measured_acceptance(path: str | os.PathLike, workload: str = "chat"
                        ) -> dict[tuple[str, int], dict]:
    """{(method, c): the last line of that method and concurrency on `workload`} of a
    spec_decode.jsonl (its mean_acceptance_length and provenance)."""
    out: dict[tuple[str, int], dict] = {}
    for line in pathlib.Path(path).read_text().splitlines():
        if not line.strip():
            continue
        rec = json.loads(line)
        if rec.get("workload") == workload and "method" in rec and "mean_acceptance_length" in rec:
            out[(rec["method"], int(rec["concurrency"]))] = rec
    return out


def predicted_speedup(acceptance_length: float, step_s: float, plain_step_s: float,
                      verifying_share: float = 1.0) -> float:
    """Tokens per second per sequence with drafts over plain decoding's (one token a step of
    plain_step_s). A share `verifying_share` of the request's steps verify drafts: each gains
    acceptance_length tokens in a step of step_s; the others are plain steps."""
    if step_s <= 0 or plain_step_s <= 0:
        raise ValueError("step times must be positive")
    if not 0.0 <= verifying_share <= 1.0:
        raise ValueError("the verifying share is a fraction of the steps")
    f = verifying_share
    tokens = 1.0 + f * (acceptance_length - 1.0)
    return (tokens / (f * step_s + (1.0 - f) * plain_step_s)) / (1.0 / plain_step_s)


def break_even_acceptance(step_s: float, plain_step_s: float) -> float:
    """The mean acceptance length at which a method's predicted speed-up is 1.0 (whatever share
    of the steps verify: a verifying step must give step_s / plain_step_s tokens)."""
    return step_s / plain_step_s


def verifying_share(measured: dict) -> float:
    """The share of a request's steps that verified drafts in a spec_decode.jsonl line: its
    verifying steps over its request steps (output tokens less accepted drafts: every request
    step gives one token besides the drafts it accepts)."""
    tokens = measured["output_tokens"] * measured.get("repeats", 1)
    steps = tokens - measured["accepted_tokens"]
    return min(1.0, measured["verifying_steps"] / steps) if steps > 0 else 0.0


def step_time_s(bytes_moved: float, hbm_bandwidth: float) -> float:
    """The roofline step time: the step's HBM traffic at the chip's bandwidth."""
    return bytes_moved / hbm_bandwidth


def prediction_rows(steps: dict[tuple[str, int], dict], acceptance: dict[tuple[str, int], dict],
                    k: int) -> list[dict]:
    """One row per (method, c) of one target from its compiled steps ({(method, c): a
    step_anatomy record}) and the measured acceptance; none's step is every method's baseline."""
    rows = []
    order = sorted(steps, key=lambda key: (key[1], METHODS.index(key[0])))
    for method, c in order:
        rec = steps[(method, c)]
        plain = steps[("none", c)]
        bw = rec["hbm_bandwidth"]
        t, t_plain = step_time_s(rec["bytes_moved"], bw), step_time_s(plain["bytes_moved"], bw)
        t_nc = step_time_s(rec["bytes_moved"] - rec["cache_copy_bytes"], bw)
        t_plain_nc = step_time_s(plain["bytes_moved"] - plain["cache_copy_bytes"], bw)
        measured = acceptance.get((method, c))
        tau = 1.0 if method == "none" else (measured or {}).get("mean_acceptance_length")
        share = 0.0 if method == "none" or measured is None else verifying_share(measured)
        cost = rec.get("xla_cost_analysis") or {}
        rows.append({
            "benchmark": "spec_decode_predicted", "target": rec["target"], "model": rec["model"],
            "layers": rec["layers"], "context": rec["context"], "method": method, "concurrency": c,
            "num_speculative_tokens": 0 if method == "none" else k, "bucket": rec["bucket"],
            "dtype": rec["dtype"], "kv_cache_dtype": rec["kv_cache_dtype"],
            "attention_impl": rec["attention_impl"], "kernels": rec["kernels"],
            "bytes_moved": rec["bytes_moved"], "xla_bytes_accessed": cost.get("bytes accessed"),
            "bytes_by_part": {part: v["bytes"] for part, v in rec["by_part"].items()},
            "minimum_bytes": rec["minimum"]["total"], "bytes_over_minimum": rec["bytes_over_minimum"],
            "cache_copies": rec["cache_copies"], "cache_copy_bytes": rec["cache_copy_bytes"],
            "hbm_bandwidth": bw, "predicted": PREDICTED,
            "predicted_step_us": round(t * 1e6, 2), "predicted_plain_step_us": round(t_plain * 1e6, 2),
            "step_cost_vs_plain": round(t / t_plain, 4),
            "break_even_acceptance_length": round(break_even_acceptance(t, t_plain), 4),
            "mean_acceptance_length": tau, "verifying_share": round(share, 4),
            "predicted_speedup": None if tau is None
            else round(predicted_speedup(tau, t, t_plain, share), 4),
            "predicted_speedup_every_step_verifying": None if tau is None
            else round(predicted_speedup(tau, t, t_plain), 4),
            # the same without the kernels that copy a whole cache (cache_copy_bytes): what the
            # step would move if the compiler kept the cache in place
            "break_even_without_cache_copies": round(break_even_acceptance(t_nc, t_plain_nc), 4),
            "predicted_speedup_without_cache_copies": None if tau is None
            else round(predicted_speedup(tau, t_nc, t_plain_nc, share), 4),
            "acceptance_source": None if method == "none" or measured is None else {
                "file": "benchmarks/results/spec_decode.jsonl", "workload": measured.get("workload"),
                "commit": measured.get("commit") or measured.get("git_sha"), "time": measured.get("time"),
                "weight_formula_speedup": measured.get("predicted_accelerator_speedup")},
            "compile_s": rec["compile_s"], "compile_cached": rec["compile_cached"],
            "lower_s": rec["lower_s"],
        })
    return rows


# ------------------------------------------------------------------------------ the drafters
def _placeholder_weights(path: pathlib.Path) -> None:
    """An empty safetensors file: the directory reads as a checkpoint; its weights stay abstract."""
    header = b"{}"
    path.write_bytes(len(header).to_bytes(8, "little") + header)


def eagle3_head_dir(root: pathlib.Path, target_hf: dict, k: int, draft_vocab: int) -> str:
    """A config-only EAGLE-3 head of the target's shape in the speculators layout (one decoder
    layer like the target's, `draft_vocab` draft tokens, reading target layers 2, L / 2 and L - 3:
    speculators' default, or 0, L / 2 and L for a target cut below 8 layers)."""
    n = int(target_hf["num_hidden_layers"])
    taps = [2, n // 2, n - 3] if n >= 8 else [0, n // 2, n]  # speculators' default where distinct
    layer = {key: v for key, v in target_hf.items() if key not in ("architectures", "torch_dtype")}
    layer.update({"model_type": "llama", "num_hidden_layers": 1, "tie_word_embeddings": False})
    config = {
        "architectures": ["Eagle3DraftModel"],
        "speculators_model_type": "eagle3",
        "speculators_config": {
            "algorithm": "eagle3", "default_proposal_method": "greedy",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": k,
                                  "accept_tolerance": 0.0, "verifier_accept_k": 1}],
            "verifier": {"architectures": list(target_hf.get("architectures") or []),
                         "name_or_path": None},
        },
        "transformer_layer_config": layer,
        "draft_vocab_size": draft_vocab,
        "eagle_aux_hidden_state_layer_ids": taps,
        "norm_before_residual": False,
        "norm_output": False,
        "target_hidden_size": None,
        "tie_word_embeddings": False,
        "dtype": "bfloat16",
    }
    out = root / "eagle3_head"
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=1))
    _placeholder_weights(out / "model.safetensors")
    return str(out)


def draft_model_dir(root: pathlib.Path, target_hf: dict, layers: int) -> str:
    """A config-only draft model: the target's config cut to `layers` layers."""
    out = root / "draft_model"
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps({**target_hf, "num_hidden_layers": layers}, indent=1))
    _placeholder_weights(out / "model.safetensors")
    return str(out)


# ------------------------------------------------------------------------------ the compiles
def compile_steps(arch: dict, target: str, methods: list[str], concurrency: list[int], *, k: int,
                  context: int, model_name: str, drafters: dict[str, str], log=print
                  ) -> dict[tuple[str, int], dict]:
    """{(method, c): step_anatomy's record of that decode step compiled for `target`}."""
    from step_anatomy import step_records

    steps = {}
    for method in methods:
        t0 = time.perf_counter()
        recs = step_records(
            arch, target, context=context, decode=concurrency, prefill=0, model_name=model_name,
            max_num_seqs=max(concurrency) * (k + 1),
            num_speculative_tokens=0 if method == "none" else k,
            draft_model=drafters.get(method, ""),
            draft_method=method if method in drafters else "",
            tokens_per_seq=1 if method == "none" else k + 1,
        )
        for rec in recs:
            steps[(method, rec["seqs"])] = rec
            log(f"{target:9s} {method:11s} c={rec['seqs']:3d} bucket {rec['bucket']}  moved "
                f"{rec['bytes_moved'] / 1e6:9.1f} MB  compile {rec['compile_s']}s"
                f"{' cached' if rec['compile_cached'] else ''}")
        log(f"{target:9s} {method:11s} ({time.perf_counter() - t0:.0f} s)")
    return steps


def table(rows: list[dict]) -> str:
    """The markdown table of the rows: per target and c, each method's step and speed-up."""
    lines = ["| target | c | method | MB moved | step us (PREDICTED) | x plain step | acceptance length "
             "(CPU) | steps verifying | break-even length | PREDICTED speed-up | without cache copies |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]

    def x(v):
        return "-" if v is None else f"{v:.2f}x"

    for r in rows:
        tau = "-" if r["mean_acceptance_length"] is None else f"{r['mean_acceptance_length']:.2f}"
        lines.append(f"| {r['target']} | {r['concurrency']} | {r['method']} | {r['bytes_moved'] / 1e6:.0f} "
                     f"| {r['predicted_step_us']:.1f} | {r['step_cost_vs_plain']:.2f} | {tau} "
                     f"| {100 * r['verifying_share']:.0f} % | {r['break_even_acceptance_length']:.2f} "
                     f"| {x(r['predicted_speedup'])} | {x(r['predicted_speedup_without_cache_copies'])} |")
    return "\n".join(lines)


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="smollm2-135m",
                   help="an architecture preset of shard-plan, or a config.json")
    p.add_argument("--layers", type=int, default=0, help="cut the target to this many layers (0: all)")
    p.add_argument("--context", type=int, default=1024,
                   help="every sequence's context (and max_model_len)")
    p.add_argument("--concurrency", type=_ints, default=[1, 4, 16],
                   help="sequences per step, comma-separated")
    p.add_argument("--topology", default="v6e:1x1,h100:1x1", help="targets, comma-separated")
    p.add_argument("--k", type=int, default=3, help="drafts per sequence and step")
    p.add_argument("--methods", default=",".join(METHODS),
                   help="comma-separated; none is always compiled")
    p.add_argument("--draft-vocab", type=int, default=4096, help="the EAGLE-3 head's draft vocabulary")
    p.add_argument("--draft-layers", type=int, default=4,
                   help="the draft model's layers (the target's shape)")
    p.add_argument("--acceptance", default=str(ACCEPTANCE),
                   help="spec_decode.jsonl with the chat workload")
    p.add_argument("--json", default=str(RESULTS),
                   help="append one JSON line per (target, method, c) ('' = none)")
    a = p.parse_args(argv)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    from step_anatomy import load_arch

    methods = ["none"] + [m for m in a.methods.split(",") if m and m != "none"]
    unknown = set(methods) - set(METHODS)
    if unknown:
        p.error(f"unknown methods {sorted(unknown)}; choose from {', '.join(METHODS)}")
    arch = load_arch(a.preset, a.layers)
    acceptance = measured_acceptance(a.acceptance)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        root = pathlib.Path(tmp)
        drafters = {}
        if "eagle3" in methods:
            drafters["eagle3"] = eagle3_head_dir(root, arch, a.k, a.draft_vocab)
        if "draft_model" in methods:
            drafters["draft_model"] = draft_model_dir(root, arch, a.draft_layers)
        for target in [t for t in a.topology.split(",") if t]:
            steps = compile_steps(arch, target, methods, a.concurrency, k=a.k, context=a.context,
                                  model_name=a.preset, drafters=drafters,
                                  log=lambda s: print(s, flush=True))
            new = prediction_rows(steps, acceptance, a.k)
            for r in new:
                r.update({"compile_only": True,
                          "draft_vocab": a.draft_vocab if r["method"] == "eagle3" else None,
                          "draft_layers": a.draft_layers if r["method"] == "draft_model" else None,
                          "max_num_seqs": max(a.concurrency) * (a.k + 1),
                          "loadavg": [round(x, 2) for x in os.getloadavg()]})
            if a.json:
                append_results(a.json, new)
            rows += new
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
