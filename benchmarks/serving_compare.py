"""`serving_benchmark.py --launch --compare-vllm`: `jaxserve serve` and `vllm serve` launched
with the same settings, alternating, on the same prompts (see serving_benchmark.py's docstring
and benchmarks/README.md)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import importlib.metadata
import os
import pathlib
import re
import shlex
import signal
import statistics
import subprocess
import sys
import time

import httpx

import cpu_class
import serving_benchmark as sb

COMPARED = (("ttft_ms", "p50"), ("ttft_ms", "p99"), ("itl_ms", "p50"), ("itl_ms", "p99"), ("tpot_ms", "p50"),
            ("e2el_ms", "p50"))


def _port(url: str) -> int:
    return int(url.rsplit(":", 1)[-1].strip("/"))


def start_server(name: str, cmd: list[str], env: dict, url: str, timeout: float, log_path: pathlib.Path):
    """Start a server in its own process group, its output to `log_path`; wait for /health."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    log = open(log_path, "w")
    print(f"[{name}] launching: {' '.join(cmd)} (log: {log_path.name})", flush=True)
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    proc.log = log
    while time.monotonic() - t0 < timeout:
        if proc.poll() is not None:
            log.close()
            tail = log_path.read_text(errors="replace").splitlines()[-25:]
            raise SystemExit(f"[{name}] exited with {proc.returncode} before it was healthy:\n" + "\n".join(tail))
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                proc.startup_s = time.monotonic() - t0
                print(f"[{name}] healthy after {proc.startup_s:.0f}s", flush=True)
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(1)
    stop_server(proc)
    raise SystemExit(f"[{name}] not healthy after {timeout:.0f}s; see {log_path}")


def stop_server(proc: subprocess.Popen) -> None:
    """SIGTERM to the server's process group (vLLM's engine processes included), then SIGKILL."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)
    with contextlib.suppress(ProcessLookupError):  # stragglers of the group
        os.killpg(proc.pid, signal.SIGKILL)
    proc.log.close()


def build_vllm_model_dir(args) -> str:
    """The transformers directory offline_throughput.py builds (hf_worker.build_hf_dir), built
    with the vLLM python (it ships torch and transformers) if it is not there yet."""
    gguf = args.gguf
    if gguf is None:
        from jaxserve.models.loader import default_gguf_path

        gguf = str(default_gguf_path())
    code = ("import pathlib, sys; sys.path.insert(0, sys.argv[1]); from hf_worker import build_hf_dir; "
            "print(build_hf_dir(pathlib.Path(sys.argv[2]), pathlib.Path(sys.argv[3])))")
    out = subprocess.run([args.vllm_python, "-c", code, str(sb.HERE), gguf, str(sb.HERE / ".cache")],
                         stdout=subprocess.PIPE, text=True, check=True)
    return out.stdout.strip().splitlines()[-1]


def vllm_key(binding: str) -> str:
    """The server's name in the results: "vllm" with vllm_worker.py's binding, else vllm:BINDING."""
    return "vllm" if binding == "all" else f"vllm:{binding}"


def vllm_env(args, binding: str) -> dict:
    """vllm_worker.py's settings (binding "all"): every core bound to vLLM's OpenMP threads,
    none reserved, unless the environment sets them; "vllm-default" leaves vLLM's own (it
    reserves one core for its other processes and computes on the rest)."""
    env = cpu_class.peer_env(args.cpu_class)
    if binding == "all":
        threads = args.vllm_threads or os.cpu_count() or 1
        env.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{threads - 1}")
        env.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
    return env


def shared_flags(args) -> list[str]:
    """The settings both servers get, in vLLM's spelling (jaxserve takes the same flags)."""
    return ["--dtype", args.dtype, "--max-num-seqs", str(args.max_num_seqs),
            "--max-model-len", str(args.max_model_len),
            "--enable-prefix-caching" if args.prefix_caching == "on" else "--no-enable-prefix-caching"]


