"""The KV-cache write's cost on TPUs, from XLA's cost analysis of programs compiled for a TPU
topology on this host (libtpu, compile-only: no TPU runs anything here, no time is measured).

Single layer (default): one layer's write of T new rows into K and V caches of N pages
(`write_kv` with impl "reference", XLA's scatter, and "tpu", the Pallas write kernel for
one-byte caches where XLA's scatter is not in place), the caches donated. For each (dtype,
Hkv, T): bytes accessed, the caches' bytes, the cache-sized copies in the optimized HLO, and
XLA's default layout of the cache. Also `words`: the one-byte write done as a 32-bit scatter on
a uint32 view of the cache (four rows of a lane a word, as the TPU packs them), for the record.

Whole step (`--whole-step`): `jaxserve shard-plan` of the Llama-3-8B step with an fp8 and a
bfloat16 cache on v6e (tp over 4 chips, bucket 64x64, 64 x 2,048 tokens, pages of 32), the
figures docs/serving.md's "Quantized KV cache" bullet quotes: KV bytes per chip and bytes accessed.
About 10 minutes a dtype on a 2-core host.

    ALLOW_MULTIPLE_LIBTPU_LOAD=1 .venv/bin/python benchmarks/kv_write_cost.py
    ALLOW_MULTIPLE_LIBTPU_LOAD=1 .venv/bin/python benchmarks/kv_write_cost.py --whole-step
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import platform
import re
import subprocess
import sys
import tempfile

from results_log import append_results

HERE = pathlib.Path(__file__).parent
REPO = HERE.parent
RESULTS = HERE / "results" / "kv_write_cost.jsonl"


def _cpu_model() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _meta() -> dict:
    sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                         text=True).stdout.strip()
    dirty = bool(subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                                cwd=REPO, capture_output=True, text=True).stdout.strip())
    import jax

    try:
        from importlib.metadata import version

        libtpu = version("libtpu")
    except Exception:  # noqa: BLE001 - not installed
        libtpu = None
    return {"time": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "git_sha": sha, "git_dirty": dirty, "jax": jax.__version__, "libtpu": libtpu,
            "host": {"cpu": _cpu_model(), "cpus": os.cpu_count()},
            "loadavg": [round(x, 2) for x in os.getloadavg()], "compile_only": True}


def _words_write(k_cache, v_cache, k, v, slot_mapping):
    """The one-byte write as a read-modify-write of 32-bit words on a uint32 view in which a word
    holds four rows of one lane (the TPU's packing): Option B, for comparison."""
    import jax.numpy as jnp
    from jax import lax

    n, ps, row = k_cache.shape  # [N, page_size, Hkv * D]

    def one(cache, new):
        words = lax.bitcast_convert_type(
            cache.reshape(n, ps // 4, 4, row).transpose(0, 1, 3, 2), jnp.uint32)
        s = slot_mapping
        page, group, byte = s // ps, (s % ps) // 4, (s % 4).astype(jnp.uint32)
        old = words[page, group]
        b = lax.bitcast_convert_type(new.astype(cache.dtype).reshape(-1, row), jnp.uint8)
        sh = (8 * byte)[:, None]
        upd = (old & ~(jnp.uint32(0xFF) << sh)) | (b.astype(jnp.uint32) << sh)
        words = words.at[page, group].set(upd, mode="drop")
        back = lax.bitcast_convert_type(words, cache.dtype)  # [n, ps/4, hd, 4]
        return back.transpose(0, 1, 3, 2).reshape(n, ps, row)

    return one(k_cache, k), one(v_cache, v)


def single_layer(topology: str, pages: int, page_size: int, tokens: list[int], heads: list[int],
                 dtypes: list[str]) -> list[dict]:
    import jax
    import jax.numpy as jnp
    from jax.sharding import SingleDeviceSharding
    from jaxserve.pallas_kernels import write_kv

    from jaxserve.tools.plan_worker import target_devices

    devices, kind, _ = target_devices({"kind": "tpu", "topology": topology})
    sharding = SingleDeviceSharding(devices[0])
    out = []
    for dtype_name in dtypes:
        dtype = jnp.dtype(dtype_name)
        for hkv in heads:
            impls = ["reference"] + (["tpu", "words"] if dtype.itemsize == 1 else [])
            for t in tokens:
                for impl in impls:
                    shape = (pages, page_size, hkv * 128)  # the server's cache layout

                    def sd(s, dt=dtype):
                        return jax.ShapeDtypeStruct(s, dt, sharding=sharding)

                    fn = _words_write if impl == "words" else (
                        lambda *a, impl=impl: write_kv(*a, impl=impl))
                    compiled = jax.jit(fn, donate_argnums=(0, 1)).lower(
                        sd(shape), sd(shape), sd((t, hkv, 128)), sd((t, hkv, 128)),
                        sd((t,), jnp.int32)).compile()
                    hlo = compiled.as_text()
                    layout = re.search(r"entry_computation_layout=\{\(\S+?\{([^}]*)\}", hlo)
                    copies = sum(1 for ln in hlo.splitlines()
                                 if re.search(rf"= \S+\[{pages},[^=]* copy\(", ln))
                    caches = 2 * pages * page_size * hkv * 128 * dtype.itemsize
                    accessed = compiled.cost_analysis().get("bytes accessed")
                    rec = {"benchmark": "kv_write_cost", "kind": "single_layer",
                           "topology": topology, "device_kind": kind, "dtype": dtype_name,
                           "pages": pages, "page_size": page_size, "num_kv_heads": hkv,
                           "head_dim": 128, "tokens": t, "impl": impl,
                           "cache_layout": layout.group(1) if layout else None,
                           "bytes_accessed": accessed, "caches_bytes": caches,
                           "accessed_over_caches": accessed / caches,
                           "new_bytes": 2 * t * hkv * 128 * dtype.itemsize,
                           "cache_copies": copies, "uses_kernel": "tpu_custom_call" in hlo}
                    out.append(rec)
                    print(f"{topology} {dtype_name:14s} Hkv={hkv} T={t:4d} {impl:9s} "
                          f"{accessed / 1e6:10.3f} MB accessed ({rec['accessed_over_caches']:.4f} "
                          f"of the caches), copies {copies}, layout {rec['cache_layout']}",
                          flush=True)
    return out


def whole_step(topology: str, kv_dtypes: list[str]) -> list[dict]:
    out = []
    for kv in kv_dtypes:
        with tempfile.TemporaryDirectory() as tmp:
            jl = pathlib.Path(tmp) / "plan.jsonl"
            cmd = [sys.executable, "-m", "jaxserve.server.cli", "shard-plan", "llama3-8b",
                   "--topology", topology, "--mesh", "1x4", "--rules", "tp", "--buckets", "64x64",
                   "--max-model-len", "2048", "--max-num-seqs", "64", "--block-size", "32",
                   "--kv-cache-dtype", kv, "--json", str(jl)]
            proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
            if proc.returncode or not jl.exists():
                raise RuntimeError(f"shard-plan failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
            plan = json.loads(jl.read_text().splitlines()[-1])
        rec = {"benchmark": "kv_write_cost", "kind": "whole_step",
               "command": "jaxserve " + " ".join(cmd[3:-2]),  # without the temporary --json
               "topology": topology, "device_kind": plan["device_kind"], "kv_dtype": kv,
               "attention_impl": plan["attention_impl"], "kv_per_device": plan["kv"]["per_device"],
               "bytes_accessed": plan["cost"]["bytes_accessed"], "flops": plan["cost"]["flops"],
               "peak_per_device": plan["memory"]["peak"], "compile_s": plan["compile_s"]}
        out.append(rec)
        print(f"{topology} Llama-3-8B step, KV {kv}: KV {rec['kv_per_device'] / 2**30:.2f} GiB a "
              f"chip, {rec['bytes_accessed'] / 1e9:.1f} GB accessed", flush=True)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--topology", default="v6e:2x2")
    p.add_argument("--pages", type=int, default=4097)
    p.add_argument("--page-size", type=int, default=32)
    p.add_argument("--tokens", default="8,64,512")
    p.add_argument("--heads", default="2,8", help="KV heads per chip")
    p.add_argument("--dtypes", default="bfloat16,float8_e4m3fn,int8")
    p.add_argument("--whole-step", action="store_true", help="also the Llama-3-8B step (slow)")
    p.add_argument("--note", default="", help="what else ran on the host meanwhile")
    p.add_argument("--out", default=str(RESULTS))
    a = p.parse_args()
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    meta = {**_meta(), "note": a.note}
    recs = single_layer(a.topology, a.pages, a.page_size, [int(x) for x in a.tokens.split(",")],
                        [int(x) for x in a.heads.split(",")], a.dtypes.split(","))
    if a.whole_step:
        recs += whole_step(a.topology, ["fp8", "bfloat16"])
    loadavg_after = [round(x, 2) for x in os.getloadavg()]
    append_results(a.out, [{**rec, **meta, "loadavg_after": loadavg_after} for rec in recs])
    return 0


if __name__ == "__main__":
    sys.exit(main())
