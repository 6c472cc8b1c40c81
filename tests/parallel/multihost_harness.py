"""Starting several local processes as one multi-host run (each with 2 simulated CPU devices,
gloo collectives on localhost): `jaxserve serve` on every process, or a script."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import httpx

from jaxserve.parallel.multihost import free_coordinator_port as free_port

DEVICES_PER_PROCESS = 2


def env() -> dict[str, str]:
    return dict(os.environ, XLA_FLAGS=f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={DEVICES_PER_PROCESS}",
                JAX_PLATFORMS="cpu")


def cluster_args(port: int, num_processes: int, process_id: int) -> list[str]:
    return ["--coordinator-address", f"127.0.0.1:{port}", "--num-processes", str(num_processes),
            "--process-id", str(process_id), "--heartbeat-timeout", "60", "--step-timeout", "30"]


def start_serve(model_dir, args: list[str], *, num_processes: int = 2, per_process: list[list[str]] | None = None):
    """`jaxserve serve` on every process (process 0 on an HTTP port); returns (processes, url)."""
    port, http = free_port(), free_port()
    procs = []
    for pid in range(num_processes):
        cmd = [sys.executable, "-m", "jaxserve.server.cli", "serve", str(model_dir), "--port", str(http),
               "--log-level", "warning", *args, *cluster_args(port, num_processes, pid),
               *((per_process or [[]] * num_processes)[pid])]
        procs.append(subprocess.Popen(cmd, env=env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    return procs, f"http://127.0.0.1:{http}"


def wait_healthy(procs, url: str, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while True:
        for p in procs:
            if p.poll() is not None:
                raise AssertionError(f"a process exited with {p.returncode}:\n{p.stdout.read()[-4000:]}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, "the run did not become healthy"
        time.sleep(0.5)


def stop(procs) -> None:
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait(10)
