"""Offline throughput of the engine on a fixed synthetic workload, optionally against HF transformers.

Workload: N prompts of random token ids (uniform lengths in [min, max], drawn from a fixed seed,
from the default model's vocabulary minus its special/added tokens), `--output-len` new tokens
each with ignore_eos, greedy. `--workload peers` is the preset the peers (vLLM, llama.cpp,
transformers) were measured on: 32 prompts of 96-160 tokens, 128 new tokens each.

Concurrency c means at most c requests in flight: one engine per dtype (max_num_seqs = the
largest c, prefix caching off so repeated runs never hit the cache), driven as a closed loop
that submits the next prompt as soon as one finishes. TTFT is first_token_time - arrival_time
with arrival = submission, so it measures prefill latency under load, not time spent queued
behind the other N - c prompts. Wall time runs from the first submission to the last output,
prefill included; step time is wall / engine steps. Startup (engine build, compile, one short
warm-up request) is reported separately and excluded.

    .venv/bin/python benchmarks/offline_throughput.py [--workload peers] [--concurrency 1 8 32]
        [--dtype float32 bfloat16] [--compare-hf --hf-python /path/to/torch-venv/bin/python]

`--compare-hf` runs benchmarks/hf_worker.py under `--hf-python` (torch CPU, static batches of
size c, left-padded `generate`) on the same prompts and prints jaxserve/HF output tok/s ratios.
`--compare-vllm` runs benchmarks/vllm_worker.py under `--vllm-python` (vLLM's CPU build: the
same closed loop, one engine per dtype) and prints jaxserve/vLLM ratios.
`--cpu-class avx2` runs every side as on an AVX2-only CPU (no AVX-512, no AMX), emulated here:
jaxserve with XLA capped to AVX2 and its kernels built for haswell, the peers with torch, oneDNN,
MKL and vLLM's kernel choice capped the same way (benchmarks/cpu_class.py says what and how; the
script re-executes itself once under that environment). The class goes into the JSON lines.
`--mesh 1x1 1x2 2x1` runs one engine per data x tensor parallel mesh as well (with `--devices N`
simulated CPU devices: `XLA_FLAGS=--xla_force_host_platform_device_count=N`, set before jax
is imported); outputs are compared with the first mesh's.
One JSON line per (mesh, dtype, concurrency) goes to benchmarks/results/offline_throughput.jsonl.
The machine may be shared: check the load average in each JSON line before trusting a figure.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import os
import pathlib
import platform
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

import cpu_class

from results_log import append_results

HERE = pathlib.Path(__file__).resolve().parent
RESULTS = HERE / "results" / "offline_throughput.jsonl"
CACHE = HERE / ".cache"
PRESETS = {
    "default": {"num_prompts": 64, "min_input": 64, "max_input": 512, "output_len": 128},
    "peers": {"num_prompts": 32, "min_input": 96, "max_input": 160, "output_len": 128},
}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workload", choices=sorted(PRESETS), default="default",
                   help="preset for the four workload sizes below (each flag overrides it)")
    p.add_argument("--num-prompts", type=int)
    p.add_argument("--min-input", type=int)
    p.add_argument("--max-input", type=int)
    p.add_argument("--output-len", type=int)
    p.add_argument("--seed", type=int, default=0, help="seed of the prompt lengths and tokens")
    p.add_argument("--model", default=None, help="model path; default: the bundled default model")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--dtype", nargs="+", default=["float32"], choices=["float32", "bfloat16"])
    p.add_argument("--quantization", nargs="+", default=["none"], choices=["none", "int8", "fp8", "int4"],
                   help="weight quantization(s) to run with each dtype (int8/fp8/int4 weights, the dtype computes)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling (with --temperature)")
    p.add_argument("--mesh", nargs="+", default=["1x1"], help="data x tensor parallel sizes, e.g. 1x1 1x2 2x1")
    p.add_argument("--devices", type=int, default=None, help="simulate N CPU devices (for --mesh)")
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--token-buckets", type=int, nargs="+", default=None)
    p.add_argument("--request-buckets", type=int, nargs="+", default=None)
    p.add_argument("--kv-cache-gib", type=float, default=None, help="KV cache budget (default: engine's)")
    p.add_argument("--compilation-cache-dir", default=None)
    p.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                   help="overlapped steps (default: the engine's, on)")
    p.add_argument("--results", default=str(RESULTS), help="JSONL file to append to ('' = none)")
    p.add_argument("--compare-hf", action="store_true", help="also run HF transformers (torch CPU)")
    p.add_argument("--hf-python", default=sys.executable, help="python with torch + transformers")
    p.add_argument("--hf-dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--hf-threads", type=int, default=2, help="torch.set_num_threads in the worker")
    p.add_argument("--hf-concurrency", type=int, nargs="+", default=None,
                   help="the concurrencies HF runs (default: --concurrency's); its static batches at c = 1 "
                        "take long on a CPU")
    p.add_argument("--compare-vllm", action="store_true",
                   help="also run vLLM (its CPU build) on the same prompts, same closed loop")
    p.add_argument("--vllm-python", default=sys.executable, help="python with vLLM")
    p.add_argument("--vllm-threads", type=int, default=None, help="cores vLLM binds (default: all)")
    p.add_argument("--gguf", default=None, help="GGUF to build the HF model from (default: the default model)")
    p.add_argument("--cpu-class", choices=cpu_class.CLASSES, default="native",
                   help="native: this CPU; avx2: every side as on an AVX2-only CPU (benchmarks/cpu_class.py)")
    args = p.parse_args(argv)
    for key, value in PRESETS[args.workload].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if not 1 <= args.min_input <= args.max_input or args.num_prompts < 1 or args.output_len < 1:
        p.error("need 1 <= --min-input <= --max-input, --num-prompts >= 1 and --output-len >= 1")
    if min(args.concurrency) < 1:
        p.error("--concurrency values must be >= 1")
    try:
        args.mesh = [tuple(int(x) for x in m.lower().split("x")) for m in args.mesh]
    except ValueError:
        p.error("--mesh takes DATAxTENSOR sizes such as 1x2")
    if any(len(m) != 2 or min(m) < 1 for m in args.mesh):
        p.error("--mesh takes DATAxTENSOR sizes such as 1x2")
    return args


def make_prompts(tokenizer, n: int, lo: int, hi: int, seed: int) -> list[list[int]]:
    """Deterministic random-token prompts that avoid special and added tokens."""
    special = set(tokenizer.all_special_ids) | set(tokenizer.get_added_vocab().values())
    allowed = np.setdiff1d(np.arange(len(tokenizer)), np.fromiter(special, dtype=np.int64))
    rng = np.random.default_rng(seed)
    lengths = rng.integers(lo, hi + 1, size=n)
    return [rng.choice(allowed, size=int(k)).tolist() for k in lengths]


def environment() -> dict:
    import jax
    import jaxlib

    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=HERE, capture_output=True, text=True,
                             check=True).stdout.strip()
        dirty = bool(subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=HERE,
                                    capture_output=True, text=True).stdout.strip())
    except (OSError, subprocess.CalledProcessError):
        sha, dirty = None, None
    devs = jax.devices()
    return {
        "git_sha": sha, "git_dirty": dirty,
        "versions": {"jax": jax.__version__, "jaxlib": jaxlib.__version__,
                     "flax": importlib.metadata.version("flax"), "python": platform.python_version()},
        "device": f"{len(devs)}x {devs[0].device_kind} ({devs[0].platform})",
        "host": {"cpu": cpu_model(), "cpu_count": os.cpu_count(), "cpu_flags": cpu_class.host_cpu()["flags"]},
    }


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
    except OSError:
        names = []
    return names[0] if names else platform.processor()


def plan_of(engine) -> dict:
    """What the CPU backend resolved (products, attention, kernel build) for the JSON lines."""
    import dataclasses

    plan = getattr(engine.parts, "plan", None)
    out = dataclasses.asdict(plan) if dataclasses.is_dataclass(plan) else {}
    try:
        from jaxserve.backends.cpu import kernels

        out["cpu_kernel_target"] = kernels.selected_target()
    except (ImportError, AttributeError):
        pass
    return out


def run_closed_loop(engine, prompts, concurrency: int, params, tag: str) -> dict:
    """At most `concurrency` requests in flight; the next prompt goes in as soon as one finishes."""
    outs: dict[int, object] = {}
    nxt = in_flight = steps = 0
    pre0 = engine.scheduler.num_preemptions
    t0 = time.perf_counter()
    while nxt < len(prompts) or engine.has_unfinished_requests():
        while nxt < len(prompts) and in_flight < concurrency:
            engine.add_request(f"{tag}-{nxt}", prompts[nxt], params)
            nxt, in_flight = nxt + 1, in_flight + 1
        for out in engine.step():
            if out.finished:
                outs[int(out.request_id.rsplit("-", 1)[1])] = out
                in_flight -= 1
        steps += 1
    wall = time.perf_counter() - t0
    results = [outs[i] for i in range(len(prompts))]
    n_out = [len(o.outputs[0].token_ids) for o in results]
    n_prompt = sum(len(p) for p in prompts)
    ttft = [1e3 * (o.metrics.first_token_time - o.metrics.arrival_time) for o in results]
    return {
        "wall_s": wall, "steps": steps, "prompt_tokens": n_prompt, "output_tokens": sum(n_out),
        "output_tok_s": sum(n_out) / wall, "total_tok_s": (n_prompt + sum(n_out)) / wall,
        "ttft_mean_ms": statistics.fmean(ttft), "ttft_median_ms": statistics.median(ttft),
        "step_mean_ms": 1e3 * wall / steps, "min_output_len": min(n_out), "max_output_len": max(n_out),
        "cached_prompt_tokens": sum(o.num_cached_tokens for o in results),
        "preemptions": engine.scheduler.num_preemptions - pre0,
        "output_ids": [list(o.outputs[0].token_ids) for o in results],
    }


def run_worker(script: str, job: dict, python: str, cls: str = "native") -> dict:
    """Run a peer's worker script on `job` under `python`, in CPU class `cls`'s environment;
    return the JSON line it prints."""
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(job, f)
    try:
        proc = subprocess.run([python, str(HERE / script), f.name], stdout=subprocess.PIPE, text=True,
                              env=cpu_class.peer_env(cls))
    finally:
        os.unlink(f.name)
    if proc.returncode != 0:
        sys.exit(f"{script} failed (exit {proc.returncode}); see its messages above.")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def default_gguf(args) -> str:
    if args.gguf is not None:
        return args.gguf
    from jaxserve.models.loader import default_gguf_path
    return str(default_gguf_path())


def run_vllm(args, prompts) -> dict:
    job = {"prompts": prompts, "concurrency": args.concurrency, "max_new_tokens": args.output_len,
           "dtypes": args.dtype, "gguf": default_gguf(args), "cache_dir": str(CACHE),
           "threads": args.vllm_threads}
    return run_worker("vllm_worker.py", job, args.vllm_python, args.cpu_class)


def check_peer_python(python: str, modules: str, peer: str, what: str) -> None:
    """Exit with a clear message unless `python` imports `modules` (for --compare-`peer`)."""
    probe = subprocess.run([python, "-c", f"import {modules}"], capture_output=True, text=True)
    if probe.returncode != 0:
        why = probe.stderr.strip().splitlines()[-1] if probe.stderr.strip() else ""
        sys.exit(f"--compare-{peer} needs {what} in {python}, which failed to import them:\n{why}\n"
                 "Peers are optional benchmark-only dependencies: install them in another venv and "
                 f"pass --{peer}-python /path/to/that/venv/bin/python.")


def run_hf(args, prompts, pad_token_id: int) -> dict:
    job = {"prompts": prompts, "concurrency": args.hf_concurrency or args.concurrency,
           "max_new_tokens": args.output_len, "dtype": args.hf_dtype, "threads": args.hf_threads,
           "gguf": default_gguf(args),
           "cache_dir": str(CACHE), "pad_token_id": pad_token_id}
    return run_worker("hf_worker.py", job, args.hf_python, args.cpu_class)


def prefix_match(a: list[list[int]], b: list[list[int]]) -> float:
    """Mean fraction of each output that agrees token for token before the first difference."""
    fracs = []
    for x, y in zip(a, b):
        k = next((i for i, (s, t) in enumerate(zip(x, y)) if s != t), min(len(x), len(y)))
        fracs.append(k / max(len(x), 1))
    return statistics.fmean(fracs)


def main(argv=None) -> None:
    args = parse_args(argv)
    cpu_class.reexec_for(args.cpu_class)  # before jax starts: XLA, glibc and numpy read it then
    if args.compare_hf:
        check_peer_python(args.hf_python, "torch, transformers", "hf",
                          "torch and transformers (plus accelerate and gguf)")
    if args.compare_vllm:
        check_peer_python(args.vllm_python, "vllm", "vllm", "vLLM")
    if args.devices:
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                                   f" --xla_force_host_platform_device_count={args.devices}").strip()
    import jaxserve  # noqa: F401 - before jax: pins JAX to the CPU on a host without accelerators
    import jax

    from jaxserve.entrypoints.llm import LLM
    from jaxserve.models.loader import load_tokenizer, resolve_model
    from jaxserve.sampling_params import SamplingParams

    tokenizer = load_tokenizer(resolve_model(args.model))
    prompts = make_prompts(tokenizer, args.num_prompts, args.min_input, args.max_input, args.seed)
    keys = ("workload", "num_prompts", "min_input", "max_input", "output_len", "seed", "temperature",
            "top_p")
    workload = {k: getattr(args, k) for k in keys}
    print(f"workload: {len(prompts)} prompts, {sum(map(len, prompts))} prompt tokens, "
          f"{args.output_len} new tokens each", flush=True)
    env = environment()
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, max_tokens=args.output_len,
                            ignore_eos=True)
    options = {"max_num_seqs": max(args.concurrency), "enable_prefix_caching": False, "show_progress": False,
               **cpu_class.jaxserve_options(args.cpu_class)}
    env["cpu_class"] = cpu_class.describe(args.cpu_class)
    for key in ("max_num_batched_tokens", "token_buckets", "request_buckets", "compilation_cache_dir",
                "async_scheduling"):
        if getattr(args, key) is not None:
            options[key] = getattr(args, key)
    if args.kv_cache_gib is not None:
        options["kv_cache_memory_bytes"] = int(args.kv_cache_gib * (1 << 30))

    rows = []
    first_ids: dict[tuple, list] = {}
    for (dp, tp), dtype, quant in [(m, d, q) for m in args.mesh for d in args.dtype for q in args.quantization]:
        t0 = time.perf_counter()
        llm = LLM(args.model, dtype=dtype, quantization=None if quant == "none" else quant,
                  data_parallel_size=dp, tensor_parallel_size=tp, **options)
        engine = llm.engine
        dev0 = jax.devices()[0]  # the weights' bytes on one device, from the live buffers
        weight_bytes = sum(s.data.nbytes for a in engine.runner.params for s in a.addressable_shards
                           if s.device == dev0)
        tag = (dtype if quant == "none" else f"{dtype}+{quant}") + ("" if (dp, tp) == (1, 1) else f"@{dp}x{tp}")
        build_s = time.perf_counter() - t0
        run_closed_loop(engine, prompts[:1], 1, params.clone(max_tokens=2), f"warmup-{tag}")
        startup = {"build_s": build_s, "startup_s": time.perf_counter() - t0, "load_s": engine.parts.load_seconds,
                   "compile_s": engine.runner.compile_seconds, "num_buckets": engine.runner.num_buckets,
                   "weight_bytes_per_device": weight_bytes, "plan": plan_of(engine)}
        print(f"[{tag}] startup {startup['startup_s']:.1f}s (load {startup['load_s']:.1f}s, "
              f"compile {startup['compile_s']:.1f}s, {startup['num_buckets']} buckets; {startup['plan']})", flush=True)
        for c in args.concurrency:
            load0 = os.getloadavg()
            recompiles0 = engine.num_compiles_after_warmup
            fig = run_closed_loop(engine, prompts, c, params, f"c{c}-{tag}")
            fig["recompiles"] = engine.num_compiles_after_warmup - recompiles0
            ref_ids = first_ids.setdefault((dtype, quant, c), fig["output_ids"])
            fig["greedy_prefix_match_first_mesh"] = prefix_match(fig["output_ids"], ref_ids)
            print(f"[{tag}] c={c}: {fig['output_tok_s']:.1f} output tok/s, wall {fig['wall_s']:.1f}s",
                  flush=True)
            config = {"dtype": dtype, "quantization": quant, "concurrency": c, "data_parallel_size": dp,
                      "tensor_parallel_size": tp, **options, "model": args.model}
            rows.append({"benchmark": "offline_throughput", "config": config, "workload": workload,
                         "startup": startup, "figures": fig, "load_avg_before": load0,
                         "load_avg_after": os.getloadavg(), **env})
        del llm, engine

    hf = None
    if args.compare_hf:
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        hf = run_hf(args, prompts, pad)
        by_c = {r["concurrency"]: r for r in hf["runs"]}
        for row in rows:
            if row["config"]["concurrency"] not in by_c:  # not in --hf-concurrency
                continue
            h = dict(by_c[row["config"]["concurrency"]])
            hf_ids = h.pop("output_ids")
            h["greedy_prefix_match"] = prefix_match(row["figures"]["output_ids"], hf_ids)
            row["hf"] = {**h, "dtype": args.hf_dtype, "threads": args.hf_threads,
                         "startup_s": hf["startup_s"], "versions": hf["versions"], "isa": hf.get("isa")}
            row["ratio_output_tok_s"] = row["figures"]["output_tok_s"] / h["output_tok_s"]
    vl = None
    if args.compare_vllm:
        vl = run_vllm(args, prompts)
        by = {(r["dtype"], r["concurrency"]): r for r in vl["runs"]}
        for row in rows:
            v = dict(by[(row["config"]["dtype"], row["config"]["concurrency"])])
            v["greedy_prefix_match"] = prefix_match(row["figures"]["output_ids"], v.pop("output_ids"))
            row["vllm"] = {**v, "versions": vl["versions"], "env": vl["env"], "isa": vl.get("isa")}
            row["ratio_vllm_output_tok_s"] = row["figures"]["output_tok_s"] / v["output_tok_s"]
    timestamp = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    if args.results:
        for row in rows:
            row["figures"] = {k: v for k, v in row["figures"].items() if k != "output_ids"}
        append_results(args.results, [{**row, "timestamp": timestamp} for row in rows])
    print_table(rows, env, hf, vl)


def first_hf(rows) -> dict:
    return next((r["hf"] for r in rows if "hf" in r), {})


def isa_summary(isa: dict) -> str:
    """One line of what a peer's torch reported (benchmarks/cpu_class.py: torch_isa)."""
    off = [k for k, v in isa.get("torch_cpu_reports", {}).items() if not v]
    return (f"class {isa.get('cpu_class')}, ATen {isa.get('aten_capability')}, torch.cpu reports no "
            f"{'/'.join(off) or '-'}, oneDNN bfloat16 {isa.get('onednn_bf16')}")


