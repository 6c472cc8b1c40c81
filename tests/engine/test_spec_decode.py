"""Speculative decoding (n-gram prompt lookup): the proposer, the acceptance rule, the config,
and the real engine on a tiny random model: greedy and seeded outputs identical with and without
drafts, log-probs per token, requests that may not draft next to ones that do, the sampled
distribution unchanged (a two-sample test), and nothing compiled after warm-up. The default
model's golden cases are in test_llm_golden.py."""

from __future__ import annotations

import numpy as np
import pytest
from scipy import stats

from jaxserve import LLM, SamplingParams
from jaxserve.config import EngineConfig
from jaxserve.speculative_config import SpeculativeConfig
from jaxserve.sampling_params import StructuredOutputsParams
from jaxserve.spec_decode import NgramProposer, accept_drafts, can_speculate
from tests.model_dirs import write_model_dir


# ---------------------------------------------------------------------------- proposer
def propose(context, k=3, lo=1, hi=3):
    return NgramProposer(k, lo, hi).propose(np.asarray(context))


def test_the_longest_ngram_at_its_latest_occurrence():
    # suffix (1, 2, 3): occurs at 0 -> proposes what followed it.
    assert propose([1, 2, 3, 4, 5, 6, 9, 1, 2, 3]) == [4, 5, 6]
    # The 3-gram (8, 2, 3) matches once, though (2, 3) occurs later with another continuation.
    assert propose([8, 2, 3, 7, 7, 2, 3, 6, 8, 2, 3]) == [7, 7, 2]
    # Several occurrences of the longest: the latest one.
    assert propose([1, 2, 5, 1, 2, 6, 1, 2], hi=2) == [6, 1, 2]
    # k caps the drafts; the context's end caps them too.
    assert propose([1, 2, 3, 4, 5, 6, 1, 2, 3], k=2) == [4, 5]
    assert propose([4, 1, 2, 1, 2], k=5, hi=2) == [1, 2]
    assert NgramProposer(5, 1, 3).propose(np.asarray([1, 2, 3, 4, 1, 2, 3]), max_drafts=1) == [4]


def test_no_match_no_drafts():
    assert propose([1, 2, 3, 4, 5]) == []
    assert propose([1, 2, 3, 9, 2, 3], lo=3, hi=3) == []  # (2, 3) repeats, but no 3-gram does
    assert propose([7]) == []
    assert propose([3, 3], lo=2, hi=2) == []  # too short for a 2-gram to occur before the suffix


def test_acceptance_rule():
    assert accept_drafts([4, 5, 6, 7], (4, 5, 6)) == [4, 5, 6, 7]  # all accepted, plus the next
    assert accept_drafts([4, 9, 6, 7], (4, 5, 6)) == [4, 9]  # stops at the first mismatch
    assert accept_drafts([1, 5, 6, 7], (4, 5, 6)) == [1]
    assert accept_drafts([3], ()) == [3]


def test_which_requests_draft():
    assert can_speculate(SamplingParams(temperature=0.7, top_p=0.9, min_tokens=3, logprobs=2,
                                        logit_bias={5: 1.0}))
    for params in (SamplingParams(presence_penalty=0.5), SamplingParams(frequency_penalty=0.1),
                   SamplingParams(repetition_penalty=1.2), SamplingParams(bad_words=["w5"]),
                   SamplingParams(structured_outputs=StructuredOutputsParams(regex="w5+"))):
        assert not can_speculate(params)


# ---------------------------------------------------------------------------- config
def test_config_follows_vllm():
    c = SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 4})
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (5, 5)
    assert SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3}'
                                   ).prompt_lookup_min == 3
    assert SpeculativeConfig.parse({"method": "[ngram]", "num_speculative_tokens": 2,
                                    "prompt_lookup_min": 2}).prompt_lookup_max == 2
    assert EngineConfig.from_kwargs(speculative_config={"method": "ngram", "num_speculative_tokens": 3}
                                    ).speculative_config.num_speculative_tokens == 3
    assert EngineConfig().speculative_config is None
    for bad, msg in [({"method": "eagle", "num_speculative_tokens": 2}, "ngram"),
                     ({"method": "ngram"}, "num_speculative_tokens"),
                     ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
                     ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4,
                       "prompt_lookup_max": 3}, "exceeds"),
                     ({"method": "ngram", "num_speculative_tokens": 2, "draft_model": "x"}, "draft_model"),
                     ({"num_speculative_tokens": 2}, "method"),
                     ("{not json", "JSON"), ([1], "object")]:
        with pytest.raises(ValueError, match=msg):
            SpeculativeConfig.parse(bad)


