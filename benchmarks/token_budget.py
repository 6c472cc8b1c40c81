"""Which token budget per step (`--max-num-batched-tokens`) serves best: TTFT and throughput of
`jaxserve serve` over HTTP streaming at several concurrencies, budgets side by side.

One `jaxserve serve --max-num-batched-tokens B` per budget (its default bucket grid for that
budget), all started first and left idle between their turns. Then, round after round, at each
concurrency c, each server in turn (the order rotated every round) runs a closed loop of c
streams over `--waves` x c prompts (at least 4), measured as `serving_benchmark.py` does
(TTFT, ITL, output tok/s). Measurements of the budgets at one concurrency are thus a few seconds
apart, so that a machine busy with other work loads them alike; the table shows medians over the
rounds and the median of each round's ratio against the first budget (c = 1, where the budget
makes no difference, shows the noise). Each measurement appends a JSON line to
benchmarks/results/token_budget.jsonl.

    .venv/bin/python benchmarks/token_budget.py --budgets 512 1024 2048 --concurrency 1 8 32 --rounds 3
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import os
import pathlib
import shlex
import shutil
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

from results_log import append_results  # noqa: E402

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


async def prepare(base_url: str, args) -> argparse.Namespace:
    """The server's model name, the prompts (token-exact through /tokenize), a warm-up."""
    ns = argparse.Namespace(base_url=base_url, api_key=None, output_len=args.output_len, timeout=3600, seed=0)
    async with httpx.AsyncClient(base_url=base_url, timeout=60) as client:
        ns.model = (await client.get("/v1/models")).json()["data"][0]["id"]
        n = max(max(args.concurrency) * args.waves, 4)
        ns.prompts, ns.lens, _ = await sb.make_prompts(client, ns.model, n, args.input_len, args.seed)
    await sb.run_once(ns, ns.prompts[:2], ns.lens[:2], concurrency=2, rate=None)
    return ns


def measure(ns: argparse.Namespace, c: int, waves: int) -> dict:
    k = max(c * waves, 4)
    load0 = os.getloadavg()
    m = asyncio.run(sb.run_once(ns, ns.prompts[:k], ns.lens[:k], concurrency=c, rate=None))
    m.update(concurrency=c, num_prompts=k, load_avg_before=load0, load_avg_after=os.getloadavg())
    return m


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--budgets", type=int, nargs="+", default=[512, 1024, 2048])
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--waves", type=int, default=2, help="prompts per run: waves x concurrency (at least 4)")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--serve-args", default="--no-enable-prefix-caching",
                   help="extra arguments for jaxserve serve (default: prefix caching off, as every round sends the "
                        "same prompts again)")
    p.add_argument("--compilation-cache-dir", default=None,
                   help="shared by the servers (default: a temporary directory, removed at the end: the first "
                        "start of each budget is then a cold start)")
    p.add_argument("--launch-timeout", type=float, default=1800)
    p.add_argument("--results", default=str(RESULTS), help="JSON lines file ('' for none)")
    args = p.parse_args(argv)
    extra = shlex.split(args.serve_args)
    cache_dir = args.compilation_cache_dir or tempfile.mkdtemp(prefix="jaxserve-budget-")
    cpu, (sha, dirty) = cpu_model(), git_state(HERE.parent)
    rows: list[dict] = []
    budgets = args.budgets
    servers: dict[int, tuple] = {}
    try:
        for budget in budgets:
            port, log = free_port(), tempfile.TemporaryFile("w+")
            proc, start_s = launch(budget, port, cache_dir, extra, log, args.launch_timeout)
            log.seek(0)
            _, phases, notes = parse_phases(log.read())
            ns = asyncio.run(prepare(f"http://127.0.0.1:{port}", args))
            servers[budget] = (proc, log, ns, {"start_s": round(start_s, 2), "start_phases": phases,
                                               "start_notes": notes})
            print(f"budget {budget}: healthy after {start_s:.1f} s ({notes.get('executables', '')})", flush=True)
        for r in range(args.rounds):
            order = budgets[r % len(budgets):] + budgets[: r % len(budgets)]
            for c in args.concurrency:
                for budget in order:
                    _, _, ns, start = servers[budget]
                    m = measure(ns, c, args.waves)
                    row = {"benchmark": "token_budget", "timestamp": datetime.datetime.now().isoformat(timespec="seconds"),
                           "git_sha": sha, "git_dirty": dirty, "cpu": cpu, "round": r,
                           "max_num_batched_tokens": budget, "serve_args": extra, "input_len": args.input_len,
                           "output_len": args.output_len, **start, **m}
                    rows.append(row)
                    print(f"round {r} c={c:3d} budget {budget:5d}: TTFT p50 {m['ttft_ms']['p50']:8.0f} ms p90 "
                          f"{m['ttft_ms']['p90']:8.0f}  ITL p50 {m['itl_ms']['p50']:6.1f} p99 {m['itl_ms']['p99']:7.1f}  "
                          f"{m['output_throughput']:6.1f} out tok/s  (load {m['load_avg_before'][0]:.2f})", flush=True)
                    if args.results:
                        append_results(args.results, row)
    finally:
        for proc, log, _, _ in servers.values():
            stop(proc)
            log.close()
        if args.compilation_cache_dir is None:
            shutil.rmtree(cache_dir, ignore_errors=True)

    print(f"\n{cpu}; git {str(sha)[:10]}{' (dirty)' if dirty else ''}; load average {os.getloadavg()[0]:.2f} "
          f"at the end; medians of {args.rounds} rounds; {args.input_len}-token prompts, {args.output_len} new tokens")
    print(f"{'budget':>6s} {'c':>3s} {'TTFT p50 ms':>12s} {'ratio':>7s} {'TTFT p90':>9s} {'ITL p50':>8s} "
          f"{'ITL p99':>8s} {'out tok/s':>9s} {'ratio':>7s}")
    pick = lambda b, c, r=None: [x for x in rows if x["max_num_batched_tokens"] == b and x["concurrency"] == c  # noqa: E731
                                 and (r is None or x["round"] == r)]
    for c in args.concurrency:
        for budget in budgets:
            xs = pick(budget, c)
            med = lambda f: statistics.median(f(x) for x in xs)  # noqa: E731
            ratios = [(pick(budget, c, r)[0]["ttft_ms"]["p50"] / pick(budgets[0], c, r)[0]["ttft_ms"]["p50"],
                       pick(budget, c, r)[0]["output_throughput"] / pick(budgets[0], c, r)[0]["output_throughput"])
                      for r in range(args.rounds)]
            print(f"{budget:6d} {c:3d} {med(lambda x: x['ttft_ms']['p50']):12.0f} "
                  f"{statistics.median(t for t, _ in ratios):6.2f}x {med(lambda x: x['ttft_ms']['p90']):9.0f} "
                  f"{med(lambda x: x['itl_ms']['p50']):8.1f} {med(lambda x: x['itl_ms']['p99']):8.1f} "
                  f"{med(lambda x: x['output_throughput']):9.1f} {statistics.median(o for _, o in ratios):6.2f}x")
    print("first starts (cold unless --compilation-cache-dir was warm; later budgets reuse the buckets they share): "
          + ", ".join(f"{b}: {s[3]['start_s']:.1f} s" for b, s in servers.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