def server_commands(args, model_dir: str) -> dict:
    host = "127.0.0.1"
    js = [sys.executable, "-m", "jaxserve.server.cli", "serve", "--host", host, "--port", str(_port(args.base_url)),
          *shared_flags(args), "--disable-log-requests", *cpu_class.jaxserve_serve_args(args.cpu_class),
          *shlex.split(args.launch_args)]
    vl = [args.vllm_python, str(sb.HERE / "vllm_serve.py"), "serve", model_dir, "--host", host,
          "--port", str(args.vllm_port), *shared_flags(args), *shlex.split(args.vllm_args)]
    if args.api_key:
        js += ["--api-key", args.api_key]
        vl += ["--api-key", args.api_key]
    cmds = {"jaxserve": (js, cpu_class.jaxserve_env(args.cpu_class), args.base_url)}
    for binding in args.vllm_binding:
        cmds[vllm_key(binding)] = (vl, vllm_env(args, binding), f"http://{host}:{args.vllm_port}")
    return cmds


def printable(cmd: list[str], model_dir: str) -> str:
    """A command line for the JSON lines, without this machine's paths."""
    out = []
    for part in cmd:
        if part == model_dir:
            part = "<transformers dir built from the GGUF>"
        elif part.endswith(("/python", "/python3")) or re.search(r"/python3?\.\d+$", part):
            part = "python"
        elif part.startswith(str(sb.HERE)):
            part = "benchmarks" + part[len(str(sb.HERE)):]
        out.append(part)
    return " ".join(out)


def batched_tokens_defaults(args, env: dict) -> dict:
    """Each server's default max_num_batched_tokens (neither server logs it): what jaxserve's
    CPU backend resolves it to, and what vLLM's own code gives its OpenAI server on this platform."""
    out = {}
    try:
        from jaxserve.backends.cpu import CpuBackend

        out["jaxserve"] = CpuBackend.default_max_num_batched_tokens
    except ImportError:
        out["jaxserve"] = None
    code = ("from vllm.engine.arg_utils import EngineArgs; from vllm.usage.usage_lib import UsageContext; "
            "print(EngineArgs.get_batch_defaults(1)[0][UsageContext.OPENAI_API_SERVER])")
    try:
        r = subprocess.run([args.vllm_python, "-c", code], env=env, capture_output=True, text=True, timeout=300)
        out["vllm"] = int(r.stdout.strip().splitlines()[-1])
    except (subprocess.SubprocessError, ValueError, IndexError):
        out["vllm"] = None
    return out


async def server_facts(url: str, headers: dict, prompts: list[str]) -> dict:
    """The served model's id, the server's version if it says, and its own token counts of the prompts."""
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=60) as client:
        r = await client.get("/v1/models")
        r.raise_for_status()
        model = r.json()["data"][0]["id"]
        version = None
        with contextlib.suppress(httpx.HTTPError, ValueError, KeyError):
            v = await client.get("/version")
            if v.status_code == 200:
                version = v.json().get("version")
        counts = [await sb._count_tokens(client, model, text) for text in prompts]
    return {"model": model, "version": version, "prompt_tokens": counts}


async def measure(args, url: str, model: str, prompts: list[str], lens: list[int]) -> list[dict]:
    run_args = argparse.Namespace(**{**vars(args), "base_url": url, "model": model})
    if args.warmup:  # the servers' first requests, then a burst at the largest concurrency
        await sb.run_once(run_args, prompts[: args.warmup], lens[: args.warmup], concurrency=args.warmup, rate=None)
        burst = argparse.Namespace(**{**vars(run_args), "output_len": 16})
        n = min(len(prompts), max(args.concurrency))
        await sb.run_once(burst, prompts[:n], lens[:n], concurrency=n, rate=None)
    runs = []
    for c in args.concurrency:
        n = min(len(prompts), c * args.prompts_per_stream) if args.prompts_per_stream else len(prompts)
        load0 = os.getloadavg()
        m = await sb.run_once(run_args, prompts[:n], lens[:n], concurrency=c, rate=None)
        m.update(label=f"concurrency={c}", concurrency=c, num_requests=n, load_avg_before=load0,
                 load_avg_after=os.getloadavg())
        print(f"  c={c}: {m['output_throughput']:.1f} output tok/s, TTFT p50 {m['ttft_ms']['p50']:.0f} ms, "
              f"ITL p50 {m['itl_ms']['p50']:.1f} ms, {m['failed']} failed, load {load0[0]:.2f}", flush=True)
        runs.append(m)
    return runs