# ---------------------------------------------------------------------------- the engine
SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
# Repetitive prompts (the tiny model also repeats itself), so that drafts are proposed often.
PROMPTS = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [9, 10, 11, 9, 10, 11, 9], [20, 21, 22, 23, 24, 20, 21],
           [30, 31, 30, 31, 30]]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(write_model_dir(tmp_path_factory.mktemp("m")))


@pytest.fixture(scope="module")
def options(compile_cache_dir):
    return dict(dtype="float32", max_num_seqs=8, max_num_batched_tokens=64, token_buckets=(16, 64),
                request_buckets=(8,), compilation_cache_dir=compile_cache_dir, show_progress=False)


@pytest.fixture(scope="module")
def spec_llm(model_dir, options):
    return LLM(model_dir, speculative_config=SPEC, seed=1, **options)


@pytest.fixture(scope="module")
def plain_llm(model_dir, options):
    return LLM(model_dir, seed=2, **options)


def tokens(llm, prompts, params):
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def spec_stats(llm):
    s = llm.engine.scheduler.make_stats()
    return s.spec_num_drafts, s.spec_num_draft_tokens, s.spec_num_accepted_tokens


def test_greedy_and_seeded_outputs_are_the_same_with_drafts(spec_llm, plain_llm):
    before = spec_stats(spec_llm)
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    assert tokens(spec_llm, PROMPTS, greedy) == tokens(plain_llm, PROMPTS, greedy)
    for p in PROMPTS:  # one at a time too (other buckets, all rows spare)
        assert tokens(spec_llm, [p], greedy) == tokens(plain_llm, [p], greedy)
    # Sampled with a seed: a row's random number depends on the seed and the output position
    # only, so drafts change nothing either (min_tokens keeps EOS out per row as well).
    seeded = [SamplingParams(temperature=t, top_p=tp, top_k=tk, min_tokens=6, max_tokens=20, seed=s)
              for s, (t, tp, tk) in enumerate([(0.5, 1.0, 0), (0.8, 0.9, 0), (1.0, 1.0, 20), (0.3, 0.95, 5)])]
    assert tokens(spec_llm, PROMPTS, seeded) == tokens(plain_llm, PROMPTS, seeded)
    drafts, draft_tokens, accepted = (a - b for a, b in zip(spec_stats(spec_llm), before))
    assert drafts > 20 and 0 < accepted < draft_tokens  # drafts were fed, some rejected
    assert spec_llm.engine.runner.counter.recompiles == 0


def test_logprobs_per_token(spec_llm, plain_llm):
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=3)
    before = spec_stats(spec_llm)[2]
    (a,) = spec_llm.generate([PROMPTS[0]], params, use_tqdm=False)
    (b,) = plain_llm.generate([PROMPTS[0]], params, use_tqdm=False)
    assert spec_stats(spec_llm)[2] > before
    a, b = a.outputs[0], b.outputs[0]
    assert a.token_ids == b.token_ids and len(a.logprobs) == len(a.token_ids)
    for x, y, tok in zip(a.logprobs, b.logprobs, a.token_ids):
        assert list(x) == list(y) and tok in x
        for t in x:
            assert x[t].logprob == pytest.approx(y[t].logprob, abs=1e-4) and x[t].rank == y[t].rank
    assert a.cumulative_logprob == pytest.approx(b.cumulative_logprob, abs=1e-3)


