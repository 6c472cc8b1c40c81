"""Time the pure-JAX reference ragged paged attention on this machine's default backend.

Decode: 32 requests x 1,024 context (Hq=9, Hkv=3, D=64, page 16, float32), versus a plain
dense attention over the same tokens with K/V already contiguous [R, 1024, Hkv, D]
(einsum + softmax); and the same executable at 128 context. Also a 256-token prefill from
scratch and a 256-token chunk after 768 cached tokens, each versus a dense causal attention
over the same contiguous tokens. Prints a table and appends one JSON line to
benchmarks/results/attention_reference.jsonl.

    .venv/bin/python benchmarks/attention_reference_bench.py [--chunk-pages 2 4 8] [--iters 20]

The machine is shared: look at the load average in the JSON line before trusting a number.
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

HQ, HKV, D, PS = 9, 3, 64, 16
RESULTS = os.path.join(os.path.dirname(__file__), "results", "attention_reference.jsonl")


def interleaved_medians_ms(cases, iters: int) -> list[float]:
    """Median wall time of each (fn, args) in ms. The cases run round-robin, one call each per
    round, so that load from other processes on a shared machine hits them all alike."""
    for f, args in cases:  # compile + warm
        jax.block_until_ready(f(*args))
        jax.block_until_ready(f(*args))
    ts = [[] for _ in cases]
    for _ in range(iters):
        for i, (f, args) in enumerate(cases):
            t0 = time.perf_counter()
            jax.block_until_ready(f(*args))
            ts[i].append(time.perf_counter() - t0)
    return [1e3 * float(np.median(t)) for t in ts]


def paged_batch(reqs, rng, t_pad=None):
    """(ctx, q_len) per request -> q, one layer's caches [N, PS, HKV * D] (the server's layout),
    metadata; pages shuffled."""
    kv = [c + n for c, n in reqs]
    need = [math.ceil(x / PS) for x in kv]
    R, P = len(reqs), max(need)
    N = 1 + sum(need)
    perm = rng.permutation(np.arange(1, N))
    bt = np.zeros((R, P), np.int32)
    k = 0
    for r, n in enumerate(need):
        bt[r, :n] = perm[k : k + n]
        k += n
    T = t_pad or sum(n for _, n in reqs)
    qsl = np.concatenate([[0], np.cumsum([n for _, n in reqs])]).astype(np.int32)
    slots = np.zeros(T, np.int32)
    t = 0
    for r, (c, n) in enumerate(reqs):
        for pos in range(c, c + n):
            slots[t] = bt[r, pos // PS] * PS + pos % PS
            t += 1
    kc = jnp.asarray(rng.standard_normal((N, PS, HKV * D), np.float32))
    vc = jnp.asarray(rng.standard_normal((N, PS, HKV * D), np.float32))
    q = jnp.asarray(rng.standard_normal((T, HQ, D), np.float32))
    md = AttentionMetadata(
        block_tables=jnp.asarray(bt),
        kv_lens=jnp.asarray(kv, jnp.int32),
        query_start_loc=jnp.asarray(qsl),
        num_seqs=jnp.asarray(R, jnp.int32),
        slot_mapping=jnp.asarray(slots),
    )
    return q, kc, vc, md


@jax.jit
def dense_decode(q, k, v):
    """q [R, Hq, D], k/v [R, S, Hkv, D] contiguous: plain attention of one query per request."""
    R, S, hkv, d = k.shape
    qg = q.reshape(R, hkv, -1, d)
    s = jnp.einsum("rhgd,rshd->rhgs", qg, k, preferred_element_type=jnp.float32) / math.sqrt(d)
    p = jax.nn.softmax(s, axis=-1)
    o = jnp.einsum("rhgs,rshd->rhgd", p, v, preferred_element_type=jnp.float32)
    return o.reshape(R, -1, d)


@jax.jit
def dense_decode_head_major(q, k, v):
    """As dense_decode, with K/V already laid out [R, Hkv, S, D] (no transpose inside)."""
    R, hkv, S, d = k.shape
    qg = q.reshape(R, hkv, -1, d)
    s = jnp.einsum("rhgd,rhsd->rhgs", qg, k, preferred_element_type=jnp.float32) / math.sqrt(d)
    p = jax.nn.softmax(s, axis=-1)
    o = jnp.einsum("rhgs,rhsd->rhgd", p, v, preferred_element_type=jnp.float32)
    return o.reshape(R, -1, d)


@jax.jit
def dense_prefill(q, k, v):
    """q [Tq, Hq, D], k/v [S, Hkv, D] contiguous: causal attention of one request's last Tq
    tokens over its S keys (Tq == S: a prefill from scratch; Tq < S: a chunk after context)."""
    S, hkv, d = k.shape
    Tq = q.shape[0]
    qg = q.reshape(Tq, hkv, -1, d)
    s = jnp.einsum("qhgd,khd->hgqk", qg, k, preferred_element_type=jnp.float32) / math.sqrt(d)
    q_pos = S - Tq + jnp.arange(Tq)
    s = jnp.where(jnp.arange(S)[None, :] <= q_pos[:, None], s, -jnp.inf)
    p = jax.nn.softmax(s, axis=-1)
    return jnp.einsum("hgqk,khd->qhgd", p, v).reshape(Tq, -1, d)


def attn_fn(chunk_pages):
    def f(q, kc, vc, md):
        return ragged_paged_attention(
            q, kc, vc, md, sm_scale=1 / math.sqrt(D), impl="reference", chunk_pages=chunk_pages
        )

    return jax.jit(f)


def dense_kv(rng, *shape):
    return (jnp.asarray(rng.standard_normal(shape, np.float32)) for _ in range(2))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--chunk-pages", type=int, nargs="*", default=[None],
                    help="pages per key-loop iteration; 0: the per-path defaults (the default)")
    ap.add_argument("--no-write", action="store_true", help="do not append to the results file")
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    it = args.iters
    cases = []  # (name, chunk_pages, fn, args, baseline name or None)

    # Decode: 32 x 1024 context (1023 cached + the new token), vs dense over contiguous K/V.
    R, S = 32, 1024
    q, kc, vc, md = paged_batch([(S - 1, 1)] * R, rng)
    kd, vd = dense_kv(rng, R, S, HKV, D)
    fns = {cp or None: attn_fn(cp or None) for cp in args.chunk_pages}
    base = "dense decode 32x1024"
    cases.append((base, None, dense_decode, (q, kd, vd), None))
    for cp, f in fns.items():
        cases.append(("reference decode 32x1024", cp, f, (q, kc, vc, md), base))
    # A stronger dense baseline: K/V pre-transposed head-major, so no copy inside the call.
    kdt, vdt = kd.transpose(0, 2, 1, 3), vd.transpose(0, 2, 1, 3)
    cases.append(("dense decode 32x1024 head-major K/V", None, dense_decode_head_major,
                  (q, kdt, vdt), None))
    # The same executable (same shapes) at a short context: the trip count follows the data.
    q2, kc2, vc2, md2 = paged_batch([(127, 1)] * R, rng)
    md2 = AttentionMetadata(
        jnp.pad(md2.block_tables, ((0, 0), (0, md.block_tables.shape[1] - 8))),
        md2.kv_lens, md2.query_start_loc, md2.num_seqs, md2.slot_mapping,
    )
    kc2 = jnp.pad(kc2, ((0, kc.shape[0] - kc2.shape[0]), (0, 0), (0, 0)))
    vc2 = jnp.pad(vc2, ((0, vc.shape[0] - vc2.shape[0]), (0, 0), (0, 0)))
    base = "dense decode 32x128"
    cases.append((base, None, dense_decode, (q2, kd[:, :128], vd[:, :128]), None))
    for cp, f in fns.items():
        cases.append(("reference decode 32x128 (same exe)", cp, f, (q2, kc2, vc2, md2), base))

    # Prefill: 256 tokens from scratch, and a 256-token chunk after 768 cached tokens.
    for ctx in (0, 768):
        name = "prefill 256" if ctx == 0 else "prefill 256 after 768"
        qp, kcp, vcp, mdp = paged_batch([(ctx, 256)], rng)
        pos = jnp.arange(ctx + 256)
        slots = mdp.block_tables[0, pos // PS] * PS + pos % PS
        kp, vp = kcp[slots // PS, slots % PS], vcp[slots // PS, slots % PS]
        base = f"dense causal {name}"
        cases.append((base, None, dense_prefill, (qp, kp, vp), None))
        for cp, f in fns.items():
            cases.append((f"reference {name}", cp, f, (qp, kcp, vcp, mdp), base))

    times = interleaved_medians_ms([(f, a) for _, _, f, a, _ in cases], it)
    by_name = {c[0]: t for c, t in zip(cases, times) if c[4] is None}
    rows = [(n, cp, t, None if b is None else by_name[b]) for (n, cp, _, _, b), t in
            zip(cases, times)]
    dense_dec = by_name["dense decode 32x1024"]
    dense_dec_hm = by_name["dense decode 32x1024 head-major K/V"]

    print(f"backend={jax.default_backend()} cpus={os.cpu_count()} Hq={HQ} Hkv={HKV} D={D} "
          f"page={PS} float32, median of {it} interleaved runs, "
          f"load avg {os.getloadavg()[0]:.1f}")
    print(f"{'case':36s} {'chunk_pages':>11s} {'median ms':>10s} {'x dense':>8s}")
    for name, cp, ms, base in rows:
        ratio = f"{ms / base:8.2f}" if base else f"{'-':>8s}"
        print(f"{name:36s} {'-' if base is None else str(cp or 'default'):>11s} {ms:10.3f} {ratio}")

    dec = [r for r in rows if r[0] == "reference decode 32x1024"]
    best = min(dec, key=lambda r: r[2])
    record = {
        "bench": "attention_reference",
        "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "backend": jax.default_backend(),
        "jax": jax.__version__,
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "load_avg_1m": round(os.getloadavg()[0], 2),
        "shape": {"Hq": HQ, "Hkv": HKV, "D": D, "page_size": PS, "dtype": "float32"},
        "iters": it,
        "rows": [
            {"case": n, "chunk_pages": cp, "median_ms": round(ms, 4),
             "x_dense": None if b is None else round(ms / b, 3)}
            for n, cp, ms, b in rows
        ],
        "decode_ratio_vs_dense": round(best[2] / dense_dec, 3),
        "decode_ratio_vs_dense_head_major": round(best[2] / dense_dec_hm, 3),
    }
    if not args.no_write:
        append_results(RESULTS, record)
        print(f"appended to {RESULTS}")
    print(f"decode reference / dense = {record['decode_ratio_vs_dense']:.2f} "
          f"(/ dense with head-major K/V = {record['decode_ratio_vs_dense_head_major']:.2f})")


if __name__ == "__main__":
    main()
