"""The Pallas Mosaic GPU ragged paged attention kernels (decode and prefill) vs the naive float64
attention, the per-chip block-size table, and what `auto` picks on a GPU.

On the CPU the kernels run in Pallas's Mosaic GPU interpreter (`impl="gpu-mosaic-interpret"`:
TMA copies, barriers, shared memory and the kernels' page walk, masks, widening of one-byte
pages and softmax, with `jnp` products in place of their wgmmas); under `pytest
--kernel-device` on a Hopper GPU they run compiled. Their compiles for H100/H200 are in
tests/tools/test_gpu_topology.py; fp8 pages in tests/pallas_kernels/test_quantized_kv.py. The
interpreter takes seconds a batch: the cases are few and small.
"""

from __future__ import annotations

import functools
import math
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jaxserve.pallas_kernels import ragged_paged_attention
from jaxserve.pallas_kernels.ragged_paged_attention import gpu_blocks, gpu_mosaic
from jaxserve.pallas_kernels.ragged_paged_attention import ops as attn_ops

from tests.pallas_kernels.attention_cases import assert_close_to_naive, make_case, random_sinks
from tests.pallas_kernels.kernel_checks import check_random_batches, tiny_llama_run

STATIC = ("sm_scale", "sliding_window", "soft_cap", "impl", "chunk_pages", "interpret")
attn_jit = jax.jit(ragged_paged_attention, static_argnames=STATIC)
KNOBS = ("sm_scale", "sliding_window", "soft_cap", "kv_splits", "prefill_splits",
         "decode_slots", "prefill_slots", "chunk_keys", "interpret")
kernel_jit = jax.jit(gpu_mosaic.ragged_paged_attention_gpu_mosaic, static_argnames=KNOBS)
CONFIGS = {  # ragged mixes of prefill and decode: GQA 4 and 8, head dims 128 and 64, pages 16, 64
    "gqa4-d128-p16": dict(hq=8, hkv=2, d=128, page_size=16, dtype=jnp.bfloat16),
    "gqa8-d64-p64": dict(hq=8, hkv=1, d=64, page_size=64, dtype=jnp.bfloat16),
}


@pytest.fixture(scope="module")
def impl(kernel_device):
    if kernel_device:
        if jax.default_backend() != "gpu":
            pytest.skip("--kernel-device: no GPU backend")
        capability = attn_ops.gpu_capability()
        if capability is None or capability < (9, 0):
            pytest.skip(
                f"--kernel-device: Mosaic GPU needs Hopper or newer (compute capability "
                f"{capability})"
            )
        return "gpu-mosaic"
    return "gpu-mosaic-interpret"


def _run(case, impl, sm_scale, **knobs):
    args = [jnp.asarray(case[k]) for k in ("q", "kc", "vc")] + [case["md"]]
    if knobs:
        return kernel_jit(*args, sm_scale=sm_scale, interpret=impl.endswith("interpret"), **knobs)
    return attn_jit(*args, sm_scale=sm_scale, impl=impl)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_random_ragged_batches(name, impl):
    # decode-only, prefill-only and mixed batches (partial last pages, padding requests): one
    # decode program holds a KV head's 4 or 8 query heads
    n = 2 if name.startswith("gqa4") else 3  # the interpreter takes seconds a batch
    errs = check_random_batches(
        functools.partial(attn_jit, impl=impl), CONFIGS[name], n=n, seed0=11
    )
    assert len(errs) == n


def test_long_context_split_kv_without_grouping(impl):
    """GQA 1, head dim 128, pages of 32: a 600-key decode beside a short one and a prefill
    chunk over a long context. The table's split count (2 here; a split reads at least 8
    chunks of 64 keys, so the short request's second split is empty), then an explicit 5
    (uneven splits, a chunk at least) with 2 chunks in flight and the prefill chunk in 3
    splits."""
    case = make_case([(599, 1), (70, 1), (400, 5)], page_size=32, hq=2, hkv=2, d=128,
                     r_pad=3, t_pad=8, dtype=jnp.bfloat16, seed=5)
    tb = gpu_blocks.lookup(128, 2)
    assert gpu_blocks.decode_splits(tb, 3, 2, case["bt"].shape[1] * 32) == 2
    sm_scale = 1 / math.sqrt(128)
    assert_close_to_naive(_run(case, impl, sm_scale), case, atol=2e-2, sm_scale=sm_scale)
    out = _run(case, impl, sm_scale, kv_splits=5, decode_slots=2, prefill_splits=3)
    assert_close_to_naive(out, case, atol=2e-2, sm_scale=sm_scale)


