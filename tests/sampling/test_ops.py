"""sampling/ops.py's value search (`boundary`) on rows that no smooth distribution gives: values
over the whole float32 range, -inf, and tie groups, with a small extraction width, so that the
search must close brackets by its key probes alone, within its bound of passes."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.sampling import ops

R, V = 4, 4096


def _rows(seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    sign = rng.choice([-1.0, 1.0], size=(R, V))
    x = (sign * 10.0 ** rng.uniform(-30, 38, size=(R, V))).astype(np.float32)
    x[0, rng.permutation(V)[:300]] = -np.inf
    x[1, rng.permutation(V)[:1500]] = 0.0  # a tie group far wider than the extraction
    x[2, rng.permutation(V)[:40]] = np.float32(3.0e38)
    x[3] = np.nextafter(np.float32(1.0), np.float32(2.0)) * np.where(x[3] > 0, 1, -1)  # 2 values
    return x


@jax.jit
def _kth(x, k):
    n = x.shape[0]
    return ops.boundary(x, jnp.ones_like, k.astype(jnp.float32), jnp.full((n,), -jnp.inf),
                        jnp.ones((n,), bool), 4)


@pytest.mark.parametrize("seed", [0, 1])
def test_kth_value_is_exact_over_the_whole_float_range(seed):
    """The k-th element in the order (value desc, id asc): its value and id, as a stable sort
    gives them, at k from the top to the last element."""
    x = _rows(seed)
    for k in (1, 2, 37, 1499, 2048, V):
        tau, ids = _kth(jnp.asarray(x), jnp.full((R,), k, jnp.int32))
        for r in range(R):
            order = np.lexsort((np.arange(V), -x[r].astype(np.float64)))
            want = order[k - 1]
            assert int(ids[r]) == want, (r, k)
            assert float(tau[r]) == float(x[r, want]), (r, k)


def test_the_search_is_bounded():
    """MAX_PASSES passes of KEY_PROBES + 1 pieces each split any bracket of float32 keys
    (fewer than 2**32) down to adjacent keys."""
    d = 0xFF800000 - 0x00800000  # the keys from -inf to inf
    for _ in range(ops.MAX_PASSES):
        d = -(-d // (ops.KEY_PROBES + 1))
    assert d <= 1
    keys = ops._key(jnp.asarray([-np.inf, -1.0, -0.0, 0.0, 1e-45, 1.0, np.inf], jnp.float32))
    assert [int(k) for k in keys] == [0x00800000, 0x40800000, 0x80000000, 0x80000000,
                                      0x80000001, 0xBF800000, 0xFF800000]
    back = ops._value(keys)
    assert list(np.asarray(back)) == [-np.inf, -1.0, 0.0, 0.0, np.float32(1e-45), 1.0, np.inf]
