"""Speculative decoding's step times: the engine's own compiled step, timed on the device at c
decoding sequences, and the speed-up that predicts at the acceptance measured on the CPU.

Three steps per concurrency c, every sequence at a context of `--context` tokens:

  plain   each sequence feeds its one token (c tokens, c sampling rows);
  ngram   each feeds its token and k drafts (c(k + 1) tokens and sampling rows): n-gram
          speculation's verifying step;
  eagle3  the same k + 1 tokens each through the step that also runs an EAGLE-3 head and drafts
          k tokens per sequence (runner/draft_head_step.py): a head of the target's shape with
          random weights, written to a temporary directory in the speculators layout
          (benchmarks/train_eagle3.py's config; the step does the same work whatever it
          drafts).

plain and ngram run on one engine with the n-gram config (n-gram drafting is host-side: its
step's program is plain decoding's), eagle3 on one with the head. The rows are written here,
as the scheduler would write them (fixed tokens, each sequence its own pages), and run through
the engine's runner: `prepare` once, then `launch` and `collect` (the step's dispatch to its
tokens on the host, the one transfer included) `--warmup` times untimed and `--steps` times
timed; the median is reported. The buckets: `--token-buckets` / `--request-buckets` where given
(the device check passes its served run's), else those the served engine's default grid picks
for the cells (T from 16 doubling, R from 8 times 4); only those are compiled, in both engines.

Per cell: `step_ms`, `tokens` (what the step can emit: c plain, c(k + 1) with drafts, all
accepted), `tok_per_s` (c over the plain step's time, the sequences' rate when nothing is
accepted), and for ngram and eagle3 the predicted decode speed-up over plain decoding at the
acceptance the CPU measured (benchmarks/results/spec_decode.jsonl, workload "chat", the row of
the same method and c, else of the method's lowest c):

  tau  the mean acceptance length (accepted drafts per verifying step + 1);
  s    the share of a request's steps that verified drafts: verifying steps / (N - A), N the
       output tokens, A the accepted drafts (every request step gives one token plus its
       accepted drafts). The n-gram method drafts only where its lookup matches, EAGLE-3 in
       nearly every step;
  e    tokens per request step, 1 + s (tau - 1) = N / (N - A);
  predicted_speedup  e x t_plain / t_step, t_step = s t_ngram + (1 - s) t_plain for n-gram (a
       step that drafts nothing is a plain step) and t_eagle3 for EAGLE-3 (its head runs in
       every step). A batch mixes verifying and plain rows; weighting per request by s is the
       simplification.
  speedup_per_verifying_step  tau x t_plain / t_spec: every step verifying at tau.

    .venv/bin/python benchmarks/spec_step_times.py [--model DIR] [--concurrency 1 4 16]
        [--context 1024] [--num-speculative-tokens 3] [--steps 20] [--out FILE]

One JSON line per (method, c) to `--out` (default benchmarks/results/spec_step_times.jsonl), each
as its cell is timed.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
import tempfile
import time

import numpy as np

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from results_log import append_results  # noqa: E402

RESULTS = HERE / "results" / "spec_step_times.jsonl"
SPEC_DECODE = HERE / "results" / "spec_decode.jsonl"
# A token budget the served grid is built to (its token buckets double from 16 up to it): any
# at or above the cells' largest step picks the same buckets for them.
DEFAULT_TOKEN_BUDGET = 2048


def random_tensors(shapes: dict[str, tuple[int, ...]], seed: int = 0) -> dict[str, np.ndarray]:
    """float32 weights of `shapes`: norms (1-d) ones, the others 0.02 x N(0, 1)."""
    rng = np.random.default_rng(seed)
    return {name: (np.ones(shape, np.float32) if len(shape) == 1
                   else 0.02 * rng.standard_normal(shape, np.float32))
            for name, shape in shapes.items()}


def write_random_head(target_dir: pathlib.Path, out: pathlib.Path, k: int, seed: int = 0
                      ) -> pathlib.Path:
    """An EAGLE-3 head for the target in `target_dir` with random weights, in the speculators
    layout (train_eagle3.py's config, its tensors' names and [out, in] shapes, no embedding
    table): one decoder layer of the target's shape, the default taps (a target too shallow for
    them: its first, middle and last layers'), train_eagle3.py's draft vocabulary size (capped
    by the target's), the first ids."""
    from safetensors.numpy import save_file
    from train_eagle3 import Recipe, drafter_hf_config

    from jaxserve.models.eagle3 import default_aux_layer_ids

    target_hf = json.loads((target_dir / "config.json").read_text())
    vocab, e = int(target_hf["vocab_size"]), int(target_hf["hidden_size"])
    f, heads = int(target_hf["intermediate_size"]), int(target_hf["num_attention_heads"])
    d = int(target_hf.get("head_dim") or e // heads)
    hq, hkv = heads * d, int(target_hf.get("num_key_value_heads") or heads) * d
    layers = int(target_hf["num_hidden_layers"])
    taps = default_aux_layer_ids(layers)
    if len(set(taps)) < 3 or not all(0 <= t <= layers for t in taps):  # too shallow a target
        taps = (0, layers // 2, layers)
    size = min(Recipe.draft_vocab, vocab)
    pre = "layers.0."
    tensors = random_tensors({
        "fc.weight": (e, 3 * e), pre + "input_layernorm.weight": (e,),
        pre + "hidden_norm.weight": (e,), pre + "self_attn.q_proj.weight": (hq, 2 * e),
        pre + "self_attn.k_proj.weight": (hkv, 2 * e),
        pre + "self_attn.v_proj.weight": (hkv, 2 * e),
        pre + "self_attn.o_proj.weight": (e, hq), pre + "post_attention_layernorm.weight": (e,),
        pre + "mlp.gate_proj.weight": (f, e), pre + "mlp.up_proj.weight": (f, e),
        pre + "mlp.down_proj.weight": (e, f), "norm.weight": (e,), "lm_head.weight": (size, e),
    }, seed)
    t2d = np.zeros(vocab, bool)
    t2d[:size] = True
    tensors |= {"d2t": np.zeros(size, np.int64), "t2d": t2d}
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(drafter_hf_config(target_hf, size, taps, k)) + "\n")
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


TINY_TARGET = {  # the rehearsal's target: the bundled model's vocabulary, two small layers
    "architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 128,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
    "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "max_position_embeddings": 2048,
    "tie_word_embeddings": False, "hidden_act": "silu", "bos_token_id": 1, "eos_token_id": 2,
}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "chat_template.jinja")


def write_tiny_target(out: pathlib.Path, seed: int = 0) -> pathlib.Path:
    """A 2-layer Llama with random weights and the bundled model's vocabulary and tokenizer, in
    `out` (an HF directory): a target the CPU compiles and steps in a moment."""
    from safetensors.numpy import save_file

    from jaxserve.models.loader import resolve_model

    bundled = resolve_model(None)
    vocab = json.loads((bundled / "config.json").read_text())["vocab_size"]
    c = {**TINY_TARGET, "vocab_size": vocab}
    e, f, d = c["hidden_size"], c["intermediate_size"], c["head_dim"]
    hq, hkv = c["num_attention_heads"] * d, c["num_key_value_heads"] * d
    shapes = {"model.embed_tokens.weight": (vocab, e), "model.norm.weight": (e,),
              "lm_head.weight": (vocab, e)}
    for i in range(c["num_hidden_layers"]):
        pre = f"model.layers.{i}."
        shapes |= {pre + "self_attn.q_proj.weight": (hq, e),
                   pre + "self_attn.k_proj.weight": (hkv, e),
                   pre + "self_attn.v_proj.weight": (hkv, e),
                   pre + "self_attn.o_proj.weight": (e, hq),
                   pre + "mlp.gate_proj.weight": (f, e), pre + "mlp.up_proj.weight": (f, e),
                   pre + "mlp.down_proj.weight": (e, f), pre + "input_layernorm.weight": (e,),
                   pre + "post_attention_layernorm.weight": (e,)}
    tensors = random_tensors(shapes, seed)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(c, indent=2) + "\n")
    for name in TOKENIZER_FILES:
        if (bundled / name).exists():
            (out / name).write_bytes((bundled / name).read_bytes())
    return out


