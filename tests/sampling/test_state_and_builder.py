"""SamplingState updates across steps, and the host-side metadata builder."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from jaxserve.engine.input_processor import tokenize_bad_words
from jaxserve.sampling import (
    SamplerConfig,
    SamplingMetadataBuilder,
    abstract_metadata,
    init_sampling_state,
    row_uniforms,
)
from jaxserve.sampling import state as state_mod
from jaxserve.sampling.state import PROMPT_BIT, output_counts, prompt_mask
from jaxserve.sampling_params import SamplingParams
from tests.sampling.harness import Req, feed, jitted

V, S = 64, 6
CFG = SamplerConfig(max_num_seqs=S, vocab_size=V, max_logprobs=4, max_bad_word_len=4,
                    max_bad_words=3, max_stop_ids=3, topk_candidates=8, slot_write_batch=2)


class Mirror:
    """What the state must hold, per slot."""

    def __init__(self):
        self.prompt = {s: set() for s in range(S)}
        self.outputs = {s: [] for s in range(S)}

    def reset(self, s):
        self.prompt[s], self.outputs[s] = set(), []

    def check(self, state, counted=range(S)):
        """Every slot's window of recent outputs; the counts of the `counted` slots (those of
        requests with penalties), and none in the others' rows."""
        counts = np.asarray(output_counts(state.token_counts))
        pm = np.asarray(prompt_mask(state.token_counts))
        recent = np.asarray(state.recent_outputs)
        W = recent.shape[1]
        for s in range(S):
            kept = s in counted
            np.testing.assert_array_equal(
                counts[s], np.bincount(self.outputs[s] if kept else [], minlength=V))
            want = np.zeros(V, bool)
            want[list(self.prompt[s]) if kept else []] = True
            np.testing.assert_array_equal(pm[s], want)
            tail = self.outputs[s][-W:]
            np.testing.assert_array_equal(recent[s], [-1] * (W - len(tail)) + tail)


@pytest.mark.parametrize("counted", [range(S), (0, 2, 3)])
def test_state_follows_chunked_prefill_decode_reset_and_recompute(counted):
    """Across steps of prefill chunks, decodes, resets and recomputes: the counts of the slots
    the steps count (requests with penalties: `penalty_slots`, a slot once per row, so
    repeated for a request's draft rows), and none for the others."""
    rng = np.random.default_rng(0)
    state = init_sampling_state(CFG)
    mirror = Mirror()
    prompts = {s: rng.integers(0, V, rng.integers(3, 12)).tolist() for s in range(S)}
    done = {s: 0 for s in range(S)}  # prompt tokens fed so far
    for step in range(30):
        reqs, resets = [], []
        for s in rng.permutation(S)[: rng.integers(1, S + 1)]:
            s = int(s)
            if rng.random() < 0.1:  # preempted and recomputed (or a new request): reset
                resets.append(s)
                mirror.reset(s)
                outs = rng.integers(0, 5, rng.integers(0, 4)).tolist()
                prompts[s] = rng.integers(0, V, rng.integers(3, 12)).tolist()
                reqs.append(Req(SamplingParams(), s, prompts[s], outs))  # prompt + re-fed outputs
                done[s] = len(prompts[s])
                mirror.prompt[s].update(prompts[s])
                mirror.outputs[s] += outs
            elif done[s] < len(prompts[s]):  # next prefill chunk
                chunk = prompts[s][done[s]: done[s] + int(rng.integers(1, 5))]
                done[s] += len(chunk)
                reqs.append(Req(SamplingParams(), s, chunk, []))
                mirror.prompt[s].update(chunk)
            else:  # decode: feed the token sampled last step
                tok = int(rng.integers(0, 5))  # small ids: repeated tokens
                reqs.append(Req(SamplingParams(), s, [], [tok]))
                mirror.outputs[s].append(tok)
        count = [r.slot for r in reqs if r.slot in counted] * 2  # repeats: draft rows
        state = feed(CFG, state, reqs, resets + [S] * (S - len(resets)), num_tokens=128,
                     count_slots=count + [S] * (2 * S - len(count)))
        mirror.check(state, counted)
    assert jitted(CFG)[1]._cache_size() == 1