def test_sliding_window_soft_cap_splits_and_small_pages(impl):
    cfg = dict(hq=3, hkv=1, d=64, page_size=8, dtype=jnp.bfloat16)
    attn = functools.partial(kernel_jit, kv_splits=3, interpret=impl.endswith("interpret"))
    check_random_batches(attn, cfg, n=1, seed0=11, sliding_window=7, soft_cap=2.0)


def test_sinks_with_sliding_window(impl):
    """Attention sinks (gpt-oss) join both kernels' split combines: decode rows in 3 splits,
    prefill blocks in one (the combine still folds the sink in), GQA 3 padded (no sink on the
    padded rows), a sliding window."""
    cfg = dict(hq=3, hkv=1, d=64, page_size=8, dtype=jnp.bfloat16)
    attn = functools.partial(kernel_jit, kv_splits=3, interpret=impl.endswith("interpret"))
    check_random_batches(attn, cfg, n=2, seed0=41, sinks=random_sinks(3, seed=7),
                         sliding_window=7)


def test_interpret_mapping_and_refusals():
    q, k = jnp.zeros((4, 4, 64), jnp.bfloat16), jnp.zeros((8, 16, 64), jnp.bfloat16)
    assert attn_ops.dispatch_name("gpu-mosaic", q, k, interpret=True) == "gpu-mosaic-interpret"
    with pytest.raises(ValueError, match=r"head dims \(64, 128\).*D=256"):  # it would spill
        gpu_mosaic.supports(
            jnp.zeros((1, 4, 256), jnp.bfloat16), jnp.zeros((2, 16, 256), jnp.bfloat16)
        )
    with pytest.raises(ValueError, match="bfloat16, float16, fp8 or int8"):
        gpu_mosaic.supports(q.astype(jnp.float32), k.astype(jnp.float32))
    with pytest.raises(ValueError, match="one-byte pages with bfloat16 or float16 queries"):
        gpu_mosaic.supports(q.astype(jnp.float32), k.astype(jnp.float8_e4m3fn))
    with pytest.raises(ValueError, match="page_size"):
        gpu_mosaic.supports(q, jnp.zeros((8, 4, 1, 64), jnp.bfloat16))


def test_tiny_llama_end_to_end(impl):
    """The tiny Llama's steps (prefill, chunked prefill with decodes, decode; one layer: the
    interpreter compiles each layer's kernels apart) through the
    kernels over a bfloat16 cache give the reference's greedy tokens, and its logits to within
    bfloat16 attention's rounding (the kernels round p to bfloat16 for the second product)."""
    ref_logits, ref_greedy = tiny_llama_run("reference", kv_dtype=jnp.bfloat16, layers=1)
    logits, greedy = tiny_llama_run(impl, kv_dtype=jnp.bfloat16, layers=1)
    assert greedy == ref_greedy
    for a, b in zip(logits, ref_logits):
        assert np.abs(b).max() > 0.1
        np.testing.assert_allclose(a, b, atol=5e-2, rtol=0)


def _gpus(*capabilities):
    return [types.SimpleNamespace(compute_capability=c) for c in capabilities]


