"""Compile the GPU attention kernels for H100 and H200 on this host (no GPU) and report what the
compilers decided: does it compile, and with how many registers, spills, bytes of shared memory
and threads per block; the grid; how many blocks fit on one SM; XLA's memory analysis of the
call. One JSON line per (chip, shape, bucket, kernel).

The kernels: "gpu" (Pallas Triton, `gpu.py`) and "gpu-mosaic" (Pallas Mosaic GPU,
`gpu_mosaic.py`), through the op's own entry point. The shapes are the per-device attention of
served models: Llama-3-8B on one GPU and over 8 (tensor parallel), Llama-3-70B over 8, SmolLM2
on one; buckets: 64 decode requests, and a 2,048-token prefill over 8 requests; bfloat16 pages
of 16 tokens, 2,048-token contexts.

Where the figures come from: each compile runs in its own process with XLA's dump (the Triton
kernel's PTX, assembled again with `ptxas -v` for its registers and spills; XLA's thunk
sequence for its grid, threads and shared memory) and Mosaic GPU's ptxas report
(MOSAIC_GPU_DUMP_PTXAS, printed when the plugin assembles it); Mosaic GPU's dynamic shared
memory is the size its launch computes (read where `jax.experimental.mosaic.gpu` adds it up).
Nothing runs on a GPU: speed is not measured here (benchmarks/kernel_benchmark.py does that on
a device).

    python benchmarks/gpu_kernel_compile.py                 # needs: make install-gpu-compile
    python benchmarks/gpu_kernel_compile.py --chips h100 --kernels gpu
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import re
import subprocess
import sys
import tempfile
import time

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


def worker(chip: str, shape: str, bucket: str, kernel: str) -> dict:
    """In a fresh process: compile one case and print its record (the parent reads the dumps)."""
    import jax
    import jax.experimental.mosaic.gpu.core as mgpu_core
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P
    from jaxserve.pallas_kernels import AttentionMetadata, ragged_paged_attention

    from jaxserve.tools.chips import gpu_devices

    smem = []
    size_of = mgpu_core._smem_tree_size  # evidence only: the size Mosaic GPU's launch requests
    mgpu_core._smem_tree_size = lambda tree: smem.append(size_of(tree)) or smem[-1]

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
    f = jax.jit(
        lambda q, k, v, md: ragged_paged_attention(q, k, v, md, sm_scale=d**-0.5, impl=kernel)
    )
    rec: dict = {}
    t0 = time.perf_counter()
    try:
        compiled = f.lower(
            sd((T, hq, d), jnp.bfloat16),
            sd((N, PAGE, hkv, d), jnp.bfloat16),
            sd((N, PAGE, hkv, d), jnp.bfloat16),
            md,
        ).compile()
    except Exception as e:  # a refusal is a result
        rec["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
        return rec
    rec["compile_s"] = round(time.perf_counter() - t0, 2)
    m = compiled.memory_analysis()
    rec["temp_bytes"] = int(m.temp_size_in_bytes)
    rec["argument_bytes"] = int(m.argument_size_in_bytes)
    if smem:
        from jaxserve.pallas_kernels.ragged_paged_attention import blocks, gpu_mosaic

        rec["smem_bytes"] = smem[-1]
        bq = gpu_mosaic.ROWS // blocks.pow2_ceil(hq // hkv)  # the kernel's grid, as it plans it
        rec["grid"] = [blocks.cdiv(T, bq) + R, hkv, 1 if T > 4 * R else 4]
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


def run_case(chip: str, shape: str, bucket: str, kernel: str) -> dict:
    with tempfile.TemporaryDirectory() as dump:
        env = {
            **os.environ,
            "JAX_PLATFORMS": "cpu",
            "XLA_FLAGS": f"--xla_dump_to={dump}",
            "MOSAIC_GPU_DUMP_PTXAS": "1",
        }
        proc = subprocess.run(
            [sys.executable, __file__, "--worker", chip, shape, bucket, kernel],
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
        if kernel == "gpu-mosaic":
            rec.update(_ptxas_report(proc.stdout + proc.stderr))
            rec["threads"] = 128
        else:
            for ptx in pathlib.Path(dump).glob("*.ptx"):
                if ".entry ragged_paged_attention_gpu" in ptx.read_text():
                    rep = subprocess.run(
                        [_ptxas(), "-arch=sm_90a", "-v", str(ptx), "-o", os.devnull],
                        capture_output=True,
                        text=True,
                        check=False,
                    )
                    rec.update(_ptxas_report(rep.stdout + rep.stderr))
            for seq in pathlib.Path(dump).glob("*thunk_sequence.txt"):
                m = re.search(
                    r"ragged_paged_attention_gpu grid: \[(\d+), (\d+), (\d+)\] "
                    r"threads: \[(\d+), 1, 1\]\s+shared_memory: (\d+) bytes",
                    seq.read_text(),
                )
                if m:
                    rec["grid"] = [int(m.group(i)) for i in (1, 2, 3)]
                    rec["threads"], rec["smem_bytes"] = int(m.group(4)), int(m.group(5))
    if rec.get("registers") and rec.get("threads") and "smem_bytes" in rec:
        by_regs = REGISTERS_PER_SM // (rec["registers"] * rec["threads"])
        by_smem = (
            SMEM_PER_SM // (rec["smem_bytes"] + 1024) if rec["smem_bytes"] else MAX_BLOCKS_PER_SM
        )
        rec["blocks_per_sm"] = min(
            by_regs, by_smem, MAX_THREADS_PER_SM // rec["threads"], MAX_BLOCKS_PER_SM
        )
        rec["warps_per_sm"] = rec["blocks_per_sm"] * rec["threads"] // 32
    return rec


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        print("@@record " + json.dumps(worker(*sys.argv[2:6])), flush=True)
        return 0
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--chips", nargs="+", default=["h100", "h200"])
    p.add_argument("--shapes", nargs="+", default=list(SHAPES))
    p.add_argument("--buckets", nargs="+", default=list(BUCKETS))
    p.add_argument("--kernels", nargs="+", default=["gpu", "gpu-mosaic"])
    p.add_argument("--out", default=str(RESULTS))
    args = p.parse_args()
    import importlib.metadata

    import jax

    sha = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False
    ).stdout.strip()
    head = {
        "bench": "gpu_kernel_compile",
        "git_sha": sha,
        "jax": jax.__version__,
        "plugin": importlib.metadata.version("jax-cuda12-plugin"),
        "page_size": PAGE,
        "context": CONTEXT,
    }
    print(
        f"{'chip':5} {'shape':15} {'bucket':13} {'kernel':11} {'regs':>4} {'spill':>5} "
        f"{'smem KB':>7} {'thr':>4} {'blk/SM':>6} {'warps':>5} {'temp MB':>7} {'compile s':>9}"
    )
    with open(args.out, "a") as out:
        for chip in args.chips:
            for shape in args.shapes:
                for bucket in args.buckets:
                    for kernel in args.kernels:
                        rec = {
                            **head,
                            "chip": chip,
                            "shape": shape,
                            "bucket": bucket,
                            "kernel": kernel,
                            **run_case(chip, shape, bucket, kernel),
                        }
                        out.write(json.dumps(rec) + "\n")
                        out.flush()
                        if "error" in rec:
                            print(
                                f"{chip:5} {shape:15} {bucket:13} {kernel:11} "
                                f"error: {rec['error'][:120]}"
                            )
                            continue
                        smem = rec.get("smem_bytes")
                        smem_kb = "-" if smem is None else f"{smem / 1024:.1f}"
                        print(
                            f"{chip:5} {shape:15} {bucket:13} {kernel:11} "
                            f"{rec.get('registers', '-'):>4} {rec.get('spill_bytes', '-'):>5} "
                            f"{smem_kb:>7} "
                            f"{rec.get('threads', '-'):>4} {rec.get('blocks_per_sm', '-'):>6} "
                            f"{rec.get('warps_per_sm', '-'):>5} {rec['temp_bytes'] / 2**20:>7.1f} "
                            f"{rec['compile_s']:>9}",
                            flush=True,
                        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
