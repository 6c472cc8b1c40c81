"""The device check: everything worth knowing on the day a GPU (or TPU) is lent, in one call of
~9 minutes (540 s of steps), run by benchmarks/device_check.sh. Each step runs as its own
process under a time limit, its output in `<out>/<step>.log`, and adds one JSON line to
`<out>/device_check.jsonl` (the step, its status, seconds, and what it measured); a step that
the overall budget leaves no time for is recorded as skipped, a step past its limit as a
timeout: nothing is cut short silently. The steps, the most valuable first:

1. env: backend, devices, device kind, versions. The chip it names decides the default out
   directory, `benchmarks/results/device_check_<chip>/` (h100, h200, v5e, ...; the device kind
   when the chip is not in jaxserve/tools/chips.py).
2. device_rates: the card's measured copy bandwidth and bfloat16 matmul rate, next to its
   published ones (benchmarks/device_rates.py); ~15 s, first because the grid's cells are
   read against its bandwidth.
3. step_throughput: a Llama-3-8B-shaped model in bfloat16 on random weights, made on the
   devices in seconds (jaxserve/tools/plan_measure.py), over every local device (tensor
   parallel): its compiled step timed at 1/8/64/256 decoding sequences at a 1,024-token context
   and a 2,048-token prefill (`jaxserve shard-plan llama3-8b --real --measure`). Each cell: tok/s
   = sequences / decode step time, and the bytes the step moves (the weights it reads: all but
   the embedding table, of which it gathers rows; the KV cache read at the context; the new
   rows written) over its time, as a fraction of the chip's published HBM bandwidth and of the
   copy bandwidth step 2 measured. One decode step at 1 and at 64 sequences runs once more
   under `jax.profiler`.
4. profile: those two traces reduced to a per-kernel table (benchmarks/trace_kernels.py:
   kernel, count, total µs, share) in `profile_kernels.jsonl` and `profile_kernels.md`, the
   traces kept beside them (`profile_decode_<seqs>.trace.json.gz`).
5. served_run: `jaxserve serve` with the default model, one chat completion, then the
   project's streaming client (benchmarks/serving_benchmark.py) at 1, 16 and 64 concurrent
   requests of random 1,024-token prompts and 128 new tokens: output tok/s, TTFT and ITL
   (p50, p99) at each.
6. spec_step_times: speculative decoding's steps timed on the device
   (benchmarks/spec_step_times.py): the default model in bfloat16, its step at 1, 4 and 16
   sequences of a 1,024-token context on the served run's buckets (64 tokens; 8 and 64
   requests), plain (one token each), verifying k = 3 drafts (the n-gram step: 4 tokens each)
   and drafting with an EAGLE-3 head of the target's shape on random weights (k = 3), each the
   median of 20 steps; per cell the tokens the step can emit and the speed-up it predicts at
   the acceptance the CPU measured (benchmarks/results/spec_decode.jsonl, chat: e x t_plain /
   t_step, the n-gram step weighted by the share of steps that verify).
7. prebuilt_serve: the served run's engine from executables compiled before the chip on a CPU
   host (`--executables DIR`: `jaxserve compile --topology h100:1x1 --out DIR/h100` with the
   served run's flags and `--kv-cache-memory 8GiB`, DIR carried to the device): time to healthy beside the served run's, the
   executables loaded and compiled (none), the same greedy completion. Skipped without DIR.
8. kernel_benchmark: the attention kernels' GB/s against the copy bandwidth and, on a GPU,
   against JAX's shipped Pallas paged_attention, with the sweep of the Mosaic GPU kernel's
   block sizes (benchmarks/kernel_benchmark.py).
9. kernel_tests: the attention kernel tests compiled and run on the device (`pytest
   --kernel-device`: the Triton and Mosaic GPU kernels on a GPU, the Mosaic kernel on a TPU).
10. golden_parity: the default model's greedy completions in float32 against transformers'
   golden data, attention on the device's kernel (benchmarks/golden_parity.py).

`--rehearse` runs the same steps on the CPU at tiny sizes (a 2-layer model at 8 sequences and a
32-token prefill, one profiled step, the served run at 1 and 2 requests of 16 tokens in and 4
out, speculative decoding's three steps of a 2-layer model at 1 and 2 sequences of a 32-token
context, the served engine's executables compiled for the CPU and served from, the kernel
benchmark's small scenarios, one interpret-mode test per kernel, one golden
case of 4 tokens), so that the script itself is known to work before any device time is spent;
tests/tools/test_device_check.py runs it. Its default out directory is
`benchmarks/results/device_check_rehearsal/`.

    python benchmarks/device_check.py [--rehearse] [--out DIR] [--budget SECONDS] [--pack]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import re
import shutil
import signal
import socket
import subprocess
import sys
import tarfile
import tempfile
import time
import urllib.request

from results_log import append_results

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
# No JAX in this process: the steps' processes own the device.
from jaxserve.tools.chips import chip_of_device_kind  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
STEPS = ["device_rates", "step_throughput", "profile", "served_run", "spec_step_times",
         "prebuilt_serve", "kernel_benchmark", "kernel_tests", "golden_parity"]
PY = sys.executable
TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": 512,
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 2,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 64,
    "max_position_embeddings": 2048,
    "tie_word_embeddings": False,
}


@dataclasses.dataclass(frozen=True)
class Sizes:
    """What the steps run at: on the device, or in the CPU rehearsal."""

    decode: str  # step_throughput's decode buckets (tokens x sequences)
    prefill: int  # the prefill cell's tokens (bucket prefill x 1)
    profile: str  # the decode buckets traced
    context: int  # decode context
    max_model_len: int
    max_num_seqs: int
    kv_memory: str | None  # shard-plan --kv-cache-memory (None: max_num_seqs x max_model_len)
    steps: int  # timed steps per cell
    serve: tuple[str, ...]  # `jaxserve serve`'s size flags for the served run
    concurrency: tuple[int, ...]
    input_len: int
    output_len: int
    prompts_per_stream: int  # prompts at concurrency c: c x this, at most num_prompts
    num_prompts: int
    warmup: int
    # prebuilt_serve's KV cache (compiling for an accelerator without it needs its size: the
    # directory's compile and the serve from it give the same)
    prebuilt_kv: str
    spec: tuple[str, ...]  # spec_step_times.py's flags (its model, concurrencies, context, steps)


DEVICE = Sizes(
    decode="16x1,16x8,64x64,256x256", prefill=2048, profile="16x1,64x64", context=1024,
    # 256 sequences of 1,024 tokens and a 2,048-token prompt: 17,408 pages of 2 MiB (34 GiB)
    # beside 15 GiB of weights, within an H100's 80 GB.
    max_model_len=2048, max_num_seqs=256, kv_memory="34GiB", steps=5,
    serve=("--max-num-seqs", "64", "--max-model-len", "1280", "--max-num-batched-tokens", "2048",
           "--token-buckets", "64", "2048", "--request-buckets", "8", "64"),
    concurrency=(1, 16, 64), input_len=1024, output_len=128, prompts_per_stream=4, num_prompts=128,
    warmup=2, prebuilt_kv="8GiB",
    # the served run's buckets that hold the cells (64 tokens at most; 2 compiles an engine)
    spec=("--concurrency", "1", "4", "16", "--context", "1024", "--steps", "20", "--warmup", "3",
          "--kv-cache-memory", "2GiB", "--token-buckets", "64", "--request-buckets", "8", "64"),
)
REHEARSAL = Sizes(
    decode="16x8", prefill=32, profile="16x8", context=64, max_model_len=128, max_num_seqs=8,
    kv_memory=None, steps=3,
    serve=("--max-num-seqs", "8", "--max-model-len", "1024", "--max-num-batched-tokens", "16",
           "--token-buckets", "16", "--request-buckets", "8"),
    concurrency=(1, 2), input_len=16, output_len=4, prompts_per_stream=1, num_prompts=2, warmup=0,
    prebuilt_kv="64MiB",
    spec=("--tiny", "--concurrency", "1", "2", "--context", "32", "--steps", "3", "--warmup", "1",
          "--kv-cache-memory", "4MiB", "--token-buckets", "16", "--request-buckets", "8"),
)
LIMITS = {  # seconds each step may take at most (the overall budget caps them too)
    "env": 90, "device_rates": 60, "step_throughput": 240, "profile": 45, "served_run": 180,
    "spec_step_times": 90, "prebuilt_serve": 90,
    "kernel_benchmark": 90, "kernel_tests": 100, "golden_parity": 90,
}


def lines_from(path: pathlib.Path, start: int) -> list[dict]:
    """The JSON lines of `path` from line `start` on (a results file may hold earlier runs')."""
    if not path.exists():
        return []
    return [json.loads(x) for x in path.read_text().splitlines()[start:]]


def line_count(path: pathlib.Path) -> int:
    return len(path.read_text().splitlines()) if path.exists() else 0


def _pairs(text: str) -> list[tuple[int, int]]:
    return [(int(t), int(r)) for t, r in re.findall(r"(\d+)x(\d+)", text)]


class Check:
    def __init__(self, out: pathlib.Path | None, rehearse: bool, budget: float, sizes: Sizes):
        # Until env has named the chip, logs go to a staging directory (`settle` moves them).
        self.out = out or pathlib.Path(tempfile.mkdtemp(prefix="device_check_"))
        self.staged = out is None
        self.out.mkdir(parents=True, exist_ok=True)
        self.rehearse, self.sizes = rehearse, sizes
        self.deadline = time.monotonic() + budget
        self.env = dict(os.environ)
        if rehearse:
            self.env["JAX_PLATFORMS"] = "cpu"
        else:  # the device's own platform, whatever the caller's shell had
            self.env.pop("JAX_PLATFORMS", None)
        self.failed = 0
        self.last_seconds: float | None = 0.0
        self.last_limit = 0.0
        self.info: dict = {}  # what the steps found that later steps read
        self.scratch = pathlib.Path(tempfile.mkdtemp(prefix="device_check_scratch_"))

    def settle(self, out: pathlib.Path) -> None:
        """Move the staged logs to `out`, the results' directory from now on."""
        out.mkdir(parents=True, exist_ok=True)
        if self.staged:
            for f in self.out.iterdir():
                if f.suffix == ".jsonl" and (out / f.name).exists():  # earlier runs' lines stay
                    with open(out / f.name, "a") as dest:
                        dest.write(f.read_text())
                else:
                    shutil.move(str(f), out / f.name)
            shutil.rmtree(self.out, ignore_errors=True)
        self.out, self.staged = out, False

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def record(self, step: str, status: str, seconds: float, **fields) -> None:
        rec = {
            "check": "device_check",
            "step": step,
            "status": status,
            "seconds": round(seconds, 1),
            "rehearse": self.rehearse,
            "time": time.time(),
            **fields,
        }
        append_results(self.out / "device_check.jsonl", rec)
        print(
            f"[device_check] {step}: {status} ({seconds:.0f}s)"
            + (f" {json.dumps(fields)[:300]}" if fields else ""),
            flush=True,
        )
        self.failed += status not in ("ok", "skipped")

    def skip_if_late(self, step: str, need: float = 10.0) -> bool:
        """Record `step` as skipped when less than `need` seconds of the budget are left."""
        if self.left() >= need:
            return False
        self.record(step, "skipped", 0.0,
                    reason=f"over the overall budget ({self.left():.0f} s left)")
        return True

    def start(self, step: str, cmd: list[str], log_name: str | None = None):
        """(the process of `cmd`, its log file `<log_name or step>.log`), started."""
        log = open(self.out / f"{log_name or step}.log", "w")
        # A session of its own: on a timeout the step's whole process group goes (shard-plan's
        # worker process held the device's memory after its parent was killed, and the next
        # step ran out of it).
        proc = subprocess.Popen(cmd, cwd=ROOT, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        return proc, log

    @staticmethod
    def stop(proc: subprocess.Popen, log, grace: float = 0.0) -> None:
        """End `proc`'s process group (SIGTERM and `grace` seconds first when given)."""
        if grace and proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGTERM)
                proc.wait(timeout=grace)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                pass
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # the step's leftovers, if any
        except ProcessLookupError:
            pass
        proc.wait()
        log.close()

    def run_until(self, step: str, cmd: list[str], until: float, log_name: str) -> int | None:
        """Run `cmd` (a helper process of `step`, its log `<log_name>.log`) until it ends or the
        monotonic time `until`; its rc, None past `until`."""
        proc, log = self.start(step, cmd, log_name=log_name)
        try:
            return proc.wait(timeout=max(1.0, until - time.monotonic()))
        except subprocess.TimeoutExpired:
            return None
        finally:
            self.stop(proc, log)

    def run(self, step: str, cmd: list[str]) -> tuple[int | None, str]:
        """Run `cmd` within min(its limit, what is left of the budget); (rc, or None on a timeout
        or a skip, and the log). A skip is recorded here; `finish` records the rest."""
        if self.skip_if_late(step):
            self.last_seconds = None
            return None, ""
        t0 = time.monotonic()
        proc, log = self.start(step, cmd)
        self.last_limit = min(LIMITS[step], self.left())
        try:
            rc = proc.wait(timeout=self.last_limit)
        except subprocess.TimeoutExpired:
            rc = None
        finally:
            self.stop(proc, log)
        self.last_seconds = time.monotonic() - t0
        return rc, (self.out / f"{step}.log").read_text(errors="replace")

    def finish(self, step: str, rc: int | None, text: str, **fields) -> None:
        if self.last_seconds is None:  # skipped: already recorded
            return
        status = "ok" if rc == 0 else "timeout" if rc is None else f"failed (rc {rc})"
        if rc is None:  # its own limit, or what the budget had left
            fields["limit_s"] = round(self.last_limit)
        if rc != 0:
            fields["tail"] = text[-1500:]
        self.record(step, status, self.last_seconds, **fields)


def out_dir_name(kind: str, rehearse: bool) -> str:
    """`device_check_<chip>`: the chip's name in chips.py, else the device kind made a name."""
    if rehearse:
        return "device_check_rehearsal"
    chip = chip_of_device_kind(kind)
    name = chip.name if chip else re.sub(r"[^a-z0-9]+", "_", kind.lower()).strip("_") or "unknown"
    return f"device_check_{name}"


def step_env(c: Check) -> dict:
    code = (
        "import jax, json, importlib.metadata as m; d = jax.devices(); "
        "print(json.dumps({'backend': jax.default_backend(), 'devices': len(d), "
        "'kind': d[0].device_kind, "
        "'compute_capability': getattr(d[0], 'compute_capability', None), "
        "'jax': jax.__version__, 'jaxlib': m.version('jaxlib')}))"
    )
    rc, text = c.run("env", [PY, "-c", code])
    info = {}
    for line in text.splitlines():
        if line.startswith("{"):
            info = json.loads(line)
    chip = chip_of_device_kind(info.get("kind", ""))
    if chip is not None:
        info.update(chip=chip.name, hbm_gb_per_s=chip.hbm_bandwidth / 1e9)
    return {"rc": rc, "text": text, **info}


def step_device_rates(c: Check) -> None:
    out = c.out / "device_rates.jsonl"
    cmd = [PY, "benchmarks/device_rates.py", "--out", str(out)]
    if c.rehearse:
        cmd.append("--small")
    before = line_count(out)
    rc, text = c.run("device_rates", cmd)
    rec = (lines_from(out, before) or [{}])[-1]
    keys = ("copy_gb_per_s", "copy_single_call_gb_per_s", "matmul_tflops", "matmuls", "chip",
            "hbm_gb_per_s", "peak_bf16_tflops", "copy_frac_of_hbm", "matmul_frac_of_peak")
    c.info["copy_gb_per_s"] = rec.get("copy_gb_per_s")
    c.finish("device_rates", rc, text, **{k: rec[k] for k in keys if k in rec})


def decode_bytes(r: dict) -> int:
    """The bytes one decode step of shard-plan record `r` moves on a device: the weights it
    reads (all but the embedding table, of which it gathers rows; a tied table is the LM head
    and read whole), each sequence's KV cache at the context, and the new rows written."""
    params = r["params"]
    groups = params.get("groups", {})
    weights = params["per_device"]
    if "lm_head" in groups:
        weights -= groups.get("embed", {}).get("per_device", 0)
    kv = r["kv"]
    per_token = kv["bytes_per_page_per_device"] / kv["page_size"]
    m = r["measure"]
    rows = m["decode_requests"] / max(1, r.get("data_parallel", 1))  # each rank's own rows
    return int(weights + rows * (m["context"] + 1) * per_token)


def step_throughput(c: Check, devices: int) -> None:
    s = c.sizes
    out = c.out / "step_throughput.jsonl"
    plan_json = c.scratch / "plan.jsonl"  # shard-plan writes it
    profile_dir = c.scratch / "profiles"
    if c.rehearse:
        (c.scratch / "config.json").write_text(json.dumps(TINY_LLAMA))
        model = str(c.scratch / "config.json")
    else:
        model = "llama3-8b"
    buckets = f"{s.decode},{s.prefill}x1"
    cmd = [PY, "-m", "jaxserve.server.cli", "shard-plan", model, "--real", "--mesh", f"1x{devices}",
           "--buckets", buckets, "--measure", "--steps", str(s.steps), "--context", str(s.context),
           "--max-model-len", str(s.max_model_len), "--max-num-seqs", str(s.max_num_seqs),
           "--dtype", "bfloat16", "--profile", str(profile_dir), "--profile-buckets", s.profile,
           "--json", str(plan_json)]
    if s.kv_memory:
        cmd += ["--kv-cache-memory", s.kv_memory]
    rc, text = c.run("step_throughput", cmd)
    rows = lines_from(plan_json, 0)
    kept = [{**r, "measure": {**r["measure"],
                              "profile": pathlib.Path(r["measure"]["profile"]).name}}
            if (r.get("measure") or {}).get("profile") else r for r in rows]
    if kept:  # shard-plan's lines (its traces named by their directory), each with its provenance
        append_results(out, kept)
    hbm = c.info.get("hbm_gb_per_s")
    copy = c.info.get("copy_gb_per_s")
    decode_buckets = set(_pairs(s.decode))
    cells, prefill, weights_s, profiles, profile_errors = [], None, None, {}, {}
    for r in rows:
        m = r.get("measure") or {}
        bucket = tuple(r.get("bucket", ()))
        if m.get("weights_s") is not None:
            weights_s = m["weights_s"]
        if bucket == (s.prefill, 1) and m.get("prefill_ms"):
            prefill = {"tokens": s.prefill, "prefill_ms": m["prefill_ms"],
                       "tok_per_s": round(s.prefill * 1e3 / m["prefill_ms"], 1)}
        elif bucket in decode_buckets and m.get("decode_ms"):
            seqs = m["decode_requests"]
            moved = decode_bytes(r)
            gbs = moved / m["decode_ms"] * 1e-6
            cell = {"seqs": seqs, "context": m["context"], "decode_ms": m["decode_ms"],
                    "tok_per_s": round(seqs * 1e3 / m["decode_ms"], 1),
                    "prefill_ms": m.get("prefill_ms"), "prefill_tokens": bucket[0],
                    "attention": r.get("attention_impl"), "bytes_moved": moved,
                    "gb_per_s": round(gbs, 1)}
            if hbm:
                cell["hbm_frac"] = round(gbs / hbm, 4)
            if copy:
                cell["copy_frac"] = round(gbs / copy, 4)
            cells.append(cell)
            if m.get("profile"):
                profiles[seqs] = m["profile"]
            if m.get("profile_error"):
                profile_errors[seqs] = m["profile_error"]
        elif r.get("error") or (r.get("memory") or {}).get("compiler"):
            cells.append({"bucket": r.get("bucket"),
                          "error": r.get("error") or r["memory"]["compiler"]})
    c.info["profiles"] = None if c.last_seconds is None else profiles  # None: the step did not run
    c.info["profile_errors"] = profile_errors
    c.info["decode_ms"] = {cell["seqs"]: cell["decode_ms"] for cell in cells if "seqs" in cell}
    c.finish("step_throughput", rc, text, model="tiny-llama" if c.rehearse else model,
             dtype="bfloat16", context=s.context, cells=cells, prefill=prefill, weights_s=weights_s,
             chip=c.info.get("chip"), hbm_gb_per_s=hbm, copy_gb_per_s=copy,
             **({"profile_errors": profile_errors} if profile_errors else {}))


def step_profile(c: Check) -> None:
    profiles = c.info.get("profiles")
    if profiles is None:
        c.record("profile", "skipped", 0.0,
                 reason="step_throughput did not run, and made no traces")
        return
    if not profiles:
        c.record("profile", "failed", 0.0, reason="step_throughput made no traces (see its record)",
                 profile_errors=c.info.get("profile_errors"))
        return
    jsonl, md = c.out / "profile_kernels.jsonl", c.out / "profile_kernels.md"
    labels = {seqs: f"decode_{seqs}" for seqs in profiles}
    cmd = [PY, "benchmarks/trace_kernels.py", "--json", str(jsonl), "--markdown", str(md),
           "--top", "25", *(f"{labels[seqs]}={path}" for seqs, path in sorted(profiles.items()))]
    before = line_count(jsonl)
    rc, text = c.run("profile", cmd)
    tables = lines_from(jsonl, before)
    by_label = {t["label"]: t for t in tables}
    summary = []
    for seqs, path in sorted(profiles.items()):
        t = by_label.get(labels[seqs])
        kept = _keep_trace(pathlib.Path(path), c.out / f"profile_decode_{seqs}.trace.json.gz")
        if t is None or t.get("error"):
            error = (t or {}).get("error", "no table")
            summary.append({"seqs": seqs, "error": error, "trace": kept})
            continue
        decode_ms = c.info.get("decode_ms", {}).get(seqs)
        summary.append({
            "seqs": seqs, "source": t["source"], "kernel_events": t["kernel_events"],
            "distinct_kernels": t["distinct_kernels"], "kernel_us": t["kernel_us"],
            "span_us": t["span_us"], "decode_ms": decode_ms, "trace": kept,
            "top": [{k: r[k] for k in ("kernel", "count", "total_us", "share")}
                    for r in t["rows"][:8]],
        })
    c.finish("profile", rc, text, traces=summary)


def _keep_trace(run_dir: pathlib.Path, dest: pathlib.Path) -> str | None:
    """Copy the trace under `run_dir` (the one trace_kernels.py reads) to `dest`."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from trace_kernels import find_trace

    try:
        shutil.copyfile(find_trace(run_dir), dest)
    except (FileNotFoundError, OSError):
        return None
    return dest.name


def _shown(path: pathlib.Path) -> str:
    """`path` as a step's command line names it: relative to the repository (the steps' working
    directory) when inside it, so that logs name no machine's paths."""
    path = path.resolve()
    return str(path.relative_to(ROOT) if path.is_relative_to(ROOT) else path)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_healthy(port: int, server: subprocess.Popen, until: float) -> None:
    """Return once the server on `port` answers /health; RuntimeError when it exits or `until`
    (monotonic) passes first."""
    while time.monotonic() < until and server.poll() is None:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.5)
    raise RuntimeError("the server did not become healthy in time" if server.poll() is None
                       else f"the server exited with {server.returncode}")


