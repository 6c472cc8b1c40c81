"""Time the CPU product kernels against XLA's dot on SmolLM2's decoder-layer shapes.

For each weight dtype (bfloat16: the AMX kernel; float32: the AVX-512 kernel) and each row
count M, it times `layers` distinct weights of each shape (q/k/v fused, o, gate/up fused, down)
in one compiled function, so that the weights come from memory as in a real step (their total
is far above the caches), and reports the median time per product, the weight-read GB/s and
the GFLOP/s. XLA's dot runs the same products on unpacked weights (`dense`). One JSON line per
(dtype, M, impl) is appended to benchmarks/results/matmul.jsonl (or --out).

    python benchmarks/matmul_benchmark.py
    python benchmarks/matmul_benchmark.py --rows 1 16 32 --dtypes bfloat16 --iters 30
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import time

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from jaxserve.models.layers.linear import dense
from jaxserve.pallas_kernels.cpu.matmul import (
    amx_available,
    avx512_available,
    pack_weight,
    packed_matmul,
)

RESULTS = os.path.join(os.path.dirname(__file__), "results", "matmul.jsonl")
# SmolLM2-135M: hidden 576, 9 + 2 x 3 heads of 64, MLP 1536 (gate and up fused).
SHAPES = {"qkv": (576, 960), "o": (576, 576), "gate_up": (576, 3072), "down": (1536, 576)}


def median_s(f, args, iters: int) -> float:
    jax.block_until_ready(f(*args))
    ts = []
    for _ in range(iters):
        t0 = time.perf_counter()
        jax.block_until_ready(f(*args))
        ts.append(time.perf_counter() - t0)
    return float(np.median(ts))


def run(dtype, m: int, layers: int, iters: int, rng) -> list[dict]:
    weights = [(0.05 * rng.standard_normal((k, n))).astype(dtype)
               for _ in range(layers) for k, n in SHAPES.values()]
    xs = {k: jnp.asarray(rng.standard_normal((m, k)), jnp.float32) for k, _ in SHAPES.values()}
    flops = 2 * m * sum(k * n for k, n in SHAPES.values()) * layers
    nbytes = sum(w.nbytes for w in weights)

    unpacked = [jnp.asarray(w) for w in weights]
    packed = [jnp.asarray(pack_weight(w)) for w in weights]
    k_of = [w.shape[0] for w in weights]

    def xla(xs, ws):
        return sum(dense("te,ef->tf", xs[k], w)[0, 0] for k, w in zip(k_of, ws))

    def kernel(xs, ws):
        return sum(packed_matmul(xs[k], w)[0, 0] for k, w in zip(k_of, ws))

    rows = []
    for impl, f, ws in (("xla", xla, unpacked), ("kernel", kernel, packed)):
        t = median_s(jax.jit(f), (xs, ws), iters)
        rows.append({"dtype": np.dtype(dtype).name, "rows": m, "impl": impl,
                     "us_per_product": 1e6 * t / len(weights), "weight_gbs": nbytes / t / 1e9,
                     "gflops": flops / t / 1e9})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 16, 32])
    ap.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"],
                    choices=["bfloat16", "float32"])
    ap.add_argument("--layers", type=int, default=30, help="distinct weights per shape")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--out", default=RESULTS, help="JSONL file to append to ('' = none)")
    args = ap.parse_args()

    rng = np.random.default_rng(0)
    env = {"time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "machine": platform.machine(), "jax": jax.__version__}
    print(f"{'dtype':10} {'rows':>4} {'impl':>7} {'us/product':>11} {'weight GB/s':>12} "
          f"{'GFLOP/s':>8}")
    for name in args.dtypes:
        if not (amx_available() if name == "bfloat16" else avx512_available()):
            print(f"{name}: no kernel on this CPU, skipped")
            continue
        dtype = ml_dtypes.bfloat16 if name == "bfloat16" else np.float32
        for m in args.rows:
            for row in run(dtype, m, args.layers, args.iters, rng):
                print(f"{row['dtype']:10} {row['rows']:>4} {row['impl']:>7} "
                      f"{row['us_per_product']:>11.1f} {row['weight_gbs']:>12.1f} "
                      f"{row['gflops']:>8.0f}")
                if args.out:
                    with open(args.out, "a") as f:
                        f.write(json.dumps({"benchmark": "matmul", **env, **row}) + "\n")


if __name__ == "__main__":
    main()
