"""The pure-JAX reference ragged paged attention against a naive float64 numpy attention."""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.pallas_kernels import AttentionMetadata, ragged_paged_attention, write_kv
from jaxserve.pallas_kernels.ragged_paged_attention import ops as attn_ops
from jaxserve.pallas_kernels.ragged_paged_attention.reference import (
    ragged_paged_attention_reference,
)
from tests.pallas_kernels.attention_cases import make_case, naive_attention, random_sinks

STATIC = ("sm_scale", "sliding_window", "soft_cap", "impl", "chunk_pages")
attn_jit = jax.jit(ragged_paged_attention, static_argnames=STATIC)


ref_jit = jax.jit(
    ragged_paged_attention_reference,
    static_argnames=("sm_scale", "sliding_window", "soft_cap", "chunk_pages", "query_block",
                     "dense_step"),
)


def check(case, *, atol=1e-5, sliding_window=None, soft_cap=None, chunk_pages=None, sm_scale=None,
          sinks=None, **ref_knobs):
    """Compare with the naive attention; ref_knobs (query_block, dense_step) call the reference
    implementation directly, otherwise the public op is called. `sinks` ([Hq]) is passed as an
    array (traced) when given."""
    d = case["q"].shape[-1]
    sm_scale = sm_scale or 1.0 / math.sqrt(d)
    fn, extra = (ref_jit, dict(ref_knobs)) if ref_knobs else (attn_jit, {})
    if sinks is not None:
        extra["sinks"] = jnp.asarray(sinks)
    out = fn(
        jnp.asarray(case["q"]),
        jnp.asarray(case["kc"]),
        jnp.asarray(case["vc"]),
        case["md"],
        sm_scale=sm_scale,
        sliding_window=sliding_window,
        soft_cap=soft_cap,
        chunk_pages=chunk_pages,
        **extra,
    )
    assert out.shape == case["q"].shape and out.dtype == case["q"].dtype
    got = np.asarray(out, np.float64)
    want = naive_attention(
        case, sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap, sinks=sinks
    )
    assert np.all(np.isfinite(got))
    np.testing.assert_allclose(got, want, atol=atol, rtol=0)
    n_live = int(case["qsl"][len(case["reqs"])])
    assert np.all(got[n_live:] == 0), "padding tokens must output zeros"
    return got


# --------------------------------------------------------------------------------------------
# Correctness
# --------------------------------------------------------------------------------------------

# Contexts ending exactly at and just past page boundaries (page 16), plus short and long ones.
# (Page size 8 boundaries fall mid-page here; test_gqa_head_dims_page_sizes covers page 8.)
DECODE_KV = [1, 2, 8, 9, 15, 16, 17, 32, 33, 47, 64, 100]
# One set of shapes for the decode-only, prefill-only, all-padding and one-executable tests, so
# that they share a single compiled executable (compiles dominate this file's run time).
SHAPES = dict(r_pad=14, t_pad=512, pages_per_req=7)


def test_decode_only():
    reqs = [(kv - 1, 1) for kv in DECODE_KV]
    check(make_case(reqs, seed=1, **SHAPES))


def test_prefill_only_query_lengths_1_to_64():
    # Every query length 1..64 appears across the cases; padding requests and padding tokens.
    lens = list(range(1, 65))
    rng = np.random.default_rng(7)
    rng.shuffle(lens)
    for i in range(0, 64, 8):
        reqs = [(0, n) for n in lens[i : i + 8]]
        check(make_case(reqs, seed=i, **SHAPES))


MIXED = [
    (16, 16),  # chunked prefill starting exactly at a page boundary
    (31, 64),  # chunked prefill starting mid-page, spanning pages
    (48, 5),
    (100, 1),  # decode
    (5, 3),
    (0, 37),  # fresh prefill, partial last page
    (20, 1),
]


@pytest.mark.parametrize("dense_step", [True, False])
def test_mixed_prefill_decode_and_chunked_prefill(dense_step):
    # Many key-loop iterations (a chunk that does not divide the page count) and several query
    # blocks per request; the last block of (0, 37), tokens 89..125, overruns T=129 (its slice
    # is clamped inside the token array); 2 padding tokens and 1 padding request. This step's
    # own tokens read through the block table like everything else (the default), or as one
    # dense [T, T] block.
    case = make_case(MIXED, r_pad=8, t_pad=129, seed=4)
    check(case, chunk_pages=3, query_block=6, dense_step=dense_step)


@pytest.mark.parametrize(
    "hq,hkv,d,page_size",
    [(4, 4, 64, 16), (9, 3, 64, 8), (16, 2, 128, 8)],
    ids=["gqa1-d64-p16", "gqa3-d64-p8", "gqa8-d128-p8"],
)
def test_gqa_head_dims_page_sizes(hq, hkv, d, page_size):
    reqs = [(0, 9), (33, 1), (7, 12), (16, 1), (40, 20)]
    case = make_case(
        reqs, hq=hq, hkv=hkv, d=d, page_size=page_size, r_pad=8, t_pad=64, seed=hq * 10 + d,
    )
    check(case)


