"""Compile the GPU attention kernels for H100 and H200 on this host (no GPU) and report what the
compilers decided: does it compile, and with how many registers, spills, bytes of shared memory
and threads per block; the grid; how many blocks fit on one SM; XLA's memory analysis of the
call. One JSON line per (chip, shape, bucket, kernel, page dtype, block sizes), with a `kernels`
list: one entry per GPU kernel the call launches (the Mosaic GPU op launches two, its decode
and its prefill kernel).

The kernels: "gpu" (Pallas Triton, `gpu.py`) and "gpu-mosaic" (Pallas Mosaic GPU,
`gpu_mosaic.py`), through the op's own entry point, with the block sizes of the chip's entry in
`gpu_blocks.py` (`--sweep`: others too); `--baseline REV` adds the Mosaic GPU kernel as it was
at a git revision (before/after on the same host and versions). The shapes are the per-device
attention of served models: Llama-3-8B on one GPU and over 8 (tensor parallel), Llama-3-70B
over 8, SmolLM2 on one; buckets: 64 decode requests, and a 2,048-token prefill over 8
requests; pages of 16 tokens (bfloat16, or `--cache-dtypes float8_e4m3fn`), 2,048-token
contexts.

Where the figures come from: each compile runs in its own process with XLA's dump (the Triton
kernel's PTX, assembled again with `ptxas -v` for its registers and spills; XLA's thunk
sequence for its grid, threads and shared memory) and Mosaic GPU's ptxas report
(MOSAIC_GPU_DUMP_PTXAS, printed when the plugin assembles it); Mosaic GPU's grid, threads and
dynamic shared memory are what its launch asks for (read where `jax.experimental.mosaic.gpu`
builds the launch). Blocks per SM: the fewest that registers (allocated 8 a thread), shared
memory (+1 KiB reserved a block) and threads allow. Nothing runs on a GPU: speed is not
measured here (benchmarks/kernel_benchmark.py does that on a device).

    python benchmarks/gpu_kernel_compile.py                 # needs: make install-gpu-compile
    python benchmarks/gpu_kernel_compile.py --chips h100 --kernels gpu
    python benchmarks/gpu_kernel_compile.py --chips h100 --buckets decode-64 \
        --kernels gpu-mosaic --cache-dtypes bfloat16 float8_e4m3fn --sweep --baseline f32aada
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import platform
import os
import pathlib
import re
import subprocess
import sys
import tempfile
import time

from results_log import append_results

RESULTS = pathlib.Path(__file__).parent / "results" / "gpu_kernel_compile.jsonl"
SHAPES = {  # name: (query heads, KV heads, head dim) on one device
    "llama3-8b-tp1": (32, 8, 128),
    "llama3-8b-tp8": (4, 1, 128),
    "llama3-70b-tp8": (8, 1, 128),
    "smollm2-tp1": (9, 3, 64),
}
BUCKETS = {"decode-64": (64, 64), "prefill-2048": (2048, 8)}
PAGE, CONTEXT = 16, 2048
REGISTERS_PER_SM, SMEM_PER_SM, MAX_THREADS_PER_SM, MAX_BLOCKS_PER_SM = 65536, 233472, 2048, 32


def _baseline_module(rev: str):
    """The Mosaic GPU kernel module as it was at git revision `rev` (its file, loaded beside
    today's: it imports today's `blocks.py`, whose functions keep their old signatures)."""
    import importlib.util

    text = subprocess.run(
        ["git", "show", f"{rev}:pallas_kernels/ragged_paged_attention/gpu_mosaic.py"],
        capture_output=True, text=True, check=True, cwd=pathlib.Path(__file__).parents[1],
    ).stdout
    path = pathlib.Path(tempfile.mkdtemp()) / f"gpu_mosaic_{rev}.py"
    path.write_text(text)
    spec = importlib.util.spec_from_file_location(f"gpu_mosaic_{rev}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def worker(chip: str, shape: str, bucket: str, kernel: str, cache_dtype: str,
           knobs_json: str) -> dict:
    """In a fresh process: compile one case and print its record (the parent reads the dumps)."""
    import jax
    import jax.experimental.mosaic.gpu.core as mgpu_core
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P
    from jaxserve.pallas_kernels import AttentionMetadata, ragged_paged_attention
    from jaxserve.pallas_kernels.ragged_paged_attention import gpu_blocks, gpu_mosaic, ops

    from jaxserve.tools.chips import gpu_devices

    launches = []  # evidence only: what Mosaic GPU's launch asks for, kernel by kernel
    launch, lower = mgpu_core._launch, mgpu_core._lower_as_gpu_kernel
    lowering = []  # the kernel being lowered

    def recording_launch(token, grid, cluster, block, smem_buffers, *args, **kwargs):
        launches.append({"kernel_name": lowering[-1] if lowering else None,
                         "grid": list(grid), "threads": int(np.prod(block)),
                         "smem_bytes": mgpu_core._smem_tree_size(smem_buffers)})
        return launch(token, grid, cluster, block, smem_buffers, *args, **kwargs)

    def naming_lower(*args, **kwargs):
        lowering.append(kwargs.get("kernel_name", args[10] if len(args) > 10 else None))
        try:
            return lower(*args, **kwargs)
        finally:
            lowering.pop()

    mgpu_core._launch = recording_launch
    mgpu_core._lower_as_gpu_kernel = naming_lower
    knobs = json.loads(knobs_json)
    if "@" in kernel:  # "gpu-mosaic@REV": that revision's kernel
        ops.register_impl(kernel, _baseline_module(kernel.split("@")[1])
                          .ragged_paged_attention_gpu_mosaic)
    impl_fn = None
    if knobs:  # the Mosaic GPU kernel's block sizes, past the table
        impl_fn = functools.partial(gpu_mosaic.ragged_paged_attention_gpu_mosaic, **knobs)

    devices = gpu_devices({"kind": "gpu", "chip": chip, "hosts": 1, "gpus_per_host": 1})
    mesh = Mesh(np.array(devices).reshape(1, 1), ("data", "model"))
    hq, hkv, d = SHAPES[shape]
    T, R = BUCKETS[bucket]
    pages_per_req = CONTEXT // PAGE
    N = R * pages_per_req + 1

    def sd(s, dt):
        return jax.ShapeDtypeStruct(s, dt, sharding=NamedSharding(mesh, P()))

    md = AttentionMetadata(
        block_tables=sd((R, pages_per_req), jnp.int32),
        kv_lens=sd((R,), jnp.int32),
        query_start_loc=sd((R + 1,), jnp.int32),
        num_seqs=sd((), jnp.int32),
        slot_mapping=sd((T,), jnp.int32),
    )

    def attend(q, k, v, md):
        if impl_fn is not None:
            return impl_fn(q, k, v, md, sm_scale=d**-0.5)
        return ragged_paged_attention(q, k, v, md, sm_scale=d**-0.5, impl=kernel)

    rec: dict = {}
    t0 = time.perf_counter()
    try:
        with gpu_blocks.target_chip(chip):  # the chip's entry of the block-size table
            compiled = jax.jit(attend).lower(
                sd((T, hq, d), jnp.bfloat16),
                sd((N, PAGE, hkv, d), jnp.dtype(cache_dtype)),
                sd((N, PAGE, hkv, d), jnp.dtype(cache_dtype)),
                md,
            ).compile()
    except Exception as e:  # a refusal is a result
        rec["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
        return rec
    rec["compile_s"] = round(time.perf_counter() - t0, 2)
    m = compiled.memory_analysis()
    rec["temp_bytes"] = int(m.temp_size_in_bytes)
    rec["argument_bytes"] = int(m.argument_size_in_bytes)
    if launches:
        rec["launches"] = launches
    return rec


def _ptxas() -> str:
    import nvidia.cuda_nvcc

    return str(pathlib.Path(nvidia.cuda_nvcc.__path__[0]) / "bin" / "ptxas")


def _ptxas_report(text: str) -> dict:
    out = {}
    m = re.search(r"Used (\d+) registers", text)
    if m:
        out["registers"] = int(m.group(1))
    m = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", text)
    if m:
        out["spill_bytes"] = int(m.group(1)) + int(m.group(2))
    return out


def _ptxas_entries(text: str) -> list[dict]:
    """Each 'Compiling entry function' block of a ptxas -v report: name, registers, spills."""
    out = []
    for block in re.split(r"Compiling entry function ", text)[1:]:
        name = re.match(r"'([^']+)'", block)
        rec = {"name": name.group(1) if name else "?", **_ptxas_report(block)}
        out.append(rec)
    return out


def _occupancy(entry: dict) -> None:
    if entry.get("registers") and entry.get("threads") and "smem_bytes" in entry:
        regs = -(-entry["registers"] // 8) * 8  # allocated by 8 a thread
        by_regs = REGISTERS_PER_SM // (regs * entry["threads"])
        by_smem = (SMEM_PER_SM // (entry["smem_bytes"] + 1024) if entry["smem_bytes"]
                   else MAX_BLOCKS_PER_SM)
        entry["blocks_per_sm"] = min(by_regs, by_smem, MAX_THREADS_PER_SM // entry["threads"],
                                     MAX_BLOCKS_PER_SM)
        entry["warps_per_sm"] = entry["blocks_per_sm"] * entry["threads"] // 32


def run_case(chip: str, shape: str, bucket: str, kernel: str, cache_dtype: str = "bfloat16",
             knobs: dict | None = None) -> dict:
    with tempfile.TemporaryDirectory() as dump:
        env = {
            **os.environ,
            "JAX_PLATFORMS": "cpu",
            "XLA_FLAGS": f"--xla_dump_to={dump}",
            "MOSAIC_GPU_DUMP_PTXAS": "1",
        }
        proc = subprocess.run(
            [sys.executable, __file__, "--worker", chip, shape, bucket, kernel, cache_dtype,
             json.dumps(knobs or {})],
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
            check=False,
        )
        lines = [x for x in proc.stdout.splitlines() if x.startswith("@@record ")]
        rec = (
            json.loads(lines[-1][len("@@record ") :])
            if lines
            else {
                "error": f"worker exited {proc.returncode}: {proc.stderr.strip().splitlines()[-1:]}"
            }
        )
        if "error" in rec:
            return rec
        entries = []
        if kernel.startswith("gpu-mosaic"):
            # ptxas names the entry `<kernel_name>_mosaic_gpu_kernel`
            launches = rec.pop("launches", [])
            for entry in _ptxas_entries(proc.stdout + proc.stderr):
                launch = next((x for x in launches if x["kernel_name"] and entry["name"]
                               .startswith(x["kernel_name"] + "_mosaic_gpu")), {})
                entries.append({**entry, **{k: v for k, v in launch.items()
                                            if k != "kernel_name"}})
        else:
            entry = {"name": "ragged_paged_attention_gpu"}
            for ptx in pathlib.Path(dump).glob("*.ptx"):
                if ".entry ragged_paged_attention_gpu" in ptx.read_text():
                    rep = subprocess.run(
                        [_ptxas(), "-arch=sm_90a", "-v", str(ptx), "-o", os.devnull],
                        capture_output=True,
                        text=True,
                        check=False,
                    )
                    entry.update(_ptxas_report(rep.stdout + rep.stderr))
            for seq in pathlib.Path(dump).glob("*thunk_sequence.txt"):
                m = re.search(
                    r"ragged_paged_attention_gpu grid: \[(\d+), (\d+), (\d+)\] "
                    r"threads: \[(\d+), 1, 1\]\s+shared_memory: (\d+) bytes",
                    seq.read_text(),
                )
                if m:
                    entry["grid"] = [int(m.group(i)) for i in (1, 2, 3)]
                    entry["threads"], entry["smem_bytes"] = int(m.group(4)), int(m.group(5))
            entries.append(entry)
    for entry in entries:
        _occupancy(entry)
    rec["kernels"] = entries
    return rec


def _variants(args) -> list[tuple[str, str, dict]]:
    """(kernel, cache dtype, knobs) to compile for each (chip, shape, bucket)."""
    out = []
    for kernel in args.kernels:
        for cache in args.cache_dtypes:
            if cache != "bfloat16" and kernel != "gpu-mosaic":
                continue  # one-byte pages: today's kernel only (the Triton one reads them too)
            out.append((kernel, cache, {}))
            if args.sweep and kernel == "gpu-mosaic":
                for slots in (2, 3, 4):
                    for keys in (64, 128):
                        out.append((kernel, cache, {"decode_slots": slots, "chunk_keys": keys}))
    for rev in args.baseline or ():
        out.append((f"gpu-mosaic@{rev}", "bfloat16", {}))
    return out


def _row(rec: dict, entry: dict) -> str:
    name = entry.get("name", "")
    part = next((p for p in ("decode", "prefill") if p in name), "-")
    smem = entry.get("smem_bytes")
    knobs = ",".join(f"{k.split('_')[0]}{v}" for k, v in rec.get("knobs", {}).items()) or "-"
    return (
        f"{rec['chip']:5} {rec['shape']:15} {rec['bucket']:13} {rec['kernel']:18} "
        f"{rec['cache_dtype'][:6]:6} {knobs:14} {part:7} {entry.get('registers', '-'):>4} "
        f"{entry.get('spill_bytes', '-'):>5} {'-' if smem is None else f'{smem / 1024:.1f}':>7} "
        f"{entry.get('threads', '-'):>4} {entry.get('blocks_per_sm', '-'):>6} "
        f"{entry.get('warps_per_sm', '-'):>5} {rec['temp_bytes'] / 2**20:>7.1f} "
        f"{rec['compile_s']:>9}"
    )


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        print("@@record " + json.dumps(worker(*sys.argv[2:8])), flush=True)
        return 0
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--chips", nargs="+", default=["h100", "h200"])
    p.add_argument("--shapes", nargs="+", default=list(SHAPES))
    p.add_argument("--buckets", nargs="+", default=list(BUCKETS))
    p.add_argument("--kernels", nargs="+", default=["gpu", "gpu-mosaic"])
    p.add_argument("--cache-dtypes", nargs="+", default=["bfloat16"],
                   help="page dtypes (float8_e4m3fn, int8: the Mosaic GPU kernel)")
    p.add_argument("--baseline", nargs="*", metavar="REV",
                   help="also compile the Mosaic GPU kernel as it was at these git revisions")
    p.add_argument("--sweep", action="store_true",
                   help="the Mosaic GPU kernel's block sizes: decode slots 2-4 x chunks of 64 "
                        "and 128 keys, besides the table's")
    p.add_argument("--out", default=str(RESULTS))
    args = p.parse_args()
    import importlib.metadata

    import jax
    import jaxlib

    sha = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False
    ).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", "*.py"],
                           capture_output=True, text=True, check=False).stdout.strip()  # code
    head = {
        "bench": "gpu_kernel_compile",
        "git_sha": sha + ("+dirty" if dirty else ""),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "host": platform.node(),
        "cpus": os.cpu_count(),
        "jax": jax.__version__,
        "jaxlib": jaxlib.__version__,
        "plugin": importlib.metadata.version("jax-cuda12-plugin"),
        "ptxas": importlib.metadata.version("nvidia-cuda-nvcc-cu12"),
        "page_size": PAGE,
        "context": CONTEXT,
    }
    print(
        f"{'chip':5} {'shape':15} {'bucket':13} {'kernel':18} {'cache':6} {'knobs':14} "
        f"{'part':7} {'regs':>4} {'spill':>5} {'smem KB':>7} {'thr':>4} {'blk/SM':>6} "
        f"{'warps':>5} {'temp MB':>7} {'compile s':>9}"
    )
    # each line is appended as soon as its case is compiled
    for chip in args.chips:
        for shape in args.shapes:
            for bucket in args.buckets:
                for kernel, cache, knobs in _variants(args):
                    rec = {
                        **head,
                        "chip": chip,
                        "shape": shape,
                        "bucket": bucket,
                        "kernel": kernel,
                        "cache_dtype": cache,
                        "knobs": knobs,
                        **run_case(chip, shape, bucket, kernel, cache, knobs),
                    }
                    append_results(args.out, rec)
                    if "error" in rec:
                        print(
                            f"{chip:5} {shape:15} {bucket:13} {kernel:18} {cache[:6]:6} "
                            f"error: {rec['error'][:120]}", flush=True
                        )
                        continue
                    for entry in rec["kernels"]:
                        print(_row(rec, entry), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
