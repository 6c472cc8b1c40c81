"""A `jax.profiler` trace reduced to a per-kernel table: which kernels one compiled step ran, how
often, for how long, and each one's share of the step's kernel time.

The input is the trace as Chrome trace events, the JSON that `jax.profiler.stop_trace` writes
next to its xplane (`<host>.trace.json.gz`, or `perfetto_trace.json.gz` with
`create_perfetto_trace=True`), found under the directory given (the newest one), or the file
itself; where a profiler wrote the xplane alone (`<host>.xplane.pb`), its planes, lines and
events are read through `jax.profiler.ProfileData` as the same events (a plane a process, a
line a thread, an event's stats its args). The kernels are the complete events ("ph": "X")
of the first of these that the trace has:

  device streams  on a device's process ("/device:GPU:0"), its threads named "Stream ..."
                  (a GPU: every CUDA kernel and copy, named as launched: a fusion, a cuBLAS
                  gemm, a Triton or Mosaic GPU kernel);
  device XLA ops  on a device's process, its "XLA Ops" thread (a TPU: one event an HLO op);
  host XLA ops    on the host, the events naming an `hlo_op` (the CPU: XLA's thunks), less
                  those that hold others (a conditional's or a loop's thunk: its body's
                  thunks are counted).

A kernel is its event name without the numbers XLA appends to tell instances apart
(`loop_multiply_fusion_12`, `ynn_fusion.22` -> `loop_multiply_fusion`, `ynn_fusion`): the 32
layers' instances of one fusion are one row, as a cuBLAS gemm or an attention kernel, which keep
their launched name, are. A row gives its count, total and mean microseconds, its share of
the kernels' total, and up to three of the HLO ops it ran for (the events' `hlo_op`). Besides
the rows: the number of kernel events, their total time (`kernel_us`) and the span from the
first kernel's start to the last one's end (`span_us`; the span less the total is the time the
device sat idle between kernels, less where kernels overlapped, as a CPU's threads do), and
where the kernels were found.

    python benchmarks/trace_kernels.py decode_1=DIR_OR_FILE decode_64=DIR_OR_FILE \
        [--json profile_kernels.jsonl] [--markdown profile_kernels.md] [--top 25]

One JSON line per trace (its label, the totals and every row; or the error that left it without
a table) is appended to --json; the markdown has a table per trace (its --top kernels, the rest
summed in one row). The command fails when a trace gave no kernels.
"""

from __future__ import annotations

import argparse
import gzip
import json
import pathlib
import re
import sys

from results_log import append_results


def find_trace(path: str | pathlib.Path) -> pathlib.Path:
    """The trace file of `path`: the file itself, else the newest `*.trace.json.gz` under the
    directory (a profiler's run directory, or the log directory above it), else the newest
    `perfetto_trace.json.gz`; FileNotFoundError when there is none."""
    path = pathlib.Path(path)
    if path.is_file():
        return path
    for pattern in ("*.trace.json.gz", "perfetto_trace.json.gz", "*.trace.json", "*.xplane.pb"):
        found = sorted(path.rglob(pattern), key=lambda p: p.stat().st_mtime)
        if found:
            return found[-1]
    raise FileNotFoundError(f"no trace (*.trace.json.gz, perfetto_trace.json.gz, *.xplane.pb) "
                            f"under {path}")


def xplane_events(path: pathlib.Path) -> list[dict]:
    """The events of an xplane file as Chrome trace events (needs JAX)."""
    from jax.profiler import ProfileData

    events = []
    for pid, plane in enumerate(ProfileData.from_file(str(path)).planes, 1):
        events.append({"ph": "M", "pid": pid, "name": "process_name", "args": {"name": plane.name}})
        for tid, line in enumerate(plane.lines, 1):
            events.append({"ph": "M", "pid": pid, "tid": tid, "name": "thread_name",
                           "args": {"name": line.name}})
            for e in line.events:
                events.append({"ph": "X", "pid": pid, "tid": tid, "name": e.name,
                               "ts": e.start_ns / 1e3, "dur": e.duration_ns / 1e3,
                               "args": {k: v for k, v in e.stats}})
    return events


def load_events(path: pathlib.Path) -> list[dict]:
    if path.name.endswith(".xplane.pb"):
        return xplane_events(path)
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        data = json.load(f)
    return data["traceEvents"] if isinstance(data, dict) else data


def kernel_events(events: list[dict]) -> tuple[list[dict], str, list[str]]:
    """(the kernels' events, where they were found, the device threads' names)."""
    processes, threads = {}, {}
    for e in events:
        if e.get("ph") == "M" and e.get("name") == "process_name":
            processes[e.get("pid")] = e.get("args", {}).get("name", "")
        elif e.get("ph") == "M" and e.get("name") == "thread_name":
            threads[(e.get("pid"), e.get("tid"))] = e.get("args", {}).get("name", "")
    complete = [e for e in events if e.get("ph") == "X" and "dur" in e]
    devices = {pid for pid, name in processes.items() if name.startswith("/device:")}
    device_threads = sorted({name for (pid, _), name in threads.items() if pid in devices})
    for source, wanted in (("device streams", lambda name: name.startswith("Stream")),
                           ("device XLA ops", lambda name: name == "XLA Ops")):
        lines = {key for key, name in threads.items() if key[0] in devices and wanted(name)}
        kernels = [e for e in complete if (e.get("pid"), e.get("tid")) in lines]
        if kernels:
            return kernels, source, device_threads
    kernels = [e for e in complete
               if e.get("pid") not in devices and (e.get("args") or {}).get("hlo_op")]
    return leaves(kernels), "host XLA ops", device_threads


