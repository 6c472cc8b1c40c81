"""Shared builders for attention tests: random ragged batches and a naive float64 attention."""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np

from jaxserve.pallas_kernels import AttentionMetadata

# --------------------------------------------------------------------------------------------
# Scenario builder and naive reference
# --------------------------------------------------------------------------------------------


def make_case(
    reqs,
    *,
    page_size=16,
    hq=4,
    hkv=2,
    d=64,
    r_pad=8,
    t_pad=None,
    pages_per_req=None,
    num_pages=None,
    dtype=np.float32,
    seed=0,
):
    """A random ragged batch. reqs: list of (cached_context_len, query_len) per live request.

    The caches `kc`, `vc` are one layer's, [N, page_size, hkv * d]. Pages are shuffled and
    non-contiguous; everything (null page included) is random. Padding requests fill up to
    r_pad, padding tokens up to t_pad (they write the null page).
    """
    rng = np.random.default_rng(seed)
    ps = page_size
    kv = [c + n for c, n in reqs]
    need = [math.ceil(x / ps) for x in kv]
    P = pages_per_req or max(max(need), 1)
    N = num_pages or (1 + r_pad * P)
    assert sum(need) + 1 <= N and max(need) <= P and len(reqs) <= r_pad
    total = sum(n for _, n in reqs)
    T = t_pad or total
    assert total <= T
    perm = rng.permutation(np.arange(1, N))  # page 0 is the null page
    bt = np.zeros((r_pad, P), np.int32)
    k = 0
    for r, n in enumerate(need):
        bt[r, :n] = perm[k : k + n]
        k += n
    qsl = np.full(r_pad + 1, total, np.int32)
    qsl[0] = 0
    qsl[1 : len(reqs) + 1] = np.cumsum([n for _, n in reqs])
    kv_lens = np.zeros(r_pad, np.int32)
    kv_lens[: len(reqs)] = kv
    slots = np.zeros(T, np.int32)
    t = 0
    for r, (c, n) in enumerate(reqs):
        for pos in range(c, c + n):
            slots[t] = bt[r, pos // ps] * ps + pos % ps
            t += 1
    slots[t:] = np.arange(T - t) % ps  # padding tokens write the null page
    shape = (N, ps, hkv * d)
    kc = rng.standard_normal(shape, np.float32)
    vc = rng.standard_normal(shape, np.float32)
    q = rng.standard_normal((T, hq, d), np.float32)
    if dtype != np.float32:  # round once, so the naive reference sees the same inputs
        q, kc, vc = (np.asarray(jnp.asarray(x, dtype)) for x in (q, kc, vc))
    md = AttentionMetadata(
        block_tables=jnp.asarray(bt),
        kv_lens=jnp.asarray(kv_lens),
        query_start_loc=jnp.asarray(qsl),
        num_seqs=jnp.asarray(len(reqs), jnp.int32),
        slot_mapping=jnp.asarray(slots),
    )
    return dict(q=q, kc=kc, vc=vc, md=md, reqs=reqs, ps=ps, bt=bt, qsl=qsl)


def naive_attention(case, *, sm_scale, sliding_window=None, soft_cap=None, sinks=None):
    """Dense float64 attention: materialise each request's K/V from its block table. `sinks`
    ([Hq]): one more logit per head in each softmax, with no value (HF's gpt-oss eager
    attention: the sink column is concatenated to the scores, softmaxed, then dropped)."""
    q = np.asarray(case["q"], np.float64)
    T, hq, d = q.shape
    n_pages, page_size, width = np.shape(case["kc"])
    hkv = width // d
    kc = np.asarray(case["kc"], np.float64).reshape(n_pages, page_size, hkv, d)
    vc = np.asarray(case["vc"], np.float64).reshape(n_pages, page_size, hkv, d)
    g = hq // hkv
    ps, bt, qsl = case["ps"], case["bt"], case["qsl"]
    out = np.zeros((T, hq, d))
    for r, (c, n) in enumerate(case["reqs"]):
        L = c + n
        pos = np.arange(L)
        K = kc[bt[r, pos // ps], pos % ps]  # [L, Hkv, D]
        V = vc[bt[r, pos // ps], pos % ps]
        K = np.repeat(K, g, axis=1)
        V = np.repeat(V, g, axis=1)
        Q = q[qsl[r] : qsl[r] + n]  # [n, Hq, D]
        qpos = np.arange(c, L)
        s = np.einsum("qhd,khd->hqk", Q, K) * sm_scale
        if soft_cap is not None:
            s = soft_cap * np.tanh(s / soft_cap)
        mask = pos[None, :] <= qpos[:, None]
        if sliding_window is not None:
            mask &= pos[None, :] > qpos[:, None] - sliding_window
        s = np.where(mask[None], s, -np.inf)
        if sinks is not None:
            sink = np.broadcast_to(np.asarray(sinks, np.float64)[:, None, None], (hq, n, 1))
            s = np.concatenate([s, sink], axis=-1)
        s = s - s.max(-1, keepdims=True)
        p = np.exp(s)
        p /= p.sum(-1, keepdims=True)
        if sinks is not None:
            p = p[..., :-1]  # the sink has no value
        out[qsl[r] : qsl[r] + n] = np.einsum("hqk,khd->qhd", p, V)
    return out


def random_reqs(rng, kind, *, page_size, max_tokens, max_reqs, max_kv, max_q=64):
    """Random live requests [(cached_len, query_len)] of one kind: 'decode', 'prefill', 'mixed'.

    Contexts are biased to end exactly at a page boundary or one past it; every batch fits in
    max_tokens tokens and max_reqs requests (leaving room for padding when drawn smaller).
    """

    def kv_len(lo):
        choice = rng.integers(3)
        if choice == 0:  # exactly at a page boundary
            kv = page_size * int(rng.integers(1, max_kv // page_size + 1))
        elif choice == 1:  # just past one
            kv = page_size * int(rng.integers(0, max_kv // page_size)) + 1
        else:
            kv = int(rng.integers(1, max_kv + 1))
        return min(max(kv, lo), max_kv)

    reqs, budget = [], max_tokens
    n = int(rng.integers(1, max_reqs + 1))
    for i in range(n):
        k = kind if kind != "mixed" else ("decode", "prefill", "chunked")[int(rng.integers(3))]
        if kind == "mixed" and i == 0:
            k = "chunked"
        if budget < 1:
            break
        if k == "decode":
            kv = kv_len(1)
            reqs.append((kv - 1, 1))
            budget -= 1
        else:
            q = int(rng.integers(1, min(max_q, budget, max_kv) + 1))
            if k == "prefill":
                reqs.append((0, q))
            else:
                kv = kv_len(q)
                reqs.append((kv - q, q))
            budget -= q
    return reqs


def random_sinks(hq, seed=0):
    """[Hq] float32 sink logits spread so that some heads' sinks dominate their scores, some
    are comparable and some negligible (scores here are O(1), up to ~5)."""
    rng = np.random.default_rng(seed)
    return (rng.uniform(-4.0, 6.0, hq)).astype(np.float32)


def assert_close_to_naive(out, case, *, atol, sm_scale, sliding_window=None, soft_cap=None,
                          sinks=None):
    assert out.shape == case["q"].shape and out.dtype == case["q"].dtype
    got = np.asarray(out, np.float64)
    want = naive_attention(case, sm_scale=sm_scale, sliding_window=sliding_window,
                           soft_cap=soft_cap, sinks=sinks)
    assert np.all(np.isfinite(got))
    err = np.abs(got - want).max()
    assert err <= atol, f"max abs err {err} > {atol} for reqs {case['reqs']}"
    n_live = int(case["qsl"][len(case["reqs"])])
    assert np.all(got[n_live:] == 0), "padding tokens must output zeros"
    return err