def print_table(rows, env, hf, vl=None) -> None:
    cls = env.get("cpu_class", {})
    print(f"\n{env['device']}, {env['host']['cpu']} ({' '.join(env['host'].get('cpu_flags', []))}), "
          f"CPU class {cls.get('name', 'native')}{' (emulated)' if cls.get('emulated') else ''}, "
          f"jax {env['versions']['jax']}, git {str(env['git_sha'])[:10]}"
          f"{' (dirty)' if env['git_dirty'] else ''}, load {rows[0]['load_avg_before'][0]:.2f} -> "
          f"{rows[-1]['load_avg_after'][0]:.2f}")
    head = f"{'engine':15} {'c':>3} {'out tok/s':>10} {'total tok/s':>11} {'TTFT mean':>10} {'TTFT med':>9} " \
           f"{'step ms':>8} {'steps':>6}"
    if hf:
        head += f" {'HF out tok/s':>12} {'HF TTFT':>8} {'ratio':>6} {'greedy=':>7}"
    if vl:
        head += f" {'vLLM tok/s':>10} {'vLLM TTFT':>9} {'ratio':>6} {'greedy=':>7}"
    print(head)
    for r in rows:
        f = r["figures"]
        q = r["config"].get("quantization", "none")
        mesh = f"{r['config'].get('data_parallel_size', 1)}x{r['config'].get('tensor_parallel_size', 1)}"
        name = r['config']['dtype'] + ('' if q == 'none' else '+' + q) + ('' if mesh == '1x1' else '@' + mesh)
        line = (f"{name:15} {r['config']['concurrency']:>3} {f['output_tok_s']:>10.1f} "
                f"{f['total_tok_s']:>11.1f} {f['ttft_mean_ms']:>8.0f}ms {f['ttft_median_ms']:>7.0f}ms "
                f"{f['step_mean_ms']:>8.1f} {f['steps']:>6}")
        if hf and "hf" in r:
            h = r["hf"]
            line += (f" {h['output_tok_s']:>12.1f} {h['ttft_mean_ms']:>6.0f}ms"
                     f" {r['ratio_output_tok_s']:>5.2f}x {100 * h['greedy_prefix_match']:>6.0f}%")
        elif hf:
            line += f" {'-':>12} {'-':>8} {'-':>6} {'-':>7}"
        if vl:
            v = r["vllm"]
            line += (f" {v['output_tok_s']:>10.1f} {v['ttft_mean_ms']:>7.0f}ms"
                     f" {r['ratio_vllm_output_tok_s']:>5.2f}x {100 * v['greedy_prefix_match']:>6.0f}%")
        print(line)
    if hf:
        print(f"HF: transformers {hf['versions']['transformers']}, torch {hf['versions']['torch']}, "
              f"{first_hf(rows).get('dtype')}, {first_hf(rows).get('threads')} threads, startup {hf['startup_s']:.1f}s; "
              "ratio = jaxserve/HF output tok/s; greedy= = mean agreeing output prefix")
    if hf and hf.get("isa"):
        print(f"HF ISA: {isa_summary(hf['isa'])}")
    for name, peer in (("HF", hf), ("vLLM", vl)):
        loads = [x for r in (peer or {}).get("runs", []) for x in (r.get("load_avg_before"), r.get("load_avg_after")) if x]
        if loads:
            print(f"{name} ran at a 1-minute load average of {min(l[0] for l in loads):.2f}-{max(l[0] for l in loads):.2f}")
    if vl:
        print(f"vLLM {vl['versions']['vllm']} ({', '.join(f'{k}={v}' for k, v in vl['env'].items())}); "
              "ratio = jaxserve/vLLM output tok/s")
        if vl.get("isa"):
            print(f"vLLM ISA: {isa_summary(vl['isa']['torch'])}; " + "; ".join(
                f"{d}: {', '.join(e['libraries'])}, attention {e['attention_isa']}"
                for d, e in vl["isa"]["engines"].items()))
    for r in rows:
        f, cfg = r["figures"], r["config"]
        if f["recompiles"] or f["preemptions"]:
            print(f"note: {cfg['dtype']} c={cfg['concurrency']}: {f['recompiles']} recompiles, "
                  f"{f['preemptions']} preemptions")


if __name__ == "__main__":
    main()
