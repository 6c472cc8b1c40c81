"""Steps 5-7: temperature, min_p, top_k, top_p and the draw itself.

The kept set is compared exactly with a float64 NumPy implementation (cases where float32
rounding could flip a decision are skipped), on every code path: the top-K candidate list, a
k-th value tie running past it, top_k > K and wide top-p nuclei (the value search's fallback), and
heavy ties. Sampled frequencies are checked against the distribution with a chi-square test."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from jaxserve.backends.cpu import kernels as cpu_kernels
from jaxserve.sampling import SamplerConfig, SamplingMetadata, row_uniforms, sampler
from tests.sampling import reference as ref

K = 8  # small candidate list, so that every path is exercised on small vocabularies


def _meta(R, temperature, top_k, top_p, min_p, seeds=None, pos=None):
    f = lambda v, dt: np.broadcast_to(np.asarray(v, dt), (R,)).copy()
    seeds = np.arange(R) if seeds is None else np.asarray(seeds)
    return SamplingMetadata(
        slots=np.zeros(R, np.int32),
        temperature=f(temperature, np.float32),
        top_k=f(top_k, np.int32),
        top_p=f(top_p, np.float32),
        min_p=f(min_p, np.float32),
        presence_penalty=np.zeros(R, np.float32),
        frequency_penalty=np.zeros(R, np.float32),
        repetition_penalty=np.ones(R, np.float32),
        use_slot_rows=np.zeros(R, bool),
        stop_ids=np.full((R, 2), -1, np.int32),
        uniform=row_uniforms(seeds, f(0 if pos is None else pos, np.int64)),
        logprobs=np.full(R, -1, np.int32),
        reset_slots=np.zeros(R, np.int32),
    )


@pytest.fixture(params=["jax", "native"], autouse=True)
def impl(request):
    """Every test runs on the JAX steps and on the CPU kernel (SamplerConfig.native)."""
    if request.param == "native" and not cpu_kernels.available():
        pytest.skip("the CPU kernels cannot be built on this host")
    global _IMPL
    _IMPL = request.param
    yield request.param
    _IMPL = "jax"


_IMPL = "jax"


def _random_fn(V):
    return _random_fn_for(V, "cpu" if _IMPL == "native" else None)


@functools.cache
def _random_fn_for(V, native):
    cfg = SamplerConfig(max_num_seqs=1, vocab_size=V, topk_candidates=K, max_logprobs=4,
                        native=native)

    @jax.jit
    def f(x, meta):
        greedy = meta.temperature <= 0
        return sampler._sample_random(jnp.asarray(x), meta, greedy, cfg, with_mask=True)

    return f


ROWS = 40  # every call uses this many rows (one compilation per vocabulary size)


def _run(rows):
    """rows: (logits [V], temperature, top_k, top_p, min_p) -> (tokens, masks) per row."""
    assert 0 < len(rows) <= ROWS
    padded = rows + [rows[0]] * (ROWS - len(rows))
    x = np.stack([r[0] for r in padded])
    meta = _meta(ROWS, *[np.array([r[i] for r in padded]) for i in range(1, 5)])
    tok, mask = _random_fn(x.shape[1])(x, meta)
    return np.asarray(tok)[: len(rows)], np.asarray(mask)[: len(rows)]


CASES = [  # temperature, top_k, top_p, min_p
    (1.0, 0, 1.0, 0.0),
    (0.7, 5, 1.0, 0.0),
    (1.3, K, 1.0, 0.0),  # k == K: the extra candidate decides whether ties run past
    (1.0, 3 * K, 1.0, 0.0),  # k > K: fallback
    (1.0, 0, 0.5, 0.0),
    (0.5, 0, 0.9, 0.0),  # nucleus usually wider than K: fallback
    (1.0, 6, 0.8, 0.0),
    (1.0, 0, 1e-6, 0.0),  # only the argmax
    (1.0, 0, 1.0, 0.1),
    (2.0, 0, 1.0, 0.3),
    (1.0, 20, 0.95, 0.05),
    (0.8, 4, 0.3, 0.2),
]


@pytest.mark.parametrize("V", [64, 1000])
@pytest.mark.parametrize("ties", [False, True])
def test_kept_set_matches_reference(V, ties):
    rng = np.random.default_rng(V + ties)
    rows = []
    for temperature, top_k, top_p, min_p in CASES:
        for _ in range(3):
            if ties:  # few distinct values: ties at every threshold
                x = rng.integers(-3, 4, V).astype(np.float32)
            else:
                x = (rng.standard_normal(V) * rng.choice([0.5, 3.0])).astype(np.float32)
            if ref.near_boundary(x.astype(np.float64), temperature, min_p, top_p, top_k):
                continue
            rows.append((x, temperature, top_k, top_p, min_p))
    tok, mask = _run(rows)
    for i, (xi, temperature, top_k, top_p, min_p) in enumerate(rows):
        want, _ = ref.kept_tokens(xi.astype(np.float64), temperature, min_p, top_k, top_p)
        np.testing.assert_array_equal(mask[i], want, err_msg=str(rows[i][1:]))
        assert want[tok[i]], (i, rows[i][1:])


def test_top_p_tiny_keeps_only_the_argmax():
    V = 1000
    rng = np.random.default_rng(1)
    x = rng.standard_normal((4, V)).astype(np.float32)
    x[3, [10, 500]] = 9.0  # tie at the top: the lower id
    tok, mask = _run([(row, 1.0, 0, 1e-6, 0.0) for row in x])
    np.testing.assert_array_equal(tok, [*np.argmax(x[:3], -1), 10])
    assert mask.sum(-1).tolist() == [1, 1, 1, 1]


def _draws(x, n_calls, **kw):
    """Samples of one distribution: R rows with distinct seeds, n_calls output positions."""
    R, V = x.shape
    f = _random_fn(V)
    out = []
    for pos in range(n_calls):
        tok, _ = f(x, _meta(R, pos=pos, seeds=np.arange(R) + 1000, **kw))
        out.append(np.asarray(tok))
    return np.concatenate(out)


@pytest.mark.parametrize(
    "temperature,top_k,top_p,min_p",
    [(1.0, 0, 1.0, 0.0), (0.7, 0, 1.0, 0.0), (1.0, 5, 0.85, 0.0), (1.5, 0, 0.8, 0.05)],
)
def test_sampled_frequencies_match_distribution(temperature, top_k, top_p, min_p):
    V, R, calls = 16, ROWS, 500  # 20k draws
    x = np.tile(np.random.default_rng(7).standard_normal(V).astype(np.float32) * 1.5, (R, 1))
    assert not ref.near_boundary(x[0].astype(np.float64), temperature, min_p, top_p, top_k)
    toks = _draws(x, calls, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    keep, dist = ref.kept_tokens(x[0].astype(np.float64), temperature, min_p, top_k, top_p)
    counts = np.bincount(toks, minlength=V)
    assert counts[~keep].sum() == 0  # excluded tokens never appear
    expected = dist[keep] * len(toks)
    assert stats.chisquare(counts[keep], expected).pvalue > 1e-3


def test_excluded_tokens_never_sampled():
    """Many draws with top-k / top-p / min-p: nothing outside the kept set."""
    V, R = 1000, ROWS
    rng = np.random.default_rng(3)
    x = (rng.standard_normal((R, V)) * 2).astype(np.float32)
    f = _random_fn(V)
    for top_k, top_p, min_p in [(3, 1.0, 0.0), (0, 0.6, 0.0), (0, 1.0, 0.2), (6, 0.7, 0.01)]:
        allowed = [ref.kept_tokens(x[i].astype(np.float64), 1.0, min_p, top_k, top_p)[0]
                   for i in range(R)]
        for pos in range(10):
            tok, _ = f(x, _meta(R, 1.0, top_k, top_p, min_p, pos=pos))
            tok = np.asarray(tok)
            assert all(allowed[i][tok[i]] for i in range(R))


@pytest.mark.parametrize("tie_value", [0.0, -0.0, 1e-38, 2.5])
def test_huge_tie_groups_at_the_boundary(tie_value):
    """The boundary falls inside a group of equal logits far larger than the candidate list
    (the value search must close onto one float, 0.0 and denormal neighbours included)."""
    V = 1000
    rng = np.random.default_rng(5)
    x = np.full(V, -5.0, np.float32)
    perm = rng.permutation(V)
    x[perm[:100]] = tie_value + 1.0
    x[perm[100:700]] = tie_value
    rows = [(x, 1.0, 0, 0.5, 0.0), (x, 1.0, 150, 1.0, 0.0), (x, 1.0, 0, 0.93, 0.0),
            (x, 1.0, 300, 0.6, 0.0)]
    rows = [r for r in rows if not ref.near_boundary(x.astype(np.float64), *r[1:2], r[4], r[3], r[2])]
    tok, mask = _run(rows)
    for i, (xi, temperature, top_k, top_p, min_p) in enumerate(rows):
        want, _ = ref.kept_tokens(xi.astype(np.float64), temperature, min_p, top_k, top_p)
        np.testing.assert_array_equal(mask[i], want, err_msg=str(rows[i][1:]))
        assert want[int(tok[i])]


def test_wide_nucleus_on_a_real_vocabulary():
    """V = 49152 (the default model's vocabulary) with nuclei of hundreds to thousands of
    tokens, as at temperature 1 with top_p 0.95 (the CPU kernel bounds its search by the
    tail's mass). A tolerance of 1e-6 skips the rows that float32 sums could flip."""
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
    tok, mask = _run(rows)
    for i, (xi, temperature, top_k, top_p, min_p) in enumerate(rows):
        want, _ = ref.kept_tokens(xi.astype(np.float64), temperature, min_p, top_k, top_p)
        assert want.sum() > 300  # a wide nucleus
        np.testing.assert_array_equal(mask[i], want, err_msg=str(rows[i][1:]))
        assert want[tok[i]]

