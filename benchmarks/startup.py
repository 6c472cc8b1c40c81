"""Start-up time of `jaxserve serve`: from launching the command to the first 200 on /health.

Cold: the compilation caches are empty (a fresh `--compilation-cache-dir`: JAX's persistent
cache and jaxserve's executables in it). Warm: they hold this configuration's executables.
The one-time work of a machine (converting the GGUF model, building the native CPU kernels,
measuring the CPU's dtype) is done by a first, unrecorded start of each variant in a cache
root of the run's own (`$XDG_CACHE_HOME`), so neither mode pays for it.

Several checkouts compare side by side (`--variant NAME=PATH`, each with its own `.venv`): the
runs alternate variants and modes, round after round, in the order of `--variant` rotated
each round, so that a machine busy with other work loads them alike. Each start appends a
JSON line to benchmarks/results/startup.jsonl (git sha, CPU, load average, the server's own
start-up phase log when it prints one) and a table of medians follows.

    .venv/bin/python benchmarks/startup.py                                  # this checkout, 3 rounds
    git worktree add --detach ../before <sha> && (cd ../before && make install)
    .venv/bin/python benchmarks/startup.py --variant before=../before --variant after=. --runs 5
"""

from __future__ import annotations

import argparse
import datetime
import http.client
import os
import pathlib
import re
import shlex
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time

from results_log import append_results

HERE = pathlib.Path(__file__).resolve().parent
REPO = HERE.parent
RESULTS = HERE / "results" / "startup.jsonl"
_SUMMARY = re.compile(r"start-up ([\d.]+) s since launch: (.*)$")
_PHASE = re.compile(r"([a-z][a-z ]*?) ([\d.]+) s(?: \(([^)]*)\))?(?:, |$)")


def cpu_model() -> str:
    """The CPU's model name, family/model numbers and the instruction sets that matter here."""
    info: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                key, _, value = line.partition(":")
                info.setdefault(key.strip(), value.strip())
    except OSError:
        return "unknown CPU"
    flags = set(info.get("flags", "").split())
    isa = [name for name, flag in (("AMX", "amx_bf16"), ("AVX-512", "avx512f"), ("AVX512-BF16", "avx512_bf16"),
                                   ("AVX2", "avx2")) if flag in flags]
    return (f"{info.get('model name', '?')} (family {info.get('cpu family', '?')} model {info.get('model', '?')}; "
            f"{', '.join(isa)}; {os.cpu_count()} cores)")


def git_state(path: pathlib.Path) -> tuple[str | None, bool | None]:
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=path, capture_output=True, text=True,
                             check=True).stdout.strip()
        dirty = bool(subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=path,
                                    capture_output=True, text=True).stdout.strip())
    except (OSError, subprocess.CalledProcessError):
        return None, None
    return sha, dirty


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def healthy(port: int) -> bool:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=1)
    try:
        conn.request("GET", "/health")
        return conn.getresponse().status == 200
    except OSError:
        return False
    finally:
        conn.close()


def parse_phases(log: str) -> tuple[float | None, dict[str, float], dict[str, str]]:
    """The server's "start-up X s since launch: phase t s, ..." line, if it printed one."""
    for line in reversed(log.splitlines()):
        m = _SUMMARY.search(line)
        if m:
            phases, notes = {}, {}
            for name, seconds, note in _PHASE.findall(m.group(2)):
                phases[name] = float(seconds)
                if note:
                    notes[name] = note
            return float(m.group(1)), phases, notes
    return None, {}, {}