@pytest.mark.parametrize(
    "window,knobs",
    [(1, {}), (7, dict(chunk_pages=1, query_block=6)), (16, dict(dense_step=True))],
    ids=["w1", "w7-small-chunks", "w16-dense-step"],
)
def test_sliding_window(window, knobs):
    reqs = [(0, 40), (30, 1), (15, 1), (17, 20), (64, 3), (2, 2), (49, 1)]
    case = make_case(reqs, page_size=8, r_pad=8, t_pad=80, seed=window)
    check(case, sliding_window=window, **knobs)


def test_soft_cap():
    reqs = [(0, 23), (45, 1), (9, 17)]
    case = make_case(reqs, hq=6, hkv=2, r_pad=4, t_pad=48, seed=11)
    # A large sm_scale makes the cap bite (scores well beyond +-soft_cap). With a window too,
    # and this step's tokens as a dense block (test_bfloat16 covers the cap on the default path).
    check(case, soft_cap=5.0, sm_scale=1.0, sliding_window=12, dense_step=True, query_block=8)


def test_bfloat16():
    reqs = [(0, 30), (40, 1), (17, 16), (64, 1)]
    case = make_case(reqs, hq=6, hkv=2, r_pad=4, t_pad=64, dtype=jnp.bfloat16, seed=5)
    # (One compile: the window and the cap are exercised too, with a cap that bites.)
    check(case, atol=2e-2, sliding_window=10, soft_cap=3.0, sm_scale=0.5)


# Attention sinks (gpt-oss): a decode request, a fresh prefill, chunked prefills crossing pages,
# with and without a sliding window, on every path of the reference (several query blocks and
# key chunks; this step's keys as a dense block).
SINK_REQS = [(0, 21), (30, 1), (15, 1), (17, 12), (64, 3), (2, 2), (49, 1)]


@pytest.mark.parametrize(
    "window,knobs",
    [(None, {}), (7, dict(chunk_pages=1, query_block=6)), (16, dict(dense_step=True))],
    ids=["full", "w7-small-chunks", "w16-dense-step"],
)
def test_sinks(window, knobs):
    case = make_case(SINK_REQS, hq=6, hkv=2, page_size=8, r_pad=8, t_pad=48, seed=21)
    sinks = random_sinks(6, seed=3)
    got = check(case, sliding_window=window, sinks=sinks, **knobs)
    # The sinks matter here (the test would catch an implementation that dropped them).
    plain = naive_attention(case, sm_scale=0.125, sliding_window=window)
    assert np.abs(got - plain).max() > 0.1


def test_sinks_are_an_input_not_a_constant():
    # One executable for every sink value; a sink of -inf is no sink at all; a huge sink drains
    # the attention to zero (the probabilities go to the sink, which has no value).
    case = make_case(SINK_REQS, hq=6, hkv=2, page_size=8, r_pad=8, t_pad=48, seed=22)
    check(case, sinks=random_sinks(6, seed=4))
    size = attn_jit._cache_size()
    got = check(case, sinks=np.full(6, -np.inf, np.float32))
    np.testing.assert_allclose(got, naive_attention(case, sm_scale=0.125), atol=1e-5, rtol=0)
    got = check(case, sinks=np.array([40.0, 0.0, 0.0, 0.0, 0.0, 40.0], np.float32))
    assert np.abs(got[:, [0, 5]]).max() < 1e-9 and np.abs(got[:, 1:5]).max() > 0.1
    assert attn_jit._cache_size() == size, "a new sink value recompiled the op"


def test_sinks_validation():
    case = make_case([(3, 2)], r_pad=2, t_pad=4, seed=4)
    args = (jnp.asarray(case["q"]), jnp.asarray(case["kc"]), jnp.asarray(case["vc"]), case["md"])
    for bad in (jnp.zeros(3), jnp.zeros((4, 1)), jnp.zeros(4, jnp.int32)):
        with pytest.raises(ValueError, match="sinks must be a floating"):
            ragged_paged_attention(*args, sm_scale=0.1, sinks=bad, impl="reference")


def test_all_padding_batch():
    case = make_case([(kv - 1, 1) for kv in DECODE_KV], seed=2, **SHAPES)
    md = case["md"]
    md = AttentionMetadata(
        block_tables=md.block_tables,
        kv_lens=jnp.zeros_like(md.kv_lens),
        query_start_loc=jnp.zeros_like(md.query_start_loc),
        num_seqs=jnp.asarray(0, jnp.int32),
        slot_mapping=md.slot_mapping,
    )
    out = attn_jit(
        jnp.asarray(case["q"]), jnp.asarray(case["kc"]), jnp.asarray(case["vc"]), md,
        sm_scale=0.125, sliding_window=None, soft_cap=None, chunk_pages=None,
    )  # the same static arguments and shapes as test_decode_only: no new compile
    assert np.all(np.asarray(out) == 0)


