"""benchmarks/device_check.sh --rehearse: every step of the device check (the device's rates,
step throughput with its prefill cell and bandwidth fractions, the profiled decode step, a
served run, speculative decoding's step times, the kernel benchmark, kernel tests, golden
parity) runs on this CPU at tiny sizes and records what it measured, so that the day a GPU or
TPU is lent no device time goes to debugging the script; a budget too short for a step records
it as skipped; the results' directory is named by the chip; the packed results hold every
file; speculative decoding's predicted speed-ups weigh the steps that verify."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import tarfile

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
import device_check  # noqa: E402

STEPS = (
    "env",
    "device_rates",
    "step_throughput",
    "profile",
    "served_run",
    "spec_step_times",
    "prebuilt_serve",
    "kernel_benchmark",
    "kernel_tests",
    "golden_parity",
    "done",
)


def _run(tmp_path, *args: str) -> tuple[subprocess.CompletedProcess, dict]:
    env = {**os.environ, "PYTHON": sys.executable}
    env.pop("OUT", None)
    proc = subprocess.run(
        ["bash", str(ROOT / "benchmarks" / "device_check.sh"), *args, "--out", str(tmp_path)],
        env=env, capture_output=True, text=True, timeout=900, check=False,
    )
    records = [json.loads(x) for x in (tmp_path / "device_check.jsonl").read_text().splitlines()]
    return proc, {r["step"]: r for r in records}


def _tiny_decode_bytes(seqs: int, context: int) -> int:
    """What one decode step of the rehearsal's 2-layer bfloat16 model moves: every weight but
    the embedding table (untied: the LM head is its own), the KV rows at the context, the new
    rows."""
    c = device_check.TINY_LLAMA
    e, f, hq, hkv, d = (c["hidden_size"], c["intermediate_size"], c["num_attention_heads"],
                        c["num_key_value_heads"], c["head_dim"])
    layer = e * hq * d * 2 + e * hkv * d * 2 + 3 * e * f + 2 * e
    weights = c["num_hidden_layers"] * layer + e + e * c["vocab_size"]  # + final norm, LM head
    kv_per_token = 2 * c["num_hidden_layers"] * hkv * d * 2
    return 2 * weights + seqs * (context + 1) * kv_per_token


@pytest.mark.slow
def test_device_check_rehearsal(tmp_path):
    proc, steps = _run(tmp_path, "--rehearse")
    assert tuple(steps) == STEPS, proc.stdout[-3000:]
    bad = {name: r.get("tail", r) for name, r in steps.items() if r["status"] != "ok"}
    assert proc.returncode == 0 and not bad, bad
    assert all(r["rehearse"] for r in steps.values())
    assert steps["env"]["backend"] == "cpu" and "chip" not in steps["env"]
    rates = steps["device_rates"]
    assert rates["copy_gb_per_s"] > 0 and rates["matmul_tflops"] > 0
    assert [m["n"] for m in rates["matmuls"]] == [256]

    through = steps["step_throughput"]
    (cell,) = through["cells"]
    assert through["context"] == 64 and through["dtype"] == "bfloat16"
    assert cell["seqs"] == 8 and cell["context"] == 64
    assert cell["tok_per_s"] > 0 and cell["prefill_ms"] > 0
    assert cell["bytes_moved"] == _tiny_decode_bytes(8, 64)
    achieved = cell["bytes_moved"] / cell["decode_ms"] * 1e-6
    assert cell["gb_per_s"] == pytest.approx(achieved, abs=0.06)
    # copy_frac is of the unrounded rate; gb_per_s is rounded to 0.1
    assert cell["copy_frac"] == pytest.approx(cell["gb_per_s"] / rates["copy_gb_per_s"],
                                              abs=0.05 / rates["copy_gb_per_s"] + 1e-4)
    assert "hbm_frac" not in cell  # a CPU has no published HBM figure
    assert through["prefill"]["tokens"] == 32 and through["prefill"]["prefill_ms"] > 0
    assert through["weights_s"] > 0  # made once, for both buckets

    (trace,) = steps["profile"]["traces"]
    assert trace["seqs"] == 8 and trace["source"] == "host XLA ops" and trace["kernel_events"] > 20
    assert trace["top"][0]["share"] > 0 and trace["decode_ms"] == cell["decode_ms"]
    assert (tmp_path / trace["trace"]).stat().st_size > 0
    assert "### decode_8" in (tmp_path / "profile_kernels.md").read_text()

    served = steps["served_run"]
    assert served["request"]["http"] == 200 and served["request"]["text"].strip()
    runs = [(r["concurrency"], r["prompts"], r["completed"], r["failed"]) for r in served["runs"]]
    assert runs == [(1, 1, 1, 0), (2, 2, 2, 0)]
    assert all(r["output_tok_per_s"] > 0 and r["ttft_ms"]["p50"] > 0 and r["itl_ms"]["p99"] > 0
               for r in served["runs"])

    spec = steps["spec_step_times"]  # plain, n-gram verifying and EAGLE-3 drafting steps
    assert spec["model"] == "tiny" and spec["num_speculative_tokens"] == 3
    cells = {(x["method"], x["concurrency"]): x for x in spec["cells"]}
    assert sorted(cells) == sorted((m, c) for m in ("plain", "ngram", "eagle3") for c in (1, 2))
    assert all(x["step_ms"] > 0 and x["bucket"] == [16, 8] for x in cells.values())
    for c in (1, 2):
        assert cells["plain", c]["tokens"] == c and "predicted_speedup" not in cells["plain", c]
        for method in ("ngram", "eagle3"):
            x = cells[method, c]
            assert x["tokens"] == 4 * c
            assert x["step_over_plain"] == pytest.approx(
                x["step_ms"] / cells["plain", c]["step_ms"], abs=1e-3)
            acc = spec["acceptance"][method]  # the CPU-measured chat acceptance
            assert acc["tau"] > 1 and 0 < acc["s"] <= 1
            assert x["speedup_per_verifying_step"] == pytest.approx(
                acc["tau"] / x["step_over_plain"], rel=0.01)
            assert x["predicted_speedup"] > 0
    # the n-gram step drafts in a share s of the steps (a plain step otherwise)
    (x, plain, acc) = (cells["ngram", 1], cells["plain", 1]["step_ms"], spec["acceptance"]["ngram"])
    e = 1 + acc["s"] * (acc["tau"] - 1)
    assert x["predicted_speedup"] == pytest.approx(
        e * plain / (acc["s"] * x["step_ms"] + (1 - acc["s"]) * plain), rel=0.01)

    prebuilt = steps["prebuilt_serve"]  # compiled here for the CPU, then served from
    assert prebuilt["loaded"] > 0 and prebuilt["compiled"] == 0, prebuilt
    assert prebuilt["same_text"] is True and prebuilt["startup_s"] > 0
    assert prebuilt["served_run_startup_s"] == served["startup_s"]

    results = steps["kernel_benchmark"]["results"]
    assert {r["impl"] for r in results} == {"gpu-interpret", "gpu-mosaic-interpret"}
    (swept,) = [r for r in results if "blocks" in r]  # the block-size sweep's one rehearsal
    assert swept["scenario"] == "decode" and swept["blocks"]["decode_slots"] == 2
    assert all(r["gb_per_s"] > 0 and 0 < r["frac_of_copy_bw"] for r in results)
    summary = steps["kernel_tests"]["summary"]
    assert "passed" in summary and "failed" not in summary
    assert steps["golden_parity"]["ok"] is True and steps["golden_parity"]["cases"] == [
        "chat_capital: exact"
    ]
    for step in STEPS[:-1]:  # each step's own output is kept, and nothing else is left behind
        assert (tmp_path / f"{step}.log").stat().st_size > 0
    assert not [p for p in tmp_path.iterdir() if p.is_dir()]


def test_a_budget_too_short_skips_every_step_on_record(tmp_path):
    proc, steps = _run(tmp_path, "--rehearse", "--budget", "0")
    assert tuple(steps) == STEPS and proc.returncode == 0, proc.stdout[-2000:]
    for name in STEPS[:-1]:
        assert steps[name]["status"] == "skipped" and steps[name]["reason"], steps[name]
    assert "did not run" in steps["profile"]["reason"]
    assert steps["done"]["status"] == "ok"


def test_the_results_directory_is_named_by_the_chip():
    name = device_check.out_dir_name
    assert name("NVIDIA H200", False) == "device_check_h200"
    assert name("NVIDIA H100 80GB HBM3", False) == "device_check_h100"
    assert name("TPU v5 lite", False) == "device_check_v5e"
    assert name("NVIDIA A100-SXM4-80GB", False) == "device_check_nvidia_a100_sxm4_80gb"
    # not the SXM board's figures
    assert name("NVIDIA H100 PCIe", False) == "device_check_nvidia_h100_pcie"
    assert name("cpu", True) == "device_check_rehearsal"


def test_a_tied_embedding_is_read_whole():
    """The bytes of a decode step: an untied embedding table is gathered (not counted), a tied
    one is the LM head (counted); each data-parallel rank's own rows."""
    rec = {"params": {"per_device": 1000, "groups": {"embed": {"per_device": 300},
                                                     "lm_head": {"per_device": 300}}},
           "kv": {"bytes_per_page_per_device": 160, "page_size": 16},
           "measure": {"decode_requests": 4, "context": 9}, "data_parallel": 2}
    assert device_check.decode_bytes(rec) == 700 + 2 * 10 * 10
    del rec["params"]["groups"]["lm_head"]
    assert device_check.decode_bytes(rec) == 1000 + 2 * 10 * 10


