"""Bytes a product with FP8 / int4 weights moves on a TPU v6e chip: XLA's path (the weight
dequantized in the step, then a dot) against the Pallas product kernel
(`pallas_kernels/quant_matmul`), compiled for one v6e chip through libtpu's compile-only
topology on this host. Nothing runs on a TPU: the figures are the compiler's, not timings.

`products`: one Llama-3-8B MLP product (x [T, 4096] @ W [4096, 14336], T = 8 and 32 decode
rows) through the model's own `dense`: bfloat16; FP8 per output channel and per 128 x 128
block; int4 as the model stores it (uint8, two values a byte, a float32 scale and zero per
group of 128 inputs); and, for the record, int4 as native `jnp.uint4` values dequantized in
bfloat16 (the README's earlier figure). For each, XLA's cost analysis of the compiled program
("bytes accessed"), its memory analysis (arguments; temporaries: a dequantized weight
materialized by XLA shows here) and, for the kernel, the bytes its block DMAs move
(`tpu.hbm_bytes`). XLA's cost analysis cannot see inside a Mosaic call: the kernel states its
own count (`pl.CostEstimate`, the same `hbm_bytes`), which XLA adds to the ops around it.

`step`: the whole Llama-3-8B-shaped decode step (the `llama3-8b` preset, bucket 8 tokens x 8
requests, reference attention, bfloat16 KV cache, context 2048: the README's table) through
`jaxserve shard-plan`'s compile (`tools/plan_compile.plan_one`), the quantized products on XLA
or on the kernel (`PlanSettings.quant_matmul_impl`). Minutes per configuration here.

    ALLOW_MULTIPLE_LIBTPU_LOAD=1 JAX_PLATFORMS=cpu python benchmarks/quant_matmul_bytes.py products
    ALLOW_MULTIPLE_LIBTPU_LOAD=1 JAX_PLATFORMS=cpu python benchmarks/quant_matmul_bytes.py step \\
        --weights bfloat16 fp8 int4 --products xla tpu
"""

from __future__ import annotations

import argparse
import datetime
import os
import pathlib
import subprocess
import sys
import time

from results_log import append_results

RESULTS = pathlib.Path(__file__).parent / "results" / "quant_matmul.jsonl"
TOPOLOGY = "v6e:2x2"
K, N, GROUP = 4096, 14336, 128
MiB = 2**20


def _head(kind: str) -> dict:
    import importlib.metadata

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], capture_output=True, text=True, check=False,
                              cwd=pathlib.Path(__file__).parent).stdout.strip()

    sha = git("rev-parse", "--short", "HEAD")
    dirty = git("status", "--porcelain", "--untracked-files=no")
    return {"benchmark": "quant_matmul_bytes", "kind": kind,
            "time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "git_sha": sha + (" + uncommitted changes" if dirty else ""), "target": TOPOLOGY,
            "ran_on_tpu": False,
            "versions": {p: importlib.metadata.version(p) for p in ("jax", "jaxlib", "libtpu")}}


def _device():
    from jaxserve.tools.plan_worker import target_devices

    devices, kind, _ = target_devices({"kind": "tpu", "topology": TOPOLOGY})
    return devices[0], kind


