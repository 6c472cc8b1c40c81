"""End-to-end `sample`: seeds, raw logprobs and ranks, prompt logprobs, the caller's extra
work in the sampler's conditional, zero recompiles. Every test runs on the JAX steps and on the
CPU kernels (SamplerConfig.native)."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest

from jaxserve.backends.cpu import kernels as cpu_kernels
from jaxserve.sampling import SamplerConfig, prompt_logprobs
from jaxserve.sampling_params import SamplingParams
from tests.sampling import reference as ref
from tests.sampling.harness import Req, build, jitted

V = 2048
CFG = SamplerConfig(max_num_seqs=16, vocab_size=V, max_logprobs=6, topk_candidates=16)
NATIVE = None  # the native sampling implementation under test ("cpu"), or JAX's ops


@pytest.fixture(params=["jax", "native"], autouse=True)
def impl(request):
    if request.param == "native" and not cpu_kernels.available():
        pytest.skip("the CPU kernels cannot be built on this host")
    global CFG, NATIVE
    saved = CFG, NATIVE
    NATIVE = "cpu" if request.param == "native" else None
    CFG = dataclasses.replace(CFG, native=NATIVE)
    yield request.param
    CFG, NATIVE = saved


def _sample(reqs, raw, R=8, seed=0):
    state, meta, _ = build(CFG, reqs, R, seed=seed)
    return jitted(CFG)[0](raw, meta, state)


def _logits(rng, R, scale=2.0):
    return (rng.standard_normal((R, V)) * scale).astype(np.float32)


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0, seed=1234),
        SamplingParams(temperature=0.8, top_k=5, top_p=0.9, seed=99),
        SamplingParams(temperature=1.2, top_p=0.99, min_p=0.01, seed=7),  # wide nucleus
    ],
)
def test_seeded_request_is_independent_of_row_and_batch(params):
    rng = np.random.default_rng(0)
    row = _logits(rng, 1)[0]
    others = [SamplingParams(temperature=1.0), SamplingParams(temperature=0.0),
              SamplingParams(temperature=0.5, top_k=3)]
    results = set()
    for trial in range(4):
        n = int(rng.integers(1, 7))
        where = int(rng.integers(0, n + 1))
        reqs = [Req(others[int(rng.integers(0, 3))], s) for s in range(n)]
        slot = 10 + trial
        reqs.insert(where, Req(params, slot, outputs=[1, 2, 3]))
        raw = _logits(rng, 8)
        raw[where] = row
        out = _sample(reqs, raw, seed=trial)  # the builder's own seed must not matter
        results.add(int(out.token_ids[where]))
    assert len(results) == 1


def test_seeds_and_positions_change_the_draw():
    rng = np.random.default_rng(1)
    raw = np.tile((rng.standard_normal(V) * 0.1).astype(np.float32), (8, 1))  # near uniform
    seeded = [Req(SamplingParams(temperature=1.0, seed=s), s) for s in range(8)]
    toks = np.asarray(_sample(seeded, raw).token_ids)
    assert len(set(toks.tolist())) >= 7  # different seeds differ
    again = np.asarray(_sample(seeded, raw).token_ids)
    np.testing.assert_array_equal(toks, again)  # same seeds: same tokens
    later = [Req(r.params, r.slot, outputs=[5] * 3) for r in seeded]
    assert (np.asarray(_sample(later, raw).token_ids) != toks).sum() >= 7  # next position
    unseeded = [Req(SamplingParams(temperature=1.0), s) for s in range(8)]
    a = np.asarray(_sample(unseeded, raw, seed=0).token_ids)
    b = np.asarray(_sample(unseeded, raw, seed=1).token_ids)
    assert len(set(a.tolist())) >= 7 and (a != b).sum() >= 7  # unseeded requests differ


def test_logprobs_ranks_and_top_tokens_are_raw():
    rng = np.random.default_rng(2)
    raw = _logits(rng, 8)
    raw[3, :10] = raw[3].max() + 1.0  # ties at the top
    reqs = [
        Req(SamplingParams(temperature=0.0, logprobs=6), 0),
        Req(SamplingParams(temperature=0.0, logprobs=0, repetition_penalty=1.5,
                           logit_bias={7: 50.0}), 1, outputs=[9]),  # sampled token ranks low
        Req(SamplingParams(temperature=1.0, logprobs=3, seed=3), 2),
        Req(SamplingParams(temperature=0.0, logprobs=2), 3),
        Req(SamplingParams(temperature=2.0, logprobs=6, presence_penalty=1.0), 4, outputs=[1]),
        Req(SamplingParams(temperature=0.0), 5),  # no logprobs asked
    ]
    out = _sample(reqs, raw)
    tok = np.asarray(out.token_ids)
    assert tok[1] == 7
    lsm = ref.log_softmax(raw)
    top = ref.top_ids(raw, CFG.max_logprobs)
    for i, r in enumerate(reqs):
        k = r.params.logprobs
        if k is None:
            continue
        np.testing.assert_allclose(float(out.logprobs[i]), lsm[i, tok[i]], atol=1e-5)
        assert int(out.rank[i]) == int((raw[i] >= raw[i, tok[i]]).sum())
        np.testing.assert_array_equal(np.asarray(out.topk_ids[i, :k]), top[i, :k])
        np.testing.assert_allclose(np.asarray(out.topk_logprobs[i, :k]),
                                   lsm[i, top[i, :k]], atol=1e-5)


def test_prompt_logprobs():
    rng = np.random.default_rng(3)
    raw = _logits(rng, 37)
    nxt = rng.integers(0, V, 37).astype(np.int32)
    lp, ids, top_lp, rank = jax.jit(prompt_logprobs, static_argnums=(2, 3))(raw, nxt, 5, NATIVE)
    lsm = ref.log_softmax(raw)
    np.testing.assert_allclose(np.asarray(lp), lsm[np.arange(37), nxt], atol=1e-5)
    np.testing.assert_array_equal(np.asarray(ids), ref.top_ids(raw, 5))
    np.testing.assert_allclose(np.asarray(top_lp), np.take_along_axis(lsm, ref.top_ids(raw, 5), 1),
                               atol=1e-5)
    np.testing.assert_array_equal(np.asarray(rank),
                                  (raw >= raw[np.arange(37), nxt][:, None]).sum(-1))


def test_no_recompilation_across_parameter_mixes():
    """One executable for every mix of features, batch composition and parameter values."""
    cfg = SamplerConfig(max_num_seqs=16, vocab_size=V, max_logprobs=6, topk_candidates=16,
                        native=NATIVE)
    f, update, write = jitted(cfg)
    rng = np.random.default_rng(4)
    menu = [
        {"temperature": 0.0},
        {"temperature": 1.0},
        {"temperature": 0.7, "top_k": 5},
        {"temperature": 0.9, "top_k": 100},
        {"temperature": 1.0, "top_p": 0.5},
        {"temperature": 1.0, "min_p": 0.2, "seed": 3},
        {"temperature": 0.0, "presence_penalty": 1.0, "frequency_penalty": 0.5, "repetition_penalty": 1.3},
        {"temperature": 0.0, "logit_bias": {3: 2.0}, "logprobs": 4},
        {"temperature": 0.5, "allowed_token_ids": [1, 2, 3], "logprobs": 0},
        {"temperature": 0.0, "min_tokens": 4, "stop_token_ids": [5], "max_tokens": 10},
    ]
    for trial in range(12):
        n = int(rng.integers(0, 9))
        reqs = [Req(SamplingParams(**menu[int(rng.integers(0, len(menu)))]), s,
                    prompt=[1, 2], outputs=rng.integers(0, V, rng.integers(0, 4)).tolist(),
                    eos=(0,), bad_words=[[4], [5, 6]] if trial % 3 == 0 else None)
                for s in rng.permutation(16)[:n]]
        state, meta, _ = build(cfg, reqs, 8, seed=trial)
        jax.block_until_ready(f(_logits(rng, 8), meta, state))
    assert f._cache_size() == 1
    assert update._cache_size() == 1
    assert write._cache_size() == 1


@pytest.mark.parametrize("features", [False, True])
def test_the_callers_extra_rides_in_the_samplers_conditional(features):
    """sample_with_extra: the caller's work runs when its flag is set (else its zeros come back),
    whether or not a row uses an optional feature, and never changes what is sampled."""
    from jaxserve.sampling.sampler import sample_with_extra

    rng = np.random.default_rng(5)
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.9, top_p=0.8, seed=3),
              SamplingParams(temperature=0.7, top_k=4, seed=4)]
    if features:
        params[0] = SamplingParams(temperature=0.0, logprobs=2, presence_penalty=0.5)
    reqs = [Req(p, s, prompt=[1, 2], outputs=[3, 3]) for s, p in enumerate(params)]
    state, meta, _ = build(CFG, reqs, 8)
    raw = _logits(rng, 8)
    cfg = CFG

    @jax.jit
    def run(raw, meta, state, flag):
        return sample_with_extra(raw, meta, state, cfg,
                                 (flag, lambda: raw.sum(axis=-1), lambda: raw[:, 0] * 0.0))

    want = jitted(CFG)[0](raw, meta, state)
    for flag in (False, True):
        out, extra = run(raw, meta, state, np.bool_(flag))
        for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(want)):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        expect = raw.sum(axis=-1) if flag else np.zeros(8, np.float32)
        np.testing.assert_allclose(np.asarray(extra), expect, rtol=1e-5)
