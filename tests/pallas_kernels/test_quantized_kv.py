"""Quantized KV pages (fp8 e4m3, int8; `pallas_kernels/kv_quant.py`) through every attention
implementation vs the naive float64 attention over the dequantized pages.

The kernels read the quantized pages; the scales (different per KV head here) are folded into q
and the output as the model does. The Pallas kernels run in their interpreters on the CPU.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from jaxserve.pallas_kernels import kv_quant
from jaxserve.pallas_kernels.ragged_paged_attention.metadata import head_view
from jaxserve.pallas_kernels.ragged_paged_attention.ops import (
    ragged_paged_attention,
    write_kv_and_attend,
)
from tests.pallas_kernels.attention_cases import assert_close_to_naive, make_case
from tests.pallas_kernels.kernel_checks import random_batches

FP8, INT8 = jnp.float8_e4m3fn, jnp.int8
# Per-KV-head scales: int8 pages hold x / s in [-127, 127] (the cases draw N(0, 1) values;
# a few are clipped, the oracle reads the same pages), fp8 ones x / s with 3 mantissa bits.
SCALES = {INT8: ((0.036, 0.05), (0.04, 0.03)), FP8: ((0.5, 2.0), (1.0, 0.25))}
STATIC = ("sm_scale", "sliding_window", "soft_cap", "impl", "k_scale", "v_scale")


def quantize_pages(cache, scale, dtype, d: int):
    """A cache [N, page_size, Hkv * D] quantized head by head (`kv_quant.quantize` takes
    [..., Hkv, D]), in the cache's layout."""
    return kv_quant.quantize(head_view(jnp.asarray(cache), d), scale, dtype).reshape(cache.shape)


def dequantize_pages(cache, scale, d: int):
    return np.asarray(kv_quant.dequantize(head_view(cache, d), scale)).reshape(cache.shape)


def quantized_attention(q, kq, vq, md, *, impl, k_scale, v_scale, sm_scale, sliding_window=None,
                        soft_cap=None):
    """The model's composition (models/layers/attention.py): scales folded into q and out."""
    hkv = kq.shape[2] // q.shape[-1]
    out = ragged_paged_attention(kv_quant.scale_query(q, k_scale, hkv, q.dtype), kq, vq, md,
                                 sm_scale=sm_scale, sliding_window=sliding_window,
                                 soft_cap=soft_cap, impl=impl)
    return kv_quant.scale_output(out, v_scale, hkv)


attn_jit = jax.jit(quantized_attention, static_argnames=STATIC)


def check_quantized(impl: str, dtype, cfg: dict, n: int, seed: int, atol: float,
                    kinds=("decode", "prefill", "mixed"), **static):
    """n seeded random batches (kinds cycling; those of other `kinds` skipped) vs naive."""
    ks, vs = SCALES[dtype]
    sm_scale = 1.0 / math.sqrt(cfg["d"])
    for kind, case in random_batches(cfg, n, seed):
        if kind not in kinds:
            continue
        kq = quantize_pages(case["kc"], ks, dtype, cfg["d"])
        vq = quantize_pages(case["vc"], vs, dtype, cfg["d"])
        assert kq.dtype == dtype and kq.nbytes == case["kc"].size  # one byte a value
        deq = dict(case, kc=dequantize_pages(kq, ks, cfg["d"]),
                   vc=dequantize_pages(vq, vs, cfg["d"]))
        out = attn_jit(jnp.asarray(case["q"]), kq, vq, case["md"], impl=impl, k_scale=ks,
                       v_scale=vs, sm_scale=sm_scale, **static)
        assert_close_to_naive(out, deq, atol=atol, sm_scale=sm_scale,
                              sliding_window=static.get("sliding_window"),
                              soft_cap=static.get("soft_cap"))


CFG = dict(hq=4, hkv=2, d=64, page_size=32, dtype=np.float32)  # page 32: the TPU's 8-bit tile


def test_quantize_rounds_to_the_grid_and_clips():
    x = jnp.asarray(np.linspace(-6, 6, 2 * 3 * 8, dtype=np.float32).reshape(2, 3, 8))
    s = (0.01, 0.05, 0.02)  # per KV head (axis -2)
    q8 = kv_quant.quantize(x, s, INT8)
    hs = np.asarray(s, np.float32)[:, None]
    want = np.clip(np.round(np.asarray(x) / hs), -127, 127)
    np.testing.assert_array_equal(np.asarray(q8), want)
    back = np.asarray(kv_quant.dequantize(q8, s))
    inside = np.abs(np.asarray(x)) <= 127 * hs
    assert np.all(np.abs(back - np.asarray(x))[inside] <= 0.5 * np.broadcast_to(hs, x.shape)[inside]
                  + 1e-7)
    f8 = kv_quant.quantize(x, (2.0,), FP8)  # one scale per tensor
    rel = np.abs(np.asarray(kv_quant.dequantize(f8, (2.0,))) - np.asarray(x))
    assert np.all(rel <= np.abs(np.asarray(x)) * 2**-4 + 2**-9 * 2)  # e4m3: 3 mantissa bits
    assert float(np.abs(np.asarray(kv_quant.quantize(x * 1e3, None, FP8), np.float32)).max()) == 448
    with pytest.raises(ValueError, match="KV heads"):
        kv_quant.head_scales((1.0, 2.0), 3)


