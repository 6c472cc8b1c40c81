"""benchmarks/device_check.sh --rehearse: every step of the device check (kernel tests,
kernel benchmark, golden parity, step throughput, a served request) runs on this CPU at tiny
sizes and records what it measured, so that the day a GPU or TPU is lent no device time goes
to debugging the script."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
STEPS = (
    "env",
    "kernel_tests",
    "kernel_benchmark",
    "golden_parity",
    "step_throughput",
    "served_request",
    "done",
)


@pytest.mark.slow
def test_device_check_rehearsal(tmp_path):
    env = {**os.environ, "PYTHON": sys.executable}
    env.pop("OUT", None)
    proc = subprocess.run(
        [
            "bash",
            str(ROOT / "benchmarks" / "device_check.sh"),
            "--rehearse",
            "--out",
            str(tmp_path),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    records = [json.loads(x) for x in (tmp_path / "device_check.jsonl").read_text().splitlines()]
    steps = {r["step"]: r for r in records}
    assert tuple(steps) == STEPS, proc.stdout[-3000:]
    bad = {name: r.get("tail", r) for name, r in steps.items() if r["status"] != "ok"}
    assert proc.returncode == 0 and not bad, bad
    assert all(r["rehearse"] for r in records)
    assert steps["env"]["backend"] == "cpu"
    assert (
        "passed" in steps["kernel_tests"]["summary"]
        and "failed" not in steps["kernel_tests"]["summary"]
    )
    results = steps["kernel_benchmark"]["results"]
    assert {r["impl"] for r in results} == {"gpu-interpret", "gpu-mosaic-interpret"}
    (swept,) = [r for r in results if "blocks" in r]  # the block-size sweep's one rehearsal
    assert swept["scenario"] == "decode" and swept["blocks"]["decode_slots"] == 2
    assert all(
        r["gb_per_s"] > 0 and 0 < r["frac_of_copy_bw"] for r in steps["kernel_benchmark"]["results"]
    )
    assert steps["golden_parity"]["ok"] is True and steps["golden_parity"]["cases"] == [
        "chat_capital: exact"
    ]
    (cell,) = steps["step_throughput"]["cells"]
    assert cell["seqs"] == 8 and cell["tok_per_s"] > 0 and cell["prefill_ms"] > 0
    served = steps["served_request"]
    assert (
        served["http"] == 200
        and served["usage"]["completion_tokens"] > 0
        and served["text"].strip()
    )
    for step in STEPS[1:-1]:  # each step's own output is kept, and nothing else is left behind
        assert (tmp_path / f"{step}.log").stat().st_size > 0
    assert not [p for p in tmp_path.iterdir() if p.is_dir()]