def test_auto_takes_mosaic_gpu_on_hopper_and_triton_elsewhere(monkeypatch, caplog):
    """`auto` on a GPU: the Mosaic GPU kernel on compute capability 9.x, then Triton for what
    it cannot take (a float32 cache), then the reference (a head dim neither takes); Triton on
    Ampere/Ada and on Blackwell (no wgmma there); either by name anywhere."""
    import logging

    assert attn_ops.auto_candidates("gpu", _gpus("9.0")) == ("gpu-mosaic", "gpu")
    assert attn_ops.auto_candidates("gpu", _gpus("9.0", "8.0")) == ("gpu",)
    for cap in ("8.0", "8.9", "10.0", "12.0"):
        assert attn_ops.resolve_impl("auto", "gpu", _gpus(cap)) == "gpu"
    assert attn_ops.resolve_impl("auto", "gpu", []) == "gpu"  # no capability known
    assert attn_ops.resolve_impl("auto", "gpu", _gpus("9.0")) == "gpu-mosaic"
    assert attn_ops.resolve_impl("gpu", "gpu", _gpus("9.0")) == "gpu"
    hopper = dict(backend="gpu", devices=_gpus("9.0"))
    q, k = jnp.zeros((4, 8, 128), jnp.bfloat16), jnp.zeros((8, 16, 2 * 128), jnp.bfloat16)
    fp8 = k.astype(jnp.float8_e4m3fn)
    assert attn_ops.dispatch_name("auto", q, k, **hopper) == "gpu-mosaic"
    assert attn_ops.dispatch_name("auto", q, fp8, **hopper) == "gpu-mosaic"
    monkeypatch.setattr(attn_ops._REGISTRY, "warned", set())
    with caplog.at_level(logging.WARNING):
        f32 = attn_ops.dispatch_name("auto", q.astype(jnp.float32), k.astype(jnp.float32),
                                     **hopper)
        odd = attn_ops.dispatch_name("auto", q[..., :96], k[..., :2 * 96], **hopper)
    assert (f32, odd) == ("gpu", "reference")
    text = caplog.text
    assert "gpu-mosaic kernel unsupported here" in text and "; using gpu" in text
    assert "using the pure-JAX reference" in text
    assert attn_ops.dispatch_name("gpu-mosaic", q, k, backend="gpu", devices=_gpus("8.0")) == (
        "gpu-mosaic")


def test_block_size_table():
    """One entry per chip, head dim and element size (H200 and H100 have their own rows, any
    other Hopper part the default), the decode split count from the grid it would fill."""
    assert gpu_blocks.chip_of("NVIDIA H100 80GB HBM3") == "h100"
    assert gpu_blocks.chip_of("NVIDIA H200") == "h200"
    assert gpu_blocks.chip_of("NVIDIA H20") == "sm90"
    for chip in gpu_blocks.CHIPS:
        for d in (64, 128, 256):
            for size in (1, 2):
                b = gpu_blocks.lookup(d, size, chip)
                assert b.decode_slots >= 2 and b.prefill_slots >= 2 and b.chunk_keys % 64 == 0
    with gpu_blocks.target_chip("h200"):
        assert gpu_blocks.current_chip() == "h200"
    b = gpu_blocks.lookup(128, 2, "h100")
    # Llama-3-8B decode of 64 requests on one GPU: 512 (request, KV head) pairs, 2 splits;
    # 8 requests at 16K: many more splits; short contexts: one.
    assert gpu_blocks.decode_splits(b, 64, 8, 2048) == 2
    assert gpu_blocks.decode_splits(b, 8, 8, 16384) == -(-b.programs // 64)
    assert gpu_blocks.decode_splits(b, 8, 8, 256) == 1


def test_the_plan_names_what_auto_runs_for_the_cache_dtype():
    """A Hopper engine's plan (what `serve` logs and the device check records): the Mosaic GPU
    kernels for bfloat16 and fp8 caches, Triton for a float32 cache (golden parity's)."""
    from jaxserve.backends import select_backend
    from jaxserve.config import CacheConfig, ModelConfig

    mesh = types.SimpleNamespace(devices=np.array(_gpus("9.0")))
    backend = select_backend("gpu")
    for dtype, kv, want in (("auto", "auto", "gpu-mosaic"), ("bfloat16", "fp8", "gpu-mosaic"),
                            ("float32", "auto", "gpu")):
        plan = backend.plan(ModelConfig(dtype=dtype), CacheConfig(kv_cache_dtype=kv), mesh)
        assert plan.attention_impl == want, (dtype, kv, plan)