def _chat(port: int, timeout: float) -> dict:
    body = json.dumps({"messages": [{"role": "user", "content": "What is the capital of France?"}],
                       "max_tokens": 16, "temperature": 0}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    t1 = time.monotonic()
    with urllib.request.urlopen(req, timeout=timeout) as r:
        reply = json.loads(r.read())
        return {"http": r.status, "latency_s": round(time.monotonic() - t1, 2),
                "text": reply["choices"][0]["message"]["content"], "usage": reply.get("usage")}


def step_served_run(c: Check) -> None:
    step = "served_run"
    if c.skip_if_late(step, 30):
        return
    s = c.sizes
    until = time.monotonic() + min(LIMITS[step], c.left())
    port = _free_port()
    cache = c.scratch / "serve_cache"  # the server's compiled steps, removed with the scratch
    results = c.out / "served_run.jsonl"
    before = line_count(results)
    cmd = [PY, "-m", "jaxserve.server.cli", "serve", "--port", str(port), *s.serve,
           "--compilation-cache-dir", str(cache), "--uvicorn-log-level", "warning"]
    t0 = time.monotonic()
    server, log = c.start(step, cmd)
    fields: dict = {"concurrency": list(s.concurrency), "input_len": s.input_len,
                    "output_len": s.output_len}
    status = "failed"
    try:
        _wait_healthy(port, server, until)
        fields["startup_s"] = round(time.monotonic() - t0, 1)
        fields["request"] = _chat(port, max(5.0, until - time.monotonic()))
        c.info["served"] = {"startup_s": fields["startup_s"], "text": fields["request"].get("text")}
        client_cmd = [PY, "benchmarks/serving_benchmark.py",
                      "--base-url", f"http://127.0.0.1:{port}",
                      "--concurrency", *map(str, s.concurrency), "--input-len", str(s.input_len),
                      "--output-len", str(s.output_len), "--num-prompts", str(s.num_prompts),
                      "--prompts-per-stream", str(s.prompts_per_stream), "--warmup", str(s.warmup),
                      "--results", str(results), "--tag", "device_check"]
        rc = c.run_until(step, client_cmd, until, f"{step}_client")
        runs = lines_from(results, before)
        fields["runs"] = [
            {"concurrency": r["config"]["concurrency"], "prompts": r["config"]["num_prompts"],
             "completed": r["completed"], "failed": r["failed"],
             "output_tok_per_s": round(r["output_throughput"], 1),
             "ttft_ms": {k: round(r["ttft_ms"][k], 1) for k in ("p50", "p99")},
             "itl_ms": {k: round(r["itl_ms"][k], 2) for k in ("p50", "p99")}}
            for r in runs
        ]
        if rc is None:
            status = "timeout"
        elif rc != 0 or len(runs) != len(s.concurrency) or any(r["failed"] for r in fields["runs"]):
            client_log_text = (c.out / f"{step}_client.log").read_text(errors="replace")
            fields["client_tail"] = client_log_text[-1500:]
        else:
            status = "ok"
    except Exception as e:  # the record says what went wrong; the check goes on
        fields["error"] = f"{type(e).__name__}: {e}"[:500]
    finally:
        c.stop(server, log, grace=20)
    if status != "ok":
        fields["tail"] = (c.out / f"{step}.log").read_text(errors="replace")[-1500:]
    c.record(step, status, time.monotonic() - t0, **fields)


def step_spec_step_times(c: Check) -> None:
    """Speculative decoding's step times (benchmarks/spec_step_times.py): plain, n-gram
    verifying and EAGLE-3 drafting steps of the default model, and the speed-ups they predict
    at the CPU-measured acceptance. Each cell is written as it is timed: a timeout keeps those
    done."""
    out = c.out / "spec_step_times.jsonl"
    cmd = [PY, "benchmarks/spec_step_times.py", "--out", _shown(out), *c.sizes.spec,
           "--compilation-cache-dir", str(c.scratch / "spec_cache")]
    before = line_count(out)
    rc, text = c.run("spec_step_times", cmd)
    rows = lines_from(out, before)
    keys = ("method", "concurrency", "step_ms", "tokens", "bucket", "step_over_plain",
            "predicted_speedup", "speedup_per_verifying_step")
    fields = {"cells": [{k: r[k] for k in keys if k in r} for r in rows]}
    if rows:
        last = rows[-1]
        fields |= {k: last[k] for k in ("model", "dtype", "context", "num_speculative_tokens",
                                        "steps", "ngram_engine_s", "eagle3_engine_s") if k in last}
        fields["acceptance"] = {r["method"]: {k: r["acceptance"][k] for k in ("tau", "s")}
                                for r in rows if "acceptance" in r}
    c.finish("spec_step_times", rc, text, **fields)


READY = re.compile(r"(\d+) executables loaded, (\d+) compiled")


def step_prebuilt_serve(c: Check, executables: pathlib.Path | None) -> None:
    """The served run's engine from executables compiled before the chip: `jaxserve serve
    --executables DIR`, DIR written on a CPU host by `jaxserve compile --topology <chip>:1x1`
    with the served run's flags (a directory of such directories, one per chip, is searched for
    the chip env found). Time to healthy beside the served run's (which compiled), what the
    engine loaded and compiled (its ready line), and the same greedy completion. The rehearsal
    compiles its directory here, for the CPU, first."""
    step = "prebuilt_serve"
    if c.skip_if_late(step, 30):
        return
    s = c.sizes
    t0 = time.monotonic()
    until = t0 + min(LIMITS[step], c.left())
    fields: dict = {}
    if c.rehearse:
        executables = c.scratch / "executables"
        compile_cmd = [PY, "-m", "jaxserve.server.cli", "compile", "--topology", "cpu",
                       "--out", str(executables), *s.serve, "--kv-cache-memory", s.prebuilt_kv,
                       "--log-level", "warning"]
        rc = c.run_until(step, compile_cmd, until, f"{step}_compile")
        fields["compile_s"] = round(time.monotonic() - t0, 1)
        if rc != 0:
            text = (c.out / f"{step}_compile.log").read_text(errors="replace")
            c.record(step, "failed", time.monotonic() - t0, tail=text[-1500:], **fields)
            return
    elif executables is None:
        c.record(step, "skipped", 0.0, reason="no --executables directory (compile one on a CPU "
                 "host: jaxserve compile --topology h100:1x1 --out DIR/h100 with the served run's "
                 f"flags and --kv-cache-memory {s.prebuilt_kv})")
        return
    elif (executables / c.info.get("chip", "")).is_dir() and c.info.get("chip"):
        executables = executables / c.info["chip"]
    fields["executables"] = _shown(executables)
    port = _free_port()
    cmd = [PY, "-m", "jaxserve.server.cli", "serve", "--port", str(port), *s.serve,
           "--kv-cache-memory", s.prebuilt_kv, "--executables", str(executables),
           "--no-compilation-cache",
           "--uvicorn-log-level", "warning"]
    t1 = time.monotonic()
    server, log = c.start(step, cmd)
    status = "failed"
    try:
        _wait_healthy(port, server, until)
        fields["startup_s"] = round(time.monotonic() - t1, 1)
        fields["request"] = _chat(port, max(5.0, until - time.monotonic()))
        ready = READY.search((c.out / f"{step}.log").read_text(errors="replace"))
        fields["loaded"], fields["compiled"] = (int(ready[1]), int(ready[2])) if ready else (None, None)
        served = c.info.get("served") or {}
        fields["served_run_startup_s"] = served.get("startup_s")
        fields["same_text"] = served.get("text") == fields["request"].get("text") if served else None
        ok = fields["loaded"] and fields["compiled"] == 0 and fields["same_text"] is not False
        status = "ok" if ok else "failed"
    except Exception as e:  # the record says what went wrong; the check goes on
        fields["error"] = f"{type(e).__name__}: {e}"[:500]
    finally:
        c.stop(server, log, grace=20)
    if status != "ok":
        fields["tail"] = (c.out / f"{step}.log").read_text(errors="replace")[-1500:]
    c.record(step, status, time.monotonic() - t0, **fields)


def step_kernel_benchmark(c: Check, backend: str) -> None:
    out = c.out / "kernels.jsonl"
    cmd = [PY, "benchmarks/kernel_benchmark.py", "--out", _shown(out)]
    if c.rehearse or backend == "cpu":  # the sweep's one variant in the interpreter
        cmd += ["--small", "--iters", "1", "--impls", "gpu-interpret", "--sweep"]
    elif backend == "gpu":  # the sweep: the Mosaic GPU kernel's block sizes (gpu_blocks.py)
        cmd += ["--impls", "reference", "gpu", "gpu-mosaic", "jax-gpu-paged", "--sweep"]
    before = line_count(out)
    rc, text = c.run("kernel_benchmark", cmd)
    rows = lines_from(out, before)
    c.finish("kernel_benchmark", rc, text, results=[
        {k: r[k] for k in ("scenario", "impl", "ms_median", "gb_per_s", "frac_of_copy_bw", "blocks")
         if k in r}
        for r in rows
    ])


def step_kernel_tests(c: Check, backend: str) -> None:
    tests = {
        "gpu": ["tests/pallas_kernels/test_gpu_kernel.py",
                "tests/pallas_kernels/test_gpu_mosaic_kernel.py"],
        "tpu": ["tests/pallas_kernels/test_tpu_kernel.py"],
    }.get(backend)
    cmd = [PY, "-m", "pytest", "-q", "-p", "no:cacheprovider",
           f"--junitxml={c.out / 'kernel_tests.xml'}"]
    if c.rehearse or tests is None:  # one quick interpret-mode test of each GPU kernel's file
        cmd += ["tests/pallas_kernels/test_gpu_kernel.py",
                "tests/pallas_kernels/test_gpu_mosaic_kernel.py",
                "-k", "lowers_to_triton and float32 or sliding_window_soft_cap_splits"]
    else:
        cmd += [*tests, "--kernel-device"]
    rc, text = c.run("kernel_tests", cmd)
    summary = next((ln for ln in reversed(text.splitlines())
                    if " passed" in ln or " failed" in ln), "")
    c.finish("kernel_tests", rc, text, summary=summary.strip("= "))


def step_golden(c: Check) -> None:
    out = c.out / "golden_parity.jsonl"
    cmd = [PY, "benchmarks/golden_parity.py", "--out", str(out)]
    if c.rehearse:
        cmd += ["--cases", "1", "--max-tokens", "4", "--token-budget", "16"]
    before = line_count(out)
    rc, text = c.run("golden_parity", cmd)
    rec = (lines_from(out, before) or [{}])[-1]
    c.finish("golden_parity", rc, text, ok=rec.get("ok"), attention=rec.get("attention"),
             cases=[f"{x['name']}: {x['status']}" for x in rec.get("cases", [])])


def pack(out: pathlib.Path, name: str) -> pathlib.Path:
    """Leave `out` as two files: device_check.jsonl and `<name>.tar.gz` holding every result and
    log under `<name>/` (one file to carry off a lent machine, to unpack in
    benchmarks/results/)."""
    archive = out / f"{name}.tar.gz"
    files = sorted(p for p in out.iterdir() if p.is_file() and p != archive)
    with tarfile.open(archive, "w:gz") as tar:
        for p in files:
            tar.add(p, arcname=f"{name}/{p.name}")
    for p in files:
        if p.name != "device_check.jsonl":
            p.unlink()
    return archive


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rehearse", action="store_true",
                   help="the same steps on the CPU at tiny sizes")
    p.add_argument("--out", default=None,
                   help="the results' directory (default: benchmarks/results/device_check_<chip>/, "
                        "the chip env finds; with --rehearse "
                        "benchmarks/results/device_check_rehearsal/)")
    p.add_argument("--budget", type=float, default=540.0,
                   help="seconds for all steps (default 540)")
    p.add_argument("--steps", nargs="+", choices=STEPS, default=STEPS,
                   help="the steps to run (env always runs first); default: all")
    p.add_argument("--buckets", default=None,
                   help=f"step_throughput's decode buckets on the device (tokens x sequences; "
                        f"default {DEVICE.decode})")
    p.add_argument("--prefill-tokens", type=int, default=None,
                   help=f"step_throughput's prefill cell on the device (default {DEVICE.prefill})")
    p.add_argument("--executables", type=pathlib.Path, default=None,
                   help="prebuilt_serve's directory of executables compiled before the chip "
                        "(`jaxserve compile --topology <chip>:1x1`), or a directory of them named "
                        "by chip (h100/, h200/)")
    p.add_argument("--pack", action="store_true",
                   help="at the end, pack the results into <out>/device_check_<chip>.tar.gz beside "
                        "device_check.jsonl")
    args = p.parse_args()
    sizes = REHEARSAL if args.rehearse else DEVICE
    if not args.rehearse and (args.buckets or args.prefill_tokens):
        sizes = dataclasses.replace(sizes, decode=args.buckets or sizes.decode,
                                    prefill=args.prefill_tokens or sizes.prefill)
    c = Check(pathlib.Path(args.out) if args.out else None, args.rehearse, args.budget, sizes)
    t0 = time.monotonic()
    try:
        env = step_env(c)
        rc, text = env.pop("rc"), env.pop("text")
        name = out_dir_name(env.get("kind", ""), args.rehearse)
        c.settle(pathlib.Path(args.out) if args.out else RESULTS / name)
        c.finish("env", rc, text, **env)
        c.info.update(env)
        backend = env.get("backend", "cpu")
        devices = 1 if args.rehearse else int(env.get("devices", 1))
        steps = {
            "device_rates": lambda: step_device_rates(c),
            "step_throughput": lambda: step_throughput(c, devices),
            "profile": lambda: step_profile(c),
            "served_run": lambda: step_served_run(c),
            "spec_step_times": lambda: step_spec_step_times(c),
            "prebuilt_serve": lambda: step_prebuilt_serve(c, args.executables),
            "kernel_benchmark": lambda: step_kernel_benchmark(c, backend),
            "kernel_tests": lambda: step_kernel_tests(c, backend),
            "golden_parity": lambda: step_golden(c),
        }
        for name in STEPS:
            if name in args.steps:
                steps[name]()
        c.record("done", "ok" if not c.failed else f"{c.failed} failed", time.monotonic() - t0,
                 out=_shown(c.out))
    finally:
        shutil.rmtree(c.scratch, ignore_errors=True)
    if args.pack:
        name = out_dir_name(c.info.get("kind", ""), args.rehearse)
        print(f"[device_check] packed into {pack(c.out, name)}", flush=True)
    return 1 if c.failed else 0


if __name__ == "__main__":
    sys.exit(main())
