"""The CPU sampling kernel (pallas_kernels/cpu/sample.py) on its own. Its kept sets and
draws are checked against the float64 reference with the JAX steps in
tests/sampling/test_truncation.py (every test there runs on both)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.pallas_kernels import cpu as cpu_kernels
from jaxserve.pallas_kernels.cpu import sample as cpu_sample

pytestmark = pytest.mark.skipif(not cpu_kernels.available(),
                                reason="the CPU kernels cannot be built on this host")


def _sample(x, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, u=0.5, active=True):
    R = x.shape[0]
    row = lambda v, dt: jnp.broadcast_to(jnp.asarray(v, dt), (R,))  # noqa: E731
    tok, mask = jax.jit(lambda x: cpu_sample.sample_rows(
        x, row(temperature, jnp.float32), row(top_k, jnp.int32), row(top_p, jnp.float32),
        row(min_p, jnp.float32), row(u, jnp.float32), row(active, jnp.bool_), with_mask=True))(x)
    return np.asarray(tok), np.asarray(mask)


def test_rows_without_mass_give_token_zero():
    x = np.random.default_rng(0).standard_normal((3, 40)).astype(np.float32)
    x[2] = -np.inf
    tok, mask = _sample(x, active=np.array([True, False, True]))
    assert tok[1:].tolist() == [0, 0]
    assert mask[0].all() and not mask[1:].any()


def test_draw_is_the_inverse_cdf_in_id_order():
    """u picks the first token whose cumulative probability (ids ascending) exceeds u."""
    x = np.log(np.array([[0.1, 0.2, 0.3, 0.4]], np.float32))
    for u, want in [(0.0, 0), (0.05, 0), (0.15, 1), (0.35, 2), (0.65, 3), (0.999, 3)]:
        assert _sample(x, u=u)[0][0] == want, u
    # top_p = 0.5 keeps {3, 2} (0.4 + 0.3 >= 0.5): renormalised 3/7 and 4/7, in id order
    tok, mask = _sample(x, top_p=0.5, u=0.4)
    assert mask[0].tolist() == [False, False, True, True] and tok[0] == 2
    assert _sample(x, top_p=0.5, u=0.5)[0][0] == 3


def test_a_row_samples_the_same_token_in_any_batch():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((8, 3000)).astype(np.float32) * 2
    tok, _ = _sample(x, temperature=0.9, top_p=0.9, u=0.37)
    for i in range(8):
        alone, _ = _sample(x[i : i + 1], temperature=0.9, top_p=0.9, u=0.37)
        assert alone[0] == tok[i]


@pytest.mark.parametrize("k", [0, 1, 7, 64])
def test_raw_logprobs_with_ties(k):
    """log_softmax at the token, rank = #{logits >= its logit}, the top k with ties to the lower
    id, on rows of few distinct values (ties everywhere) and a V that is no multiple of 16."""
    rng = np.random.default_rng(k)
    N, V = 37, 1003
    x = rng.integers(-4, 5, (N, V)).astype(np.float32)
    x[:5] = rng.standard_normal((5, V)).astype(np.float32) * 3
    tok = rng.integers(0, V, N).astype(np.int32)
    lp, ids, top, rank = jax.jit(cpu_sample.raw_logprobs, static_argnums=2)(x, tok, k)
    x64 = x.astype(np.float64)
    lsm = x64 - (x64.max(1, keepdims=True) +
                 np.log(np.exp(x64 - x64.max(1, keepdims=True)).sum(1, keepdims=True)))
    rows = np.arange(N)
    np.testing.assert_allclose(np.asarray(lp), lsm[rows, tok], atol=1e-5)
    np.testing.assert_array_equal(np.asarray(rank), (x >= x[rows, tok][:, None]).sum(1))
    want = np.stack([np.lexsort((np.arange(V), -x[i]))[:k] for i in range(N)])
    np.testing.assert_array_equal(np.asarray(ids), want.reshape(N, k))
    np.testing.assert_allclose(np.asarray(top), np.take_along_axis(lsm, want.reshape(N, k), 1),
                               atol=1e-5)