def test_count_by_scatter_and_by_loop_count_the_same_tokens():
    """_count has one form per platform (a scatter on GPUs and the CPU, a loop over the slots
    on TPUs, whose row update is dense in a small step): both fold exactly the kept tokens of
    the listed slots (repeats and S's among them) into their rows, a one-token step included,
    and leave every other row alone."""
    rng = np.random.default_rng(2)
    counts0 = rng.integers(0, 3, (S, V)) | np.where(rng.random((S, V)) < 0.2, PROMPT_BIT, 0)
    cases = ((12, [1, 4, 1, S]), (1, [3, S, S, S]), (1, [S] * 4), (12, [5, 0, 2, 2]),
             (state_mod.DENSE_COUNT_TOKENS + 8, [2, 0, 2, S]))  # a large step scatters
    for T, count_slots in cases:
        slots = rng.integers(0, S, T)
        if T == 1:
            slots[:] = 3
        tokens = rng.integers(0, V, T)
        is_prompt = rng.random(T) < 0.4
        keep = rng.random(T) < 0.9
        want = counts0.copy()
        for s, t, p, k in zip(slots, tokens, is_prompt, keep):
            if k and s in count_slots:
                want[s, t] = want[s, t] | PROMPT_BIT if p else want[s, t] + 1
        counted = np.isin(slots, count_slots)
        args = (jnp.asarray(counts0, jnp.int32), jnp.asarray(slots, jnp.int32),
                jnp.asarray(tokens, jnp.int32), jnp.asarray(is_prompt), jnp.asarray(keep & counted),
                jnp.asarray(count_slots, jnp.int32))
        for form in (state_mod._count_by_scatter, state_mod._count_by_loop):
            np.testing.assert_array_equal(np.asarray(jax.jit(form)(*args)), want, form.__name__)


def test_reset_by_scatter_and_by_loop_clear_the_same_rows():
    """_reset has one form per platform (a scatter on GPUs, a loop elsewhere): both clear
    exactly the listed slots, whatever their order, repeats and the S's among them."""
    rng = np.random.default_rng(1)
    counts = jnp.asarray(rng.integers(0, 9, (S, V)), jnp.int32)
    recent = jnp.asarray(rng.integers(0, V, (S, CFG.max_bad_word_len - 1)), jnp.int32)
    for slots in ([S] * 4, [3, S, 0, S], [5, 1, 5, 2], [0, 1, 2, 3]):
        slots = jnp.asarray(slots, jnp.int32)
        by_scatter = jax.jit(state_mod._reset_by_scatter)(counts, recent, slots)
        by_loop = jax.jit(state_mod._reset_by_loop)(counts, recent, slots)
        cleared = np.isin(np.arange(S), np.asarray(slots))
        for a, b, orig, fill in zip(by_scatter, by_loop, (counts, recent), (0, -1)):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
            np.testing.assert_array_equal(np.asarray(a)[cleared], fill)
            np.testing.assert_array_equal(np.asarray(a)[~cleared], np.asarray(orig)[~cleared])