def acceptance(path: pathlib.Path, method: str, c: int) -> dict | None:
    """The CPU-measured acceptance of `method` on the chat workload at concurrency c (else at
    the method's lowest c): tau, s and e (the module docstring), with where they came from."""
    if not path.exists():
        return None
    rows = [r for r in map(json.loads, path.read_text().splitlines())
            if r.get("workload") == "chat" and r.get("method") == method]
    if not rows:
        return None
    same = [r for r in rows if r["concurrency"] == c]
    r = same[-1] if same else min(reversed(rows), key=lambda x: x["concurrency"])
    outputs = r["output_tokens"] * r.get("repeats", 1)
    request_steps = outputs - r["accepted_tokens"]
    share = r["verifying_steps"] / request_steps if request_steps else 0.0
    return {"tau": round(r["mean_acceptance_length"], 4), "s": round(share, 4),
            "e": round(outputs / request_steps, 4), "from_concurrency": r["concurrency"],
            "commit": r.get("commit")}


def predicted(method: str, acc: dict, t_plain: float, t_spec: float) -> dict:
    """The module docstring's predicted speed-ups of a method's step time `t_spec`."""
    s = acc["s"]
    t_step = s * t_spec + (1 - s) * t_plain if method == "ngram" else t_spec
    return {"predicted_speedup": round(acc["e"] * t_plain / t_step, 3),
            "speedup_per_verifying_step": round(acc["tau"] * t_plain / t_spec, 3)}


