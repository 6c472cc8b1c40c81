"""The Pallas GPU (Triton) ragged paged attention kernel vs the naive float64 attention.

On the CPU the kernel runs with the Pallas interpreter (`impl="gpu-interpret"`); under
`pytest --kernel-device` on a GPU it runs compiled (`impl="gpu"`). The Triton lowering itself
is checked on the CPU too (lowering needs no GPU; only compiling the Triton IR does).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.pallas_kernels import ragged_paged_attention
from jaxserve.pallas_kernels.ragged_paged_attention import ops as attn_ops
from jaxserve.pallas_kernels.ragged_paged_attention.gpu import ragged_paged_attention_gpu
from tests.pallas_kernels.attention_cases import assert_close_to_naive, make_case, random_sinks
from tests.pallas_kernels.kernel_checks import (
    check_random_batches,
    query_length_sweep_cases,
    tiny_llama_run,
)

STATIC = ("sm_scale", "sliding_window", "soft_cap", "impl", "chunk_pages", "interpret")
attn_jit = jax.jit(ragged_paged_attention, static_argnames=STATIC)
KNOBS = ("sm_scale", "sliding_window", "soft_cap", "chunk_pages", "queries_per_block",
         "kv_splits", "interpret")
kernel_jit = jax.jit(ragged_paged_attention_gpu, static_argnames=KNOBS)

CONFIGS = {  # GQA ratios 1, 3, 8; head dims 64 and 128; page sizes 8 and 16
    "gqa1-d64-p8-f32": dict(hq=2, hkv=2, d=64, page_size=8, dtype=np.float32),
    "gqa3-d64-p16-f32": dict(hq=3, hkv=1, d=64, page_size=16, dtype=np.float32),
    "gqa8-d128-p8-f32": dict(hq=8, hkv=1, d=128, page_size=8, dtype=np.float32),
    "gqa3-d128-p16-bf16": dict(hq=6, hkv=2, d=128, page_size=16, dtype=jnp.bfloat16),
}


@pytest.fixture(scope="module")
def impl(kernel_device):
    if kernel_device:
        if jax.default_backend() != "gpu":
            pytest.skip("--kernel-device: no GPU backend")
        return "gpu"
    return "gpu-interpret"


@pytest.mark.parametrize("name", list(CONFIGS))
def test_random_ragged_batches(name, impl):
    # 7 seeded batches per config (decode-only, prefill-only, mixed in turn): 28 in all, 21 f32.
    attn = functools.partial(attn_jit, impl=impl)
    errs = check_random_batches(attn, CONFIGS[name], n=7, seed0=100 * len(name))
    assert len(errs) == 7


def test_sliding_window_soft_cap_and_splits(impl):
    # The window and the cap together, several KV splits (decode over long contexts) and small
    # key chunks; kernel knobs called directly.
    cfg = CONFIGS["gqa3-d64-p16-f32"]
    interp = impl == "gpu-interpret"
    for window, cap, splits in ((7, 2.0, 3), (None, 3.0, 5)):
        attn = functools.partial(kernel_jit, kv_splits=splits, chunk_pages=1, interpret=interp)
        check_random_batches(attn, cfg, n=3, seed0=7 + (window or 0), sliding_window=window,
                             soft_cap=cap)


@pytest.mark.parametrize("window,splits", [(7, 3), (None, 1)], ids=["w7-3-splits", "full-1-split"])
def test_sinks(window, splits, impl):
    # Attention sinks (gpt-oss) join the splits' combine: several splits and one, with a
    # sliding window and without; GQA 3 padded to 4 heads (the padded head has no sink).
    cfg = CONFIGS["gqa3-d64-p16-f32"]
    attn = functools.partial(kernel_jit, kv_splits=splits, chunk_pages=1,
                             interpret=impl == "gpu-interpret")
    check_random_batches(attn, cfg, n=2, seed0=31, sinks=random_sinks(cfg["hq"], seed=6),
                         sliding_window=window)


def test_query_lengths_1_to_64(impl):
    cfg = CONFIGS["gqa1-d64-p8-f32"]
    for case in query_length_sweep_cases(cfg, seed=5):
        out = attn_jit(jnp.asarray(case["q"]), jnp.asarray(case["kc"]), jnp.asarray(case["vc"]),
                       case["md"], sm_scale=0.125, impl=impl)
        assert_close_to_naive(out, case, atol=1e-5, sm_scale=0.125)


def test_block_size_knobs_and_all_padding(impl):
    interp = impl == "gpu-interpret"
    case = make_case([(31, 33), (15, 1), (16, 1), (0, 17)], page_size=8, hq=8, hkv=2, d=64,
                     r_pad=6, t_pad=64, seed=3)
    for bq, chunk in ((4, 2), (16, 8)):
        out = kernel_jit(jnp.asarray(case["q"]), jnp.asarray(case["kc"]), jnp.asarray(case["vc"]),
                         case["md"], sm_scale=0.2, queries_per_block=bq, chunk_pages=chunk,
                         interpret=interp)
        assert_close_to_naive(out, case, atol=1e-5, sm_scale=0.2)
    md = case["md"]
    empty = type(md)(block_tables=md.block_tables, kv_lens=jnp.zeros_like(md.kv_lens),
                     query_start_loc=jnp.zeros_like(md.query_start_loc),
                     num_seqs=jnp.asarray(0, jnp.int32), slot_mapping=md.slot_mapping)
    out = kernel_jit(jnp.asarray(case["q"]), jnp.asarray(case["kc"]), jnp.asarray(case["vc"]),
                     empty, sm_scale=0.2, interpret=interp)
    assert np.all(np.asarray(out) == 0)


@pytest.mark.parametrize("dtype,d", [(jnp.float32, 64), (jnp.bfloat16, 128)])
def test_lowers_to_triton(dtype, d):
    """The Triton lowering (Pallas -> Triton IR) runs on any host; only compiling needs a GPU."""
    case = make_case([(20, 1), (0, 12)], page_size=16, hq=8, hkv=1, d=d, r_pad=4, t_pad=16)
    args = [jnp.asarray(case[k], dtype) for k in ("q", "kc", "vc")] + [case["md"]]
    lowered = kernel_jit.trace(*args, sm_scale=0.1, sliding_window=8, soft_cap=5.0,
                               kv_splits=2).lower(lowering_platforms=("cuda",))
    assert "xla.gpu.triton" in lowered.as_text()


def test_validation_errors():
    case = make_case([(3, 2)], page_size=16, hq=4, hkv=2, d=64, r_pad=2, t_pad=4)
    q, kc, vc = (jnp.asarray(case[k]) for k in ("q", "kc", "vc"))
    md = case["md"]
    call = functools.partial(ragged_paged_attention, sm_scale=0.1, impl="gpu-interpret")
    with pytest.raises(ValueError, match="not whole heads"):
        call(q[..., :48], kc, vc, md)
    with pytest.raises(ValueError, match="multiple of Hkv"):
        call(q[:, :3], kc, vc, md)
    with pytest.raises(ValueError, match=r"\[T, Hq, D\]"):
        call(q[0], kc, vc, md)
    with pytest.raises(ValueError, match="one dtype"):
        call(q.astype(jnp.bfloat16), kc, vc, md)
    with pytest.raises(ValueError, match=r"\[N, page_size, Hkv \* D\]"):  # a layer-stacked cache
        call(q, kc[None], vc[None], md)
    with pytest.raises(ValueError, match="slot_mapping"):
        call(q[:3], kc, vc, md)
    with pytest.raises(ValueError, match="kv_lens"):
        call(q, kc, vc, type(md)(md.block_tables, md.kv_lens[:1], md.query_start_loc,
                                    md.num_seqs, md.slot_mapping))
    with pytest.raises(ValueError, match="integer"):
        call(q, kc, vc, type(md)(md.block_tables, md.kv_lens.astype(jnp.float32),
                                    md.query_start_loc, md.num_seqs, md.slot_mapping))
    with pytest.raises(ValueError, match="power-of-two head dim"):
        ragged_paged_attention_gpu(q[..., :48], kc[..., :48], vc[..., :48], md, sm_scale=0.1)
    # auto never picks an unsupported kernel; interpret=True maps "gpu" to "gpu-interpret".
    assert attn_ops.resolve_impl("auto", backend="gpu") == "gpu"
    out = ragged_paged_attention(q, kc, vc, md, sm_scale=0.1, impl="gpu", interpret=True)
    assert out.shape == q.shape


def test_tiny_llama_end_to_end(impl):
    ref_logits, ref_greedy = tiny_llama_run("reference")
    logits, greedy = tiny_llama_run(impl)
    assert greedy == ref_greedy
    for a, b in zip(logits, ref_logits):
        assert np.abs(b).max() > 0.1
        np.testing.assert_allclose(a, b, atol=1e-4, rtol=0)
    assert math.isfinite(float(np.abs(logits[-1]).max()))


def test_a_gpu_serves_the_triton_kernel_and_falls_back_for_unsupported_shapes(monkeypatch, caplog):
    """On a GPU that is not a Hopper one (here: devices that report no compute capability)
    `auto` is the Triton kernel (what `jaxserve serve` takes, through the GPU backend's plan;
    Hopper takes the Mosaic GPU one: test_gpu_mosaic_kernel.py); a shape it cannot take goes to
    the reference, with the reason logged once as a warning; an explicit kernel name is never
    replaced."""
    import logging

    from jaxserve.backends import select_backend
    from jaxserve.config import CacheConfig, ModelConfig
    from jaxserve.parallel.mesh import make_mesh

    plan = select_backend("gpu").plan(ModelConfig(), CacheConfig(), make_mesh(1, 1))
    assert plan.attention_impl == "gpu" and plan.dtype == plan.kv_dtype == "bfloat16"
    q, k = jnp.zeros((4, 8, 128), jnp.bfloat16), jnp.zeros((8, 16, 2, 128), jnp.bfloat16)
    assert attn_ops.dispatch_name("auto", q, k, backend="gpu") == "gpu"
    monkeypatch.setattr(attn_ops._REGISTRY, "warned", set())
    with caplog.at_level(logging.WARNING):
        for _ in range(2):
            name = attn_ops.dispatch_name("auto", q[..., :96], k[..., :96], backend="gpu")
            assert name == "reference"
    warnings = [r.getMessage() for r in caplog.records if "unsupported" in r.getMessage()]
    assert warnings == ["ragged_paged_attention: gpu kernel unsupported here (the gpu kernel "
                        "needs a power-of-two head dim >= 16, got D=96); using the pure-JAX "
                        "reference"]
    assert attn_ops.dispatch_name("gpu-mosaic", q, k, backend="gpu") == "gpu-mosaic"
