"""Speculative decoding (n-gram prompt lookup) against plain decoding, same prompts, same run.

Two engines of the same settings, one with `--speculative-config`, run alternately (plain,
speculative, plain, ...; `--repeats` each) on each workload and concurrency, as a closed loop
(at most c requests in flight, see offline_throughput.py). Reported per (workload, c): output
tok/s of each (median of the repeats) and their ratio, the acceptance rate (accepted / drafted
tokens), the mean accepted length (tokens a request gains per step that fed drafts: accepted
drafts + 1), and whether the greedy outputs are identical (they must be).

Workloads:
  repeat  chat prompts that ask to repeat, copy-edit or lightly rewrite a passage (the
          answer repeats much of the prompt: where prompt lookup helps), greedy, up to
          `--output-len` tokens, stopping at EOS (the same tokens with and without drafts);
  peers   the peer workload (32 random-token prompts of 96-160 tokens, 128 new tokens each,
          EOS ignored). Nothing in a random prompt is worth looking up, but greedy decoding
          of such prompts soon repeats itself, and then its own output is.

Drafts take only the sampling rows no request needs (`max_num_seqs` rows a step): at c equal
to max_num_seqs nothing drafts, and the run shows the cost of speculation's non-overlapped
steps alone.

    .venv/bin/python benchmarks/spec_decode_benchmark.py [--workload repeat peers] [--concurrency 1 8]
        [--dtype bfloat16] [--speculative-config '{"method": "ngram", "num_speculative_tokens": 4}']

One JSON line per (workload, dtype, c) to benchmarks/results/spec_decode.jsonl.

With `--eagle3 DIR` (an EAGLE-3 head for the model, e.g. train_eagle3.py's) the run compares
three methods side by side instead: none, ngram and eagle3 (the same k drafts), on the `chat`
workload (CHAT_PROMPTS: varied instructions, none of train_eagle3.py's training or held-out
ones, chat-templated, greedy, `--output-len` tokens, default 64) at each concurrency (default 1,
4, 16), as a closed loop driven through the engine's own batching (offline_throughput.py's
`run_closed_loop`: at most c requests in flight, each step a batch of them). One JSON line per
(method, c): output tok/s and its ratio to none, the mean acceptance length (accepted drafts per
verifying step + 1, from the scheduler's counters: vLLM's definition), the counters themselves,
whether the outputs equal none's, and a *predicted* accelerator speed-up (`predicted_speedup`:
a formula over the measured counters, not a measurement; spec_decode_predicted.py predicts it
from the steps compiled for v6e and H100 instead, with these lines' acceptance).

    .venv/bin/python benchmarks/spec_decode_benchmark.py --eagle3 DIR [--concurrency 1 4 16]
        [--output-len 64] [--num-speculative-tokens 3] [--repeats 1]

With `--draft-model DIR` (a smaller causal LM with the model's vocabulary and tokenizer) the
draft model's method ("draft_model") joins the comparison, alone with none and ngram or next to
eagle3 when `--eagle3` is given too; its predicted speed-up counts k + 1 draft-model passes a
step (one over the step's tokens, k chained), EAGLE-3's k.

    .venv/bin/python benchmarks/spec_decode_benchmark.py --draft-model DIR [--eagle3 DIR] ...
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

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from offline_throughput import environment, make_prompts, run_closed_loop  # noqa: E402

from results_log import append_results  # noqa: E402

RESULTS = HERE / "results" / "spec_decode.jsonl"
DEFAULT_SPEC = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 5}'

PASSAGES = [
    "The harbour town woke slowly. Fishing boats came in with the tide, gulls argued over the nets, and the baker "
    "on the corner opened his shutters at six, as he had every morning for thirty years. By eight the market "
    "square was full of crates of oranges, bolts of cloth and the voices of traders calling out their prices.",
    "To install the package, first create a virtual environment and activate it. Then run the install command "
    "with the version you need, and check that the command-line tool starts by asking it for its version. If "
    "the tool cannot be found, make sure the environment's bin folder is on your PATH and open a new shell.",
    "Maria planted tomatoes, beans and basil in the spring. She watered them every evening, pulled the weeds on "
    "Saturdays and tied the tomato plants to bamboo canes when they grew tall. In August the garden gave her "
    "more tomatoes than she could eat, so she gave baskets of them to her neighbours and made jars of sauce.",
    "The meeting will start at ten o'clock in the large conference room on the third floor. Please bring the "
    "quarterly report, your notes from the last review and any questions about the new budget. Coffee will be "
    "served at half past nine, and the meeting should end before noon so that everyone can make it to lunch.",
    "A good cup of tea needs fresh water, a warm pot and patience. Boil the water, pour a little into the pot "
    "to warm it, then empty it and add one spoon of leaves for each cup. Pour the water over the leaves, wait "
    "four minutes, and serve it with milk or lemon, as your guests prefer.",
    "The old library kept its rarest books in a locked room at the end of the east corridor. Visitors could "
    "read them only at the long oak table under the window, wearing cotton gloves, with a librarian nearby. "
    "Nobody was allowed to take a pen into the room; pencils were given out at the door and collected again.",
    "Every Friday the team writes a short summary of the week: what was finished, what is still in progress, "
    "and what is blocked. The summary goes to the whole department, so it should be clear to readers who do "
    "not know the details of the project, and it should never be longer than one page.",
    "The train left the station at exactly seven minutes past nine. It crossed the river, passed the old mill "
    "and the wheat fields, and climbed slowly into the hills, where the morning fog still lay in the valleys. "
    "Most of the passengers were asleep; a few read newspapers, and one small boy counted the tunnels aloud.",
]
TASKS = [
    "Repeat the following passage exactly, word for word:\n\n{p}",
    "Copy this text and correct any spelling mistakes in it:\n\n{p}",
    "Rewrite this paragraph in the past tense where it is not already, keeping everything else the same:\n\n{p}",
    "Here is a paragraph:\n\n{p}\n\nWrite it out again, but replace every comma with a semicolon.",
]


def repeat_prompts(tokenizer, n: int) -> list[list[int]]:
    out = []
    for i in range(n):
        text = TASKS[i % len(TASKS)].format(p=PASSAGES[i % len(PASSAGES)])
        out.append(tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                                 tokenize=True, return_dict=False))
    return [list(p) for p in out]


# Chat instructions for the eagle3 comparison: none is in train_eagle3.py's INSTRUCTIONS or
# HELD_OUT (the head never trained on them), varied in kind (facts, how-to, code, writing, lists).
CHAT_PROMPTS = [
    "What is the tallest mountain in Africa, and how high is it?",
    "Explain how a refrigerator keeps food cold.",
    "Write a short thank-you note to a neighbour who watered my plants.",
    "How do I count the words in a string in Python?",
    "Give me four tips for running a first 5k race.",
    "What is the difference between a virus and a bacterium?",
    "Describe a busy train station in the morning.",
    "Why does bread go stale?",
    "List three advantages of electric cars and one drawback.",
    "Write a four-line poem about a snowy forest.",
    "How does a compass work?",
    "Explain what a budget is and why a family might keep one.",
    "What are some good ways to make new friends in a new city?",
    "Summarize the story of Cinderella in three sentences.",
    "How do I write a function in JavaScript that adds two numbers?",
    "What happens to water when it freezes?",
]


def chat_prompts(tokenizer, n: int) -> list[list[int]]:
    """The first `n` CHAT_PROMPTS (cycled), chat-templated as one user turn each."""
    return [list(tokenizer.apply_chat_template([{"role": "user", "content": CHAT_PROMPTS[i % len(CHAT_PROMPTS)]}],
                                               add_generation_prompt=True, tokenize=True, return_dict=False))
            for i in range(n)]


def mean_acceptance_length(verifying_steps: int, accepted_tokens: int) -> float:
    """vLLM's mean acceptance length: accepted drafts per step that verified drafts, plus the one
    token every such step samples itself (1.0 when nothing was verified)."""
    return 1.0 + accepted_tokens / verifying_steps if verifying_steps else 1.0


def predicted_speedup(output_tokens: int, accepted_tokens: int, num_drafts: int, draft_cost: float) -> float:
    """Predicted decode speed-up on a memory-bound accelerator: output tokens per request step
    (N / (N - A): every step gives a request one token plus the drafts it accepted) over a
    step's cost in plain steps, 1 + k * r. Assumes a step's time is its weight reads (k + 1 query
    tokens cost what 1 does) and each of the k draft passes a step runs costs r plain steps (r:
    the drafter's bytes over the target's; 0 for host-side n-gram lookup)."""
    if output_tokens <= accepted_tokens:
        raise ValueError("accepted drafts must be fewer than the output tokens")
    return output_tokens / (output_tokens - accepted_tokens) / (1.0 + num_drafts * draft_cost)


def weight_bytes(model_dir: str | os.PathLike, itemsize: int = 2) -> int:
    """Bytes of the checkpoint's tensors in `model_dir` at `itemsize` bytes per element (what a
    pass reads at that dtype; a tied embedding counted once)."""
    from safetensors import safe_open

    total = 0
    for path in pathlib.Path(model_dir).glob("*.safetensors"):
        with safe_open(str(path), "numpy") as f:
            for name in f.keys():
                n = 1
                for d in f.get_slice(name).get_shape():
                    n *= d
                total += n * itemsize
    return total


def spec_counters(engine) -> tuple[int, int, int]:
    s = engine.scheduler.make_stats()
    return s.spec_num_drafts, s.spec_num_draft_tokens, s.spec_num_accepted_tokens


def draft_passes(method: str, k: int) -> int:
    """The drafter's passes a step runs for k drafts: EAGLE-3's head one over the step's tokens
    and k - 1 chained; a draft model one over the step's tokens and k chained; none else."""
    return {"eagle3": k, "draft_model": k + 1}.get(method, 0)


