"""The device check: everything worth knowing on the day a GPU (or TPU) is lent, in at most ten
minutes, run by benchmarks/device_check.sh. Each step runs as its own process under a time
limit, its output in `<out>/<step>.log`, and adds one JSON line to `<out>/device_check.jsonl`
(the step, its status, seconds, and what it measured); a step past the overall budget is
skipped, never cut short silently.

1. env: backend, devices, versions.
2. kernel_tests: the attention kernel tests compiled and run on the device (`pytest
   --kernel-device`: the Triton and Mosaic GPU kernels on a GPU, the Mosaic kernel on a TPU).
3. kernel_benchmark: the kernels' GB/s against the device's copy bandwidth (the roofline) and,
   on a GPU, against JAX's shipped Pallas paged_attention (benchmarks/kernel_benchmark.py);
   with the sweep of the Mosaic GPU kernel's block sizes around its per-chip table's.
4. golden_parity: the default model's greedy completions in float32 against transformers'
   golden data, attention on the device's kernel (benchmarks/golden_parity.py).
5. step_throughput: a Llama-3-8B-shaped model on random weights over every local device
   (tensor parallel), its compiled step timed at 1/8/64/256 decoding sequences and a prefill
   (`jaxserve shard-plan --real --measure`); tok/s = sequences / decode step time.
6. served_request: `jaxserve serve` with the default model, one chat completion over HTTP.

`--rehearse` runs the same steps on the CPU at tiny sizes (one interpret-mode test per kernel,
the kernel benchmark's small scenarios, a 2-layer model at one bucket, one golden case of 4
tokens, steps of 16 tokens), so that the script itself is known to work before any
device time is spent; tests/tools/test_device_check.py runs it.

    python benchmarks/device_check.py [--rehearse] [--out DIR] [--budget SECONDS]
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

from results_log import append_results

ROOT = pathlib.Path(__file__).resolve().parent.parent
STEPS = ["kernel_tests", "kernel_benchmark", "golden_parity", "step_throughput", "served_request"]
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


class Check:
    def __init__(self, out: pathlib.Path, rehearse: bool, budget: float,
                 buckets: str = "16x1,16x8,64x64,256x256"):
        self.out, self.rehearse, self.deadline = out, rehearse, time.monotonic() + budget
        self.buckets = buckets  # step_throughput's (tokens x sequences) on the device
        self.env = dict(os.environ)
        if rehearse:
            self.env["JAX_PLATFORMS"] = "cpu"
        else:  # the device's own platform, whatever the caller's shell had
            self.env.pop("JAX_PLATFORMS", None)
        self.failed = 0

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

    def run(self, step: str, limit: float, cmd: list[str]) -> tuple[int | None, str]:
        """Run `cmd` within min(limit, what is left of the budget); (rc or None on timeout, log)."""
        left = self.deadline - time.monotonic()
        if left < 10:
            self.record(step, "skipped", 0.0, reason="over the overall budget")
            return None, ""
        log = self.out / f"{step}.log"
        t0 = time.monotonic()
        with open(log, "w") as f:
            # A session of its own: on a timeout the step's whole process group goes (shard-plan's
            # worker process held the device's memory after its parent was killed, and the next
            # step ran out of it).
            proc = subprocess.Popen(cmd, cwd=ROOT, env=self.env, stdout=f, stderr=subprocess.STDOUT,
                                    start_new_session=True)
            try:
                rc = proc.wait(timeout=min(limit, left))
            except subprocess.TimeoutExpired:
                rc = None
            finally:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)  # the step's leftovers, if any
                except ProcessLookupError:
                    pass
                proc.wait()
        self.last_seconds = time.monotonic() - t0
        return rc, log.read_text(errors="replace")

    def finish(self, step: str, rc: int | None, text: str, **fields) -> None:
        status = "ok" if rc == 0 else "timeout" if rc is None else f"failed (rc {rc})"
        if rc != 0:
            fields["tail"] = text[-1500:]
        self.record(step, status, self.last_seconds, **fields)


def step_env(c: Check) -> str:
    code = (
        "import jax, json, importlib.metadata as m; d = jax.devices(); "
        "print(json.dumps({'backend': jax.default_backend(), 'devices': len(d), "
        "'kind': d[0].device_kind, "
        "'compute_capability': getattr(d[0], 'compute_capability', None), "
        "'jax': jax.__version__, 'jaxlib': m.version('jaxlib')}))"
    )
    rc, text = c.run("env", 120, [PY, "-c", code])
    info = {}
    for line in text.splitlines():
        if line.startswith("{"):
            info = json.loads(line)
    c.finish("env", rc, text, **info)
    return info.get("backend", "cpu")


def step_kernel_tests(c: Check, backend: str) -> None:
    tests = {
        "gpu": [
            "tests/pallas_kernels/test_gpu_kernel.py",
            "tests/pallas_kernels/test_gpu_mosaic_kernel.py",
        ],
        "tpu": ["tests/pallas_kernels/test_tpu_kernel.py"],
    }.get(backend)
    cmd = [
        PY,
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        f"--junitxml={c.out / 'kernel_tests.xml'}",
    ]
    if c.rehearse or tests is None:  # one quick interpret-mode test of each GPU kernel's file
        cmd += [
            "tests/pallas_kernels/test_gpu_kernel.py",
            "tests/pallas_kernels/test_gpu_mosaic_kernel.py",
            "-k",
            "lowers_to_triton and float32 or sliding_window_soft_cap_splits",
        ]
    else:
        cmd += [*tests, "--kernel-device"]
    rc, text = c.run("kernel_tests", 150, cmd)
    summary = next(
        (ln for ln in reversed(text.splitlines()) if " passed" in ln or " failed" in ln), ""
    )
    c.finish("kernel_tests", rc, text, summary=summary.strip("= "))


def step_kernel_benchmark(c: Check, backend: str) -> None:
    out = c.out / "kernels.jsonl"
    cmd = [PY, "benchmarks/kernel_benchmark.py", "--out", str(out)]
    if c.rehearse or backend == "cpu":  # the sweep's one variant in the interpreter
        cmd += ["--small", "--iters", "1", "--impls", "gpu-interpret", "--sweep"]
    elif backend == "gpu":  # the sweep: the Mosaic GPU kernel's block sizes (gpu_blocks.py)
        cmd += ["--impls", "reference", "gpu", "gpu-mosaic", "jax-gpu-paged", "--sweep"]
    rc, text = c.run("kernel_benchmark", 180, cmd)
    rows = [json.loads(x) for x in out.read_text().splitlines()] if out.exists() else []
    c.finish(
        "kernel_benchmark",
        rc,
        text,
        results=[
            {k: r[k] for k in ("scenario", "impl", "ms_median", "gb_per_s", "frac_of_copy_bw",
                               "blocks") if k in r}
            for r in rows
        ],
    )


def step_golden(c: Check) -> None:
    out = c.out / "golden_parity.jsonl"
    cmd = [PY, "benchmarks/golden_parity.py", "--out", str(out)]
    if c.rehearse:
        cmd += ["--cases", "1", "--max-tokens", "4", "--token-budget", "16"]
    rc, text = c.run("golden_parity", 120, cmd)
    rec = json.loads(out.read_text().splitlines()[-1]) if out.exists() else {}
    c.finish(
        "golden_parity",
        rc,
        text,
        ok=rec.get("ok"),
        attention=rec.get("attention"),
        cases=[f"{x['name']}: {x['status']}" for x in rec.get("cases", [])],
    )


def step_throughput(c: Check, devices: int) -> None:
    out = c.out / "step_throughput.jsonl"
    plan_json = pathlib.Path(tempfile.mkdtemp()) / "plan.jsonl"  # shard-plan writes it
    if c.rehearse:
        tmp = pathlib.Path(tempfile.mkdtemp())
        (tmp / "config.json").write_text(json.dumps(TINY_LLAMA))
        model, buckets, ctx, max_len, seqs = str(tmp / "config.json"), "16x8", 64, 128, 8
    else:  # 256 sequences of 1,152 tokens: 36 GiB of KV cache + 15 GiB of weights over the devices
        model, buckets, ctx, max_len, seqs = "llama3-8b", c.buckets, 1024, 1152, 256
    cmd = [
        PY,
        "-m",
        "jaxserve.server.cli",
        "shard-plan",
        model,
        "--real",
        "--mesh",
        f"1x{devices}",
        "--buckets",
        buckets,
        "--measure",
        "--steps",
        "3" if c.rehearse else "5",
        "--context",
        str(ctx),
        "--max-model-len",
        str(max_len),
        "--max-num-seqs",
        str(seqs),
        "--json",
        str(plan_json),
    ]
    rc, text = c.run("step_throughput", 200, cmd)
    if c.rehearse:
        shutil.rmtree(tmp, ignore_errors=True)
    rows = [json.loads(x) for x in plan_json.read_text().splitlines()] if plan_json.exists() else []
    shutil.rmtree(plan_json.parent, ignore_errors=True)
    if rows:  # shard-plan's lines, each with its provenance
        append_results(out, rows)
    cells = []
    for r in rows:
        m = r.get("measure") or {}
        if m.get("decode_ms"):
            seqs_ = r["bucket"][1]
            cells.append(
                {
                    "seqs": seqs_,
                    "decode_ms": m["decode_ms"],
                    "tok_per_s": round(seqs_ * 1e3 / m["decode_ms"], 1),
                    "prefill_ms": m.get("prefill_ms"),
                    "prefill_tokens": r["bucket"][0],
                    "attention": r.get("attention_impl"),
                }
            )
        elif r.get("error") or (r.get("memory") or {}).get("compiler"):
            cells.append(
                {"bucket": r.get("bucket"), "error": r.get("error") or r["memory"]["compiler"]}
            )
    c.finish(
        "step_throughput",
        rc,
        text,
        model=model if not c.rehearse else "tiny-llama",
        context=ctx,
        cells=cells,
    )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def step_served_request(c: Check) -> None:
    step, left = "served_request", c.deadline - time.monotonic()
    if left < 30:
        c.record(step, "skipped", 0.0, reason="over the overall budget")
        return
    port, cache = _free_port(), tempfile.mkdtemp()  # the server's compiled steps, removed after
    budget = ["16"] if c.rehearse else ["16", "256"]  # token buckets (the last is the budget)
    cmd = [
        PY,
        "-m",
        "jaxserve.server.cli",
        "serve",
        "--port",
        str(port),
        "--max-num-seqs",
        "8",
        "--max-model-len",
        "1024",
        "--max-num-batched-tokens",
        budget[-1],
        "--token-buckets",
        *budget,
        "--request-buckets",
        "8",
        "--compilation-cache-dir",
        cache,
        "--uvicorn-log-level",
        "warning",
    ]
    t0 = time.monotonic()
    log = open(c.out / f"{step}.log", "w")
    server = subprocess.Popen(
        cmd, cwd=ROOT, env=c.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )
    fields: dict = {}
    status = "failed"
    try:
        limit = min(150.0, left)
        while time.monotonic() - t0 < limit and server.poll() is None:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                time.sleep(0.5)
        fields["startup_s"] = round(time.monotonic() - t0, 1)
        body = json.dumps(
            {
                "messages": [{"role": "user", "content": "What is the capital of France?"}],
                "max_tokens": 16,
                "temperature": 0,
            }
        ).encode()
        req = urllib.request.Request(
            f"http://127.0.0.1:{port}/v1/chat/completions",
            data=body,
            headers={"Content-Type": "application/json"},
        )
        t1 = time.monotonic()
        with urllib.request.urlopen(req, timeout=max(5.0, limit - (t1 - t0))) as r:
            reply = json.loads(r.read())
            fields.update(
                http=r.status,
                latency_s=round(time.monotonic() - t1, 2),
                text=reply["choices"][0]["message"]["content"],
                usage=reply.get("usage"),
            )
        status = "ok"
    except Exception as e:  # the record says what went wrong; the check goes on
        fields["error"] = f"{type(e).__name__}: {e}"[:500]
    finally:
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGTERM)
            try:
                server.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(server.pid, signal.SIGKILL)
                server.wait()
        log.close()
        shutil.rmtree(cache, ignore_errors=True)
    if status != "ok":
        fields["tail"] = (c.out / f"{step}.log").read_text(errors="replace")[-1500:]
    c.record(step, status, time.monotonic() - t0, **fields)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--rehearse", action="store_true", help="the same steps on the CPU at tiny sizes"
    )
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "device_check"))
    p.add_argument(
        "--budget", type=float, default=570.0, help="seconds for all steps (default 570)"
    )
    p.add_argument("--steps", nargs="+", choices=STEPS, default=STEPS,
                   help="the steps to run (env always runs first); default: all")
    p.add_argument("--buckets", default="16x1,16x8,64x64,256x256",
                   help="step_throughput's buckets on the device (tokens x sequences)")
    args = p.parse_args()
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    c = Check(out, args.rehearse, args.budget, args.buckets)
    t0 = time.monotonic()
    backend = step_env(c)
    devices = 1
    env_line = [json.loads(x) for x in (out / "device_check.jsonl").read_text().splitlines()][-1]
    if not args.rehearse:
        devices = int(env_line.get("devices", 1))
    steps = {
        "kernel_tests": lambda: step_kernel_tests(c, backend),
        "kernel_benchmark": lambda: step_kernel_benchmark(c, backend),
        "golden_parity": lambda: step_golden(c),
        "step_throughput": lambda: step_throughput(c, devices),
        "served_request": lambda: step_served_request(c),
    }
    for name in STEPS:
        if name in args.steps:
            steps[name]()
    c.record("done", "ok" if not c.failed else f"{c.failed} failed", time.monotonic() - t0)
    return 1 if c.failed else 0


if __name__ == "__main__":
    sys.exit(main())