def test_requests_that_may_not_draft_run_beside_ones_that_do(spec_llm, plain_llm):
    params = [SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, repetition_penalty=1.3),
              SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=8, presence_penalty=0.5, frequency_penalty=0.5),
              SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)]
    assert tokens(spec_llm, PROMPTS, params) == tokens(plain_llm, PROMPTS, params)
    engine = spec_llm.engine
    engine.add_request("pen", PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=12, repetition_penalty=1.3))
    seen = []
    while engine.has_unfinished_requests():
        engine.step()
        req = engine.core.scheduler.get_request("pen")
        if req is not None:
            seen.append(list(req.spec_token_ids))
    assert seen and not any(seen)  # never given drafts


def test_the_sampled_distribution_is_unchanged(spec_llm, plain_llm):
    """Unseeded requests (each engine draws its own seeds: independent samples): the
    distributions of the 2nd-5th tokens, which accepted drafts decide, agree (chi-square
    two-sample test per position; fixed engine seeds, so the test is deterministic). The tiny
    random model's distributions are flat at temperature 1; at 0.1 it falls into the loop its
    prompt ends with, about half of the drafts are accepted, and a rule that accepted drafts
    too often (or took the wrong row's sample) would move the distributions far."""
    n = 240
    params = SamplingParams(temperature=0.1, max_tokens=5, ignore_eos=True)
    prompt = [9, 10, 11, 9, 10, 11, 9, 50, 50, 53, 18, 91, 18, 91, 18]
    before = spec_stats(spec_llm)
    # Two at a time: drafts take the rows nobody waits for.
    a = np.asarray([t for _ in range(n // 2) for t in tokens(spec_llm, [prompt] * 2, params)])
    b = np.asarray(tokens(plain_llm, [prompt] * n, params))
    drafts, draft_tokens, accepted = (x - y for x, y in zip(spec_stats(spec_llm), before))
    assert drafts > n and accepted > 0.25 * draft_tokens
    for pos in (1, 2, 3, 4):
        cats = sorted(set(a[:, pos]) | set(b[:, pos]))
        table = np.array([[np.sum(a[:, pos] == c) for c in cats], [np.sum(b[:, pos] == c) for c in cats]])
        big = table.sum(0) >= 10  # pool the rare tokens into one column
        table = np.concatenate([table[:, big], table[:, ~big].sum(1, keepdims=True)], axis=1)
        table = table[:, table.sum(0) > 0]
        p = stats.chi2_contingency(table).pvalue
        assert p > 1e-3, (pos, p, table)


def test_steps_overlap_when_no_row_is_spare(spec_llm, plain_llm):
    """With every sampling row taken nothing can draft, and the steps overlap again (the core
    collects a step in flight first whenever drafts become possible); the tokens do not change."""
    core = spec_llm.engine.core
    assert core.async_scheduling
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    prompts = [[5 + i, 6 + i, 7 + i, 5 + i, 6 + i] for i in range(12)]  # 12 requests, 8 rows
    overlapped = 0
    engine = spec_llm.engine
    for i, p in enumerate(prompts):
        engine.add_request(f"o{i}", p, greedy)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
        overlapped += core._in_flight is not None
    assert overlapped > 5
    assert [done[f"o{i}"] for i in range(len(prompts))] == tokens(plain_llm, prompts, greedy)


def test_with_data_parallelism(model_dir, plain_llm, compile_cache_dir):
    """Two data-parallel ranks (simulated devices), each drafting within its own rows."""
    llm = LLM(model_dir, data_parallel_size=2, max_num_seqs=16, max_num_batched_tokens=64, token_buckets=(32,),
              request_buckets=(8,), dtype="float32", speculative_config=SPEC, compilation_cache_dir=compile_cache_dir,
              show_progress=False)
    greedy = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    assert tokens(llm, PROMPTS * 2, greedy) == tokens(plain_llm, PROMPTS * 2, greedy)
    assert spec_stats(llm)[2] > 0 and llm.engine.runner.counter.recompiles == 0
    # Acceptances per draft position, summed over the ranks (vLLM's _num_accepted_tokens_per_pos).
    per_pos = llm.engine.scheduler.make_stats().spec_num_accepted_per_pos
    assert sum(per_pos) == spec_stats(llm)[2] and list(per_pos) == sorted(per_pos, reverse=True)
    assert len(per_pos) > 1 and per_pos[0] <= spec_stats(llm)[0]
