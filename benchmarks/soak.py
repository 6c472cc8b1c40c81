"""Soak test of `jaxserve serve` under more load than it can serve at once.

Starts the server as a subprocess (the default model unless --launch-args names one; or use
--base-url for a running server), then:

1. greedy probes (completions and chat, temperature 0), kept for later;
2. the load: --num-requests requests from --concurrency concurrent clients, mixed: chat and
   completions, streaming and not, n = 2 on some, logprobs on some, greedy and sampled, and
   --cancel-fraction of them cancelled by the client mid-way (a stream dropped after a few
   chunks, a plain request given up after a random wait). A refused request (503) is retried
   after its Retry-After, as the OpenAI SDK does, and so is one whose connection failed before
   any response (a keep-alive connection closed as it was reused); both are counted.
3. the checks: no 5xx but the back-pressure 503s (and the deadline's 504s when the server has
   --request-timeout), every gauge back to idle (nothing running or waiting, no KV block in
   use) within --idle-timeout of the last response, and the greedy probes unchanged.

Prints completed / cancelled / failed, refusals, p50/p90/p99 latency (from the first attempt to
the last byte, retries included) and appends one JSON line to benchmarks/results/soak.jsonl.

    .venv/bin/python benchmarks/soak.py                                    # 128 clients, 256 requests
    .venv/bin/python benchmarks/soak.py --concurrency 16 --num-requests 32 --launch-args "--max-num-seqs 8"
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import datetime
import importlib.metadata
import json
import os
import pathlib
import platform
import random
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
from typing import Any

import httpx

from results_log import append_results

RESULTS = pathlib.Path(__file__).parent / "results" / "soak.jsonl"
_WORDS = ("time person year way day thing man world life hand part child eye woman place work week case point "
          "government company number group problem fact water river mountain music science garden window "
          "history light story paper market energy forest ocean planet signal engine bridge letter").split()
PROBES = [("completion", "The capital of France is"), ("completion", "def fibonacci(n):"),
          ("completion", "Once upon a time, in a small village,"), ("chat", "Name three primary colors."),
          ("chat", "What is 12 times 12?")]


@dataclasses.dataclass
class Outcome:
    kind: str  # chat|completion, stream|plain
    status: str  # "completed", "cancelled", "failed", "timeout" (the server's deadline)
    latency: float = 0.0  # first attempt -> last byte (completed only)
    ttft: float | None = None  # first attempt -> first content chunk (streams)
    refusals: int = 0  # 503s retried
    reconnects: int = 0  # connection errors before any response, retried
    detail: str = ""
    output_tokens: int = 0


# ---------------------------------------------------------------------------- the load
def make_request(rng: random.Random, i: int, cancel_fraction: float) -> dict[str, Any]:
    chat = rng.random() < 0.5
    text = " ".join(rng.choice(_WORDS) for _ in range(rng.randint(8, 160)))
    body: dict[str, Any] = {"max_tokens": rng.randint(16, 128), "stream": rng.random() < 0.75}
    if rng.random() < 0.5:
        body["temperature"] = 0.0
    else:
        body.update(temperature=0.8, top_p=0.95, seed=i)
    if rng.random() < 0.25:
        body.update(n=2, temperature=0.8, seed=i)
    if rng.random() < 0.25:
        body.update({"logprobs": True, "top_logprobs": 2} if chat else {"logprobs": 2})
    if body["stream"]:
        body["stream_options"] = {"include_usage": True}
    if chat:
        body["messages"] = [{"role": "user", "content": f"Continue this text: {text}"}]
    else:
        body["prompt"] = text
    cancel = None
    if rng.random() < cancel_fraction:  # chunks to read before dropping a stream, or seconds to wait
        cancel = rng.randint(1, 6) if body["stream"] else rng.uniform(0.5, 20.0)
    return {"chat": chat, "body": body, "cancel": cancel}


async def send(client: httpx.AsyncClient, req: dict[str, Any], deadline: float) -> Outcome:
    body, path = req["body"], "/v1/chat/completions" if req["chat"] else "/v1/completions"
    kind = f"{'chat' if req['chat'] else 'completion'}/{'stream' if body['stream'] else 'plain'}"
    t0 = time.monotonic()
    refusals = reconnects = 0
    while True:
        try:
            if body["stream"]:
                out = await _stream(client, path, body, req["cancel"], t0)
            else:
                out = await _plain(client, path, body, req["cancel"], t0)
        except _NoResponse as e:
            # The connection failed before any response (typically a pooled keep-alive
            # connection the server closed as it was reused): the request never ran. Retried,
            # as the OpenAI SDK retries connection errors, and counted.
            if reconnects < 3:
                reconnects += 1
                continue
            return Outcome(kind, "failed", detail=f"no response: {e}", refusals=refusals, reconnects=reconnects)
        except (httpx.HTTPError, OSError) as e:
            return Outcome(kind, "failed", detail=f"{type(e).__name__}: {e}", refusals=refusals, reconnects=reconnects)
        if out.status == "refused" and time.monotonic() < deadline:
            refusals += 1
            await asyncio.sleep(float(out.detail or 1))
            continue
        out.kind, out.refusals, out.reconnects = kind, refusals, reconnects
        return out


class _NoResponse(Exception):
    pass


class _Send:
    """client.stream(...) whose connection errors before the response headers are _NoResponse."""

    def __init__(self, client: httpx.AsyncClient, path: str, body: dict):
        self.cm = client.stream("POST", path, json=body)

    async def __aenter__(self) -> httpx.Response:
        try:
            return await self.cm.__aenter__()
        except httpx.TransportError as e:
            raise _NoResponse(f"{type(e).__name__}: {e}") from e

    async def __aexit__(self, *exc) -> None:
        await self.cm.__aexit__(*exc)


async def _plain(client, path, body, cancel, t0) -> Outcome:
    async def request() -> Outcome:
        async with _Send(client, path, body) as r:
            text = (await r.aread()).decode()
            return _verdict(r.status_code, r.headers, text, t0, lambda: json.loads(text)["usage"]["completion_tokens"])

    task = asyncio.ensure_future(request())
    if cancel is not None:
        done, _ = await asyncio.wait({task}, timeout=cancel)
        if not done:
            task.cancel()  # closes the connection: the server aborts the request
            return Outcome("", "cancelled")
    return await task


async def _stream(client, path, body, cancel, t0) -> Outcome:
    ttft, chunks, tokens = None, 0, 0
    async with _Send(client, path, body) as r:
        if r.status_code != 200:
            text = (await r.aread()).decode()
            return _verdict(r.status_code, r.headers, text, t0, lambda: 0)
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                code = event["error"].get("code")
                return Outcome("", "timeout" if code == 504 else "failed", detail=f"in-stream {code}: "
                               f"{event['error'].get('message', '')[:120]}")
            if event.get("usage") and not event.get("choices"):
                tokens = event["usage"]["completion_tokens"]
            if event.get("choices"):
                chunks += 1
                if ttft is None:
                    ttft = time.monotonic() - t0
                if cancel is not None and chunks >= cancel:
                    return Outcome("", "cancelled")  # leaving the block drops the connection
    return Outcome("", "completed", latency=time.monotonic() - t0, ttft=ttft, output_tokens=tokens)


def _verdict(code: int, headers, text: str, t0: float, tokens) -> Outcome:
    if code == 200:
        return Outcome("", "completed", latency=time.monotonic() - t0, output_tokens=tokens())
    if code == 503 and "retry-after" in headers:
        return Outcome("", "refused", detail=headers["retry-after"])
    return Outcome("", "timeout" if code == 504 else "failed", detail=f"HTTP {code}: {text[:160]}")


async def run_load(client: httpx.AsyncClient, requests: list[dict], concurrency: int, patience: float) -> list[Outcome]:
    sem = asyncio.Semaphore(concurrency)
    deadline = time.monotonic() + patience

    async def guarded(req):
        async with sem:
            return await send(client, req, deadline)

    return await asyncio.gather(*(guarded(r) for r in requests))


# ---------------------------------------------------------------------------- checks
async def probe(client: httpx.AsyncClient) -> list[str]:
    texts = []
    for kind, text in PROBES:
        if kind == "chat":
            r = await client.post("/v1/chat/completions", json={
                "messages": [{"role": "user", "content": text}], "max_tokens": 24, "temperature": 0})
            r.raise_for_status()
            texts.append(r.json()["choices"][0]["message"]["content"])
        else:
            r = await client.post("/v1/completions", json={"prompt": text, "max_tokens": 24, "temperature": 0})
            r.raise_for_status()
            texts.append(r.json()["choices"][0]["text"])
    return texts


def metrics(text: str) -> dict[str, float]:
    """Labelled samples by name without the prefix (vLLM's `vllm:`, jaxserve's own `jaxserve:`),
    labels other than model_name and engine in brackets: `request_success_total[stop]`."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith(("vllm:", "jaxserve:")) and "{" in line:
            name, rest = line.split("{", 1)
            labels = re.findall(r'(\w+)="([^"]*)"', rest.rsplit("}", 1)[0])
            extra = ",".join(v for k, v in labels if k not in ("model_name", "engine"))
            out[name.split(":", 1)[1] + (f"[{extra}]" if extra else "")] = float(line.rsplit(" ", 1)[1])
    return out


async def seconds_to_idle(client: httpx.AsyncClient, limit: float) -> tuple[float | None, dict[str, float]]:
    t0 = time.monotonic()
    while True:
        m = metrics((await client.get("/metrics")).text)
        if m["num_requests_running"] == 0 and m["num_requests_waiting"] == 0 and m["kv_cache_usage_perc"] == 0:
            return time.monotonic() - t0, m
        if time.monotonic() - t0 > limit:
            return None, m
        await asyncio.sleep(0.002)


# ---------------------------------------------------------------------------- report
def pct(xs: list[float], p: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    k = (len(xs) - 1) * p / 100
    lo, hi = int(k), min(int(k) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def summarize(outs: list[Outcome], duration: float) -> dict[str, Any]:
    by = {s: [o for o in outs if o.status == s] for s in ("completed", "cancelled", "failed", "timeout")}
    lat = [o.latency for o in by["completed"]]
    ttft = [o.ttft for o in by["completed"] if o.ttft is not None]
    details: dict[str, int] = {}
    for o in by["failed"]:
        details[o.detail[:100]] = details.get(o.detail[:100], 0) + 1
    return {
        "requests": len(outs), "duration_s": duration,
        **{s: len(v) for s, v in by.items()},
        "refusals_503": sum(o.refusals for o in outs), "requests_refused_once": sum(o.refusals > 0 for o in outs),
        "reconnects": sum(o.reconnects for o in outs),
        "output_tokens": sum(o.output_tokens for o in by["completed"]),
        "latency_s": {"p50": pct(lat, 50), "p90": pct(lat, 90), "p99": pct(lat, 99), "max": max(lat, default=0)},
        "ttft_s": {"p50": pct(ttft, 50), "p99": pct(ttft, 99)},
        "failures": details,
        "kinds": {k: sum(o.kind == k for o in outs) for k in sorted({o.kind for o in outs})},
    }


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def _git(*args: str) -> str:
    try:
        return subprocess.run(["git", *args], capture_output=True, text=True, check=True,
                              cwd=pathlib.Path(__file__).parent).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


# ---------------------------------------------------------------------------- launch
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(port: int, launch_args: str, timeout: float) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "jaxserve.server.cli", "serve", "--port", str(port), "--log-level", "warning",
           *shlex.split(launch_args)]
    print("launching:", " ".join(cmd), flush=True)
    proc = subprocess.Popen(cmd)
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited with {proc.returncode}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                print(f"server healthy after {time.monotonic() - t0:.0f} s", flush=True)
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(1)
    proc.terminate()
    raise SystemExit("the server did not become healthy in time")


async def amain(args: argparse.Namespace, base_url: str) -> dict[str, Any]:
    # Pooled connections expire before the server's 5 s keep-alive does (else one may be reused
    # just as the server closes it).
    limits = httpx.Limits(max_connections=args.concurrency + 8, max_keepalive_connections=args.concurrency + 8,
                          keepalive_expiry=2.0)
    async with httpx.AsyncClient(base_url=base_url, timeout=args.client_timeout, limits=limits) as client:
        before = await probe(client)
        m0 = metrics((await client.get("/metrics")).text)
        rng = random.Random(args.seed)
        requests = [make_request(rng, i, args.cancel_fraction) for i in range(args.num_requests)]
        print(f"load: {args.num_requests} requests, {args.concurrency} concurrent clients", flush=True)
        t0 = time.monotonic()
        outs = await run_load(client, requests, args.concurrency, args.patience)
        duration = time.monotonic() - t0
        idle_s, m1 = await seconds_to_idle(client, args.idle_timeout)
        after = await probe(client)
    summary = summarize(outs, duration)
    counters = ("admission_rejections_total[max_num_queued_reqs]", "num_preemptions_total",
                "request_success_total[stop]", "request_success_total[length]", "request_success_total[abort]",
                "recompiles_total")
    delta = {k: m1.get(k, 0) - m0.get(k, 0) for k in counters}
    summary.update(
        seconds_to_idle=idle_s, idle=idle_s is not None,
        gauges_after={k: m1[k] for k in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc")},
        max_waiting_requests=m1.get("max_waiting_requests"), server_counters=delta,
        greedy_unchanged=before == after, probes_changed=[i for i, (a, b) in enumerate(zip(before, after)) if a != b],
    )
    return summary


def print_summary(s: dict[str, Any]) -> None:
    lat, ttft = s["latency_s"], s["ttft_s"]
    print(f"\n=== soak: {s['requests']} requests in {s['duration_s']:.0f} s")
    print(f"completed {s['completed']} | cancelled {s['cancelled']} | failed {s['failed']} | "
          f"timed out (504) {s['timeout']} | 503 refusals retried {s['refusals_503']} "
          f"({s['requests_refused_once']} requests) | connections retried {s['reconnects']}")
    print(f"latency s: p50 {lat['p50']:.1f}  p90 {lat['p90']:.1f}  p99 {lat['p99']:.1f}  max {lat['max']:.1f}"
          f" | TTFT s (streams): p50 {ttft['p50']:.1f}  p99 {ttft['p99']:.1f}")
    idle = f"{s['seconds_to_idle']:.3f} s" if s["idle"] else "NOT IDLE"
    print(f"idle after the load: {idle} ({s['gauges_after']}) | greedy output unchanged: {s['greedy_unchanged']}")
    print(f"server: {s['server_counters']} (waiting limit {s['max_waiting_requests']})")
    if s["failures"]:
        print("failures:", s["failures"])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-url", default=None, help="a running server (default: launch one)")
    p.add_argument("--launch-args", default="", help="extra arguments for jaxserve serve")
    p.add_argument("--launch-timeout", type=float, default=1800)
    p.add_argument("--concurrency", type=int, default=128)
    p.add_argument("--num-requests", type=int, default=256)
    p.add_argument("--cancel-fraction", type=float, default=0.2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--client-timeout", type=float, default=600, help="per HTTP attempt (the OpenAI SDK's default)")
    p.add_argument("--patience", type=float, default=3600, help="seconds during which refused requests are retried")
    p.add_argument("--idle-timeout", type=float, default=10, help="how long the gauges may take to reach idle")
    p.add_argument("--tag", default="")
    p.add_argument("--results", default=str(RESULTS), help="JSON-lines file ('' to skip)")
    args = p.parse_args(argv)
    proc, base_url = None, args.base_url
    if base_url is None:
        port = free_port()
        proc, base_url = launch(port, args.launch_args, args.launch_timeout), f"http://127.0.0.1:{port}"
    load0 = os.getloadavg()
    try:
        summary = asyncio.run(amain(args, base_url))
    finally:
        if proc is not None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(120)
            except subprocess.TimeoutExpired:
                proc.kill()
    print_summary(summary)
    ok = (summary["failed"] == 0 and summary["idle"] and summary["greedy_unchanged"]
          and summary["completed"] + summary["cancelled"] + summary["timeout"] == summary["requests"])
    if args.results:
        record = {
            "time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "git_sha": _git("rev-parse", "HEAD"),
            "git_dirty": bool(_git("status", "--porcelain", "--untracked-files=no", "--", ":(top)",
                                   ":(top,exclude)benchmarks/results")),  # results appended do not count
            "versions": {n: importlib.metadata.version(n) for n in ("jax", "jaxlib", "httpx")},
            "host": {"cpu": cpu_model(), "cpu_count": os.cpu_count()},
            "load_avg_before": load0, "load_avg_after": os.getloadavg(),
            "config": {"launch_args": args.launch_args if proc is not None else None, "concurrency": args.concurrency,
                       "num_requests": args.num_requests, "cancel_fraction": args.cancel_fraction, "seed": args.seed,
                       "tag": args.tag},
            "server_exit_code": proc.returncode if proc is not None else None,
            "ok": ok, **summary,
        }
        append_results(args.results, record)
    print("OK" if ok else "CHECKS FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