def served_buckets(cells: list[tuple[int, int]], max_rows: int) -> tuple[list[int], list[int]]:
    """(token buckets, request buckets): those the served engine's default grid picks for the
    (tokens, sampling rows) of each cell."""
    from jaxserve.compiled_step.buckets import BucketGrid

    grid = BucketGrid.build(max(DEFAULT_TOKEN_BUDGET, max(t for t, _ in cells)), max_rows)
    picks = [grid.pick(t, r) for t, r in cells]
    return sorted({t for t, _ in picks}), sorted({r for _, r in picks})


class StepTimer:
    """One engine's runner, timing steps of c sequences at a fixed context."""

    def __init__(self, llm, context: int, seed: int = 0):
        self.llm, self.runner = llm, llm.engine.core.runner
        self.context, self.rng = context, np.random.default_rng(seed)
        self.active: frozenset[str] = frozenset()

    def rows(self, c: int, drafts: int, tag: str, new: bool):
        from jaxserve.core.sched_output import NewRequestData, ScheduledRequest
        from jaxserve.sampling_params import SamplingParams

        ps = self.runner.page_size
        pages = -(-(self.context + drafts + 1) // ps)
        params = SamplingParams(temperature=0.0, max_tokens=1 << 20, ignore_eos=True)
        out = []
        for i in range(c):
            tokens = tuple(int(x) for x in self.rng.integers(3, 100, size=1 + drafts))
            prompt = tuple(int(x) for x in self.rng.integers(3, 100, size=self.context))
            blocks = tuple(range(1 + i * pages, 1 + (i + 1) * pages)) if new else ()
            out.append(ScheduledRequest(
                f"{tag}-{i}", tokens, self.context, len(tokens), blocks, True, new, False,
                num_draft_tokens=drafts,
                new=NewRequestData(prompt, params, None, ()) if new else None))
        return tuple(out)

    def time(self, c: int, drafts: int, tag: str, warmup: int, steps: int) -> dict:
        """The median ms of `steps` steps of c sequences feeding 1 + `drafts` tokens each."""
        from jaxserve.core.sched_output import StepBatch

        runner = self.runner
        admit = StepBatch((self.rows(c, drafts, tag, True),), self.active, ())
        self.active = frozenset(s.request_id for s in admit.ranks[0])
        runner.execute(admit)  # admits the sequences (their slots and pages)
        plan = runner.prepare(StepBatch((self.rows(c, drafts, tag, False),), frozenset(), ()))
        times = []
        for i in range(warmup + steps):
            t0 = time.perf_counter()
            runner.collect(runner.launch(plan))
            if i >= warmup:
                times.append(time.perf_counter() - t0)
        return {"step_ms": round(1e3 * statistics.median(times), 3), "bucket": list(plan.bucket)}


def engine(model: str | None, spec: dict, args, buckets) -> object:
    from jaxserve import LLM
    from jaxserve.config_cli import parse_bytes

    tokens, requests = buckets
    options = {"dtype": args.dtype, "speculative_config": spec, "max_model_len":
               args.context + 2 * args.num_speculative_tokens + 16, "token_buckets": tokens,
               "request_buckets": requests, "enable_prefix_caching": False,
               "show_progress": False, "kv_cache_memory_bytes": parse_bytes(args.kv_cache_memory)}
    if args.compilation_cache_dir:
        options["compilation_cache_dir"] = args.compilation_cache_dir
    return LLM(model, **options)


def run(args, scratch: pathlib.Path) -> list[dict]:
    """Time every cell (the module docstring), the tiny target and the head written under
    `scratch`; the records, each appended to `args.out` as it is timed."""
    import jax

    from jaxserve.models.loader import resolve_model

    k, cs = args.num_speculative_tokens, args.concurrency
    model = str(write_tiny_target(scratch / "target")) if args.tiny else args.model
    model_dir = resolve_model(model)
    device = f"{jax.device_count()}x {jax.devices()[0].device_kind}"
    cells = [(c, c) for c in cs] + [(c * (k + 1), c * (k + 1)) for c in cs]
    buckets = ((sorted(args.token_buckets), sorted(args.request_buckets)) if args.token_buckets
               else served_buckets(cells, max(cs) * (k + 1)))
    base = {"benchmark": "spec_step_times",
            "model": "tiny" if args.tiny else args.model or "default", "dtype": args.dtype,
            "context": args.context, "num_speculative_tokens": k, "steps": args.steps,
            "warmup": args.warmup, "device": device, "token_buckets": buckets[0],
            "request_buckets": buckets[1]}
    rows, plain = [], {}

    def emit(method: str, c: int, timed: dict, extra: dict) -> None:
        rec = {**base, "method": method, "concurrency": c, **timed, **extra}
        rows.append(rec)
        append_results(args.out, rec)
        print(json.dumps({x: rec[x] for x in ("method", "concurrency", "step_ms", "tokens")
                          if x in rec} | {x: rec[x] for x in ("predicted_speedup",) if x in rec}),
              flush=True)

    ngram = {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": 2,
             "prompt_lookup_max": 5}
    t0 = time.perf_counter()
    timer = StepTimer(engine(model, ngram, args, buckets), args.context)
    base["ngram_engine_s"] = round(time.perf_counter() - t0, 1)
    for c in cs:
        timed = timer.time(c, 0, f"plain{c}", args.warmup, args.steps)
        plain[c] = timed["step_ms"]
        emit("plain", c, timed, {"tokens": c, "tok_per_s": round(c / timed["step_ms"] * 1e3, 1)})
    for c in cs:
        timed = timer.time(c, k, f"ngram{c}", args.warmup, args.steps)
        emit("ngram", c, timed, spec_fields("ngram", c, k, timed, plain[c], args))
    del timer
    t0 = time.perf_counter()
    head = write_random_head(model_dir, scratch / "eagle3", k)
    eagle3 = {"method": "eagle3", "model": str(head), "num_speculative_tokens": k}
    timer = StepTimer(engine(model, eagle3, args, buckets), args.context)
    base["eagle3_engine_s"] = round(time.perf_counter() - t0, 1)
    for c in cs:
        timed = timer.time(c, k, f"eagle3{c}", args.warmup, args.steps)
        emit("eagle3", c, timed, spec_fields("eagle3", c, k, timed, plain[c], args))
    return rows


def spec_fields(method: str, c: int, k: int, timed: dict, t_plain: float, args) -> dict:
    """A drafting cell's tokens, its time over plain's, and its acceptance and predictions."""
    fields = {"tokens": c * (k + 1), "step_over_plain": round(timed["step_ms"] / t_plain, 3)}
    acc = acceptance(args.acceptance, method, c)
    if acc is not None:
        fields |= {"acceptance": acc, **predicted(method, acc, t_plain, timed["step_ms"])}
    return fields


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="the target (default: the bundled model)")
    p.add_argument("--tiny", action="store_true",
                   help="the target: a 2-layer Llama of random weights with the bundled model's "
                        "tokenizer (the CPU rehearsal's)")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument("--context", type=int, default=1024, help="every sequence's context")
    p.add_argument("--num-speculative-tokens", type=int, default=3)
    p.add_argument("--steps", type=int, default=20, help="timed steps per cell (median)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps per cell first")
    p.add_argument("--token-buckets", type=int, nargs="+", default=None,
                   help="the engines' token buckets (default: the served default grid's picks)")
    p.add_argument("--request-buckets", type=int, nargs="+", default=None,
                   help="the engines' request buckets (with --token-buckets)")
    p.add_argument("--kv-cache-memory", default="2GiB",
                   help="each engine's KV cache (bytes, suffixes allowed)")
    p.add_argument("--compilation-cache-dir", default=None)
    p.add_argument("--acceptance", type=pathlib.Path, default=SPEC_DECODE,
                   help="the CPU-measured acceptance (spec_decode_benchmark.py's --eagle3 rows)")
    p.add_argument("--out", type=pathlib.Path, default=RESULTS)
    args = p.parse_args(argv)
    if (args.token_buckets is None) != (args.request_buckets is None):
        p.error("--token-buckets and --request-buckets go together")
    with tempfile.TemporaryDirectory(prefix="spec_step_times_") as scratch:
        run(args, pathlib.Path(scratch))
    return 0


if __name__ == "__main__":
    sys.exit(main())
