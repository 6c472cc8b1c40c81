"""benchmarks/trace_kernels.py: a jax.profiler trace reduced to a per-kernel table, on a trace
recorded on this CPU (one decode step of a 2-layer Llama, `jaxserve shard-plan --measure
--profile`) and on traces laid out as a GPU's and a TPU's are (a device process whose stream
or "XLA Ops" threads hold the kernels, beside host events that must not count)."""

from __future__ import annotations

import gzip
import json
import pathlib
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
import trace_kernels  # noqa: E402

CPU_TRACE = ROOT / "tests" / "data" / "traces" / "cpu_decode_step.trace.json.gz"


def _meta(pid, name, tid=None):
    if tid is None:
        return {"ph": "M", "pid": pid, "name": "process_name", "args": {"name": name}}
    return {"ph": "M", "pid": pid, "tid": tid, "name": "thread_name", "args": {"name": name}}


def _x(pid, tid, name, ts, dur, hlo_op=None):
    e = {"ph": "X", "pid": pid, "tid": tid, "name": name, "ts": ts, "dur": dur}
    if hlo_op:
        e["args"] = {"hlo_op": hlo_op, "hlo_module": "jit_step"}
    return e


GEMM = "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_cublas"


def gpu_trace() -> dict:
    """A GPU's layout: kernels on the device's stream threads; the derived "XLA Ops" line and
    the host's thunk events span the same time and must not be counted again."""
    events = [_meta(1, "/device:GPU:0"), _meta(1, "Stream #13(Compute)", 13),
              _meta(1, "XLA Ops", 99), _meta(700, "/host:CPU"), _meta(700, "python", 5)]
    ts = 100.0
    for layer in range(2):
        for name, op, dur in ((f"loop_multiply_fusion_{3 * layer}",
                               f"multiply_fusion.{3 * layer}", 2.0),
                              (GEMM, f"dot.{layer}", 10.0),
                              (f"ragged_paged_attention_{layer}", f"custom-call.{layer}", 6.0)):
            events.append(_x(1, 13, name, ts, dur, op))
            events.append(_x(1, 99, op, ts, dur, op))  # the derived line
            events.append(_x(700, 5, f"Thunk:{op}", ts - 50, 1.0, op))  # the host's launch
            ts += dur + 1.0  # a microsecond of idle between kernels
    return {"displayTimeUnit": "ns", "traceEvents": events}


def tpu_trace() -> dict:
    events = [_meta(2, "/device:TPU:0"), _meta(2, "XLA Ops", 3), _meta(2, "XLA Modules", 4),
              _x(2, 4, "jit_step(123)", 0.0, 30.0), _x(2, 3, "fusion.1", 0.0, 10.0, "fusion.1"),
              _x(2, 3, "fusion.2", 12.0, 8.0, "fusion.2"),
              _x(2, 3, "convolution.7", 20.0, 9.0, "convolution.7")]
    return {"traceEvents": events}


def _write(tmp_path: pathlib.Path, name: str, trace: dict) -> pathlib.Path:
    run = tmp_path / name / "plugins" / "profile" / "2026_01_01_00_00_00"
    run.mkdir(parents=True)
    path = run / "host.trace.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump(trace, f)
    return tmp_path / name


def test_a_recorded_cpu_decode_step():
    t = trace_kernels.summarize(CPU_TRACE, "decode_8")
    assert t["source"] == "host XLA ops" and t["device_threads"] == []
    rows = t["rows"]
    # XLA's thunks, less the conditionals' that span their bodies' thunks (124 events, 4 of them
    # conditionals holding others), one row per kernel without its instance numbers
    assert t["kernel_events"] == 120 == sum(r["count"] for r in rows)
    assert t["distinct_kernels"] == len(rows) == 35
    by_name = {r["kernel"]: r for r in rows}
    assert by_name["ynn_fusion"]["count"] == 22 and rows[0]["kernel"] == "ynn_fusion"
    assert by_name["ffi_call"]["hlo_ops"] == ["ffi_call.54", "ffi_call.58"]
    assert not any(r["kernel"][-1].isdigit() for r in rows)
    assert [r["total_us"] for r in rows] == sorted((r["total_us"] for r in rows), reverse=True)
    assert sum(r["share"] for r in rows) == pytest.approx(1.0, abs=1e-3)
    assert sum(r["total_us"] for r in rows) == pytest.approx(t["kernel_us"], rel=1e-6)
    assert 0 < t["kernel_us"] <= t["span_us"]


