"""The AMX bfloat16 matmul kernel and the packed-weight path of `dense` (needs a CPU with AMX)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jaxserve.models.layers.linear import PackedWeight, dense, dense_group, pack_for_spec
from jaxserve.pallas_kernels.cpu.matmul import amx_available, amx_matmul, pack_weight

needs_amx = pytest.mark.skipif(not amx_available(), reason="this CPU has no AMX-BF16")


def _bf16(rng, *shape, scale=1.0):
    return (scale * rng.standard_normal(shape)).astype(ml_dtypes.bfloat16)


def test_pack_weight_layout():
    rng = np.random.default_rng(0)
    k, n = 64, 96
    w = _bf16(rng, k, n)
    blocks = pack_weight(w)
    assert blocks.shape == (n // 16, k // 32, 16, 32) and blocks.dtype == ml_dtypes.bfloat16
    for nb, kb, p, c, e in [(0, 0, 0, 0, 0), (5, 1, 15, 15, 1), (2, 1, 7, 3, 0), (3, 0, 9, 12, 1)]:
        assert blocks[nb, kb, p, 2 * c + e] == w[32 * kb + 2 * p + e, 16 * nb + c]
    with pytest.raises(ValueError, match="multiples of 32"):
        pack_weight(w[:48])


@needs_amx
@pytest.mark.parametrize("m", [1, 5, 16, 17, 32, 33, 70])
def test_matches_float32_product(m):
    rng = np.random.default_rng(m)
    k, n = 96, 160
    x, w = _bf16(rng, m, k), _bf16(rng, k, n, scale=0.1)
    want = x.astype(np.float32) @ w.astype(np.float32)
    got = jax.jit(amx_matmul)(jnp.asarray(x), jnp.asarray(pack_weight(w)))
    assert got.shape == (m, n) and got.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)


@needs_amx
def test_large_output_uses_every_strip():
    # An LM-head-like product (many 32-column strips spread over the thread pool).
    rng = np.random.default_rng(1)
    x, w = _bf16(rng, 3, 64), _bf16(rng, 64, 32 * 150, scale=0.1)
    got = np.asarray(amx_matmul(jnp.asarray(x), jnp.asarray(pack_weight(w))))
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
    blocks, out_shape = pack_for_spec(spec, w)
    got = jax.jit(lambda x, b: dense(spec, x, PackedWeight(b, (out_shape,))))(x, jnp.asarray(blocks))
    want = dense(spec, x, jnp.asarray(w))
    assert got.shape == want.shape and got.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


def test_unpackable_products_stay_on_xla():
    w = np.zeros((64, 40), ml_dtypes.bfloat16)  # N = 40 is not a multiple of 32
    assert pack_for_spec("te,ef->tf", w) is None
    assert pack_for_spec("et,ef->tf", np.zeros((64, 64), ml_dtypes.bfloat16)) is None


def test_bad_shapes_are_errors():
    x = jnp.zeros((4, 64), jnp.bfloat16)
    with pytest.raises(ValueError, match="does not match"):
        amx_matmul(x, jnp.zeros((2, 3, 16, 32), jnp.bfloat16))


@needs_amx
def test_fused_group_splits_like_separate_products():
    rng = np.random.default_rng(5)
    spec = "te,ehd->thd"
    x = jnp.asarray(rng.standard_normal((9, 64)), jnp.float32)
    ws = [_bf16(rng, 64, h, 16, scale=0.1) for h in (4, 2, 2)]
    packed = [pack_for_spec(spec, w) for w in ws]
    fused = PackedWeight(jnp.asarray(np.concatenate([b for b, _ in packed])),
                         tuple(s for _, s in packed))
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
    from tests.models.model_utils import PagedRunner
    from tests.pallas_kernels.kernel_checks import TINY_LLAMA

    cfg = ArchConfig.from_hf(TINY_LLAMA)
    models = [create_model(cfg, dtype=jnp.bfloat16, seed=3) for _ in range(2)]
    assert models[1].pack_for_amx() == 2 * 4 + 1  # qkv, o, gate_up, down per layer; LM head
    layer = models[1].layers[0]
    assert isinstance(layer.wqkv, PackedParam) and not hasattr(layer, "wq")
    rng = np.random.default_rng(2)
    seqs = [rng.integers(0, cfg.vocab_size, size=n).tolist() for n in (13, 6)]
    logits = []
    for model in models:
        run = PagedRunner(model, page_size=16, num_pages=16, seed=1)
        kw = dict(num_tokens=32, num_reqs=4, pages_per_req=2)
        out = run.step([(0, seqs[0], 0), (1, seqs[1], 0)], **kw)
        out += run.step([(0, [5], 13), (1, [7], 6)], **kw)
        logits.append([np.asarray(o, np.float32) for o in out])
    for a, b in zip(*logits):
        assert np.abs(b).max() > 0.1
        np.testing.assert_allclose(a, b, atol=3e-2, rtol=0)
