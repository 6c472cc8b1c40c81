"""The reports of `jaxserve shard-plan`: a table on stdout, a markdown report, a PNG plot."""

from __future__ import annotations

import datetime
import importlib.metadata
import pathlib
import subprocess

_COLS = [("target", 14), ("mesh", 5), ("rules", 18), ("bucket", 8), ("params/dev", 10), ("kv/dev", 10),
         ("kv tokens", 10), ("peak/dev", 10), ("fits", 5), ("coll/step", 10), ("coll MiB", 9),
         ("GFLOP", 8), ("compile s", 9), ("decode ms", 9), ("prefill ms", 10)]


def _version(pkg: str) -> str | None:
    try:
        return importlib.metadata.version(pkg)
    except importlib.metadata.PackageNotFoundError:
        return None


def git_sha() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=5,
                             cwd=pathlib.Path(__file__).parent)
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def target_name(target: dict) -> str:
    if target["kind"] in ("tpu", "gpu"):
        return target["topology"]
    if target["kind"] == "cpu":
        hosts = target.get("hosts", 1)
        return f"cpu x{target['devices']}" + (f" over {hosts} processes" if hosts > 1 else "")
    return "real"


def run_header(name: str, arch: dict, jobs: list[dict]) -> dict:
    return {
        "tool": "shard-plan", "time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "git_sha": git_sha(),
        "versions": {p: _version(p)
                     for p in ("jax", "jaxlib", "flax", "libtpu", "jax-cuda12-plugin")},
        "model": name,
        "arch": {k: arch.get(k) for k in ("architectures", "num_hidden_layers", "hidden_size", "num_attention_heads",
                                          "num_key_value_heads", "head_dim", "intermediate_size", "vocab_size",
                                          "num_local_experts", "num_experts")
                 if arch.get(k) is not None},
        "max_model_len": jobs[0]["settings"]["max_model_len"] if jobs else None,
        "max_num_seqs": jobs[0]["settings"]["max_num_seqs"] if jobs else None,
    }


def mib(x) -> str:
    return "-" if x is None else f"{x / 2**20:.1f}M" if x < 2**30 else f"{x / 2**30:.2f}G"


def _cells(rec: dict) -> list[str]:
    mem = rec.get("memory") or {}
    coll = rec.get("collectives") or {}
    meas = rec.get("measure") or {}
    fits = mem.get("fits")
    if rec.get("error") and not mem:
        fits_cell = "ERR"
    else:
        fits_cell = "-" if fits is None else "yes" if fits else "NO"
    kv = rec.get("kv") or {}
    flops = (rec.get("cost") or {}).get("flops")
    return [str(rec.get("target", "")), rec.get("mesh", ""), str(rec.get("rules", "")),
            "x".join(map(str, rec.get("bucket", []))), mib((rec.get("params") or {}).get("per_device")),
            mib(kv.get("per_device")), str(kv.get("tokens", "-")), mib(mem.get("peak")), fits_cell,
            str(coll.get("count", "-")), "-" if not coll else f"{coll.get('bytes', 0) / 2**20:.2f}",
            "-" if flops is None else f"{flops / 1e9:.2f}", str(rec.get("compile_s", "-")),
            str(meas.get("decode_ms", "-")), str(meas.get("prefill_ms", "-"))]


def table_header() -> str:
    return "  ".join(name.ljust(w) for name, w in _COLS)


def table_row(rec: dict) -> str:
    row = "  ".join(c.ljust(w) for c, (_, w) in zip(_cells(rec), _COLS))
    if rec.get("error"):
        row += f"\n    error: {rec['error'].splitlines()[0][:200]}"
    elif (rec.get("memory") or {}).get("compiler"):
        row += f"\n    compiler: {rec['memory']['compiler'][:200]}"
    return row


def footer(records: list[dict], seconds: float) -> str:
    return f"{len(records)} configurations in {seconds:.0f}s"


def _collective_text(coll: dict) -> str:
    parts = [f"{k} {v['count']} ({v['bytes'] / 2**20:.2f} MiB, groups {','.join(map(str, v['group_sizes']))})"
             for k, v in (coll.get("total") or {}).items()]
    return "; ".join(parts) or "none"