def compare_methods(args, tokenizer, env: dict) -> list[dict]:
    """none / ngram / eagle3 (`args.eagle3`) / draft_model (`args.draft_model`) side by side on
    the chat workload, one row each (method, c); prints the table."""
    from jaxserve.entrypoints.llm import LLM
    from jaxserve.models.loader import resolve_model
    from jaxserve.sampling_params import SamplingParams

    k = args.num_speculative_tokens
    configs = {"none": None,
               "ngram": {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": 2,
                         "prompt_lookup_max": 5},
               "eagle3": {"method": "eagle3", "model": str(args.eagle3), "num_speculative_tokens": k},
               "draft_model": {"method": "draft_model", "model": str(args.draft_model), "num_speculative_tokens": k}}
    configs = {name: spec for name, spec in configs.items() if getattr(args, name, True)}
    # Drafts take only spare sampling rows: enough for every request at the largest c to draft.
    options = {"enable_prefix_caching": False, "show_progress": False,
               "max_num_seqs": args.max_num_seqs or max(args.concurrency) * (k + 1)}
    if args.compilation_cache_dir is not None:
        options["compilation_cache_dir"] = args.compilation_cache_dir
    dtype = args.dtype[0]
    target_bytes = weight_bytes(resolve_model(args.model))
    draft_cost = {name: weight_bytes(resolve_model(spec["model"])) / target_bytes if spec and "model" in spec
                  else 0.0 for name, spec in configs.items()}
    prompts = chat_prompts(tokenizer, args.num_prompts or len(CHAT_PROMPTS))
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len or 64)
    engines = {}
    for name, spec in configs.items():
        t0 = time.perf_counter()
        engines[name] = LLM(args.model, dtype=dtype, speculative_config=spec, **options).engine
        for c in args.concurrency:  # warm-up: compile the buckets each concurrency uses
            run_closed_loop(engines[name], prompts[:c], c, params.clone(max_tokens=8), f"warmup-{name}-{c}")
        print(f"[{name}] engine ready and warm in {time.perf_counter() - t0:.0f} s", flush=True)
    rows = []
    for c in args.concurrency:
        figs: dict[str, list[dict]] = {name: [] for name in engines}
        counts = {}
        for name, engine in engines.items():  # alternating: none, ngram, eagle3, draft_model, none, ...
            counts[name] = spec_counters(engine)
        for r in range(args.repeats):
            for name, engine in engines.items():
                figs[name].append(run_closed_loop(engine, prompts, c, params, f"chat-{name}-{c}-{r}"))
        tok_s = {name: statistics.median(f["output_tok_s"] for f in fs) for name, fs in figs.items()}
        for name, engine in engines.items():
            steps, drafted, accepted = (a - b for a, b in zip(spec_counters(engine), counts[name]))
            tau = mean_acceptance_length(steps, accepted)
            rows.append({
                "benchmark": "spec_decode", "workload": "chat", "method": name, "dtype": dtype,
                "concurrency": c, "speculative_config": configs[name], "options": options,
                "batching": "closed loop, engine's own batching", "num_prompts": len(prompts),
                "max_tokens": params.max_tokens, "repeats": args.repeats,
                "output_tokens": figs[name][0]["output_tokens"], "output_tok_s": tok_s[name],
                "ratio_vs_none": tok_s[name] / tok_s["none"], "runs": [f["output_tok_s"] for f in figs[name]],
                "mean_acceptance_length": tau, "verifying_steps": steps, "draft_tokens": drafted,
                "accepted_tokens": accepted, "acceptance_rate": accepted / drafted if drafted else 0.0,
                "draft_cost_per_pass": draft_cost[name],
                "predicted_accelerator_speedup": predicted_speedup(
                    sum(f["output_tokens"] for f in figs[name]), accepted,
                    draft_passes(name, k), draft_cost[name]),
                "identical_to_none": all(f["output_ids"] == n["output_ids"]
                                         for f, n in zip(figs[name], figs["none"])),
                **env,
            })
    print(f"\n{env['host']['cpu']} ({env['host']['cpu_count']} cores), {env['device']}, {dtype}, "
          f"git {str(env['git_sha'])[:10]}, k={k}, {len(prompts)} chat prompts x {params.max_tokens} tokens, "
          f"greedy, closed loop (engine batching), median of {args.repeats}")
    print(f"{'c':>3} {'method':11} {'tok/s':>7} {'vs none':>7} {'accept len':>10} {'steps':>6} {'drafted':>7} "
          f"{'accepted':>8} {'same':>5} {'predicted accel':>15}")
    for r in rows:
        print(f"{r['concurrency']:>3} {r['method']:11} {r['output_tok_s']:>7.1f} {r['ratio_vs_none']:>6.2f}x "
              f"{r['mean_acceptance_length']:>10.2f} {r['verifying_steps']:>6} {r['draft_tokens']:>7} "
              f"{r['accepted_tokens']:>8} {str(r['identical_to_none']):>5} "
              f"{r['predicted_accelerator_speedup']:>14.2f}x")
    costs = ", ".join(f"{draft_cost[name]:.3f} ({name})" for name in configs if name != "none")
    print(f"predicted accel = N / (N - A) / (1 + p * r): N output tokens, A accepted drafts, p drafter passes "
          f"a step (eagle3 k, draft_model k + 1), r = drafter bytes / target bytes = {costs}")
    return rows


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workload", nargs="+", default=["repeat", "peers"], choices=["repeat", "peers"])
    p.add_argument("--concurrency", type=int, nargs="+", default=None, help="default: 1 8 (1 4 16 with --eagle3 or --draft-model)")
    p.add_argument("--dtype", nargs="+", default=["bfloat16"], choices=["float32", "bfloat16"])
    p.add_argument("--num-prompts", type=int, default=None, help="default: 8 (repeat), 32 (peers)")
    p.add_argument("--output-len", type=int, default=None, help="default: 256 (repeat), 128 (peers)")
    p.add_argument("--repeats", type=int, default=None,
                   help="alternating runs of each engine (median); default 3 (1 with --eagle3 or --draft-model)")
    p.add_argument("--speculative-config", default=DEFAULT_SPEC)
    p.add_argument("--eagle3", default=None, metavar="DIR",
                   help="compare none / ngram / eagle3 (this head) on the chat workload instead")
    p.add_argument("--draft-model", default=None, metavar="DIR",
                   help="compare none / ngram / draft_model (this draft model; and eagle3 with --eagle3) instead")
    p.add_argument("--num-speculative-tokens", type=int, default=3,
                   help="k of every method (--eagle3, --draft-model)")
    p.add_argument("--model", default=None)
    p.add_argument("--max-num-seqs", type=int, default=None, help="default: the engine's")
    p.add_argument("--compilation-cache-dir", default=None)
    p.add_argument("--results", default=str(RESULTS), help="JSONL file to append to ('' = none)")
    args = p.parse_args(argv)
    compare = args.eagle3 or args.draft_model
    args.concurrency = args.concurrency or ([1, 4, 16] if compare else [1, 8])
    args.repeats = args.repeats or (1 if compare else 3)

    from jaxserve.entrypoints.llm import LLM
    from jaxserve.models.loader import load_tokenizer, resolve_model
    from jaxserve.sampling_params import SamplingParams

    tokenizer = load_tokenizer(resolve_model(args.model))
    env = environment()
    if compare:
        rows = compare_methods(args, tokenizer, env)
        if args.results:
            append_results(args.results, rows)
        return
    spec = json.loads(args.speculative_config)
    options = {"enable_prefix_caching": False, "show_progress": False}
    for key in ("max_num_seqs", "compilation_cache_dir"):
        if getattr(args, key) is not None:
            options[key] = getattr(args, key)
    rows = []
    for dtype in args.dtype:
        engines = {"plain": LLM(args.model, dtype=dtype, **options).engine,
                   "spec": LLM(args.model, dtype=dtype, speculative_config=spec, **options).engine}
        for workload in args.workload:
            if workload == "repeat":
                prompts = repeat_prompts(tokenizer, args.num_prompts or 8)
                params = SamplingParams(temperature=0.0, max_tokens=args.output_len or 256)
            else:
                prompts = make_prompts(tokenizer, args.num_prompts or 32, 96, 160, 0)
                params = SamplingParams(temperature=0.0, max_tokens=args.output_len or 128, ignore_eos=True)
            for name, engine in engines.items():  # warm-up
                run_closed_loop(engine, prompts[:1], 1, params.clone(max_tokens=4), f"warmup-{name}")
            for c in args.concurrency:
                figs: dict[str, list[dict]] = {"plain": [], "spec": []}
                load0 = os.getloadavg()
                before = spec_counters(engines["spec"])
                for r in range(args.repeats):
                    for name, engine in engines.items():
                        figs[name].append(run_closed_loop(engine, prompts, c, params, f"{workload}-{name}-{c}-{r}"))
                drafts, draft_tokens, accepted = (a - b for a, b in zip(spec_counters(engines["spec"]), before))
                tok_s = {name: statistics.median(f["output_tok_s"] for f in fs) for name, fs in figs.items()}
                same = all(a["output_ids"] == b["output_ids"] for a, b in zip(figs["plain"], figs["spec"]))
                row = {
                    "benchmark": "spec_decode", "workload": workload, "dtype": dtype, "concurrency": c,
                    "speculative_config": spec, "options": options, "num_prompts": len(prompts),
                    "output_tokens": figs["plain"][0]["output_tokens"],
                    "plain_output_tok_s": tok_s["plain"], "spec_output_tok_s": tok_s["spec"],
                    "ratio": tok_s["spec"] / tok_s["plain"],
                    "plain_runs": [f["output_tok_s"] for f in figs["plain"]],
                    "spec_runs": [f["output_tok_s"] for f in figs["spec"]],
                    "acceptance_rate": accepted / draft_tokens if draft_tokens else 0.0,
                    "mean_accepted_length": 1 + accepted / drafts if drafts else 1.0,
                    "drafting_steps": drafts, "draft_tokens": draft_tokens, "accepted_tokens": accepted,
                    "identical_outputs": same, "load_avg_before": load0, "load_avg_after": os.getloadavg(),
                    **env, "timestamp": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                }
                rows.append(row)
                print(f"[{dtype} {workload} c={c}] plain {tok_s['plain']:.1f} tok/s, speculative "
                      f"{tok_s['spec']:.1f} tok/s ({row['ratio']:.2f}x), acceptance {row['acceptance_rate']:.2f}, "
                      f"mean accepted length {row['mean_accepted_length']:.2f}, identical {same}", flush=True)
        del engines
    if args.results:
        append_results(args.results, rows)
    print(f"\n{env['host']['cpu']}, {env['device']}, git {str(env['git_sha'])[:10]}, spec {args.speculative_config}")
    print(f"{'dtype':9} {'workload':8} {'c':>3} {'plain tok/s':>11} {'spec tok/s':>10} {'ratio':>6} "
          f"{'accept':>6} {'mean len':>8} {'same':>5}")
    for r in rows:
        print(f"{r['dtype']:9} {r['workload']:8} {r['concurrency']:>3} {r['plain_output_tok_s']:>11.1f} "
              f"{r['spec_output_tok_s']:>10.1f} {r['ratio']:>5.2f}x {r['acceptance_rate']:>6.2f} "
              f"{r['mean_accepted_length']:>8.2f} {str(r['identical_outputs']):>5}")


if __name__ == "__main__":
    t0 = time.perf_counter()
    main()
    print(f"({time.perf_counter() - t0:.0f} s)")