@pytest.mark.parametrize("dtype", [FP8, INT8], ids=["fp8", "int8"])
def test_reference_reads_quantized_pages(dtype):
    check_quantized("reference", dtype, CFG, 3, 40, 1e-5)
    if dtype == FP8:  # bfloat16 queries over fp8 pages, window and soft cap
        check_quantized("reference", dtype, dict(CFG, dtype=jnp.bfloat16), 3, 50, 2e-2,
                        kinds=("mixed",), sliding_window=24, soft_cap=5.0)


# The Pallas kernels' interpreters are slow: one dtype each (both take the same convert).
def test_tpu_kernel_reads_quantized_pages():
    with pltpu.force_tpu_interpret_mode():
        check_quantized("tpu", FP8, CFG, 3, 60, 1e-5, kinds=("mixed",))


def test_gpu_kernel_reads_quantized_pages():
    check_quantized("gpu-interpret", INT8, CFG, 3, 70, 1e-5, kinds=("mixed",))


def test_gpu_mosaic_kernel_reads_fp8_pages():
    """fp8 pages copied as they are and widened in shared memory for wgmma (bfloat16 queries,
    per-KV-head scales folded in by the caller): a ragged mix of prefill and decode, head dim
    128 with a GQA group of 4 in the decode kernel's rows."""
    cfg = dict(hq=8, hkv=2, d=128, page_size=16, dtype=jnp.bfloat16)
    check_quantized("gpu-mosaic-interpret", FP8, cfg, 3, 75, 2e-2, kinds=("mixed",))


@pytest.mark.parametrize("dtype", [FP8, INT8], ids=["fp8", "int8"])
def test_cpu_kernel_reads_quantized_pages(dtype):
    from jaxserve.backends.cpu.kernels import attention as cpu_attention  # registers "cpu"
    from tests.pallas_kernels.kernel_checks import need_cpu_target

    need_cpu_target("native")
    assert dtype in cpu_attention.CACHE_DTYPES
    check_quantized("cpu", dtype, CFG, 3, 80, 1e-5)
    check_quantized("cpu", dtype, dict(CFG, page_size=16), 3, 90, 1e-5, kinds=("mixed",),
                    sliding_window=20)


@pytest.mark.parametrize("impl", ["reference", "cpu"])
def test_write_then_attend_quantizes_on_write(impl):
    """write_kv_and_attend with quantized k/v writes exactly those bytes and attends over them
    (the CPU kernel: in place, in one call)."""
    if impl == "cpu":
        from jaxserve.backends.cpu.kernels import attention  # noqa: F401 - registers "cpu"
        from tests.pallas_kernels.kernel_checks import need_cpu_target

        need_cpu_target("native")
    case = make_case([(5, 3), (0, 9)], page_size=32, hq=4, hkv=2, d=64, r_pad=4, t_pad=16)
    ks, vs = SCALES[INT8]
    kq0 = quantize_pages(case["kc"], ks, INT8, 64)
    vq0 = quantize_pages(case["vc"], vs, INT8, 64)
    rng = np.random.default_rng(0)
    k_new = rng.standard_normal((16, 2, 64), np.float32)
    v_new = rng.standard_normal((16, 2, 64), np.float32)

    @jax.jit
    def step(q, k, v, kc, vc, md):
        out, kc, vc = write_kv_and_attend(
            kv_quant.scale_query(q, ks, 2, q.dtype), kv_quant.quantize(k, ks, INT8),
            kv_quant.quantize(v, vs, INT8), kc, vc, md, sm_scale=0.125, impl=impl)
        return kv_quant.scale_output(out, vs, 2), kc, vc

    out, kq, vq = step(jnp.asarray(case["q"]), k_new, v_new, kq0, vq0, case["md"])
    assert kq.dtype == INT8 and vq.dtype == INT8
    slots = np.asarray(case["md"].slot_mapping)[:12]  # the live tokens' slots
    page, off = slots // 32, slots % 32
    np.testing.assert_array_equal(np.asarray(kq)[page, off],
                                  np.asarray(kv_quant.quantize(k_new[:12], ks, INT8)).reshape(12, -1))
    deq = dict(case, kc=dequantize_pages(kq, ks, 64), vc=dequantize_pages(vq, vs, 64))
    assert_close_to_naive(out, deq, atol=1e-5, sm_scale=0.125)


def test_kernels_that_cannot_read_them_fall_back(caplog):
    """gpu-mosaic reads one-byte pages with 16-bit queries only: "auto" on a chip whose only
    kernel it is then runs the reference, saying so."""
    from jaxserve.pallas_kernels.ragged_paged_attention import gpu_mosaic, ops

    kq = jnp.zeros((4, 32, 2 * 64), FP8)
    q = jnp.zeros((8, 4, 64), jnp.float32)
    gpu_mosaic.supports(q.astype(jnp.bfloat16), kq)
    with pytest.raises(ValueError, match="16-bit|bfloat16 or float16 queries"):
        gpu_mosaic.supports(q, kq)
    ops.register_impl("fakechip", ops._REGISTRY.impls["reference"], gpu_mosaic.supports)
    try:
        with caplog.at_level("WARNING"):
            name = ops.dispatch_name("auto", q, kq, backend="fakechip")
    finally:
        ops._REGISTRY.impls.pop("fakechip")
        ops._SUPPORTS.pop("fakechip")
    assert name == "reference"
    assert "float32" in caplog.text and "reference" in caplog.text