def _product_cases():
    """name -> (weight format, the product's impl, (function of x and the weight's arrays,
    the arrays' (shape, dtype))."""
    import jax.numpy as jnp

    from jaxserve.models.layers.linear import QuantizedProduct, QuantizedWeight, dense

    spec = "te,ef->tf"

    def quantized(dtype, q_shape, s_shape, zero: bool, packed: bool, impl: str):
        product = None if impl == "xla" else QuantizedProduct(impl)

        def fn(x, q, s, *z):
            zero_ = z[0] if z else None
            return dense(spec, x, QuantizedWeight(q, s, "bfloat16", zero_, 0 if packed else None,
                                                  product))

        shapes = [(q_shape, dtype)] + [(s_shape, jnp.float32)] * (2 if zero else 1)
        return fn, shapes

    def uint4_bf16(x, q, s, z):  # the README's earlier figure: native uint4, bfloat16 math
        w = q.reshape(K // GROUP, GROUP, N).astype(jnp.bfloat16)
        w = ((w - z[:, None].astype(jnp.bfloat16)) * s[:, None].astype(jnp.bfloat16)).reshape(K, N)
        return jnp.einsum(spec, x, w, preferred_element_type=jnp.float32)

    g = (K // GROUP, N)
    bf16 = (lambda x, w: dense(spec, x, w), [((K, N), jnp.bfloat16)])
    cases = {"bfloat16": ("bfloat16", "xla", bf16),
             "int4 native uint4, bfloat16 math": (
                 "int4 g128 (jnp.uint4)", "xla",
                 (uint4_bf16, [((K, N), jnp.uint4), (g, jnp.float32), (g, jnp.float32)]))}
    for impl in ("xla", "tpu"):
        cases[f"fp8 per channel / {impl}"] = (
            "fp8 per channel", impl,
            quantized(jnp.float8_e4m3fn, (K, N), (1, N), False, False, impl))
        cases[f"fp8 128x128 blocks / {impl}"] = (
            "fp8 128x128 blocks", impl,
            quantized(jnp.float8_e4m3fn, (K, N), (K // 128, N // 128), False, False, impl))
        cases[f"int4 g128 / {impl}"] = (
            "int4 g128 (uint8, two a byte)", impl,
            quantized(jnp.uint8, (K // 2, N), g, True, True, impl))
    return cases


def _bits(dtype) -> int:
    """Bits a value of `dtype` takes on the chip (4-bit types are packed two a byte)."""
    import jax.numpy as jnp

    dtype = jnp.dtype(dtype)
    return 4 if dtype in (jnp.dtype(jnp.uint4), jnp.dtype(jnp.int4)) else 8 * dtype.itemsize


def products(args) -> list[dict]:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    from jaxserve.pallas_kernels.quant_matmul import tpu

    device, kind = _device()
    sharding = NamedSharding(Mesh(np.array([device]).reshape(1, 1), ("data", "model")), P())
    head = {**_head("product"), "device_kind": kind, "shape": [K, N], "group": GROUP}
    records = []
    for T in args.tokens:
        for name, (fmt, impl, (fn, shapes)) in _product_cases().items():
            x = jax.ShapeDtypeStruct((T, K), jnp.bfloat16, sharding=sharding)
            abstract = [jax.ShapeDtypeStruct(s, d, sharding=sharding) for s, d in shapes]
            t0 = time.perf_counter()
            compiled = jax.jit(fn).lower(x, *abstract).compile()
            compile_s = time.perf_counter() - t0
            cost = compiled.cost_analysis()
            cost = (cost[0] if isinstance(cost, list) else cost) or {}
            mem = compiled.memory_analysis()
            weight = sum(int(np.prod(s)) * _bits(d) // 8 for s, d in shapes)
            rec = {**head, "tokens": T, "case": name, "weights": fmt, "product": impl,
                   "weight_bytes": weight,  # values, scales and zeros as stored
                   "bytes_accessed": float(cost.get("bytes accessed", 0.0)),
                   "argument_bytes": int(mem.argument_size_in_bytes),
                   "temp_bytes": int(mem.temp_size_in_bytes),
                   "kernel_calls": compiled.as_text().count("tpu_custom_call"),
                   "compile_s": round(compile_s, 2)}
            if impl == "tpu":
                packed = fmt.startswith("int4")
                groups = shapes[1][0][0]
                t = tpu.tiling(T, K, N, groups, packed, packed)
                rec["kernel_hbm_bytes"] = tpu.hbm_bytes(t, -(-T // t.tm) * t.tm, K, N, groups, 1, 2,
                                                        packed)
                rec["tiling"] = {"tm": t.tm, "tn": t.tn, "tk": t.tk, "mode": t.mode}
            records.append(rec)
            blocks = rec.get("kernel_hbm_bytes")
            print(f"T={T:3d} {name:36s} accessed {rec['bytes_accessed'] / MiB:8.1f} MiB  temp "
                  f"{rec['temp_bytes'] / MiB:7.1f} MiB  weight {weight / MiB:6.1f} MiB"
                  + (f"  kernel blocks {blocks / MiB:.1f} MiB" if blocks else ""), flush=True)
    return records


def step(args) -> list[dict]:
    from jaxserve.parallel.mesh import make_mesh
    from jaxserve.tools.plan_compile import PlanSettings, plan_one
    from jaxserve.tools.plan_worker import target_devices
    from jaxserve.tools.shard_plan import model_config

    _, arch = model_config("llama3-8b")
    devices, kind, memory = target_devices({"kind": "tpu", "topology": TOPOLOGY})
    mesh = make_mesh(1, 1, devices=devices)
    records = []
    for weights in args.weights:
        for impl in args.products:
            if weights == "bfloat16" and impl != "xla":
                continue  # no quantized product: the same program
            settings = PlanSettings(arch=arch, platform="tpu", max_model_len=args.context,
                                    max_num_seqs=8, dtype="bfloat16", attention_impl="reference",
                                    quantization=None if weights == "bfloat16" else weights,
                                    device_memory=memory, quant_matmul_impl=impl,
                                    kv_cache_dtype=args.kv_cache_dtype)
            rec = plan_one(settings, mesh, "tp", (8, 8), kind)
            cost = rec.get("cost", {})
            out = {**_head("step"), "model": "llama3-8b preset", "device_kind": kind, "mesh": "1x1",
                   "bucket": [8, 8], "context": args.context, "kv_cache_dtype": args.kv_cache_dtype,
                   "attention_impl": rec["attention_impl"],
                   "weights": weights, "product": rec["quant_matmul_impl"],
                   "params_bytes_per_device": rec["params"]["per_device"],
                   "peak_bytes_per_device": rec.get("memory", {}).get("peak"),
                   "step_bytes_accessed": cost.get("bytes_accessed"),
                   "bytes_accessed_per_decode_token": (cost.get("bytes_accessed") or 0) / 8,
                   "step_flops": cost.get("flops"),
                   "quant_matmul_calls": sum(n for name, n in (rec.get("kernels") or {}).items()
                                             if name.startswith("quant_matmul_tpu")),
                   "compile_s": rec.get("compile_s")}
            records.append(out)
            weights_gib = out["params_bytes_per_device"] / 2**30
            print(f"{weights:9s} {impl:4s} weights {weights_gib:6.2f} GiB  accessed per token"
                  f" {out['bytes_accessed_per_decode_token'] / 2**30:6.2f} GiB  "
                  f"compile {out['compile_s']} s", flush=True)
    return records


def main() -> int:
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # compile-only
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="what", required=True)
    pp = sub.add_parser("products", help="one 4096 x 14336 product (seconds)")
    pp.add_argument("--tokens", type=int, nargs="+", default=[8, 32])
    ps = sub.add_parser("step", help="the whole Llama-3-8B-shaped decode step (minutes each)")
    ps.add_argument("--weights", nargs="+", default=["bfloat16", "fp8", "int4"])
    ps.add_argument("--products", nargs="+", default=["xla", "tpu"])
    ps.add_argument("--context", type=int, default=2048)
    ps.add_argument("--kv-cache-dtype", default="bfloat16", help="the KV cache's (fp8: one byte a value)")
    for q in (pp, ps):
        q.add_argument("--out", default=str(RESULTS))
    args = p.parse_args()
    records = products(args) if args.what == "products" else step(args)
    append_results(args.out, records)
    return 0


if __name__ == "__main__":
    sys.exit(main())
