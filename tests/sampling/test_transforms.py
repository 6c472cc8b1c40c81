"""Steps 1-3 (allowed ids, bad words, logit bias, min_tokens, penalties) and greedy, against an
independent float64 NumPy implementation of vLLM's definitions."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.sampling import SamplerConfig, sampler
from jaxserve.sampling_params import SamplingParams
from tests.sampling import reference as ref
from tests.sampling.harness import Req, build, jitted

V, R = 1024, 8
CFG = SamplerConfig(max_num_seqs=16, vocab_size=V, max_logprobs=8, topk_candidates=16)


@jax.jit
def _processed(x, meta, state):
    pen = (meta.presence_penalty != 0) | (meta.frequency_penalty != 0) | (
        meta.repetition_penalty != 1
    )
    return sampler._process(x, meta, state, jnp.any(meta.use_slot_rows), jnp.any(pen))


def _random_request(rng, slot):
    prompt = rng.integers(0, V, rng.integers(1, 40)).tolist()
    outputs = rng.integers(0, 60, rng.integers(0, 30)).tolist()  # small ids: repeats
    kw = {"temperature": 0.0}
    if rng.random() < 0.5:
        kw.update(
            presence_penalty=float(rng.uniform(-2, 2)),
            frequency_penalty=float(rng.uniform(-2, 2)),
            repetition_penalty=float(rng.uniform(0.5, 2.0)),
        )
    if rng.random() < 0.4:
        kw["logit_bias"] = {int(t): float(rng.uniform(-5, 5)) for t in rng.integers(0, V, 20)}
    if rng.random() < 0.25:
        kw["allowed_token_ids"] = sorted(set(rng.integers(0, V, 50).tolist()))
    if rng.random() < 0.4:
        kw["min_tokens"] = int(rng.integers(0, 40))
        kw["stop_token_ids"] = rng.integers(0, V, rng.integers(0, 4)).tolist()
        kw["max_tokens"] = 100
    bad = None
    if rng.random() < 0.4:
        bad = [[int(rng.integers(0, V))]]  # single token: always banned
        if outputs:  # a multi-token word whose prefix matches the last outputs
            n = int(rng.integers(1, min(len(outputs), 5) + 1))
            bad.append(outputs[-n:] + [int(rng.integers(0, V))])
        bad.append([1, 2, 3, int(rng.integers(0, V))])  # usually does not match
    eos = (int(rng.integers(0, V)),)
    return Req(SamplingParams(**kw), slot, prompt, outputs, eos, bad)


@pytest.mark.parametrize("seed", range(4))
def test_processed_logits_match_reference(seed):
    rng = np.random.default_rng(seed)
    reqs = [_random_request(rng, slot) for slot in rng.permutation(16)[:R - 2]]
    raw = (rng.standard_normal((R, V)) * 3).astype(np.float32)  # negative logits included
    state, meta, _ = build(CFG, reqs, R)
    got = np.asarray(_processed(raw, meta, state), np.float64)
    for i, r in enumerate(reqs):
        p = r.params
        stops = list(p.stop_token_ids) + ([] if p.ignore_eos else list(r.eos))
        want = ref.processed_logits(
            raw[i], prompt=r.prompt, outputs=r.outputs, allowed=p.allowed_token_ids,
            logit_bias=p.logit_bias, bad_words=r.bad_words or [], min_tokens=p.min_tokens,
            stop_ids=stops, presence=p.presence_penalty, frequency=p.frequency_penalty,
            repetition=p.repetition_penalty,
        )
        np.testing.assert_array_equal(np.isneginf(got[i]), np.isneginf(want))
        fin = np.isfinite(want)
        np.testing.assert_allclose(got[i][fin], want[fin], rtol=2e-6, atol=2e-6)
    # padding rows are untouched
    np.testing.assert_array_equal(got[R - 2:], raw[R - 2:])
    # greedy rows take the argmax of the processed logits
    out = jitted(CFG)[0](raw, meta, state)
    np.testing.assert_array_equal(np.asarray(out.token_ids)[: R - 2],
                                  np.argmax(got[: R - 2], axis=-1))


def test_multi_token_bad_word_follows_outputs():
    """The last token of a bad word is banned only right after its prefix was generated."""
    word = [7, 8, 9]
    raw = np.zeros((R, V), np.float32)
    raw[:, 9] = 5.0  # 9 is the argmax unless banned
    params = SamplingParams(temperature=0.0)
    for outputs, banned in [([1, 7, 8], True), ([7, 8, 1], False), ([8], False), ([], False)]:
        reqs = [Req(params, 3, [5, 6], outputs, (), [word])]
        state, meta, _ = build(CFG, reqs, R)
        tok = int(jitted(CFG)[0](raw, meta, state).token_ids[0])
        assert (tok != 9) == banned, (outputs, tok)


def test_min_tokens_suppresses_eos_and_stop_ids_until_reached():
    raw = np.zeros((R, V), np.float32)
    raw[:, 11] = 9.0  # eos
    raw[:, 12] = 8.0  # a stop token id
    raw[:, 13] = 7.0
    p = SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[12])
    for n_out, want in [(0, 13), (2, 13), (3, 11), (5, 11)]:
        state, meta, _ = build(CFG, [Req(p, 0, [1], [20] * n_out, (11,))], R)
        assert int(jitted(CFG)[0](raw, meta, state).token_ids[0]) == want
    p_ign = SamplingParams(temperature=0.0, min_tokens=3, ignore_eos=True)
    state, meta, _ = build(CFG, [Req(p_ign, 0, [1], [], (11,))], R)
    assert int(jitted(CFG)[0](raw, meta, state).token_ids[0]) == 11


def test_greedy_is_exact_argmax_at_full_vocab():
    cfg = SamplerConfig(max_num_seqs=4, vocab_size=49152)
    rng = np.random.default_rng(0)
    raw = rng.standard_normal((4, 49152)).astype(np.float32)
    raw[1, [100, 30000]] = 50.0  # a tie: the first index wins, like np.argmax
    raw[2] = np.round(raw[2])  # many ties
    state, meta, _ = build(cfg, [Req(SamplingParams(temperature=0.0), s) for s in range(3)], 4)
    out = jitted(cfg)[0](raw, meta, state)
    np.testing.assert_array_equal(np.asarray(out.token_ids), np.argmax(raw, -1))
