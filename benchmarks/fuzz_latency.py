"""Small requests' latency while the route fuzz runs, optionally with other processes
compiling XLA programs on the same cores: what does a small request wait on?

The server (the test suite's live-server configuration: the default model, float32, 8 sequences,
buckets 16/128) runs in this process. One client sends the route fuzz of
tests/server/test_fuzz.py one request at a time (by default as the test sends it; `--uncapped`
keeps the generated max_tokens / n, so some requests run to the end of the context), while a
second client sends a small request every 0.2 s: a 4-token completion of a short unicode
prompt, as in the fuzz run that reported hangs. `--hogs N` starts N processes that compile
XLA programs in a loop (another job's compiles on the same 2 cores).

Reported, one JSON line to benchmarks/results/fuzz_latency.jsonl: the probes' latency (p50,
p99, max), the XLA compilations anywhere in this process after warm-up (JAX's compile log),
the event loop's largest lag (a 10 ms timer), the fuzz requests slower than 5 s, and the
statuses.

    .venv/bin/python benchmarks/fuzz_latency.py --examples 2000 --hogs 2
    .venv/bin/python benchmarks/fuzz_latency.py --examples 1500 --hogs 2 --uncapped
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import asyncio  # noqa: E402
import json  # noqa: E402
import logging  # noqa: E402
import pathlib  # noqa: E402
import random  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402

from results_log import append_results  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
RESULTS = ROOT / "benchmarks" / "results" / "fuzz_latency.jsonl"

HOG = """
import jax, jax.numpy as jnp
for i in range(1_000_000):
    f = jax.jit(lambda x, i=i: jnp.tanh(x @ x.T + i).sum())
    f.lower(jax.ShapeDtypeStruct((512 + i % 64, 512), jnp.float32)).compile()
"""


def unicode_prompt(rnd: random.Random) -> str:
    ranges = [(0x4E00, 500), (0xE9, 1), (0x3B1, 20), (0x1F600, 50)]
    return "".join(chr(a + rnd.randrange(n)) for a, n in (rnd.choice(ranges) for _ in range(rnd.randrange(2, 8))))


def percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--examples", type=int, default=2000, help="fuzz requests")
    ap.add_argument("--hogs", type=int, default=0, help="processes compiling XLA programs meanwhile")
    ap.add_argument("--uncapped", action="store_true", help="keep the fuzz's max_tokens and n as generated")
    args = ap.parse_args()

    import httpx
    import jax
    from hypothesis import HealthCheck, given, settings

    import tests.server.test_fuzz as fuzz
    from jaxserve.config import EngineConfig
    from jaxserve.engine.setup import build_engine
    from jaxserve.server.app import build_app
    from jaxserve.server.config import ServerConfig
    from jaxserve.engine.async_client import AsyncEngineClient
    from tests.live_server import LiveServer, free_port
    from tests.server.conftest import API_KEY, ENGINE_OPTIONS, MODEL

    if args.uncapped:
        fuzz._cheap = lambda path, body: body
    engine = AsyncEngineClient.in_thread(build_engine(EngineConfig.from_kwargs(model=None, **ENGINE_OPTIONS)))
    app = build_app(engine, ServerConfig(served_model_name=(MODEL, "alias"), api_key=(API_KEY,),
                                         max_request_body=1 << 20, shutdown_grace=5, enable_sleep_mode=True,
                                         tool_call_parser="hermes", enable_auto_tool_choice=True,
                                         disable_log_requests=True))
    server = LiveServer(app, free_port())
    server.start()

    compiles: list[str] = []

    class CompileLog(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if "ompil" in record.getMessage():
                compiles.append(record.getMessage()[:200])

    jax.config.update("jax_log_compiles", True)
    logging.getLogger("jax").addHandler(CompileLog())
    lags: list[float] = []

    async def ticker() -> None:
        while True:
            t = time.perf_counter()
            await asyncio.sleep(0.01)
            lags.append(time.perf_counter() - t - 0.01)

    asyncio.run_coroutine_threadsafe(ticker(), engine._loop)
    hogs = [subprocess.Popen([sys.executable, "-c", HOG]) for _ in range(args.hogs)]
    keyed = {"Authorization": f"Bearer {API_KEY}"}
    probes: list[float] = []
    stop = threading.Event()

    def probe() -> None:
        rnd = random.Random(0)
        with httpx.Client(base_url=server.base_url, timeout=600) as c:
            while not stop.is_set():
                t = time.perf_counter()
                r = c.post("/v1/completions", headers=keyed,
                           json={"model": MODEL, "prompt": unicode_prompt(rnd), "max_tokens": 4})
                assert r.status_code == 200, r.text
                probes.append(time.perf_counter() - t)
                stop.wait(0.2)

    statuses: dict[int, int] = {}
    slow: list[tuple[float, str, str]] = []
    prober = threading.Thread(target=probe)
    t0 = time.time()
    prober.start()
    try:
        with httpx.Client(base_url=server.base_url, timeout=900) as c:
            @settings(max_examples=args.examples, derandomize=True, deadline=None, database=None,
                      suppress_health_check=list(HealthCheck))
            @given(case=fuzz.fuzz_requests())
            def run(case) -> None:
                method, path, body, headers = case
                t = time.perf_counter()
                r = c.request(method, path, content=body or None, headers=headers)
                if time.perf_counter() - t > 5:
                    slow.append((round(time.perf_counter() - t, 1), path, body[:200].decode("utf-8", "replace")))
                statuses[r.status_code] = statuses.get(r.status_code, 0) + 1

            run()
    finally:
        stop.set()
        prober.join()
        for h in hogs:
            h.kill()
        server.stop()
    row = {"time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "examples": args.examples,
           "uncapped": args.uncapped, "hogs": args.hogs, "seconds": round(time.time() - t0, 1),
           "load_avg_1m": os.getloadavg()[0], "probes": len(probes),
           "probe_p50_s": percentile(probes, 0.5), "probe_p99_s": percentile(probes, 0.99),
           "probe_max_s": max(probes, default=float("nan")), "compiles_after_warmup": len(compiles),
           "engine_recompiles": engine.stats.recompiles, "event_loop_max_lag_s": max(lags, default=0.0),
           "statuses": statuses, "slow_fuzz_requests": sorted(slow, reverse=True)[:10]}
    print(json.dumps(row, indent=1))
    append_results(RESULTS, row)


if __name__ == "__main__":
    main()
