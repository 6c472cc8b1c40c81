"""The product kernels on packed weights: AMX bfloat16 tiles (needs a CPU with AMX) and the
strips' products of float32 or bfloat16 weights (AVX-512, and AVX2 + FMA in builds without
AVX-512: each strips test runs on the kernel build targets "native" and "haswell"), and the
packed-weight path of `dense`."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jaxserve.backends.cpu.packing import KERNEL, pack_for_spec, pack_linear_weights
from jaxserve.models.layers.linear import PackedWeight, dense, dense_group
from jaxserve.backends.cpu.kernels.matmul import (
    amx_available,
    avx2_available,
    avx512_available,
    pack_weight,
    packed_matmul,
)
from tests.pallas_kernels.kernel_checks import need_cpu_target

needs_amx = pytest.mark.skipif(not amx_available(), reason="this CPU has no AMX-BF16")


def _bf16(rng, *shape, scale=1.0):
    return (scale * rng.standard_normal(shape)).astype(ml_dtypes.bfloat16)


def test_pack_weight_layout():
    rng = np.random.default_rng(0)
    k, n = 64, 96
    w = _bf16(rng, k, n)
    blocks = pack_weight(w, tiles=True)
    assert blocks.shape == (n // 16, k // 32, 16, 32) and blocks.dtype == ml_dtypes.bfloat16
    for nb, kb, p, c, e in [(0, 0, 0, 0, 0), (5, 1, 15, 15, 1), (2, 1, 7, 3, 0), (3, 0, 9, 12, 1)]:
        assert blocks[nb, kb, p, 2 * c + e] == w[32 * kb + 2 * p + e, 16 * nb + c]
    with pytest.raises(ValueError, match="multiples of 32"):
        pack_weight(w[:48], tiles=True)
    with pytest.raises(ValueError, match="bfloat16"):
        pack_weight(w.astype(np.float32), tiles=True)


@needs_amx
@pytest.mark.parametrize("m", [1, 5, 16, 17, 32, 33, 70])
def test_matches_float32_product(m):
    rng = np.random.default_rng(m)
    k, n = 96, 160
    x, w = _bf16(rng, m, k), _bf16(rng, k, n, scale=0.1)
    want = x.astype(np.float32) @ w.astype(np.float32)
    got = jax.jit(packed_matmul)(jnp.asarray(x), jnp.asarray(pack_weight(w, tiles=True)))
    assert got.shape == (m, n) and got.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)


@needs_amx
def test_large_output_uses_every_strip():
    # An LM-head-like product (many 32-column strips spread over the thread pool).
    rng = np.random.default_rng(1)
    x, w = _bf16(rng, 3, 64), _bf16(rng, 64, 32 * 150, scale=0.1)
    got = np.asarray(packed_matmul(jnp.asarray(x), jnp.asarray(pack_weight(w, tiles=True))))
    np.testing.assert_allclose(got, x.astype(np.float32) @ w.astype(np.float32), rtol=1e-5,
                               atol=1e-5)


@needs_amx
@pytest.mark.parametrize("spec,x_shape,w_shape", [
    ("te,ehd->thd", (7, 64), (64, 4, 16)),
    ("thd,hde->te", (7, 4, 16), (4, 16, 96)),
    ("te,ef->tf", (40, 64), (64, 128)),
    ("ne,ve->nv", (3, 64), (160, 64)),  # a tied LM head: the embedding is [V, E]
])
def test_dense_with_packed_weights_matches_einsum(spec, x_shape, w_shape):
    rng = np.random.default_rng(len(spec))
    x = jnp.asarray(rng.standard_normal(x_shape), jnp.float32)
    w = _bf16(rng, *w_shape, scale=0.1)
    blocks, out_shape = pack_for_spec(spec, w, tiles=True)
    got = jax.jit(lambda x, b: dense(spec, x, PackedWeight(b, (out_shape,), KERNEL)))(
        x, jnp.asarray(blocks))
    want = dense(spec, x, jnp.asarray(w))
    assert got.shape == want.shape and got.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


def test_unpackable_products_stay_on_xla():
    w = np.zeros((64, 40), ml_dtypes.bfloat16)  # N = 40 is not a multiple of 32
    assert pack_for_spec("te,ef->tf", w, tiles=True) is None
    assert pack_for_spec("et,ef->tf", np.zeros((64, 64), ml_dtypes.bfloat16), tiles=False) is None


def test_bad_shapes_are_errors():
    x = jnp.zeros((4, 64), jnp.bfloat16)
    with pytest.raises(ValueError, match="does not match"):
        packed_matmul(x, jnp.zeros((2, 3, 16, 32), jnp.bfloat16))


@needs_amx
def test_fused_group_splits_like_separate_products():
    rng = np.random.default_rng(5)
    spec = "te,ehd->thd"
    x = jnp.asarray(rng.standard_normal((9, 64)), jnp.float32)
    ws = [_bf16(rng, 64, h, 16, scale=0.1) for h in (4, 2, 2)]
    packed = [pack_for_spec(spec, w, tiles=True) for w in ws]
    fused = PackedWeight(jnp.asarray(np.concatenate([b for b, _ in packed])),
                         tuple(s for _, s in packed), KERNEL)
    outs = dense_group(spec, x, fused)
    for got, w in zip(outs, ws):
        want = dense(spec, x, jnp.asarray(w))
        assert got.shape == want.shape
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


@needs_amx
def test_packed_tiny_llama_matches_unpacked():
    """A tiny bfloat16 Llama with its weights packed (q/k/v and gate/up fused, tied LM head)
    gives the logits of the same model on XLA's dot, to float32 summation order."""
    from jaxserve.models.arch_config import ArchConfig
    from jaxserve.models.layers.linear import PackedParam
    from jaxserve.models.weights import create_model
    from tests.pallas_kernels.kernel_checks import TINY_LLAMA

    cfg = ArchConfig.from_hf(TINY_LLAMA)
    models = [create_model(cfg, dtype=jnp.bfloat16, seed=3) for _ in range(2)]
    assert pack_linear_weights(models[1], *models[1].product_specs, tiles=True) == 2 * 4 + 1  # qkv, o, gate_up, down per layer; LM head
    layer = models[1].layers[0]
    assert isinstance(layer.wqkv, PackedParam) and not hasattr(layer, "wq")
    a, b = _tiny_llama_logits(models[0]), _tiny_llama_logits(models[1])
    for x, y in zip(a, b):
        assert np.abs(x).max() > 0.1
        np.testing.assert_allclose(x, y, atol=3e-2, rtol=0)


