"""The CPU sampling kernel (backends/cpu/kernels/sample.py) on its own, on each kernel build target
(`kernel_checks.CPU_TARGETS`: AVX-512, AVX2 and portable passes over a row). Its kept sets and
draws are also checked through the sampler against the float64 reference with the JAX steps
in tests/sampling/test_truncation.py (every test there runs on both, with the process's build);
here the kept sets of each build are compared with the same reference directly."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.backends.cpu.kernels import sample as cpu_sample
from tests.pallas_kernels.kernel_checks import CPU_TARGETS, need_cpu_target
from tests.sampling import reference as ref


@pytest.fixture(params=CPU_TARGETS, autouse=True)
def target(request):
    need_cpu_target(request.param)
    return request.param


@functools.cache
def _sample_fn(target):
    return jax.jit(functools.partial(cpu_sample.sample_rows, with_mask=True, target=target))


def _sample(target, x, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, u=0.5, active=True):
    R = x.shape[0]
    row = lambda v, dt: jnp.broadcast_to(jnp.asarray(v, dt), (R,))  # noqa: E731
    tok, mask = _sample_fn(target)(
        jnp.asarray(x), row(temperature, jnp.float32), row(top_k, jnp.int32),
        row(top_p, jnp.float32), row(min_p, jnp.float32), row(u, jnp.float32),
        row(active, jnp.bool_))
    return np.asarray(tok), np.asarray(mask)


def test_rows_without_mass_give_token_zero(target):
    x = np.random.default_rng(0).standard_normal((3, 40)).astype(np.float32)
    x[2] = -np.inf
    tok, mask = _sample(target, x, active=np.array([True, False, True]))
    assert tok[1:].tolist() == [0, 0]
    assert mask[0].all() and not mask[1:].any()


def test_draw_is_the_inverse_cdf_in_id_order(target):
    """u picks the first token whose cumulative probability (ids ascending) exceeds u."""
    x = np.log(np.array([[0.1, 0.2, 0.3, 0.4]], np.float32))
    for u, want in [(0.0, 0), (0.05, 0), (0.15, 1), (0.35, 2), (0.65, 3), (0.999, 3)]:
        assert _sample(target, x, u=u)[0][0] == want, u
    # top_p = 0.5 keeps {3, 2} (0.4 + 0.3 >= 0.5): renormalised 3/7 and 4/7, in id order
    tok, mask = _sample(target, x, top_p=0.5, u=0.4)
    assert mask[0].tolist() == [False, False, True, True] and tok[0] == 2
    assert _sample(target, x, top_p=0.5, u=0.5)[0][0] == 3


def test_a_row_samples_the_same_token_in_any_batch(target):
    rng = np.random.default_rng(1)
    x = rng.standard_normal((8, 3000)).astype(np.float32) * 2
    tok, _ = _sample(target, x, temperature=0.9, top_p=0.9, u=0.37)
    for i in range(8):
        alone, _ = _sample(target, x[i : i + 1], temperature=0.9, top_p=0.9, u=0.37)
        assert alone[0] == tok[i]


def _check_kept_sets(target, rows, u=0.37):
    """rows: (logits [V], temperature, top_k, top_p, min_p), one V: the kept sets equal the
    float64 reference's, and the drawn token is kept."""
    x = np.stack([r[0] for r in rows])
    col = lambda i, dt: np.array([r[i] for r in rows], dt)  # noqa: E731
    tok, mask = _sample(target, x, col(1, np.float32), col(2, np.int32), col(3, np.float32),
                        col(4, np.float32), u)
    for i, (xi, temperature, top_k, top_p, min_p) in enumerate(rows):
        want, _ = ref.kept_tokens(xi.astype(np.float64), temperature, min_p, top_k, top_p)
        np.testing.assert_array_equal(mask[i], want, err_msg=str(rows[i][1:]))
        assert want[tok[i]], (i, rows[i][1:])
    return mask


@pytest.mark.parametrize("V", [64, 1003])
@pytest.mark.parametrize("ties", [False, True])
def test_kept_sets_match_the_reference(target, V, ties):
    """The cases of tests/sampling/test_truncation.py (temperature, min_p, top_k with ties at
    the k-th value, top_p), on a V that is a multiple of 16 and one that is not."""
    from tests.sampling.test_truncation import CASES

    rng = np.random.default_rng(V + ties)
    rows = []
    for temperature, top_k, top_p, min_p in CASES:
        for _ in range(3):
            if ties:  # few distinct values: ties at every threshold
                x = rng.integers(-3, 4, V).astype(np.float32)
            else:
                x = (rng.standard_normal(V) * rng.choice([0.5, 3.0])).astype(np.float32)
            if not ref.near_boundary(x.astype(np.float64), temperature, min_p, top_p, top_k):
                rows.append((x, temperature, top_k, top_p, min_p))
    _check_kept_sets(target, rows)


def test_wide_nuclei_on_a_real_vocabulary(target):
    """V = 49152 with nuclei of hundreds to thousands of tokens (the histogram search over many
    candidates); rows that float32 sums could flip are skipped."""
    V = 49152
    rng = np.random.default_rng(11)
    rows = []
    for temperature, top_k, top_p, min_p in [(1.0, 0, 0.95, 0.0), (0.8, 0, 0.9, 0.0),
                                             (1.0, 2000, 0.99, 0.0), (1.2, 0, 0.5, 0.001)]:
        for _ in range(5):
            x = (rng.standard_normal(V) * 2.5).astype(np.float32)
            if not ref.near_boundary(x.astype(np.float64), temperature, min_p, top_p, top_k,
                                     tol=1e-6):
                rows.append((x, temperature, top_k, top_p, min_p))
                break
    assert len(rows) == 4
    mask = _check_kept_sets(target, rows)
    assert (mask.sum(-1) > 300).all()  # wide nuclei


@pytest.mark.parametrize("k", [0, 1, 7, 64])
def test_raw_logprobs_with_ties(target, k):
    """log_softmax at the token, rank = #{logits >= its logit}, the top k with ties to the lower
    id, on rows of few distinct values (ties everywhere) and a V that is no multiple of 16."""
    rng = np.random.default_rng(k)
    N, V = 37, 1003
    x = rng.integers(-4, 5, (N, V)).astype(np.float32)
    x[:5] = rng.standard_normal((5, V)).astype(np.float32) * 3
    tok = rng.integers(0, V, N).astype(np.int32)
    fn = jax.jit(functools.partial(cpu_sample.raw_logprobs, target=target), static_argnums=2)
    lp, ids, top, rank = fn(x, tok, k)
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