def leaves(events: list[dict]) -> list[dict]:
    """The events that hold no other on their thread: a host's conditional or loop thunk spans
    the thunks it runs, which are counted themselves."""
    parents = set()
    by_thread: dict = {}
    for i, e in enumerate(events):
        by_thread.setdefault((e.get("pid"), e.get("tid")), []).append(i)
    for idx in by_thread.values():
        stack: list[int] = []
        for i in sorted(idx, key=lambda i: (float(events[i]["ts"]), -float(events[i]["dur"]))):
            start = float(events[i]["ts"])
            while stack and _end(events[stack[-1]]) <= start:
                stack.pop()
            if stack:
                parents.add(stack[-1])
            stack.append(i)
    return [e for i, e in enumerate(events) if i not in parents]


def _end(e: dict) -> float:
    return float(e["ts"]) + float(e["dur"])


def kernel_name(event_name: str) -> str:
    """An event's kernel: its name less the instance numbers at its end."""
    return _INSTANCE.sub("", event_name) or event_name


_INSTANCE = re.compile(r"([._]\d+)+$")


def kernel_table(kernels: list[dict]) -> list[dict]:
    """One row per kernel, the longest total first."""
    total = sum(float(e["dur"]) for e in kernels) or 1.0
    rows: dict[str, dict] = {}
    for e in kernels:
        name = kernel_name(e["name"])
        row = rows.setdefault(name, {"kernel": name, "count": 0, "total_us": 0.0, "hlo_ops": []})
        row["count"] += 1
        row["total_us"] += float(e["dur"])
        op = (e.get("args") or {}).get("hlo_op")
        if op and op not in row["hlo_ops"] and len(row["hlo_ops"]) < 3:
            row["hlo_ops"].append(op)
    out = sorted(rows.values(), key=lambda r: -r["total_us"])
    for r in out:
        r["mean_us"] = round(r["total_us"] / r["count"], 3)
        r["share"] = round(r["total_us"] / total, 4)
        r["total_us"] = round(r["total_us"], 3)
    return out


def summarize(path: str | pathlib.Path, label: str) -> dict:
    """The per-kernel table of the trace at `path` (a file or a directory holding one)."""
    trace = find_trace(path)
    kernels, source, device_threads = kernel_events(load_events(trace))
    starts = [float(e["ts"]) for e in kernels]
    ends = [float(e["ts"]) + float(e["dur"]) for e in kernels]
    return {
        "label": label,
        "trace": trace.name,
        "source": source,
        "device_threads": device_threads,
        "kernel_events": len(kernels),
        "distinct_kernels": len({kernel_name(e["name"]) for e in kernels}),
        "kernel_us": round(sum(float(e["dur"]) for e in kernels), 3),
        "span_us": round(max(ends) - min(starts), 3) if kernels else 0.0,
        "rows": kernel_table(kernels),
    }


def markdown(tables: list[dict], top: int) -> str:
    out = []
    for t in tables:
        if t.get("error"):
            out += [f"### {t['label']}", "", f"no table: {t['error']}", ""]
            continue
        out += [f"### {t['label']}", "",
                f"{t['kernel_events']} kernel events, {t['distinct_kernels']} distinct, "
                f"{t['kernel_us']:.1f} µs of kernels over a span of {t['span_us']:.1f} µs "
                f"({t['source']}; {t['trace']})", "",
                "| kernel | count | total µs | mean µs | share | HLO ops |",
                "| --- | ---: | ---: | ---: | ---: | --- |"]
        for r in t["rows"][:top]:
            name = r["kernel"] if len(r["kernel"]) <= 80 else r["kernel"][:77] + "..."
            out.append(f"| `{name}` | {r['count']} | {r['total_us']:.1f} | {r['mean_us']:.2f} | "
                       f"{100 * r['share']:.1f} % | {', '.join(r['hlo_ops'])} |")
        rest = t["rows"][top:]
        if rest:
            out.append(f"| ({len(rest)} others) | {sum(r['count'] for r in rest)} | "
                       f"{sum(r['total_us'] for r in rest):.1f} | | "
                       f"{100 * sum(r['share'] for r in rest):.1f} % | |")
        out.append("")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("traces", nargs="+", metavar="LABEL=PATH",
                   help="a label and a trace file or a directory holding one")
    p.add_argument("--json", default=None, help="append one JSON line per trace here")
    p.add_argument("--markdown", default=None, help="write the tables here")
    p.add_argument("--top", type=int, default=25, help="kernels a markdown table lists")
    args = p.parse_args(argv)
    tables = []
    for item in args.traces:
        label, sep, path = item.partition("=")
        if not sep:
            label, path = pathlib.Path(item).name, item
        try:
            tables.append(summarize(path, label))
        except (FileNotFoundError, ValueError, KeyError) as e:  # the other traces still count
            tables.append({"label": label, "error": f"{type(e).__name__}: {e}", "kernel_events": 0,
                           "rows": []})
    if args.json:
        append_results(args.json, tables)
    text = markdown(tables, args.top)
    if args.markdown:
        pathlib.Path(args.markdown).write_text(text)
    print(text)
    return 0 if all(t["kernel_events"] for t in tables) else 1


if __name__ == "__main__":
    sys.exit(main())
