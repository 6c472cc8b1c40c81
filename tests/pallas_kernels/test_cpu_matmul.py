"""The AMX bfloat16 matmul kernel and the packed-weight path of `dense` (needs a CPU with AMX)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jaxserve.models.layers.linear import PackedWeight, dense, pack_for_spec
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
    got = jax.jit(lambda x, b: dense(spec, x, PackedWeight(b, out_shape)))(x, jnp.asarray(blocks))
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