def _tiny_llama_logits(model, layer_impl=None):
    from tests.models.model_utils import PagedRunner

    rng = np.random.default_rng(2)
    seqs = [rng.integers(0, model.config.vocab_size, size=n).tolist() for n in (13, 6)]
    run = PagedRunner(model, page_size=16, num_pages=16, seed=1, layer_impl=layer_impl)
    kw = dict(num_tokens=32, num_reqs=4, pages_per_req=2)
    out = run.step([(0, seqs[0], 0), (1, seqs[1], 0)], **kw)
    out += run.step([(0, [5], 13), (1, [7], 6)], **kw)
    return [np.asarray(o, np.float32) for o in out]


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_fused_layer_matches_the_composed_packed_layer(dtype):
    """With every product packed, the CPU backend runs a layer as five kernel calls
    (`cpu_layer.fused_layer`: norms, residuals, GLU, rotary and casts inside the kernels); it
    gives the logits of the model's own layer on the same packed weights."""
    from jaxserve.backends.cpu import layer as cpu_layer
    from jaxserve.backends.base import DevicePlan
    from jaxserve.backends.cpu import CpuBackend
    from jaxserve.models.arch_config import ArchConfig
    from jaxserve.models.weights import create_model
    from tests.pallas_kernels.kernel_checks import TINY_LLAMA

    impl = "amx" if dtype == jnp.bfloat16 else "avx512"
    if not (amx_available() if dtype == jnp.bfloat16 else avx512_available()):
        pytest.skip(f"no {impl} product kernel on this CPU")
    model = create_model(ArchConfig.from_hf(TINY_LLAMA), dtype=dtype, seed=4)
    backend = CpuBackend()
    assert backend.layer_impl(model) is None  # nothing packed yet: the model's own layer
    name = jnp.dtype(dtype).name
    backend.prepare_model(model, DevicePlan(name, name, "cpu", impl, "cpu", "ragged"))
    assert backend.layer_impl(model) is cpu_layer.fused_layer
    fused = _tiny_llama_logits(model, cpu_layer.fused_layer)
    composed = _tiny_llama_logits(model)
    atol = 3e-2 if dtype == jnp.bfloat16 else 1e-4
    for x, y in zip(fused, composed):
        assert np.abs(y).max() > 0.1
        np.testing.assert_allclose(x, y, atol=atol, rtol=0)


