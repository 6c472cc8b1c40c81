"""Time the CPU product kernels against XLA's dot on SmolLM2's shapes.

For each weight dtype (bfloat16: the AMX kernel where it runs, else the strips kernel like
float32; float32: the AVX-512 or AVX2 kernel, whichever the kernel build has) and each row
count M, it times `layers` distinct weights of each decoder-layer shape (q/k/v fused, o,
gate/up fused, down) in one compiled function, as in a real step, and with --lm-head the tied
LM head (576 x 49152: 113 MB in float32) alone. XLA's dot runs the same products on unpacked
weights (`dense`). Weights sit on transparent huge pages where the system has them, as the
engine places them. The implementations alternate call by call in one process (A/B/A/B), each
call timed with the last-level cache emptied first (a read of twice its size), as in a decode
step whose weights stream from memory, and each reports the median time per product, the
weight-read GB/s, the GFLOP/s and the fraction of the memory-bandwidth floor, the bound that
matters at one row, two ways: `of floor` reads the weights at the streaming rate measured at
start (numpy reductions on 1 and 2 threads over 512 MiB on huge pages, each pass from memory:
the median pass of the fastest way); `vs read` against the time numpy takes to read the same
bytes on 2 threads (np.dot of each half with itself; a max over bfloat16 weights read as
int32), timed in the same alternation, so that others' work on a shared machine slows both
alike (numpy reads these many small arrays more slowly than the probe its one large one, so
this one can pass 100 %).
One JSON line per (dtype, shapes, M, impl) is appended to benchmarks/results/matmul.jsonl (or
--out), with the CPU, the kernel build target, XLA_FLAGS and the load average.
--compare-target adds another build's strips kernel to the alternation (e.g. the host's
AVX-512 one next to the AVX2 one).

AVX2-only CPUs (no AVX-512, no AMX) can be emulated on a larger x86 CPU: XLA limited with
--xla_cpu_max_isa=AVX2 and the kernels built for target "haswell":

    python benchmarks/matmul_benchmark.py
    python benchmarks/matmul_benchmark.py --rows 1 16 32 --dtypes bfloat16 --iters 30
    XLA_FLAGS=--xla_cpu_max_isa=AVX2 python benchmarks/matmul_benchmark.py \\
        --kernel-target haswell --dtypes float32 --rows 1 8 32 --lm-head
"""

from __future__ import annotations

import argparse
import datetime
import glob
import os
import platform
import threading
import time

import jaxserve  # noqa: F401 - before jax: pins JAX to the CPU on a host without accelerators
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from jaxserve.models.layers.linear import dense
from jaxserve.backends.cpu import kernels as cpu
from jaxserve.backends.cpu.kernels.matmul import (
    amx_available,
    pack_weight,
    packed_matmul,
    strips_kernel,
)
from jaxserve.backends.cpu.huge_pages import place_on_huge_pages, thp_enabled

from results_log import append_results

RESULTS = os.path.join(os.path.dirname(__file__), "results", "matmul.jsonl")
# SmolLM2-135M: hidden 576, 9 + 2 x 3 heads of 64, MLP 1536 (gate and up fused), vocabulary
# 49152 (the LM head is the tied embedding).
SHAPES = {"qkv": (576, 960), "o": (576, 576), "gate_up": (576, 3072), "down": (1536, 576)}
LM_HEAD = (576, 49152)


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            line = next((x for x in f if x.startswith("model name")), "")
    except OSError:
        line = ""
    return line.partition(":")[2].strip() or platform.processor()


def last_level_cache_bytes() -> int:
    """The largest CPU cache's size (sysfs), or 64 MiB where it cannot be read."""
    sizes = []
    for d in glob.glob("/sys/devices/system/cpu/cpu0/cache/index*"):
        try:
            with open(os.path.join(d, "size")) as f:
                text = f.read().strip()
        except OSError:
            continue
        scale = {"K": 2**10, "M": 2**20, "G": 2**30}.get(text[-1:], 1)
        sizes.append(int(text.rstrip("KMG")) * scale)
    return max(sizes, default=64 * 2**20)


