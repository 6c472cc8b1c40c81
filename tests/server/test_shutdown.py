"""SIGTERM on `jaxserve serve` (a real process on a tiny model): in-flight requests finish within
the grace period, or end with finish_reason "abort" after it; nothing hangs; the process exits 0."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest

from tests.model_dirs import write_model_dir


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(model_dir, compile_cache_dir, grace: float, launcher: tuple[str, ...] = ("-m", "jaxserve.server.cli"),
           log_level: str = "warning", extra: tuple[str, ...] = (), env: dict[str, str] | None = None):
    """`jaxserve serve` on the tiny model (`launcher`: the Python arguments before the CLI's;
    `env`: more environment variables)."""
    port = _free_port()
    cmd = [sys.executable, *launcher, "serve", str(model_dir), "--port", str(port),
           "--dtype", "float32", "--max-num-seqs", "8", "--max-num-batched-tokens", "16",
           "--token-buckets", "16", "--request-buckets", "8", "--shutdown-grace", str(grace),
           "--compilation-cache-dir", compile_cache_dir, "--log-level", log_level, *extra]
    env = dict(os.environ, XLA_FLAGS=os.environ["XLA_FLAGS"] + " --xla_force_host_platform_device_count=1", JAX_PLATFORMS="cpu",
               **(env or {}))
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    while True:
        assert proc.poll() is None, proc.stdout.read()
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, "the server did not become healthy"
        time.sleep(0.2)


def _stream(url: str, max_tokens: int, first_chunk: threading.Event, result: dict) -> None:
    body = {"prompt": "w5 w6 w7", "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True}
    events = []
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
                first_chunk.set()
    result["events"] = events


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_model_dir(tmp_path_factory.mktemp("tiny"))


@pytest.mark.parametrize("grace, want", [(30.0, "length"), (0.0, "abort")])
def test_sigterm_drains_and_exits_zero(model_dir, compile_cache_dir, grace, want):
    proc, url = _start(model_dir, compile_cache_dir, grace)
    try:
        first, result = threading.Event(), {}
        client = threading.Thread(target=_stream, args=(url, 200, first, result))
        client.start()
        assert first.wait(60)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        client.join(60)
        assert not client.is_alive()
        assert proc.wait(30) == 0
        assert time.monotonic() - t0 < grace + 20
    finally:
        if proc.poll() is None:
            proc.kill()
    events = result["events"]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    finish = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"][0]["finish_reason"]]
    assert finish == [want]
    text = "".join(c["choices"][0]["text"] for c in chunks)
    assert (len(text.split()) == 200) == (want == "length")


def test_a_grace_under_one_second_does_not_wait_forever():
    """`--shutdown-grace 0.5` once became uvicorn's "wait forever" (int(0.5) == 0 -> None)."""
    from jaxserve.server.cli import build_parser, graceful_shutdown_timeout

    args = build_parser().parse_args(["serve", "--shutdown-grace", "0.5"])
    assert args.shutdown_grace == 0.5 and graceful_shutdown_timeout(0.5) == 6
    for bad in ("-1", "nan", "inf", "soon"):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["serve", "--shutdown-grace", bad])