def _median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def compare(args: argparse.Namespace) -> None:
    args.max_num_seqs = args.max_num_seqs or max(args.concurrency)
    args.vllm_port = args.vllm_port or _port(args.base_url) + 1
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    model_dir = build_vllm_model_dir(args)
    cmds = server_commands(args, model_dir)
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    logs = sb.HERE / ".cache" / "serving_logs"
    host = cpu_class.host_cpu()
    common = {
        "benchmark": "serving_compare", "compare_id": stamp, "git_sha": sb._git_sha(), "tag": args.tag,
        "host": host, "cpu_class": cpu_class.describe(args.cpu_class),
        "settings": {"dtype": args.dtype, "max_num_seqs": args.max_num_seqs, "max_model_len": args.max_model_len,
                     "prefix_caching": args.prefix_caching, "num_prompts": args.num_prompts,
                     "input_len": args.input_len, "output_len": args.output_len, "concurrency": args.concurrency,
                     "rounds": args.rounds, "warmup": args.warmup, "seed": args.seed,
                     "prompts_per_stream": args.prompts_per_stream,
                     "vllm_binding": args.vllm_binding,
                     "vllm_threads_env": {vllm_key(b): {k: cmds[vllm_key(b)][1].get(k, "unset (vLLM's default)")
                                                        for k in ("VLLM_CPU_OMP_THREADS_BIND",
                                                                  "VLLM_CPU_NUM_OF_RESERVED_CPU",
                                                                  "VLLM_CPU_KVCACHE_SPACE")}
                                          for b in args.vllm_binding},
                     "max_num_batched_tokens_defaults": batched_tokens_defaults(
                         args, cmds[vllm_key(args.vllm_binding[0])][1])},
        "commands": {k: printable(v[0], model_dir) for k, v in cmds.items()},
        "versions": {"jax": importlib.metadata.version("jax"), "python": sys.version.split()[0]},
    }
    print(f"{host['model']} ({' '.join(host['flags'])}), CPU class {args.cpu_class}; {args.dtype}, max_num_seqs "
          f"{args.max_num_seqs}, max_model_len {args.max_model_len}, prefix caching {args.prefix_caching} on both",
          flush=True)
    prompts = lens = exact = None
    results: dict[str, list[list[dict]]] = {name: [] for name in cmds}
    facts: dict[str, dict] = {}
    for rnd in range(args.rounds):
        for name in cmds:
            cmd, env, url = cmds[name]
            log_path = logs / f"{stamp}-{name}-{rnd}.log"
            proc = start_server(name, cmd, env, url, args.launch_timeout, log_path)
            try:
                if prompts is None:  # made once, with jaxserve's tokenizer; the same text for both
                    async def make():
                        async with httpx.AsyncClient(base_url=url, headers=headers, timeout=60) as client:
                            r = await client.get("/v1/models")
                            r.raise_for_status()
                            return await sb.make_prompts(client, r.json()["data"][0]["id"], args.num_prompts,
                                                      args.input_len, args.seed)
                    prompts, lens, exact = asyncio.run(make())
                    print(f"{len(prompts)} prompts of {statistics.fmean(lens):.1f} tokens "
                          f"({'exact' if exact else 'approximate'}), {args.output_len} output tokens each", flush=True)
                f = asyncio.run(server_facts(url, headers, prompts))
                runs = asyncio.run(measure(args, url, f["model"], prompts, lens))
            finally:
                stop_server(proc)
            facts[name] = {"model": printable([f["model"]], model_dir), "version": f["version"],
                           "prompt_tokens_mean": (statistics.fmean(x for x in f["prompt_tokens"] if x is not None)
                                                  if any(x is not None for x in f["prompt_tokens"]) else None)}
            results[name].append(runs)
            now = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
            sb.append_results(args.results, [{**common, "time": now, "server": name, "round": rnd,
                                           "startup_s": proc.startup_s, "server_facts": facts[name],
                                           "input_len_exact": exact, **m} for m in runs])
    summary = summarize_compare(args, results)
    now = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    sb.append_results(args.results, [{**common, "time": now, "server": "summary", "server_facts": facts, **row}
                                  for row in summary])
    print_compare(args, summary, facts, common)


