"""`jaxserve serve` logs where its start-up went once it listens, and a second start of the same
configuration loads every executable instead of compiling, and serves with them (real
processes, a tiny model)."""

from __future__ import annotations

import re
import signal

import httpx
import pytest

from tests.model_dirs import write_model_dir
from tests.server.test_shutdown import _start


def _start_up_line(model_dir, cache_dir, engine_core: str) -> str:
    proc, url = _start(model_dir, cache_dir, grace=0.0, log_level="info", extra=("--engine-core", engine_core))
    # A request runs the steps (the second time: executables another process compiled).
    r = httpx.post(url + "/v1/completions", json={"prompt": "w5 w6 w7", "max_tokens": 4, "temperature": 0},
                   timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4, r.text
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, out[-2000:]
    lines = [line for line in out.splitlines() if "start-up " in line and "since launch" in line]
    assert len(lines) == 1, out[-3000:]
    # The engine's plan, once, with where its core runs and why (engine/plan.py).
    plans = [line for line in out.splitlines() if "engine plan: " in line]
    assert len(plans) == 1 and f"engine_core {engine_core} (given (--engine-core))" in plans[0], out[-3000:]
    assert "dtype " in plans[0] and "kv_cache " in plans[0], plans[0]
    return lines[0]


@pytest.mark.parametrize("engine_core", ["thread", "process"])
def test_the_start_up_line_names_its_phases_and_a_restart_loads_its_executables(tmp_path, engine_core):
    """With the engine in a process of its own, its build's phases reach the serving process's line."""
    model = write_model_dir(tmp_path / "m")
    cache = str(tmp_path / "cache")  # empty: the first start compiles
    first = _start_up_line(model, cache, engine_core)
    for phase in ("imports", "weights", "kv cache", "executables", "server"):
        assert f" {phase} " in first, first
    compiled = re.search(r"executables [\d.]+ s \(0 loaded, (\d+) compiled\)", first)
    assert compiled and int(compiled.group(1)) >= 2, first
    total = float(re.search(r"start-up ([\d.]+) s since launch", first).group(1))
    phases = sum(float(x) for x in re.findall(r" ([\d.]+) s", first.split(": ", 2)[-1]))
    assert abs(phases - total) < 0.2  # the phases (and "other") add up to the whole
    second = _start_up_line(model, cache, engine_core)
    assert f"({compiled.group(1)} loaded, 0 compiled)" in second, second