def _rms_norm_bf16(x, norm, eps):
    """The kernel's prologue in numpy: float32 RMSNorm times norm, rounded to bfloat16."""
    x32 = x.astype(np.float32)
    inv = np.float32(1.0) / np.sqrt(np.mean(x32 * x32, axis=-1, keepdims=True) + np.float32(eps))
    return (x32 * inv * norm.astype(np.float32)).astype(ml_dtypes.bfloat16)


@needs_amx
@pytest.mark.parametrize("m", [1, 17, 40])
@pytest.mark.parametrize("x_dtype", [np.float32, ml_dtypes.bfloat16])
def test_fused_norm_and_residual(m, x_dtype):
    rng = np.random.default_rng(m)
    k, n = 96, 160
    x = (3.0 * rng.standard_normal((m, k))).astype(x_dtype)
    norm = (1.0 + 0.1 * rng.standard_normal(k)).astype(np.float32)
    res = rng.standard_normal((m, n)).astype(np.float32)
    w = _bf16(rng, k, n, scale=0.1)
    a = _rms_norm_bf16(x, norm, 1e-5).astype(np.float32)
    fn = jax.jit(lambda x, w, nrm, r: packed_matmul(x, w, norm=nrm, eps=1e-5, residual=r))
    got = np.asarray(fn(jnp.asarray(x), jnp.asarray(pack_weight(w, tiles=True)), jnp.asarray(norm),
                        jnp.asarray(res)))
    np.testing.assert_allclose(got, res + a @ w.astype(np.float32), rtol=1e-4, atol=1e-4)
    # Without the norm a float32 x is rounded to bfloat16 (not truncated).
    got = np.asarray(packed_matmul(jnp.asarray(x), jnp.asarray(pack_weight(w, tiles=True))))
    want = x.astype(ml_dtypes.bfloat16).astype(np.float32) @ w.astype(np.float32)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@needs_amx
@pytest.mark.parametrize("m", [2, 33])
def test_fused_glu(m):
    rng = np.random.default_rng(100 + m)
    k, f = 64, 96  # gate and up: 96 columns each
    x = rng.standard_normal((m, k)).astype(np.float32)
    wg, wu = _bf16(rng, k, f, scale=0.3), _bf16(rng, k, f, scale=0.3)
    norm = (1.0 + 0.1 * rng.standard_normal(k)).astype(np.float32)
    packed = np.concatenate([pack_weight(wg, tiles=True), pack_weight(wu, tiles=True)], axis=0)
    got = np.asarray(packed_matmul(jnp.asarray(x), jnp.asarray(packed), norm=jnp.asarray(norm),
                                eps=1e-6, glu=True))
    a = _rms_norm_bf16(x, norm, 1e-6).astype(np.float64)
    g, u = a @ wg.astype(np.float64), a @ wu.astype(np.float64)
    assert got.shape == (m, f)
    np.testing.assert_allclose(got, g / (1 + np.exp(-g)) * u, rtol=1e-4, atol=1e-4)