# --------------------------------------------------------------------------------------------
# Tracing, compilation and dispatch
# --------------------------------------------------------------------------------------------


def test_one_executable_serves_all_context_lengths():
    # Decode at growing contexts (0 to 7 pages), then a prefill: same shapes, same executable.
    batches = [[(0, 1)], [(5, 1), (111, 1)], [(95, 1), (31, 1), (16, 1)], [(40, 60), (3, 1)]]
    sizes = []
    for i, reqs in enumerate(batches):
        case = make_case(reqs, seed=100 + i, **SHAPES)
        check(case)  # the public op, jitted once at module level (attn_jit)
        sizes.append(attn_jit._cache_size())
    assert sizes[1:] == sizes[:1] * (len(sizes) - 1), f"recompiled: cache sizes {sizes}"


def test_per_layer_caches_with_write_kv():
    """The model's use: one cache pair per layer, a loop over layers, write_kv then attention.
    Every layer's cache holds different values, so each layer's output checks that it read its
    own arrays."""
    L, hq, hkv, d = 3, 6, 2, 64
    reqs = [(0, 11), (21, 1), (16, 5)]
    case = make_case(reqs, hq=hq, hkv=hkv, d=d, r_pad=4, t_pad=24, seed=9)
    rng = np.random.default_rng(19)
    T = case["q"].shape[0]
    shape = case["kc"].shape
    kcs = [case["kc"]] + [rng.standard_normal(shape, np.float32) for _ in range(L - 1)]
    vcs = [case["vc"]] + [rng.standard_normal(shape, np.float32) for _ in range(L - 1)]
    qs = rng.standard_normal((L, T, hq, d), np.float32)
    ks = rng.standard_normal((L, T, hkv, d), np.float32)
    vs = rng.standard_normal((L, T, hkv, d), np.float32)
    md = case["md"]

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def step(kcs, vcs, qs, ks, vs, md):
        kcs, vcs, outs = list(kcs), list(vcs), []
        for i in range(L):
            kcs[i], vcs[i] = write_kv(kcs[i], vcs[i], ks[i], vs[i], md.slot_mapping)
            outs.append(ragged_paged_attention(qs[i], kcs[i], vcs[i], md, sm_scale=0.125))
        return tuple(kcs), tuple(vcs), outs

    kc_out, vc_out, outs = step(tuple(map(jnp.asarray, kcs)), tuple(map(jnp.asarray, vcs)),
                                qs, ks, vs, md)
    # Expected: the caches with the new K/V written at slot_mapping (live tokens), then naive.
    n_live = int(case["qsl"][len(reqs)])
    slots = np.asarray(md.slot_mapping)[:n_live]
    for i in range(L):
        kc_w, vc_w = kcs[i].copy(), vcs[i].copy()
        kc_w[slots // 16, slots % 16] = ks[i, :n_live].reshape(n_live, -1)
        vc_w[slots // 16, slots % 16] = vs[i, :n_live].reshape(n_live, -1)
        # Live pages must match exactly (the null page holds arbitrary padding writes).
        np.testing.assert_array_equal(np.asarray(kc_out[i])[1:], kc_w[1:])
        np.testing.assert_array_equal(np.asarray(vc_out[i])[1:], vc_w[1:])
        want = naive_attention(dict(case, q=qs[i], kc=kc_w, vc=vc_w), sm_scale=0.125)
        np.testing.assert_allclose(np.asarray(outs[i]), want, atol=1e-5, rtol=0)


def test_dispatch():
    # The CPU backend registers its kernel when it is loaded (the op's layer is below it).
    import jaxserve.backends.cpu.kernels.attention  # noqa: F401

    assert attn_ops.resolve_impl("reference") == "reference"
    # On the CPU "auto" names the native kernel (which falls back to the reference when it
    # cannot be built; tests/pallas_kernels/test_cpu_kernel.py).
    assert attn_ops.resolve_impl("auto", backend="cpu") == "cpu"
    assert attn_ops.resolve_impl("auto", backend="rocm") == "reference"
    case = make_case([(3, 2)], r_pad=2, t_pad=4, seed=4)
    args = (jnp.asarray(case["q"]), jnp.asarray(case["kc"]), jnp.asarray(case["vc"]), case["md"])
    for impl in ("tpu", "gpu"):
        if impl not in attn_ops.available_impls():
            with pytest.raises(ValueError, match="not available yet"):
                ragged_paged_attention(*args, sm_scale=0.1, impl=impl)
    with pytest.raises(ValueError, match="unknown impl"):
        ragged_paged_attention(*args, sm_scale=0.1, impl="cuda-graphs")
    with pytest.raises(ValueError, match="multiple"):
        ragged_paged_attention(args[0][:, :3], *args[1:], sm_scale=0.1)