class CacheEvictor:
    """Empties the CPU caches of earlier data: a read of twice the last-level cache."""

    def __init__(self):
        self.buf = np.ones(2 * last_level_cache_bytes() // 4, np.float32)

    def __call__(self) -> None:
        self.buf.max()


def read_bandwidth_gbs(evict: CacheEvictor, mib: int = 512, repeats: int = 5) -> float:
    """The streaming read rate of numpy reductions over `mib` MiB on 1 and 2 threads (GB/s),
    each pass from memory: the median of `repeats` passes of the fastest way. The floor's
    denominator."""
    (on_huge_pages,), _ = place_on_huge_pages([jnp.ones(mib * 2**20 // 4, jnp.float32)])
    a = np.asarray(on_huge_pages)  # a view of the arena, as the weights in run()
    best = 0.0
    for fn in (np.max, lambda p: np.dot(p, p)):
        for n in (1, 2):
            parts = np.array_split(a, n)
            rates = []
            for _ in range(repeats):
                evict()
                ts = [threading.Thread(target=fn, args=(p,)) for p in parts]
                t0 = time.perf_counter()
                for t in ts:
                    t.start()
                for t in ts:
                    t.join()
                rates.append(a.nbytes / (time.perf_counter() - t0) / 1e9)
            best = max(best, float(np.median(rates)))
    return best


def _read_all(chunks: list[list[np.ndarray]]) -> None:
    """Read every chunk once, list i on thread i."""
    def read(arrays):
        for a in arrays:
            np.dot(a, a) if a.dtype == np.float32 else a.max()
    ts = [threading.Thread(target=read, args=(c,)) for c in chunks]
    for t in ts:
        t.start()
    for t in ts:
        t.join()


def alternate_medians(fns: dict, iters: int, evict: CacheEvictor) -> dict[str, float]:
    """Median seconds per call of each fn(), called in turn (A, B, A, B, ...) after a warm-up,
    the caches emptied before each."""
    for f in fns.values():
        jax.block_until_ready(f())
    ts = {name: [] for name in fns}
    for _ in range(iters):
        for name, f in fns.items():
            evict()
            t0 = time.perf_counter()
            jax.block_until_ready(f())
            ts[name].append(time.perf_counter() - t0)
    return {name: float(np.median(t)) for name, t in ts.items()}


def run(dtype, shapes: list[tuple[int, int]], m: int, iters: int, rng, bw_gbs: float,
        kernel_name: str, evict: CacheEvictor, compare: tuple[str, str] | None = None) -> list[dict]:
    weights = [(0.05 * rng.standard_normal((k, n))).astype(dtype) for k, n in shapes]
    ks = sorted({k for k, _ in shapes})
    xs = {k: jnp.asarray(rng.standard_normal((m, k)), jnp.float32) for k in ks}
    flops = 2 * m * sum(k * n for k, n in shapes)
    nbytes = sum(w.nbytes for w in weights)

    # On huge pages, as the engine places its weights (with 4 KiB pages the one-row products
    # read ~25 % slower).
    unpacked = place_on_huge_pages([jnp.asarray(w) for w in weights])[0]
    packed = place_on_huge_pages([jnp.asarray(pack_weight(w, tiles=kernel_name == "amx")) for w in weights])[0]
    k_of = [w.shape[0] for w in weights]

    def xla(xs, ws):
        return sum(dense("te,ef->tf", xs[k], w)[0, 0] for k, w in zip(k_of, ws))

    def kernel(xs, ws, target=None):
        return sum(packed_matmul(xs[k], w, target=target)[0, 0] for k, w in zip(k_of, ws))

    xla_jit, kernel_jit = jax.jit(xla), jax.jit(kernel, static_argnames="target")
    halves = [np.array_split((w if dtype == np.float32 else w.view(np.int32)).reshape(-1), 2)
              for w in weights]
    chunks = [[h[i] for h in halves] for i in range(2)]
    fns = {"read": lambda: _read_all(chunks), "xla": lambda: xla_jit(xs, unpacked),
           "kernel": lambda: kernel_jit(xs, packed)}
    names = {"xla": "xla", "kernel": kernel_name}
    if compare is not None:
        fns["kernel@" + compare[0]] = lambda: kernel_jit(xs, packed, target=compare[0])
        names["kernel@" + compare[0]] = compare[1]
    times = alternate_medians(fns, iters, evict)
    t_read = times.pop("read")
    rows = []
    for impl, t in times.items():
        rows.append({"dtype": np.dtype(dtype).name, "rows": m, "impl": impl,
                     "kernel": names[impl], "us_per_product": 1e6 * t / len(weights),
                     "weight_gbs": nbytes / t / 1e9, "gflops": flops / t / 1e9,
                     "bandwidth_floor_fraction": nbytes / bw_gbs / 1e9 / t,
                     "read_gbs_alternating": nbytes / t_read / 1e9,
                     "floor_fraction_alternating": t_read / t,
                     "speedup_vs_xla": times["xla"] / t})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 16, 32])
    ap.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"],
                    choices=["bfloat16", "float32"])
    ap.add_argument("--layers", type=int, default=30, help="distinct weights per shape")
    ap.add_argument("--lm-head", action="store_true",
                    help=f"also time the LM head {LM_HEAD[0]}x{LM_HEAD[1]} alone")
    ap.add_argument("--kernel-target", default=cpu.DEFAULT_TARGET, choices=list(cpu.BUILD_TARGETS),
                    help="the kernels' build target (haswell: AVX2 + FMA, no AVX-512)")
    ap.add_argument("--compare-target", choices=list(cpu.BUILD_TARGETS), default=None,
                    help="also time this build's strips kernel (alternating with the others)")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--out", default=RESULTS, help="JSONL file to append to ('' = none)")
    args = ap.parse_args()

    cpu.select_target(args.kernel_target)
    rng = np.random.default_rng(0)
    evict = CacheEvictor()
    bw = read_bandwidth_gbs(evict)
    env = {"time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "machine": platform.machine(), "cpu": cpu_model(), "cores": os.cpu_count(),
           "jax": jax.__version__, "xla_flags": os.environ.get("XLA_FLAGS", ""),
           "kernel_target": args.kernel_target, "read_gbs": bw,
           "caches": "emptied before each call", "huge_pages": thp_enabled(),
           "loadavg_1m": os.getloadavg()[0]}  # others' work on the machine skews the times
    print(f"{env['cpu']}, {env['cores']} cores; kernels built for {args.kernel_target!r}; "
          f"XLA_FLAGS={env['xla_flags']!r}; streaming read ~{bw:.1f} GB/s; "
          f"load average {env['loadavg_1m']:.1f}")
    print(f"{'dtype':9} {'shapes':8} {'rows':>4} {'impl':>7} {'us/product':>11} "
          f"{'weight GB/s':>12} {'GFLOP/s':>8} {'of floor':>9} {'vs read':>8} {'vs xla':>7}")
    sets = [("layers", [s for _ in range(args.layers) for s in SHAPES.values()])]
    if args.lm_head:
        sets.append(("lm_head", [LM_HEAD]))
    for name in args.dtypes:
        # bfloat16: AMX tiles where they run, else strips like float32 (widened in the kernel)
        kernel = "amx" if name == "bfloat16" and amx_available() else strips_kernel()
        if kernel is None:
            print(f"{name}: no kernel in this build on this CPU, skipped")
            continue
        dtype = ml_dtypes.bfloat16 if name == "bfloat16" else np.float32
        compare = None
        if args.compare_target and kernel != "amx":  # strips on both sides
            other = strips_kernel(args.compare_target)
            compare = (args.compare_target, other) if other else None
        for set_name, shapes in sets:
            for m in args.rows:
                for row in run(dtype, shapes, m, args.iters, rng, bw, kernel, evict, compare):
                    row = {"shapes": set_name, **row}
                    print(f"{row['dtype']:9} {set_name:8} {row['rows']:>4} {row['kernel']:>7} "
                          f"{row['us_per_product']:>11.1f} {row['weight_gbs']:>12.1f} "
                          f"{row['gflops']:>8.0f} {row['bandwidth_floor_fraction']:>8.0%} "
                          f"{row['floor_fraction_alternating']:>8.0%} "
                          f"{row['speedup_vs_xla']:>6.2f}x")
                    if args.out:
                        append_results(args.out, {"benchmark": "matmul", **env, **row})


if __name__ == "__main__":
    main()