def start_once(variant: pathlib.Path, cache_root: pathlib.Path, compile_dir: pathlib.Path, serve_args: list[str],
               timeout: float) -> dict:
    """Launch `jaxserve serve`, wait for /health 200, stop it (SIGTERM); the figures."""
    port = free_port()
    exe = variant / ".venv" / "bin" / "jaxserve"
    cmd = [str(exe), "serve", "--port", str(port), "--compilation-cache-dir", str(compile_dir), *serve_args]
    env = {**os.environ, "XDG_CACHE_HOME": str(cache_root)}
    load0 = os.getloadavg()
    with tempfile.TemporaryFile("w+") as log:
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, cwd=variant, env=env, stdout=log, stderr=subprocess.STDOUT)
        seconds = None
        try:
            while time.perf_counter() - t0 < timeout:
                if healthy(port):
                    seconds = time.perf_counter() - t0
                    break
                if proc.poll() is not None:
                    break
                time.sleep(0.02)
        finally:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        log.seek(0)
        text = log.read()
    if seconds is None:
        tail = "\n".join(text.splitlines()[-20:])
        raise RuntimeError(f"{' '.join(cmd)} did not become healthy (exit {proc.returncode}):\n{tail}")
    logged, phases, notes = parse_phases(text)
    return {"seconds": round(seconds, 3), "logged_seconds": logged, "phases": phases, "notes": notes,
            "load_avg_before": load0, "load_avg_after": os.getloadavg()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--variant", action="append", default=None, metavar="NAME=PATH",
                   help="a checkout with its own .venv (repeat to compare; default: this one, as 'this')")
    p.add_argument("--runs", type=int, default=3, help="rounds: each runs every variant cold and warm once")
    p.add_argument("--modes", nargs="+", default=["cold", "warm"], choices=["cold", "warm"])
    p.add_argument("--serve-args", default="", help="extra arguments for jaxserve serve (default: none)")
    p.add_argument("--cache-root", default=None,
                   help="$XDG_CACHE_HOME of the servers (default: a temporary directory, removed at the end)")
    p.add_argument("--timeout", type=float, default=900, help="seconds one start may take")
    p.add_argument("--results", default=str(RESULTS), help="JSON lines file ('' for none)")
    args = p.parse_args(argv)

    variants: list[tuple[str, pathlib.Path]] = []
    for spec in args.variant or [f"this={REPO}"]:
        name, _, path = spec.partition("=")
        if not path:
            p.error(f"--variant wants NAME=PATH, got {spec!r}")
        root = pathlib.Path(path).resolve()
        if not (root / ".venv" / "bin" / "jaxserve").exists():
            p.error(f"{root} has no .venv/bin/jaxserve (run `make install` there)")
        variants.append((name, root))
    serve_args = shlex.split(args.serve_args)
    cache_root = pathlib.Path(args.cache_root or tempfile.mkdtemp(prefix="jaxserve-startup-"))
    cpu = cpu_model()
    shas = {name: git_state(root) for name, root in variants}
    rows: list[dict] = []
    try:
        for name, root in variants:  # the machine's one-time work, and the warm caches
            print(f"[{name}] first start (converts the model, builds the kernels, compiles) ...", flush=True)
            first = start_once(root, cache_root, cache_root / f"xla-{name}", serve_args, args.timeout)
            print(f"[{name}] first start: {first['seconds']:.1f} s", flush=True)
        for r in range(args.runs):
            order = variants[r % len(variants):] + variants[: r % len(variants)]
            for mode in args.modes:
                for name, root in order:
                    if mode == "cold":
                        compile_dir = cache_root / f"cold-{name}-{r}"
                    else:
                        compile_dir = cache_root / f"xla-{name}"
                    res = start_once(root, cache_root, compile_dir, serve_args, args.timeout)
                    if mode == "cold":
                        shutil.rmtree(compile_dir, ignore_errors=True)
                    sha, dirty = shas[name]
                    row = {"benchmark": "startup", "timestamp": datetime.datetime.now().isoformat(timespec="seconds"),
                           "variant": name, "git_sha": sha, "git_dirty": dirty, "mode": mode, "round": r,
                           "serve_args": serve_args, "cpu": cpu, **res}
                    rows.append(row)
                    phases = ", ".join(f"{k} {v:.2f}" for k, v in res["phases"].items() if v >= 0.05)
                    print(f"  round {r} {mode:4s} {name:10s} {res['seconds']:6.2f} s  load "
                          f"{res['load_avg_before'][0]:.2f}  {phases}", flush=True)
                    if args.results:
                        append_results(args.results, row)
    finally:
        if args.cache_root is None:
            shutil.rmtree(cache_root, ignore_errors=True)

    print(f"\n{cpu}; load average {os.getloadavg()[0]:.2f} at the end")
    print(f"{'variant':12s} {'git':10s} {'mode':5s} {'n':>2s} {'median s':>9s} {'min':>7s} {'max':>7s} {'vs first':>9s}")
    base: dict[str, float] = {}
    for mode in args.modes:
        for name, _ in variants:
            xs = [row["seconds"] for row in rows if row["variant"] == name and row["mode"] == mode]
            if not xs:
                continue
            med = statistics.median(xs)
            base.setdefault(mode, med)
            sha, dirty = shas[name]
            print(f"{name:12s} {(sha or '?')[:8] + ('+' if dirty else ''):10s} {mode:5s} {len(xs):2d} {med:9.2f} "
                  f"{min(xs):7.2f} {max(xs):7.2f} {med / base[mode]:8.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