def test_fused_bad_arguments_are_errors():
    x = jnp.zeros((4, 64), jnp.float32)
    w = jnp.zeros((6, 2, 16, 32), jnp.bfloat16)  # K = 64, N = 96
    with pytest.raises(ValueError, match="norm must be"):
        packed_matmul(x, w, norm=jnp.ones((32,)))
    with pytest.raises(ValueError, match="residual must be"):
        packed_matmul(x, w, residual=jnp.zeros((4, 64)))
    with pytest.raises(ValueError, match="glu needs"):
        packed_matmul(x, w, glu=True)


# Builds whose strips' product the tests run: the host's own (AVX-512 or AVX2) and "haswell"
# (AVX2 + FMA without AVX-512: the kernel AVX2-only CPUs run).
F32_TARGETS = ("native", "haswell")
STRIP_DTYPES = (np.float32, ml_dtypes.bfloat16)


def need_f32_kernel(target: str) -> None:
    need_cpu_target(target)
    if not (avx512_available(target) or avx2_available(target)):
        pytest.skip(f"no float32 product kernel in the {target!r} build on this CPU (it needs "
                    "AVX-512, or AVX2 and FMA)")


def test_haswell_build_has_the_avx2_product():
    need_f32_kernel("haswell")
    assert avx2_available("haswell") and not avx512_available("haswell")
    # The host's build has one float32 product at most, AVX-512 where the CPU has it.
    assert not (avx512_available("native") and avx2_available("native"))


