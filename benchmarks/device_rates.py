"""The device's own rates, measured: the copy bandwidth and the bfloat16 matmul rate, each next to
the chip's published figure (jaxserve/tools/chips.py) where the chip is known.

- copy bandwidth: `kernel_benchmark.measure_bandwidth_gbs`, the roofline the kernel benchmark
  uses: an on-device `x * 1` over --copy-mib MiB of float32, (read + write) bytes / median time;
- matmul rate: a square bfloat16 product (float32 accumulation, bfloat16 out) at each --sizes
  N, 2 N^3 flops / median time; the best size is the rate.

One JSON line (the device, both rates, their fractions of the published figures, every size's
time) is appended to --out and printed.

    python benchmarks/device_rates.py [--out rates.jsonl]           # device sizes
    python benchmarks/device_rates.py --small                       # CPU: tiny sizes
"""

from __future__ import annotations

import argparse
import json
import os

import jax
import jax.numpy as jnp

from jaxserve.tools.chips import chip_of_device_kind
from kernel_benchmark import measure_bandwidth_gbs, medians_ms
from results_log import append_results

RESULTS = os.path.join(os.path.dirname(__file__), "results", "device_rates.jsonl")


def matmul_tflops(n: int, iters: int) -> tuple[float, float]:
    """(median ms, TFLOP/s) of an n x n x n bfloat16 product."""
    ka, kb = jax.random.split(jax.random.key(0))
    a = jax.random.normal(ka, (n, n), jnp.bfloat16)
    b = jax.random.normal(kb, (n, n), jnp.bfloat16)
    f = jax.jit(lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.float32).astype(jnp.bfloat16))
    (ms,) = medians_ms([(f, (a, b))], iters)
    return ms, 2 * n**3 / (ms * 1e-3) / 1e12


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--small", action="store_true", help="tiny sizes (the CPU rehearsal)")
    p.add_argument("--copy-mib", type=int, default=None, help="MiB copied (default 1024; --small 16)")
    p.add_argument("--sizes", type=int, nargs="+", default=None,
                   help="matmul sizes N (default 4096 8192; --small 256)")
    p.add_argument("--iters", type=int, default=None, help="timed calls (default 20; --small 3)")
    p.add_argument("--out", default=RESULTS, help="JSONL file to append to ('' = none)")
    args = p.parse_args(argv)
    iters = args.iters or (3 if args.small else 20)
    copy_mib = args.copy_mib or (16 if args.small else 1024)
    sizes = args.sizes or ([256] if args.small else [4096, 8192])
    device = jax.devices()[0]
    copy_gbs = measure_bandwidth_gbs(copy_mib << 20, iters)
    matmuls = []
    for n in sizes:
        ms, tflops = matmul_tflops(n, iters)
        matmuls.append({"n": n, "ms_median": round(ms, 4), "tflops": round(tflops, 2)})
    best = max(m["tflops"] for m in matmuls)
    rec = {"bench": "device_rates", "backend": jax.default_backend(), "device_kind": device.device_kind,
           "copy_mib": copy_mib, "copy_gb_per_s": round(copy_gbs, 1), "matmul_dtype": "bfloat16",
           "matmul_tflops": best, "matmuls": matmuls, "iters": iters}
    chip = chip_of_device_kind(device.device_kind)
    if chip is not None:
        rec.update(chip=chip.name, hbm_gb_per_s=chip.hbm_bandwidth / 1e9,
                   peak_bf16_tflops=chip.peak_flops / 1e12,
                   copy_frac_of_hbm=round(copy_gbs * 1e9 / chip.hbm_bandwidth, 4),
                   matmul_frac_of_peak=round(best * 1e12 / chip.peak_flops, 4))
    if args.out:
        append_results(args.out, [rec])
    print(json.dumps(rec))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
