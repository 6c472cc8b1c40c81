"""A mixed load for leak tests over real HTTP: completions and chat, streaming and not, n = 2
with logprobs, streams the client drops after the first chunk, requests the client gives up
on, invalid bodies, requests the engine fails, requests past the server's deadline, and what
a full queue refuses. `wait_idle` then reads the gauges until the engine is idle."""

from __future__ import annotations

import asyncio
import collections
import json
import re
import time
from collections.abc import Callable, Sequence

import httpx

KINDS = ("completion", "chat", "chat_stream", "completion_stream", "cancel", "client_timeout", "invalid",
         "engine_error", "deadline")


async def one(client: httpx.AsyncClient, kind: str, prompt: str, max_tokens: int, long_tokens: int,
              bad_params: dict | None = None) -> str:
    """Send one request of `kind`; returns the outcome: an HTTP status, "cancelled", or
    "stream-<code>" for an error event inside a stream."""
    body: dict = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    chat: dict = {"messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens, "temperature": 0}
    if kind == "completion":
        body.update(n=2, logprobs=2, temperature=0.8, seed=7)
        r = await client.post("/v1/completions", json=body)
        return str(r.status_code)
    if kind == "chat":
        r = await client.post("/v1/chat/completions", json={**chat, "logprobs": True, "top_logprobs": 2})
        return str(r.status_code)
    if kind == "invalid":
        r = await client.post("/v1/completions", json={**body, "max_tokens": -1})
        return str(r.status_code)
    if kind == "engine_error":  # parameters that pass the frontend and fail in the engine
        r = await client.post("/v1/completions", json={**body, **(bad_params or {})})
        return str(r.status_code)
    if kind == "client_timeout":
        try:
            r = await client.post("/v1/completions", json={**body, "max_tokens": max_tokens * 4}, timeout=0.05)
        except httpx.TimeoutException:
            return "cancelled"
        return str(r.status_code)  # a refusal is answered at once
    path, payload = (("/v1/chat/completions", chat) if kind == "chat_stream"
                     else ("/v1/completions", body))
    payload = {**payload, "stream": True}
    if kind == "deadline":
        payload["max_tokens"] = long_tokens  # more than the deadline allows
        payload["ignore_eos"] = True
    async with client.stream("POST", path, json=payload) as r:
        if r.status_code != 200:
            return str(r.status_code)
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            if kind == "cancel":
                return "cancelled"  # leaving the block closes the connection mid-stream
            data = line[6:]
            if data != "[DONE]" and "error" in (event := json.loads(data)):
                return f"stream-{event['error']['code']}"
    return "200"


async def run_mix(base_url: str, kinds: Sequence[str], prompt: Callable[[int], str], *, max_tokens: int = 8,
                  long_tokens: int = 400, headers: dict | None = None,
                  bad_params: dict | None = None) -> collections.Counter:
    """All of `kinds` at once (one request each); the outcomes, counted."""
    async with httpx.AsyncClient(base_url=base_url, headers=headers or {}, timeout=120) as client:
        outcomes = await asyncio.gather(*(one(client, k, prompt(i), max_tokens, long_tokens, bad_params)
                                          for i, k in enumerate(kinds)))
    return collections.Counter(zip(kinds, outcomes))


def gauges(metrics_text: str) -> dict[str, float]:
    """Every labelled sample by its name without the prefix (`vllm:` or `jaxserve:`); labels
    other than model_name and engine go in brackets: `admission_rejections_total[max_num_queued_reqs]`."""
    out = {}
    for line in metrics_text.splitlines():
        if line.startswith(("vllm:", "jaxserve:")) and "{" in line:
            name, rest = line.split("{", 1)
            labels = re.findall(r'(\w+)="([^"]*)"', rest.rsplit("}", 1)[0])
            extra = ",".join(v for k, v in labels if k not in ("model_name", "engine"))
            out[name.split(":", 1)[1] + (f"[{extra}]" if extra else "")] = float(line.rsplit(" ", 1)[1])
    return out


def wait_idle(base_url: str, num_blocks: int, *, headers: dict | None = None, timeout: float = 10.0) -> float:
    """Poll /metrics until nothing runs or waits and every KV block is free; returns the
    seconds it took. Fails after `timeout`."""
    t0 = time.monotonic()
    while True:
        g = gauges(httpx.get(base_url + "/metrics", headers=headers or {}).text)
        if (g["num_requests_running"], g["num_requests_waiting"], g["num_free_kv_blocks"]) == (0, 0, num_blocks - 1):
            return time.monotonic() - t0
        assert time.monotonic() - t0 < timeout, f"not idle after {timeout} s: {g}"
        time.sleep(0.01)
