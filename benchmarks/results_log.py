"""The one writer of benchmark result lines: every script appends its JSON lines through
`append_results`, which gives each line its provenance, so that a figure quoted in
docs/performance.md can be traced to the code, the moment, the machine and the libraries that
gave it:

- "commit": the checkout's HEAD (the full sha; "git_dirty" says whether tracked files differed
  from it), or "not recorded" outside a git checkout;
- "time": when the line was written (UTC, ISO 8601), unless the record carries its own;
- "host": the CPU as /proc/cpuinfo names it (model name, family and model numbers, the vector
  extensions that decide which kernels run, the cores this process may use); a record's own
  "host" dict adds to it (a device it ran on), a record's own "host" string is kept as "label";
- "versions": Python and the installed jax, jaxlib, flax, numpy, libtpu and JAX CUDA plugins;
  a record's own "versions" dict adds to them.

A record's other fields are its own. Lines written before this writer existed were given these
fields from the repository's history where they lacked them (their "provenance" field says so).
"""

from __future__ import annotations

import datetime
import functools
import importlib.metadata
import json
import os
import pathlib
import platform
import subprocess
from collections.abc import Iterable

ROOT = pathlib.Path(__file__).resolve().parent.parent
NOT_RECORDED = "not recorded"
# The packages whose versions decide a figure (those not installed are left out).
VERSIONED = ("jax", "jaxlib", "flax", "numpy", "libtpu", "jax-cuda12-plugin", "jax-cuda13-plugin",
             "jaxserve")
# The CPU features that choose the native kernels (DESIGN §6) and XLA:CPU's code.
CPU_FEATURES = ("avx2", "fma", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16")


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


@functools.cache
def commit() -> tuple[str, bool | None]:
    """(HEAD's full sha, whether tracked files differ from it), or ("not recorded", None)."""
    sha = _git("rev-parse", "HEAD")
    if not sha:
        return NOT_RECORDED, None
    status = _git("status", "--porcelain", "--untracked-files=no")
    return sha, (bool(status) if status is not None else None)


@functools.cache
def host() -> dict:
    """The CPU this process runs on, as /proc/cpuinfo names it (platform's words elsewhere)."""
    info: dict[str, str] = {}
    try:
        for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            key = key.strip()
            if key in ("model name", "cpu family", "model", "flags") and key not in info:
                info[key] = value.strip()
            if not line.strip() and info:
                break  # the first processor's block is enough
    except OSError:
        pass
    flags = set(info.get("flags", "").split())
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {
        "cpu": info.get("model name") or platform.processor() or platform.machine(),
        "cpu_family": int(info["cpu family"]) if info.get("cpu family", "").isdigit() else None,
        "cpu_model": int(info["model"]) if info.get("model", "").isdigit() else None,
        "cpu_features": [f for f in CPU_FEATURES if f in flags],
        "cores": cores,
        "machine": platform.machine(),
    }


@functools.cache
def versions() -> dict:
    """Python's version and each installed package of VERSIONED's."""
    found = {"python": platform.python_version()}
    for name in VERSIONED:
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            pass
    return found


def provenance() -> dict:
    """The fields every result line carries: commit, git_dirty, time, host, versions."""
    sha, dirty = commit()
    return {
        "commit": sha,
        "git_dirty": dirty,
        "time": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "host": host(),
        "versions": versions(),
    }


def with_provenance(record: dict, base: dict | None = None) -> dict:
    """`record` with the provenance fields (`base`, or this process's) its own fields lack."""
    base = base or provenance()
    out = {**base, **record}
    own_host = record.get("host")
    if isinstance(own_host, dict):
        out["host"] = {**base["host"], **own_host}
    elif own_host is not None:
        out["host"] = {**base["host"], "label": own_host}
    if isinstance(record.get("versions"), dict):
        out["versions"] = {**base["versions"], **record["versions"]}
    if record.get("time") is None:
        out["time"] = base["time"]
    return out


def append_results(path: str | os.PathLike, records: dict | Iterable[dict]) -> list[dict]:
    """Append `records` (one dict or several) to the JSON-lines file `path`, each with its
    provenance; returns the lines as written."""
    records = [records] if isinstance(records, dict) else list(records)
    base = provenance()
    lines = [with_provenance(r, base) for r in records]
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        f.writelines(json.dumps(line, default=str) + "\n" for line in lines)
    return lines