def test_packing_leaves_the_summary_and_one_archive(tmp_path):
    for name in ("device_check.jsonl", "env.log", "step_throughput.jsonl"):
        (tmp_path / name).write_text(name)
    archive = device_check.pack(tmp_path, "device_check_h100")
    left = sorted(p.name for p in tmp_path.iterdir())
    assert left == ["device_check.jsonl", "device_check_h100.tar.gz"]
    names = ("device_check.jsonl", "env.log", "step_throughput.jsonl")
    with tarfile.open(archive) as tar:
        assert sorted(tar.getnames()) == [f"device_check_h100/{n}" for n in names]
        assert tar.extractfile("device_check_h100/env.log").read() == b"env.log"


def test_the_predicted_speedups_weigh_the_steps_that_verify(tmp_path):
    """spec_step_times' acceptance from spec_decode_benchmark's chat rows: tau, the share s of a
    request's steps that verified, tokens per request step e = N / (N - A); n-gram steps that
    draft nothing cost a plain step, EAGLE-3's every step runs its head."""
    import spec_step_times as sst

    row = {"workload": "chat", "method": "ngram", "concurrency": 1, "output_tokens": 100,
           "repeats": 1, "accepted_tokens": 20, "verifying_steps": 10,
           "mean_acceptance_length": 3.0}
    (tmp_path / "spec.jsonl").write_text("\n".join(json.dumps(r) for r in [
        row, {**row, "concurrency": 4, "verifying_steps": 20, "mean_acceptance_length": 2.0},
        {**row, "workload": "repeat", "concurrency": 2}]))
    acc = sst.acceptance(tmp_path / "spec.jsonl", "ngram", 4)
    assert (acc["tau"], acc["s"], acc["e"], acc["from_concurrency"]) == (2.0, 0.25, 1.25, 4)
    acc = sst.acceptance(tmp_path / "spec.jsonl", "ngram", 2)  # no chat row at 2: the lowest c
    assert (acc["tau"], acc["s"], acc["e"], acc["from_concurrency"]) == (3.0, 0.125, 1.25, 1)
    assert sst.acceptance(tmp_path / "spec.jsonl", "eagle3", 1) is None
    # n-gram: 1.25 tokens a step at 0.125 x 2 ms + 0.875 x 1 ms
    assert sst.predicted("ngram", acc, 1.0, 2.0) == {
        "predicted_speedup": round(1.25 / 1.125, 3), "speedup_per_verifying_step": 1.5}
    assert sst.predicted("eagle3", acc, 1.0, 2.0)["predicted_speedup"] == 0.625
    assert sst.served_buckets([(1, 1), (16, 16), (64, 64)], 64) == ([16, 32, 64], [8, 32, 64])