@pytest.mark.parametrize("w_dtype", STRIP_DTYPES)
@pytest.mark.parametrize("target", F32_TARGETS)
@pytest.mark.parametrize("k,n", [(32, 64), (96, 128), (608, 192)])
@pytest.mark.parametrize("m", [1, 2, 3, 6, 8, 13, 40])
def test_strips_product_and_fused_ops(m, k, n, target, w_dtype):
    """float32 or bfloat16 weights: column-strip packing and the float32 product (every
    row-block size of both kernels; bfloat16 weights widened exactly), plain and with the norm
    prologue and residual / GLU epilogues, x float32 or bfloat16, against float64 numpy (no
    rounding of x to bfloat16)."""
    need_f32_kernel(target)
    rng = np.random.default_rng(200 + m + k)
    x = rng.standard_normal((m, k)).astype(np.float32)
    w = (0.1 * rng.standard_normal((k, n))).astype(w_dtype)
    packed = pack_weight(w, tiles=False)
    assert packed.shape == (n // 32, k, 32) and packed.dtype == w_dtype
    assert packed[1, 5, 7] == w[5, 32 + 7]
    x64, w64 = x.astype(np.float64), w.astype(np.float64)
    packed = jnp.asarray(packed)
    mm = functools.partial(packed_matmul, target=target)
    got = np.asarray(jax.jit(mm)(jnp.asarray(x), packed))
    np.testing.assert_allclose(got, x64 @ w64, rtol=1e-5, atol=1e-5)
    norm = (1.0 + 0.1 * rng.standard_normal(k)).astype(np.float32)
    res = rng.standard_normal((m, n)).astype(np.float32)
    a = x64 / np.sqrt(np.mean(x64 * x64, axis=-1, keepdims=True) + 1e-5) * norm
    got = np.asarray(mm(jnp.asarray(x), packed, norm=jnp.asarray(norm), eps=1e-5,
                        residual=jnp.asarray(res)))
    np.testing.assert_allclose(got, res + a @ w64, rtol=1e-5, atol=1e-5)
    got = np.asarray(mm(jnp.asarray(x), packed, glu=True))
    g, u = x64 @ w64[:, : n // 2], x64 @ w64[:, n // 2:]
    np.testing.assert_allclose(got, g / (1 + np.exp(-g)) * u, rtol=1e-5, atol=1e-5)
    got = np.asarray(mm(jnp.asarray(x), packed, norm=jnp.asarray(norm), eps=1e-5, glu=True))
    g, u = a @ w64[:, : n // 2], a @ w64[:, n // 2:]
    np.testing.assert_allclose(got, g / (1 + np.exp(-g)) * u, rtol=1e-5, atol=1e-5)
    xb = x.astype(ml_dtypes.bfloat16)  # widened exactly in the prologue
    got = np.asarray(mm(jnp.asarray(xb), packed))
    np.testing.assert_allclose(got, xb.astype(np.float64) @ w64, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("w_dtype", STRIP_DTYPES)
@pytest.mark.parametrize("target", F32_TARGETS)
def test_strips_lm_head_shape_uses_every_strip(target, w_dtype):
    # Many 32-column strips over the thread pool, and a K that is no multiple of any block.
    need_f32_kernel(target)
    rng = np.random.default_rng(2)
    x = rng.standard_normal((9, 576)).astype(np.float32)
    w = (0.05 * rng.standard_normal((576, 32 * 150))).astype(w_dtype)
    got = np.asarray(packed_matmul(jnp.asarray(x), jnp.asarray(pack_weight(w, tiles=False)), target=target))
    np.testing.assert_allclose(got, x.astype(np.float64) @ w.astype(np.float64), rtol=1e-5,
                               atol=1e-5)


@pytest.mark.skipif(not (avx512_available() or avx2_available()),
                    reason="no strips product kernel in this process's build on this CPU")
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_strips_tiny_llama_packed_matches_unpacked(dtype):
    """Packed in strips, float32 or bfloat16 weights give the logits of XLA's dot on the same
    weights (bfloat16: XLA rounds the activations to bfloat16 at each product, the kernel
    keeps them float32: logits of magnitude ~10 differ by up to ~0.05)."""
    from jaxserve.models.arch_config import ArchConfig
    from jaxserve.models.weights import create_model
    from tests.pallas_kernels.kernel_checks import TINY_LLAMA

    cfg = ArchConfig.from_hf(TINY_LLAMA)
    models = [create_model(cfg, dtype=dtype, seed=3) for _ in range(2)]
    assert pack_linear_weights(models[1], *models[1].product_specs, tiles=False) == 2 * 4 + 1
    assert models[1].layers[0].wqkv[...].dtype == dtype
    atol = 1e-4 if dtype == jnp.float32 else 1e-1
    for x, y in zip(_tiny_llama_logits(models[0]), _tiny_llama_logits(models[1])):
        assert np.abs(x).max() > 0.1
        np.testing.assert_allclose(x, y, atol=atol, rtol=0)


@pytest.mark.parametrize("dtype,target,tiles", [
    (jnp.bfloat16, "native", True), (jnp.float32, "native", False), (jnp.float32, "haswell", False),
    (jnp.bfloat16, "haswell", False)])
@pytest.mark.parametrize("live", [0, 5, 40])
def test_live_rows_skip_the_padding(dtype, target, tiles, live):
    """With `live`, rows past it are not computed: zeros, or the residual's rows."""
    if not tiles:
        need_f32_kernel(target)
    elif not amx_available(target):
        pytest.skip("this CPU has no AMX-BF16")
    rng = np.random.default_rng(live)
    m, k, n = 40, 64, 96
    x = rng.standard_normal((m, k)).astype(np.float32)
    w = (0.1 * rng.standard_normal((k, n))).astype(dtype)
    res = rng.standard_normal((m, n)).astype(np.float32)
    packed = jnp.asarray(pack_weight(np.asarray(w), tiles))
    mm = functools.partial(packed_matmul, target=target)
    fn = jax.jit(lambda x, r, live: (mm(x, packed, live=live),
                                     mm(x, packed, residual=r, live=live)))
    plain, with_res = (np.asarray(a) for a in fn(jnp.asarray(x), jnp.asarray(res), live))
    full = np.asarray(mm(jnp.asarray(x), packed))
    np.testing.assert_array_equal(plain[:live], full[:live])
    np.testing.assert_array_equal(plain[live:], 0.0)
    np.testing.assert_allclose(with_res[:live], res[:live] + full[:live], rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(with_res[live:], res[live:])
