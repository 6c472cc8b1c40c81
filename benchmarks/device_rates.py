"""The device's own rates, measured: the copy bandwidth and the bfloat16 matmul rate, each next to
the chip's published figure (jaxserve/tools/chips.py) where the chip is known.

Both are timed as the device runs back-to-back work: `--iters` calls dispatched one after the
other, one wait at the end, the time per call of the best of three such rounds, so that
neither the host's dispatch nor its wait for each result is counted (a decode step's kernels
run back to back the same way).

- copy bandwidth: `x + 1` in place over --copy-mib MiB of float32 (the buffer donated from call
  to call), (read + write) bytes / time. Beside it, `copy_single_call_gb_per_s`: the kernel
  benchmark's roofline (`kernel_benchmark.measure_bandwidth_gbs`: `x * 1`, each call waited
  for), whose gap to the first is the per-call overhead its fractions carry;
- matmul rate: a square bfloat16 product (float32 accumulation, bfloat16 out) at each --sizes
  N, 2 N^3 flops / time; the best size is the rate.

One JSON line (the device, the rates, their fractions of the published figures, every size's
time) is appended to --out and printed.

    python benchmarks/device_rates.py [--out rates.jsonl]           # device sizes
    python benchmarks/device_rates.py --small                       # CPU: tiny sizes
"""

from __future__ import annotations

import argparse
import json
import os
import time

import jaxserve  # noqa: F401 - before jax: pins JAX to the CPU on a host without accelerators
import jax
import jax.numpy as jnp

from jaxserve.tools.chips import chip_of_device_kind
from kernel_benchmark import measure_bandwidth_gbs
from results_log import append_results

RESULTS = os.path.join(os.path.dirname(__file__), "results", "device_rates.jsonl")


def back_to_back_ms(call, iters: int, rounds: int = 3) -> float:
    """Milliseconds per call of `call()` (which returns its result), `iters` calls dispatched
    back to back and the last one waited for (one device runs them in order): the best of
    `rounds` rounds after a warm-up."""
    jax.block_until_ready(call())
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(iters - 1):
            call()
        jax.block_until_ready(call())
        best = min(best, (time.perf_counter() - t0) / iters)
    return 1e3 * best


def copy_gb_per_s(nbytes: int, iters: int) -> float:
    """(read + write) GB/s of `x + 1` in place over nbytes of float32."""
    state = {"x": jnp.zeros((nbytes // 4,), jnp.float32)}
    f = jax.jit(lambda x: x + 1.0, donate_argnums=0)

    def call():
        state["x"] = f(state["x"])  # each call reads and writes the buffer the last one wrote
        return state["x"]

    ms = back_to_back_ms(call, iters)
    return 2 * nbytes / (ms * 1e-3) / 1e9


def matmul_tflops(n: int, iters: int) -> tuple[float, float]:
    """(ms, TFLOP/s) of an n x n x n bfloat16 product."""
    ka, kb = jax.random.split(jax.random.key(0))
    a = jax.random.normal(ka, (n, n), jnp.bfloat16)
    b = jax.random.normal(kb, (n, n), jnp.bfloat16)
    f = jax.jit(lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.float32).astype(jnp.bfloat16))
    ms = back_to_back_ms(lambda: f(a, b), iters)
    return ms, 2 * n**3 / (ms * 1e-3) / 1e12


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--small", action="store_true", help="tiny sizes (the CPU rehearsal)")
    p.add_argument("--copy-mib", type=int, default=None,
                   help="MiB copied (default 2048; --small 16)")
    p.add_argument("--sizes", type=int, nargs="+", default=None,
                   help="matmul sizes N (default 4096 8192; --small 256)")
    p.add_argument("--iters", type=int, default=None,
                   help="calls a round (default 20; --small 3)")
    p.add_argument("--out", default=RESULTS, help="JSONL file to append to ('' = none)")
    args = p.parse_args(argv)
    iters = args.iters or (3 if args.small else 20)
    copy_mib = args.copy_mib or (16 if args.small else 2048)
    sizes = args.sizes or ([256] if args.small else [4096, 8192])
    device = jax.devices()[0]
    copy = copy_gb_per_s(copy_mib << 20, iters)
    single = measure_bandwidth_gbs(min(copy_mib, 1024) << 20, iters)
    matmuls = []
    for n in sizes:
        ms, tflops = matmul_tflops(n, iters)
        matmuls.append({"n": n, "ms": round(ms, 4), "tflops": round(tflops, 2)})
    best = max(m["tflops"] for m in matmuls)
    rec = {"bench": "device_rates", "backend": jax.default_backend(),
           "device_kind": device.device_kind, "copy_mib": copy_mib,
           "copy_gb_per_s": round(copy, 1), "copy_single_call_gb_per_s": round(single, 1),
           "matmul_dtype": "bfloat16", "matmul_tflops": best, "matmuls": matmuls, "iters": iters}
    chip = chip_of_device_kind(device.device_kind)
    if chip is not None:
        rec.update(chip=chip.name, hbm_gb_per_s=chip.hbm_bandwidth / 1e9,
                   peak_bf16_tflops=chip.peak_flops / 1e12,
                   copy_frac_of_hbm=round(copy * 1e9 / chip.hbm_bandwidth, 4),
                   matmul_frac_of_peak=round(best * 1e12 / chip.peak_flops, 4))
    if args.out:
        append_results(args.out, [rec])
    print(json.dumps(rec))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
