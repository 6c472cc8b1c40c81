"""Which token budget per step (`--max-num-batched-tokens`) serves best: TTFT and throughput of
`jaxserve serve` over HTTP streaming at several concurrencies, budgets side by side.

For each round, each budget in turn (the order rotated every round, so that a machine busy with
other work loads them alike): launch `jaxserve serve --max-num-batched-tokens B` (its default
bucket grid for that budget; the compilation caches shared, so only the first start of a budget
compiles, and that first start's time to /health is recorded as its cold start), then at each
concurrency c a closed loop of c streams over `--waves` x c prompts (at least 4), measured as
`serving_benchmark.py` does (TTFT, ITL, output tok/s), then stop the server. Each measurement
appends a JSON line to benchmarks/results/token_budget.jsonl; a table of medians over the
rounds follows, with ratios against the first budget.

    .venv/bin/python benchmarks/token_budget.py --budgets 512 1024 2048 --concurrency 1 8 32 --rounds 3
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import pathlib
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time

import httpx

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import serving_benchmark as sb  # noqa: E402
from startup import cpu_model, free_port, git_state, healthy, parse_phases  # noqa: E402

RESULTS = HERE / "results" / "token_budget.jsonl"


def launch(budget: int, port: int, cache_dir: str, extra: list[str], log, timeout: float) -> tuple[subprocess.Popen, float]:
    cmd = [sys.executable, "-m", "jaxserve.server.cli", "serve", "--port", str(port), "--max-num-batched-tokens",
           str(budget), "--compilation-cache-dir", cache_dir, "--disable-log-requests", *extra]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    while time.perf_counter() - t0 < timeout:
        if healthy(port):
            return proc, time.perf_counter() - t0
        if proc.poll() is not None:
            raise SystemExit(f"the server for budget {budget} exited with {proc.returncode}")
        time.sleep(0.05)
    proc.kill()
    raise SystemExit(f"the server for budget {budget} did not become healthy in {timeout:.0f} s")


def stop(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


async def measure(base_url: str, concurrencies: list[int], args) -> list[dict]:
    ns = argparse.Namespace(base_url=base_url, api_key=None, output_len=args.output_len, timeout=3600, seed=0)
    async with httpx.AsyncClient(base_url=base_url, timeout=60) as client:
        model = (await client.get("/v1/models")).json()["data"][0]["id"]
        n = max(max(concurrencies) * args.waves, 4)
        prompts, lens, _ = await sb.make_prompts(client, model, n, args.input_len, args.seed)
    ns.model = model
    await sb.run_once(ns, prompts[:2], lens[:2], concurrency=2, rate=None)  # warm-up
    out = []
    for c in concurrencies:
        k = max(c * args.waves, 4)
        load0 = os.getloadavg()
        m = sb.run_once(ns, prompts[:k], lens[:k], concurrency=c, rate=None)
        m = await m
        m.update(concurrency=c, num_prompts=k, load_avg_before=load0, load_avg_after=os.getloadavg())
        out.append(m)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--budgets", type=int, nargs="+", default=[512, 1024, 2048])
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--waves", type=int, default=2, help="prompts per run: waves x concurrency (at least 4)")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--serve-args", default="", help="extra arguments for jaxserve serve")
    p.add_argument("--compilation-cache-dir", default=None,
                   help="shared by the servers (default: a temporary directory: the first start of each budget "
                        "is then a cold start)")
    p.add_argument("--launch-timeout", type=float, default=1800)
    p.add_argument("--results", default=str(RESULTS), help="JSON lines file ('' for none)")
    args = p.parse_args(argv)
    extra = shlex.split(args.serve_args)
    cache_dir = args.compilation_cache_dir or tempfile.mkdtemp(prefix="jaxserve-budget-")
    cpu, (sha, dirty) = cpu_model(), git_state(HERE.parent)
    rows: list[dict] = []
    budgets = args.budgets
    for r in range(args.rounds):
        order = budgets[r % len(budgets):] + budgets[: r % len(budgets)]
        for budget in order:
            port = free_port()
            with tempfile.TemporaryFile("w+") as log:
                proc, start_s = launch(budget, port, cache_dir, extra, log, args.launch_timeout)
                try:
                    runs = asyncio.run(measure(f"http://127.0.0.1:{port}", args.concurrency, args))
                finally:
                    stop(proc)
                log.seek(0)
                _, phases, notes = parse_phases(log.read())
            for m in runs:
                row = {"benchmark": "token_budget", "timestamp": datetime.datetime.now().isoformat(timespec="seconds"),
                       "git_sha": sha, "git_dirty": dirty, "cpu": cpu, "round": r, "max_num_batched_tokens": budget,
                       "serve_args": extra, "input_len": args.input_len, "output_len": args.output_len,
                       "start_s": round(start_s, 2), "start_phases": phases, "start_notes": notes, **m}
                rows.append(row)
                print(f"round {r} budget {budget:5d} c={m['concurrency']:3d}: TTFT p50 {m['ttft_ms']['p50']:8.0f} ms "
                      f"p90 {m['ttft_ms']['p90']:8.0f}  ITL p50 {m['itl_ms']['p50']:6.1f} p99 {m['itl_ms']['p99']:7.1f}  "
                      f"{m['output_throughput']:6.1f} out tok/s  (start {start_s:.1f} s, "
                      f"{notes.get('executables', '')}; load {m['load_avg_before'][0]:.2f})", flush=True)
                if args.results:
                    with open(args.results, "a") as f:
                        f.write(json.dumps(row) + "\n")

    print(f"\n{cpu}; git {str(sha)[:10]}{' (dirty)' if dirty else ''}; load average {os.getloadavg()[0]:.2f} "
          f"at the end; medians of {args.rounds} rounds; {args.input_len}-token prompts, {args.output_len} new tokens")
    print(f"{'budget':>6s} {'c':>3s} {'TTFT p50 ms':>12s} {'vs first':>8s} {'TTFT p90':>9s} {'ITL p50':>8s} "
          f"{'ITL p99':>8s} {'out tok/s':>9s} {'vs first':>8s}")
    for c in args.concurrency:
        base = None
        for budget in budgets:
            xs = [x for x in rows if x["max_num_batched_tokens"] == budget and x["concurrency"] == c]
            med = lambda f: statistics.median(f(x) for x in xs)  # noqa: E731
            ttft, tput = med(lambda x: x["ttft_ms"]["p50"]), med(lambda x: x["output_throughput"])
            base = base or (ttft, tput)
            print(f"{budget:6d} {c:3d} {ttft:12.0f} {ttft / base[0]:7.2f}x {med(lambda x: x['ttft_ms']['p90']):9.0f} "
                  f"{med(lambda x: x['itl_ms']['p50']):8.1f} {med(lambda x: x['itl_ms']['p99']):8.1f} "
                  f"{tput:9.1f} {tput / base[1]:7.2f}x")
    starts = {b: [x["start_s"] for x in rows if x["max_num_batched_tokens"] == b and x["round"] == 0][:1]
              for b in budgets}
    print("first start (cold unless --compilation-cache-dir was warm): " +
          ", ".join(f"{b}: {s[0]:.1f} s" for b, s in starts.items() if s))
    return 0


if __name__ == "__main__":
    sys.exit(main())
