"""Time the ragged paged attention implementations on this machine's default backend.

For each scenario (decode: R requests x context C; mixed: a prefill chunk plus decodes) and
each implementation it reports the median wall time (after warm-up, calls interleaved
round-robin), the K/V bytes the step must read, the achieved GB/s and its fraction of the
device's measured copy bandwidth (a large on-device copy, read + write bytes / time). On a GPU
the decode scenario also runs JAX's shipped `jax.experimental.pallas.ops.gpu.paged_attention`
(its own head-major page layout, transposed once outside the timing); the Mosaic GPU kernel
("gpu-mosaic") runs on Hopper and newer and is skipped, with the reason, elsewhere. One JSON
line per (scenario, impl) is appended to benchmarks/results/kernels.jsonl (or --out).

`--sweep`: the Mosaic GPU kernel's block sizes around its per-chip table's
(`pallas_kernels/ragged_paged_attention/gpu_blocks.py`, whose values are predicted from the
compilers' figures, not measured): in the decode scenarios, the table's entry and decode
pipeline depths of 2-4 chunks, chunks of 128 keys, half and twice the KV splits; one JSON
line each (impl "gpu-mosaic", its `blocks` and the table's `chip`), the best per scenario
printed last. On the CPU (`--small`) it rehearses one variant in the interpreter.

    python benchmarks/kernel_benchmark.py                   # device sizes
    python benchmarks/kernel_benchmark.py --small           # CPU: tiny sizes, interpret kernels
    python benchmarks/kernel_benchmark.py --impls reference gpu --iters 50
    python benchmarks/kernel_benchmark.py --impls gpu-mosaic --sweep
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import time

import jaxserve  # noqa: F401 - before jax: pins JAX to the CPU on a host without accelerators
import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.pallas_kernels import AttentionMetadata, ragged_paged_attention

from results_log import append_results

RESULTS = os.path.join(os.path.dirname(__file__), "results", "kernels.jsonl")


def medians_ms(cases, iters: int) -> list[float]:
    for f, args in cases:  # compile + warm up
        jax.block_until_ready(f(*args))
        jax.block_until_ready(f(*args))
    ts = [[] for _ in cases]
    for _ in range(iters):
        for i, (f, args) in enumerate(cases):
            t0 = time.perf_counter()
            jax.block_until_ready(f(*args))
            ts[i].append(time.perf_counter() - t0)
    return [1e3 * float(np.median(t)) for t in ts]


def measure_bandwidth_gbs(nbytes: int, iters: int) -> float:
    """Device copy bandwidth: (read + write) bytes / median time of `x * 1` on nbytes."""
    x = jnp.ones((nbytes // 4,), jnp.float32)
    f = jax.jit(lambda x: x * 1.0)
    (ms,) = medians_ms([(f, (x,))], iters)
    return 2 * x.nbytes / (ms * 1e-3) / 1e9


def paged_batch(reqs, *, hq, hkv, d, ps, dtype, t_pad, r_pad, pages_per_req, seed=0):
    """(ctx, q_len) per request -> (q, k_cache, v_cache, md) with shuffled pages, one layer's
    caches [N, page_size, Hkv * D] (the layout the server stores)."""
    rng = np.random.default_rng(seed)
    need = [math.ceil((c + n) / ps) for c, n in reqs]
    num_pages = 1 + sum(need)
    perm = rng.permutation(np.arange(1, num_pages))
    bt = np.zeros((r_pad, pages_per_req), np.int32)
    k = 0
    for r, n in enumerate(need):
        bt[r, :n] = perm[k : k + n]
        k += n
    total = sum(n for _, n in reqs)
    qsl = np.full(r_pad + 1, total, np.int32)
    qsl[0] = 0
    qsl[1 : len(reqs) + 1] = np.cumsum([n for _, n in reqs])
    kv = np.zeros(r_pad, np.int32)
    kv[: len(reqs)] = [c + n for c, n in reqs]
    slots = np.zeros(t_pad, np.int32)
    md = AttentionMetadata(
        block_tables=jnp.asarray(bt), kv_lens=jnp.asarray(kv), query_start_loc=jnp.asarray(qsl),
        num_seqs=jnp.asarray(len(reqs), jnp.int32), slot_mapping=jnp.asarray(slots),
    )
    key = jax.random.PRNGKey(seed)
    k1, k2, k3 = jax.random.split(key, 3)
    shape = (num_pages, ps, hkv * d)
    kc = jax.random.normal(k1, shape, dtype)
    vc = jax.random.normal(k2, shape, dtype)
    q = jax.random.normal(k3, (t_pad, hq, d), dtype)
    return q, kc, vc, md


def kv_bytes(reqs, hkv, d, itemsize) -> int:
    return sum(c + n for c, n in reqs) * hkv * d * 2 * itemsize


def jax_gpu_paged_attention_case(q, kc, vc, md, reqs, ps, sm_scale):
    """JAX's shipped Pallas GPU paged_attention (decode only) on the same K/V."""
    from jax.experimental.pallas.ops.gpu import paged_attention as jpa

    R = len(reqs)
    d = q.shape[-1]
    per_head = (kc.shape[0], ps, kc.shape[2] // d, d)
    k_pages = jnp.transpose(kc.reshape(per_head), (2, 0, 1, 3))  # [Hkv, N, ps, D]
    v_pages = jnp.transpose(vc.reshape(per_head), (2, 0, 1, 3))
    bt = md.block_tables[:R]
    lengths = md.kv_lens[:R]
    pps = bt.shape[1]
    k_splits = max(s for s in (1, 2, 4, 8, 16) if pps % s == 0)
    ppcb = max(c for c in (1, 2, 4, 8) if (pps // k_splits) % c == 0)

    @jax.jit
    def f(q, k_pages, v_pages, bt, lengths):
        # sm_scale folded into q (the shipped kernel has no scale argument)
        return jpa.paged_attention(q[:R] * sm_scale, k_pages, v_pages, bt, lengths,
                                   pages_per_compute_block=ppcb, k_splits=k_splits)

    return f, (q, k_pages, v_pages, bt, lengths)


def sweep_variants(table, splits: int, small: bool) -> list[dict]:
    """Block sizes to time besides the table's entry ({}): decode pipeline depths, 128-key
    chunks, half and twice the table's KV splits (an explicit split count: every split takes
    its share, however short)."""
    if small:  # the rehearsal: one variant, in the interpreter
        return [{"decode_slots": 2}]
    out = [{}]
    out += [{"decode_slots": n} for n in (2, 3, 4) if n != table.decode_slots]
    out.append({"decode_slots": 2, "chunk_keys": 128})
    out += [{"kv_splits": n} for n in sorted({max(1, splits // 2), 2 * splits}) if n != splits]
    return out


def sweep_cases(q, kc, vc, md, sm_scale, *, small: bool, interpret: bool):
    """(blocks, f, args) per variant of the Mosaic GPU kernel's block sizes."""
    from jaxserve.pallas_kernels.ragged_paged_attention import gpu_blocks, gpu_mosaic

    R, P = md.block_tables.shape
    table = gpu_blocks.lookup(q.shape[-1], jnp.dtype(kc.dtype).itemsize)
    splits = gpu_blocks.decode_splits(table, R, kc.shape[2] // q.shape[-1], P * kc.shape[1])
    for knobs in sweep_variants(table, splits, small):
        blocks = {"decode_slots": table.decode_slots, "chunk_keys": table.chunk_keys,
                  "kv_splits": splits, **knobs, "table": not knobs}
        f = jax.jit(lambda q, kc, vc, md, knobs=knobs: gpu_mosaic.ragged_paged_attention_gpu_mosaic(
            q, kc, vc, md, sm_scale=sm_scale, interpret=interpret, **knobs))
        yield blocks, f, (q, kc, vc, md)


def scenarios(small: bool):
    if small:
        return [
            ("decode", dict(hq=4, hkv=2, d=64, ps=16, r=4, ctx=64, t_pad=4)),
            ("mixed", dict(hq=4, hkv=2, d=64, ps=16, r=4, ctx=48, t_pad=40, prefill=32)),
        ]
    return [
        ("decode", dict(hq=32, hkv=8, d=128, ps=16, r=64, ctx=2048, t_pad=64)),
        ("decode-long", dict(hq=32, hkv=8, d=128, ps=16, r=8, ctx=16384, t_pad=8)),
        ("mixed", dict(hq=32, hkv=8, d=128, ps=16, r=32, ctx=1024, t_pad=544, prefill=512)),
    ]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--impls", nargs="*", default=None)
    ap.add_argument("--iters", type=int, default=None)
    ap.add_argument("--small", action="store_true", help="tiny sizes (CPU / interpret mode)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--out", default=RESULTS)
    ap.add_argument("--sweep", action="store_true",
                    help="also time the Mosaic GPU kernel's block sizes around its table's")
    args = ap.parse_args(argv)
    backend = jax.default_backend()
    small = args.small or backend == "cpu"
    iters = args.iters or (5 if small else 30)
    impls = args.impls or {
        "gpu": ["reference", "gpu", "gpu-mosaic", "jax-gpu-paged"],
        "tpu": ["reference", "tpu"],
    }.get(backend, ["reference", "cpu", "gpu-interpret", "tpu-interpret"])
    dtype = jnp.dtype(args.dtype)
    bw = measure_bandwidth_gbs((16 if small else 1024) << 20, iters)
    device = str(jax.devices()[0].device_kind)
    print(f"backend={backend} device={device} measured copy bandwidth {bw:.1f} GB/s")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    rows = []
    for name, s in scenarios(small):
        reqs = [(s["ctx"] - 1, 1)] * s["r"]
        if "prefill" in s:  # one chunk of `prefill` queries after ctx cached, then decodes
            reqs = [(s["ctx"], s["prefill"])] + [(s["ctx"] - 1, 1)] * (s["r"] - 1)
        ppr = math.ceil((s["ctx"] + s.get("prefill", 1)) / s["ps"])
        q, kc, vc, md = paged_batch(reqs, hq=s["hq"], hkv=s["hkv"], d=s["d"], ps=s["ps"],
                                    dtype=dtype, t_pad=s["t_pad"], r_pad=s["r"],
                                    pages_per_req=ppr)
        sm_scale = 1.0 / math.sqrt(s["d"])
        cases, names = [], []
        for impl in impls:
            if impl == "jax-gpu-paged":
                if name.startswith("decode") and backend == "gpu":
                    cases.append(jax_gpu_paged_attention_case(q, kc, vc, md, reqs, s["ps"],
                                                              sm_scale))
                    names.append(impl)
                continue
            f = jax.jit(lambda q, kc, vc, md, impl=impl: ragged_paged_attention(
                q, kc, vc, md, sm_scale=sm_scale, impl=impl))
            try:
                jax.block_until_ready(f(q, kc, vc, md))
            except Exception as e:  # e.g. a kernel that cannot take these shapes here
                print(f"{name:12s} {impl:14s} skipped: {type(e).__name__}: {str(e)[:200]}")
                continue
            cases.append((f, (q, kc, vc, md)))
            names.append(impl)
        blocks = [None] * len(cases)
        if args.sweep and name.startswith("decode"):
            interp = backend != "gpu"
            for variant, f, fargs in sweep_cases(q, kc, vc, md, sm_scale, small=small,
                                                 interpret=interp):
                try:
                    jax.block_until_ready(f(*fargs))
                except Exception as e:  # e.g. a variant past the shared memory
                    print(f"{name:12s} gpu-mosaic {variant} skipped: {type(e).__name__}: "
                          f"{str(e)[:200]}")
                    continue
                cases.append((f, fargs))
                names.append("gpu-mosaic-interpret" if interp else "gpu-mosaic")
                blocks.append(variant)
        times = medians_ms(cases, iters)
        nbytes = kv_bytes(reqs, s["hkv"], s["d"], dtype.itemsize)
        for impl, ms, variant in zip(names, times, blocks):
            gbs = nbytes / (ms * 1e-3) / 1e9
            row = dict(
                bench="ragged_paged_attention", scenario=name, impl=impl, backend=backend,
                device=device, dtype=dtype.name, ms_median=round(ms, 4),
                kv_bytes=nbytes, gb_per_s=float(f"{gbs:.5g}"), copy_bw_gb_per_s=round(bw, 1),
                frac_of_copy_bw=float(f"{gbs / bw:.4g}"), iters=iters, time=time.time(),
                load_avg=os.getloadavg()[0], host=platform.node(), **s,
            )
            if variant is not None:
                from jaxserve.pallas_kernels.ragged_paged_attention import gpu_blocks

                row.update(sweep=True, blocks=variant, chip=gpu_blocks.current_chip())
            rows.append(row)
            print(f"{name:12s} {impl:14s} {ms:9.3f} ms  {gbs:8.1f} GB/s  "
                  f"({100 * gbs / bw:5.1f}% of copy bw)"
                  + (f"  {variant}" if variant is not None else ""))
    for scenario in sorted({r["scenario"] for r in rows if r.get("sweep")}):
        swept = [r for r in rows if r.get("sweep") and r["scenario"] == scenario]
        best = max(swept, key=lambda r: r["gb_per_s"])
        table = next((r for r in swept if r["blocks"]["table"]), None)
        print(f"sweep {scenario}: best {best['blocks']} {best['gb_per_s']} GB/s"
              + (f"; the table's {table['gb_per_s']} GB/s" if table else ""))
    append_results(args.out, rows)
    print(f"wrote {len(rows)} lines to {args.out}")
    return rows


if __name__ == "__main__":
    main()
