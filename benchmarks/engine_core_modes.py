"""The engine core on a thread of the server's process against in a process of its own
(`jaxserve serve --engine-core thread|process`), side by side over HTTP.

Two workloads, each at several concurrencies (default 32 and 128 streams), the two modes
alternating round after round on the same prompts:

- `real`: `jaxserve serve` on the default model (--dtype, --max-model-len 1024, prefix caching
  off, --max-num-seqs the largest concurrency), streaming completions of --input-len tokens and
  --output-len new tokens (ignore_eos), as benchmarks/serving_benchmark.py sends them.
- `null`: the same server over the null model of benchmarks/host_overhead.py (a compiled step
  that costs almost nothing, the default model's tokenizer), standing in for an accelerator
  whose step takes a few milliseconds: what is left is the host's work (HTTP, detokenizing,
  scheduling), where the two modes differ.

Reported per (workload, concurrency, mode): output tok/s, TTFT and ITL p50 / p99 (medians over
rounds), one JSON line per run in benchmarks/results/engine_core_modes.jsonl and a table of the
process/thread ratios.

    .venv/bin/python benchmarks/engine_core_modes.py [--workloads real null] [--concurrency 32 128] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import pathlib
import socket
import statistics
import subprocess
import sys
import time

from results_log import append_results

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parent
RESULTS = HERE / "results" / "engine_core_modes.jsonl"
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(ROOT))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------------------- the null-model server
class NullParts:
    """Builds host_overhead's null-model engine (picklable: the engine process calls it)."""

    def __init__(self, max_num_seqs: int):
        self.max_num_seqs = max_num_seqs

    def __call__(self, on_model_path=None, timer=None):
        import dataclasses

        import host_overhead

        parts = host_overhead.null_parts(self.max_num_seqs, async_scheduling=True)
        info = parts.info
        parts.info = dataclasses.replace(info, max_num_seqs=self.max_num_seqs,
                                         kv_cache_tokens=parts.core.scheduler.cache_tokens)
        return parts


def serve_null(mode: str, port: int, max_num_seqs: int) -> None:
    """Serve the null model over HTTP with the engine core on a thread or in a process."""
    import logging

    import uvicorn

    from jaxserve.engine.async_client import AsyncEngineClient
    from jaxserve.engine.core_process import ProcessCore
    from jaxserve.server.app import build_app
    from jaxserve.server.config import ServerConfig

    logging.basicConfig(level=logging.WARNING)
    build = NullParts(max_num_seqs)
    if mode == "thread":
        client = AsyncEngineClient.in_thread(build())
    else:
        import host_overhead

        transport, info, stats = ProcessCore.spawn(build)
        client = AsyncEngineClient(transport, host_overhead._null_tokenizer(32), info, stats, mode="process")
    app = build_app(client, ServerConfig(shutdown_grace=1, disable_log_requests=True))
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning")


# ---------------------------------------------------------------------------- driver
def start(workload: str, mode: str, port: int, args: argparse.Namespace) -> subprocess.Popen:
    if workload == "null":
        cmd = [sys.executable, __file__, "--serve-null", mode, "--port", str(port),
               "--max-num-seqs", str(max(args.concurrency))]
    else:
        cmd = [str(ROOT / ".venv" / "bin" / "jaxserve"), "serve", "--port", str(port), "--engine-core", mode,
               "--dtype", args.dtype, "--max-model-len", "1024", "--no-enable-prefix-caching",
               "--max-num-seqs", str(max(args.concurrency)), "--log-level", "warning", "--disable-log-requests"]
    log = open(HERE / ".cache" / f"engine-core-{workload}-{mode}.log", "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    import httpx

    deadline = time.time() + 900
    while time.time() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the {workload} server ({mode}) exited; see {log.name}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(1)
    proc.kill()
    raise SystemExit(f"the {workload} server ({mode}) did not become healthy")


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


async def measure(port: int, args: argparse.Namespace, concurrency: int, prompts, lens) -> dict:
    import serving_benchmark as sb

    import httpx

    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=600) as c:
        model = (await c.get("/v1/models")).json()["data"][0]["id"]
        for i in range(2):  # warm-up
            await sb.one_request(c, model, prompts[i], lens[i], 8)
    ns = argparse.Namespace(base_url=f"http://127.0.0.1:{port}", model=model, api_key=None, seed=0,
                            output_len=args.output_len, timeout=3600)
    return await sb.run_once(ns, prompts, lens, concurrency=concurrency, rate=None)


async def prompts_for(port: int, args: argparse.Namespace):
    import httpx
    import serving_benchmark as sb

    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=600) as c:
        model = (await c.get("/v1/models")).json()["data"][0]["id"]
        prompts, lens, _ = await sb.make_prompts(c, model, args.num_prompts, args.input_len, seed=0)
    return prompts, lens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workloads", nargs="+", default=["null", "real"], choices=["null", "real"])
    ap.add_argument("--concurrency", type=int, nargs="+", default=[32, 128])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--num-prompts", type=int, default=None, help="default: 2 x the concurrency")
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--serve-null", choices=["thread", "process"], help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--max-num-seqs", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve_null:
        serve_null(args.serve_null, args.port, args.max_num_seqs)
        return
    (HERE / ".cache").mkdir(exist_ok=True)
    rows = []
    for workload in args.workloads:
        for c in args.concurrency:
            args.num_prompts_c = args.num_prompts or 2 * c
            for r in range(args.rounds):
                for mode in (["thread", "process"] if r % 2 == 0 else ["process", "thread"]):
                    port = free_port()
                    proc = start(workload, mode, port, args)
                    try:
                        saved, args.num_prompts = args.num_prompts, args.num_prompts_c
                        prompts, lens = asyncio.run(prompts_for(port, args))
                        args.num_prompts = saved
                        m = asyncio.run(measure(port, args, c, prompts, lens))
                    finally:
                        stop(proc)
                    row = {"time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "workload": workload,
                           "mode": mode, "concurrency": c, "round": r, "load_avg_1m": os.getloadavg()[0],
                           "cores": os.cpu_count(), "input_len": args.input_len, "output_len": args.output_len,
                           "dtype": args.dtype, **m}
                    rows.append(row)
                    print(f"{workload:5} c={c:4d} r{r} {mode:7}: {m['output_throughput']:8.1f} out tok/s, TTFT p50 "
                          f"{m['ttft_ms']['p50']:7.0f} ms p99 {m['ttft_ms']['p99']:7.0f}, ITL p50 "
                          f"{m['itl_ms']['p50']:6.1f} ms p99 {m['itl_ms']['p99']:6.1f} ({m['failed']} failed)",
                          flush=True)
                    append_results(RESULTS, row)
    print("\nmedians over rounds (process / thread):")
    for workload in args.workloads:
        for c in args.concurrency:
            def med(mode: str, key, workload=workload, c=c) -> float:
                return statistics.median(key(x) for x in rows if x["workload"] == workload and x["concurrency"] == c
                                         and x["mode"] == mode)
            for name, key in (("out tok/s", lambda x: x["output_throughput"]),
                              ("TTFT p50 ms", lambda x: x["ttft_ms"]["p50"]),
                              ("TTFT p99 ms", lambda x: x["ttft_ms"]["p99"]),
                              ("ITL p50 ms", lambda x: x["itl_ms"]["p50"]),
                              ("ITL p99 ms", lambda x: x["itl_ms"]["p99"])):
                t, p = med("thread", key), med("process", key)
                print(f"{workload:5} c={c:4d} {name:12}: thread {t:9.1f}  process {p:9.1f}  ({p / t:.2f}x)")


if __name__ == "__main__":
    main()