def summarize_compare(args, results: dict) -> list[dict]:
    """Per concurrency: each server's medians over rounds, the jaxserve/vLLM ratios."""
    rows = []
    for i, c in enumerate(args.concurrency):
        row = {"concurrency": c}
        for name in results:
            runs = [r[i] for r in results[name]]
            s = {f"{k[:-3]}_{q}_ms": _median([r[k][q] for r in runs]) for k, q in COMPARED}
            s["output_tok_s"] = _median([r["output_throughput"] for r in runs])
            s["output_tok_s_runs"] = [r["output_throughput"] for r in runs]
            s["failed"] = sum(r["failed"] for r in runs)
            s["load_avg_1m"] = [r["load_avg_before"][0] for r in runs]
            row[name] = s
        for name in results:
            if name != "jaxserve":
                row[f"ratio_jaxserve_over_{name}"] = {k: row["jaxserve"][k] / row[name][k] if row[name][k] else None
                                                      for k in row["jaxserve"] if k.endswith(("_ms", "_tok_s"))}
        rows.append(row)
    return rows


def print_compare(args, summary: list[dict], facts: dict, common: dict) -> None:
    binding = "; ".join(f"{name}: " + ", ".join(f"{k}={v}" for k, v in env.items())
                        for name, env in common["settings"]["vllm_threads_env"].items())
    tokens = ", ".join(f"{k} {v.get('prompt_tokens_mean')}" for k, v in facts.items())
    names = list(facts)
    print(f"\n{common['host']['model']}, CPU class {args.cpu_class}, {args.dtype}, {args.num_prompts} prompts of "
          f"{args.input_len} tokens, {args.output_len} out, medians of {args.rounds} round(s); git "
          f"{common['git_sha'][:10]}; vLLM {facts[names[1]].get('version')} ({binding}); max_num_batched_tokens "
          f"(each server's default): {common['settings']['max_num_batched_tokens_defaults']}; mean prompt tokens "
          f"by each server's tokenizer: {tokens}")
    cols = [("TTFT p50", "ttft_p50_ms"), ("TTFT p99", "ttft_p99_ms"), ("ITL p50", "itl_p50_ms"), ("ITL p99", "itl_p99_ms"),
            ("TPOT p50", "tpot_p50_ms"), ("E2E p50", "e2el_p50_ms"), ("out tok/s", "output_tok_s")]
    print(f"{'c':>3} {'server':26} " + " ".join(f"{h:>10}" for h, _ in cols) + "   load")
    for row in summary:
        for name in names:
            s = row[name]
            print(f"{row['concurrency']:>3} {name:26} " + " ".join(f"{s[k]:>10.1f}" for _, k in cols) +
                  "   " + " ".join(f"{x:.2f}" for x in s["load_avg_1m"]) + (f"  ({s['failed']} failed)" if s["failed"] else ""))
        for name in names[1:]:
            r = row[f"ratio_jaxserve_over_{name}"]
            print(f"{'':>3} {'jaxserve/' + name:26} " + " ".join(f"{r[k]:>9.2f}x" if r[k] else f"{'-':>10}"
                                                                for _, k in cols))
    print("ratio = jaxserve / vLLM (latencies in ms: < 1 means jaxserve is quicker; out tok/s: > 1 means jaxserve "
          "is faster); times in ms")