def test_builder_rows_padding_and_limits():
    b = SamplingMetadataBuilder(CFG, seed=0)
    b.admit(2, SamplingParams(temperature=0.5, top_k=3, top_p=0.9, min_p=0.1, seed=2**40 + 5,
                              min_tokens=2, stop_token_ids=[7], max_tokens=5, logprobs=2,
                              presence_penalty=0.5), eos_token_ids=(1,))
    b.admit(4, SamplingParams(temperature=0.0, logit_bias={3: 1.0}), bad_words_token_ids=[[5, 6]])
    m = b.build([4, 2], [0, 1], 4)
    assert m.slots.tolist() == [4, 2, 0, 0]
    assert m.temperature.tolist() == [0.0, 0.5, -1.0, -1.0]
    assert m.top_k.tolist() == [0, 3, 0, 0] and m.logprobs.tolist() == [-1, 2, -1, -1]
    assert m.use_slot_rows.tolist() == [True, False, False, False]
    assert sorted(m.stop_ids[1].tolist()) == [-1, 1, 7] and (m.stop_ids[[0, 2, 3]] == -1).all()
    assert m.uniform[1] == row_uniforms([2**40 + 5], [1])[0]
    assert sorted(m.reset_slots.tolist()) == [2, 4, S, S]
    m2 = b.build([2], [2], 2)  # min_tokens reached; no more resets
    assert (m2.stop_ids == -1).all() and m2.reset_slots.tolist() == [S, S]
    writes = b.take_slot_writes()
    assert len(writes) == 1 and writes[0].slots.tolist() == [4, S]
    assert writes[0].logit_bias[0, 3] == 1.0 and writes[0].bad_words[0, 0].tolist() == [-2, -2, 5, 6]
    assert b.take_slot_writes() == []
    # What admission cannot store is refused before (the input processor's validation).
    with pytest.raises(ValueError, match="logprobs"):
        CFG.check_request(SamplingParams(logprobs=5))
    with pytest.raises(ValueError, match="bad word"):
        CFG.check_request(SamplingParams(), bad_words_token_ids=[[1, 2, 3, 4, 5]])
    with pytest.raises(ValueError, match="stop token"):
        CFG.check_request(SamplingParams(min_tokens=1, stop_token_ids=[1, 2, 3]), eos_token_ids=(9,))
    with pytest.raises(ValueError, match="outside"):
        b.admit(S, SamplingParams())


def test_built_metadata_always_matches_the_abstract_shapes():
    want = jax.tree.map(lambda a: (a.shape, a.dtype), abstract_metadata(CFG, 4))
    b = SamplingMetadataBuilder(CFG)
    for s, p in enumerate([SamplingParams(), SamplingParams(temperature=0, seed=3, logprobs=2),
                           SamplingParams(min_tokens=2, max_tokens=3, stop_token_ids=[1])]):
        b.admit(s, p, eos_token_ids=(0,))
        got = b.build(list(range(s + 1)), [0] * (s + 1), 4)
        assert jax.tree.map(lambda a: (a.shape, a.dtype), got) == want


def test_unseeded_requests_draw_different_seeds():
    b = SamplingMetadataBuilder(CFG)
    for s in range(S):
        b.admit(s, SamplingParams())
    u = b.build(list(range(S)), [0] * S, S).uniform
    assert len(set(u.tolist())) == S


def test_row_uniforms_depend_on_seed_and_position_only():
    seeds = np.arange(20000, dtype=np.uint64) * np.uint64(7919)
    u = row_uniforms(seeds, np.zeros(20000))
    assert u.dtype == np.float32 and (u >= 0).all() and (u < 1).all()
    assert stats.kstest(u, "uniform").pvalue > 1e-3
    v = row_uniforms(np.full(20000, 42, np.uint64), np.arange(20000))
    assert stats.kstest(v, "uniform").pvalue > 1e-3
    np.testing.assert_array_equal(row_uniforms(seeds[:5], [3] * 5), row_uniforms(seeds[:5], [3] * 5))


def test_tokenize_bad_words_adds_the_spaced_form():
    vocab = {"bad": [10], " bad": [11], "two words": [12, 13], " two words": [14, 13]}
    assert tokenize_bad_words(["bad", " two words"], vocab.__getitem__) == [[10], [11], [12, 13],
                                                                            [14, 13]]


def test_slot_rows_by_loop_are_the_gathered_rows():
    """The sampler reads a slot's rows of the state by a gather, or on TPUs by a loop of
    dynamic slices: the same rows, for repeated slots and tables of any width."""
    from jaxserve.sampling import sampler

    rng = np.random.default_rng(3)
    slots = jnp.asarray([4, 0, 4, 5], jnp.int32)
    for table in (rng.standard_normal((S, V)).astype(np.float32), rng.integers(-2, V, (S, 12)),
                  rng.integers(-1, V, (S, 3))):
        table = jnp.asarray(table)
        np.testing.assert_array_equal(np.asarray(jax.jit(sampler._slot_rows_by_loop)(table, slots)),
                                      np.asarray(table)[np.asarray(slots)])