def markdown(records: list[dict], header: dict, args) -> str:
    arch = header["arch"]
    lines = [
        f"# shard-plan: {header['model']}",
        "",
        f"- model: {header['model']} ({', '.join(arch.get('architectures', []))}: {arch.get('num_hidden_layers')} layers, "
        f"hidden {arch.get('hidden_size')}, {arch.get('num_attention_heads')} query / "
        f"{arch.get('num_key_value_heads')} KV heads, vocab {arch.get('vocab_size')})",
        f"- max_model_len {header['max_model_len']}, KV cache sized for {header['max_num_seqs']} sequences"
        + (f" (or {mib(args.kv_cache_memory_bytes)} per device)" if args.kv_cache_memory_bytes else ""),
        f"- jax {header['versions'].get('jax')}, libtpu {header['versions'].get('libtpu') or '-'}, "
        f"jax-cuda12-plugin {header['versions'].get('jax-cuda12-plugin') or '-'}, "
        f"git {header['git_sha']}, {header['time']}",
        "- per device: params, KV cache, peak = XLA's memory analysis of the compiled step (arguments + outputs "
        "- aliased + temporaries + code); coll/step: collective ops in the step's HLO and their result bytes",
        "",
        "| " + " | ".join(name for name, _ in _COLS) + " |",
        "|" + "---|" * len(_COLS),
    ]
    for rec in records:
        lines.append("| " + " | ".join(_cells(rec)) + " |")
    lines += ["", "## Details", ""]
    for rec in records:
        title = f"{rec.get('target')} {rec.get('mesh')} {rec.get('rules')} {'x'.join(map(str, rec.get('bucket', [])))}"
        lines.append(f"### {title}")
        if rec.get("error"):
            lines += ["", f"error: `{rec['error'].splitlines()[0][:300]}`", ""]
            continue
        p, kv = rec.get("params") or {}, rec.get("kv") or {}
        mem = rec.get("memory") or {}
        lines.append("")
        lines.append(f"- attention: {rec.get('attention_impl')}" + (f" ({rec['attention_note']})"
                                                                    if rec.get("attention_note") else "")
                     + f"; dtype {rec.get('dtype')}, KV {rec.get('kv_dtype')}")
        if rec.get("kernels"):
            lines.append("- kernels in the compiled step: "
                         + ", ".join(f"{k} x{n}" for k, n in rec["kernels"].items()))
        if p:
            groups = ", ".join(f"{g} {mib(v['per_device'])}"
                               + (f" (asked {mib(v['requested_per_device'])})"
                                  if v["requested_per_device"] < v["per_device"] else "")
                               for g, v in p["groups"].items())
            lines.append(f"- params per device: {mib(p['per_device'])} of {mib(p['total'])}: {groups}")
            if p.get("replicated"):
                lines.append(f"- replicated although the rules split them: {'; '.join(p['replicated'])}")
        if kv:
            lines.append(f"- KV: {kv['spec']}, {kv['bytes_per_page_per_device']} B per page per device, "
                         f"{kv['num_pages']} pages = {kv['tokens']} tokens ({kv['max_requests_at_max_len']} requests "
                         f"at max_model_len); {mib(kv['per_device'])} per device"
                         + (f" ({rec['kv_heads_note']}: the bytes include the zero heads)"
                            if rec.get("kv_heads_note") else ""))
        if mem:
            if mem.get("compiler"):
                lines.append(f"- memory: does not fit: `{mem['compiler'][:300]}`")
            else:
                lines.append(f"- memory: arguments {mib(mem['argument'])}, outputs {mib(mem['output'])}, "
                             f"aliased {mib(mem['alias'])}, temporaries {mib(mem['temp'])}, peak {mib(mem['peak'])}"
                             + (f" of {mib(mem['device_memory'])}: {'fits' if mem['fits'] else 'DOES NOT FIT'}"
                                if mem.get("device_memory") else ""))
        coll = rec.get("collectives")
        if coll:
            lines.append(f"- collectives per step: {_collective_text(coll)}")
            per_layer = ", ".join(f"{k} {v['count']:g}" for k, v in coll["per_layer"].items())
            other = ", ".join(f"{k} {v['count']}" for k, v in coll["other"].items())
            lines.append(f"  - per layer: {per_layer or 'none'}; outside the layers: {other or 'none'}")
        if rec.get("cost"):
            c = rec["cost"]
            accessed = (f"{c['bytes_accessed'] / 2**20:.1f} MiB accessed" if c.get("bytes_accessed")
                        else "bytes not analysed")
            source = c.get("source", "xla cost analysis")
            lines.append(f"- cost per device ({source}): {c['flops'] / 1e9:.2f} GFLOP, "
                         f"{accessed}; compiled in {rec.get('compile_s')} s")
        if rec.get("measure"):
            m = rec["measure"]
            lines.append(f"- measured: decode {m.get('decode_ms')} ms (context {m.get('context')}), "
                         f"prefill {m.get('prefill_ms')} ms (median of {m.get('steps')})")
        lines.append("")
    return "\n".join(lines)


def plot(records: list[dict], path: str) -> None:
    """Memory per device against collective bytes per step; step (or compile) time per mesh."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SystemExit("--plot needs matplotlib: pip install 'jaxserve[bench]'") from None
    ok = [r for r in records if not r.get("error") and r.get("memory") and r["memory"].get("peak") is not None]
    fig, (a, b) = plt.subplots(1, 2, figsize=(13, 5))
    for rec in ok:
        x = rec["collectives"]["bytes"] / 2**20
        y = rec["memory"]["peak"] / 2**20
        a.scatter(x, y, s=30)
        a.annotate(f"{rec['mesh']} {rec['rules']} {'x'.join(map(str, rec['bucket']))}", (x, y), fontsize=6,
                   xytext=(3, 3), textcoords="offset points")
    a.set_xlabel("collective bytes per step (MiB, result shapes)")
    a.set_ylabel("peak memory per device (MiB)")
    a.set_title("memory vs communication")
    measured = any(r.get("measure") for r in ok)
    key = "decode_ms" if measured else None
    labels, values = [], []
    for rec in ok:
        labels.append(f"{rec['mesh']}\n{rec['rules']}\n{'x'.join(map(str, rec['bucket']))}")
        values.append(rec["measure"].get(key) or 0 if measured else rec.get("compile_s", 0))
    b.bar(range(len(values)), values)
    b.set_xticks(range(len(values)), labels, fontsize=6)
    b.set_ylabel("decode step (ms, measured)" if measured else "compile time (s)")
    b.set_title("step time vs mesh shape" if measured else "compile time vs mesh shape")
    fig.suptitle(f"shard-plan: {ok[0]['model'] if ok else ''} on {ok[0]['target'] if ok else ''}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