def test_a_gpu_trace_counts_the_stream_kernels_once(tmp_path):
    t = trace_kernels.summarize(_write(tmp_path, "gpu", gpu_trace()), "decode_1")
    assert t["source"] == "device streams"
    assert t["device_threads"] == ["Stream #13(Compute)", "XLA Ops"]
    assert t["kernel_events"] == 6 and t["kernel_us"] == pytest.approx(36.0)
    assert t["span_us"] == pytest.approx(36.0 + 5.0)  # five idle microseconds between six kernels
    rows = {r["kernel"]: r for r in t["rows"]}
    assert set(rows) == {GEMM, "loop_multiply_fusion", "ragged_paged_attention"}
    assert rows[GEMM]["count"] == 2 and rows[GEMM]["share"] == pytest.approx(20 / 36, abs=1e-4)
    assert rows["loop_multiply_fusion"]["hlo_ops"] == ["multiply_fusion.0", "multiply_fusion.3"]
    assert t["rows"][0]["kernel"] == GEMM


def test_a_tpu_trace_reads_its_xla_ops_line(tmp_path):
    t = trace_kernels.summarize(_write(tmp_path, "tpu", tpu_trace()), "decode_64")
    assert t["source"] == "device XLA ops"
    assert [(r["kernel"], r["count"]) for r in t["rows"]] == [("fusion", 2), ("convolution", 1)]
    assert t["kernel_us"] == pytest.approx(27.0) and t["span_us"] == pytest.approx(29.0)


def test_the_command_writes_lines_and_tables(tmp_path, capsys):
    gpu = _write(tmp_path, "gpu", gpu_trace())
    out, md = tmp_path / "k.jsonl", tmp_path / "k.md"
    argv = [f"decode_1={gpu}", f"decode_8={CPU_TRACE}", "--json", str(out), "--markdown", str(md),
            "--top", "2"]
    assert trace_kernels.main(argv) == 0
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert [x["label"] for x in lines] == ["decode_1", "decode_8"]
    # each line with results_log's provenance
    assert all(x["commit"] and x["host"] and x["versions"] for x in lines)
    text = md.read_text()
    assert "### decode_1" in text and f"| `{GEMM}` | 2 | 20.0 |" in text
    assert "| (33 others) |" in text  # the CPU table's kernels past the top 2, summed
    assert "### decode_8" in capsys.readouterr().out
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FileNotFoundError, match="no trace"):
        trace_kernels.find_trace(empty)
    # a directory without a trace: its line says so, the other trace's table is still made
    assert trace_kernels.main([f"none={empty}", f"gpu={gpu}", "--json", str(out)]) == 1
    none, made = [json.loads(x) for x in out.read_text().splitlines()][-2:]
    assert "no trace" in none["error"] and made["kernel_events"] == 6
    assert "no table: FileNotFoundError" in capsys.readouterr().out
    nothing = _write(tmp_path, "nothing", {"traceEvents": [_meta(700, "/host:CPU")]})
    assert trace_kernels.main([f"x={nothing}"]) == 1  # a trace without kernels fails the command


def test_the_xplane_reads_as_its_trace_json():
    """A step with a conditional and a three-pass loop, its trace kept both ways by the
    profiler: the same table from the xplane (through jax.profiler.ProfileData) as from the
    JSON; the conditional's and the loop's thunks, which span their bodies', are not rows."""
    data = ROOT / "tests" / "data" / "traces"
    from_json = trace_kernels.summarize(data / "cpu_cond_loop.trace.json.gz", "json")
    from_xplane = trace_kernels.summarize(data / "cpu_cond_loop.xplane.pb", "xplane")
    assert from_json["rows"] == from_xplane["rows"]
    assert from_json["kernel_us"] == pytest.approx(from_xplane["kernel_us"])
    rows = {r["kernel"]: r for r in from_json["rows"]}
    assert rows["sine_add_fusion"]["count"] == 3  # the loop's body, once a pass
    assert not [k for k in rows if k.startswith(("while", "cond", "conditional"))]
