"""Greedy LLM.generate reproduces transformers' golden completions on the real default model:
one at a time, all at once, with forced chunked prefill, with preemption, with prefix-cache hits.
Also: seeded sampling is reproducible across batch compositions, and nothing compiles after
warm-up."""

from __future__ import annotations

import pytest

from jaxserve import LLM, SamplingParams

pytestmark = pytest.mark.slow


def greedy(case) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=len(case["completion_token_ids"]), ignore_eos=True)


def assert_matches_golden(case, token_ids):
    """Exact match, except that a divergence is accepted right after a golden step whose top-2
    log-probs are within 1e-3 (a float32 near-tie: either token is a correct greedy choice)."""
    want = case["completion_token_ids"]
    assert len(token_ids) == len(want), case["name"]
    for i, (a, b) in enumerate(zip(token_ids, want)):
        if a != b:
            top = case["steps"][i]["top5"]
            assert top[0][1] - top[1][1] < 1e-3, f"{case['name']}: diverged at step {i} ({a} != {b})"
            assert a == top[1][0], f"{case['name']}: step {i} took neither of the tied tokens"
            return
    assert token_ids == want


def greedy_batch(llm, cases):
    """Every case in one batch: greedy, with top-2 log-probs."""
    params = [greedy(c).clone(logprobs=2) for c in cases]
    return llm.generate([c["prompt_token_ids"] for c in cases], params, use_tqdm=False)


def assert_same_greedy_outputs(a_outs, b_outs, tol):
    """Two engines' `greedy_batch` of the same cases: the same greedy tokens and top-2 log-probs."""
    assert len(a_outs) == len(b_outs)
    for a, b in zip(a_outs, b_outs):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for la, lb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert la.keys() == lb.keys()
            assert all(abs(la[t].logprob - lb[t].logprob) < tol for t in la)


@pytest.fixture
def llm(small_llm):
    return small_llm


@pytest.fixture(scope="module")
def llm_batch(small_llm, golden):
    """The default engine's `greedy_batch` of every golden case: what the engines of other
    settings are compared with (computed once: the engine is deterministic)."""
    return greedy_batch(small_llm, golden["cases"])


@pytest.fixture(scope="module")
def tight_llm(small_engine_options):
    """Token budget 32 (every prompt is chunked) and a KV cache of 30 pages of 16 tokens: the
    golden cases together need ~46 pages, so running them at once preempts."""
    opts = dict(small_engine_options, max_num_batched_tokens=32, token_buckets=(16, 32), num_pages=30, max_model_len=448)
    return LLM(**opts)


def test_one_at_a_time(llm, golden):
    for case in golden["cases"]:
        (out,) = llm.generate([case["prompt_token_ids"]], greedy(case), use_tqdm=False)
        assert out.prompt_token_ids == case["prompt_token_ids"]
        assert_matches_golden(case, out.outputs[0].token_ids)
        assert out.outputs[0].finish_reason == "length"


def test_all_at_once_and_prefix_cache_hits(llm, golden):
    cases = golden["cases"] * 2  # every case twice: the second copy hits the prefix cache
    hits_before = llm.engine.scheduler.make_stats().prefix_cache_hits
    outs = llm.generate([c["prompt_token_ids"] for c in cases], [greedy(c) for c in cases], use_tqdm=False)
    for case, out in zip(cases, outs):
        assert_matches_golden(case, out.outputs[0].token_ids)
    stats = llm.engine.scheduler.make_stats()
    assert stats.prefix_cache_hits > hits_before
    assert any(o.num_cached_tokens > 0 for o in outs)
    assert llm.engine.num_compiles_after_warmup == 0


def test_chunked_prefill_and_preemption(tight_llm, golden):
    cases = golden["cases"]
    before = tight_llm.engine.scheduler.make_stats().num_preemptions
    outs = tight_llm.generate([c["prompt_token_ids"] for c in cases], [greedy(c) for c in cases], use_tqdm=False)
    for case, out in zip(cases, outs):
        assert_matches_golden(case, out.outputs[0].token_ids)
    stats = tight_llm.engine.scheduler.make_stats()
    assert stats.num_preemptions > before, "the tiny cache should have forced a preemption"
    assert stats.num_running == 0 and stats.kv_cache_usage == 0.0
    assert tight_llm.engine.num_compiles_after_warmup == 0


def test_seeded_sampling_is_batch_independent(llm):
    p = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=12, ignore_eos=True)
    prompt = "Write a short poem about the sea."
    (alone,) = llm.generate(prompt, p, use_tqdm=False)
    others = [SamplingParams(temperature=0.7, top_k=20, max_tokens=8, ignore_eos=True, seed=s) for s in range(5)]
    mixed = llm.generate(["Hello", "Tell me a joke", prompt, "1 2 3", "Why?", "Paris is"],
                         others[:2] + [p] + others[2:], use_tqdm=False)
    assert mixed[2].outputs[0].token_ids == alone.outputs[0].token_ids
    (again,) = llm.generate(prompt, p, use_tqdm=False)
    assert again.outputs[0].token_ids == alone.outputs[0].token_ids
    (other_seed,) = llm.generate(prompt, p.clone(seed=99), use_tqdm=False)
    assert other_seed.outputs[0].token_ids != alone.outputs[0].token_ids


def test_mixed_workload_compiles_nothing(llm):
    params = [
        SamplingParams(temperature=0.0, max_tokens=5),
        SamplingParams(temperature=0.8, top_k=5, max_tokens=7, seed=1),
        SamplingParams(temperature=1.2, top_p=0.5, min_p=0.1, max_tokens=3),
        SamplingParams(temperature=0.5, presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.2, max_tokens=6),
        SamplingParams(temperature=1.0, logit_bias={42: 5.0}, logprobs=3, max_tokens=4),
        SamplingParams(temperature=0.0, prompt_logprobs=2, max_tokens=2),
    ]
    prompts = ["a " * n for n in (1, 40, 3, 200, 17, 9)]
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [5, 7, 3, 6, 4, 2] or all(o.finished for o in outs)
    assert outs[4].outputs[0].logprobs is not None and len(outs[4].outputs[0].logprobs) == len(outs[4].outputs[0].token_ids)
    assert outs[5].prompt_logprobs is not None and outs[5].prompt_logprobs[0] is None
    assert llm.engine.num_compiles_after_warmup == 0


def test_stop_strings_and_text(llm, golden):
    case = next(c for c in golden["cases"] if c["name"] == "chat_capital")
    full = case["completion_text"]
    stop = "Paris"
    assert stop in full
    (out,) = llm.generate([case["prompt_token_ids"]], greedy(case).clone(stop=[stop]), use_tqdm=False)
    c = out.outputs[0]
    assert c.text == full[: full.index(stop)] and c.finish_reason == "stop" and c.stop_reason == stop
    (out,) = llm.generate([case["prompt_token_ids"]], greedy(case).clone(stop=[stop], include_stop_str_in_output=True), use_tqdm=False)
    assert out.outputs[0].text == full[: full.index(stop) + len(stop)]


def test_chat_uses_template(llm, golden):
    case = next(c for c in golden["cases"] if c["name"] == "chat_system")
    (out,) = llm.chat(case["messages"], greedy(case), use_tqdm=False)
    assert out.prompt == case["text"]
    assert_matches_golden(case, out.outputs[0].token_ids)


def test_logprobs_and_prompt_logprobs_match_golden(llm, golden):
    cases = golden["cases"]
    params = [greedy(c).clone(logprobs=5, prompt_logprobs=1) for c in cases]
    outs = llm.generate([c["prompt_token_ids"] for c in cases], params, use_tqdm=False)
    for case, out in zip(cases, outs):
        comp = out.outputs[0]
        assert_matches_golden(case, comp.token_ids)
        n = len(comp.token_ids)
        for i in range(n):
            if comp.token_ids[i] != case["completion_token_ids"][i]:
                break  # an accepted near-tie divergence: later steps see another prefix
            step, lp = case["steps"][i], comp.logprobs[i]
            chosen = lp[comp.token_ids[i]]
            assert abs(chosen.logprob - step["logprob"]) < 1e-3
            assert chosen.rank == 1
            top = sorted(((v.rank, t, v.logprob) for t, v in lp.items() if v.rank is not None and v.rank <= 5))
            got_ids = [t for _, t, _ in top][:5]
            want_ids = [t for t, _ in step["top5"]]
            for (_, t, v), (wt, wv) in zip(top, step["top5"]):
                assert abs(v - wv) < 1e-3
                assert t == wt or abs(v - lp.get(wt, chosen).logprob) < 1e-4, (case["name"], i, got_ids, want_ids)
        plp = out.prompt_logprobs
        assert plp[0] is None and len(plp) == len(case["prompt_token_ids"])
        want = case["prompt_logprobs"]
        for j in range(1, len(plp)):
            tok = case["prompt_token_ids"][j]
            assert abs(plp[j][tok].logprob - want[j - 1]) < 1e-3, (case["name"], j)


def test_parallel_samples_share_the_prompt(llm, golden):
    case = next(c for c in golden["cases"] if c["name"] == "plain_long")  # 279 prompt tokens
    hits_before = llm.engine.scheduler.make_stats().prefix_cache_hits
    p = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=6, ignore_eos=True)
    (out,) = llm.generate([case["prompt_token_ids"]], p, use_tqdm=False)
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert all(len(c.token_ids) == 6 for c in out.outputs)
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1, "each sample has its own random stream"
    # the children after the first read the prompt's full blocks from the cache
    assert llm.engine.scheduler.make_stats().prefix_cache_hits - hits_before >= 2 * (278 // 16) * 16
    (again,) = llm.generate([case["prompt_token_ids"]], p, use_tqdm=False)
    assert [c.token_ids for c in again.outputs] == [c.token_ids for c in out.outputs]
    with pytest.raises(ValueError, match="n > 1"):
        SamplingParams(n=2, temperature=0.0)


def test_overlapped_steps_equal_plain_steps(small_engine_options, golden, llm, llm_batch):
    """Greedy tokens and log-probs are the same with async scheduling (the default: step t+1
    planned and launched while step t runs) and without, with every case in one batch (so
    requests finish while others still run)."""
    assert llm.engine.core.async_scheduling
    plain = LLM(**small_engine_options, async_scheduling=False)
    assert not plain.engine.core.async_scheduling
    assert_same_greedy_outputs(llm_batch, greedy_batch(plain, golden["cases"]), tol=1e-5)
    assert llm.engine.num_compiles_after_warmup == 0 and plain.engine.num_compiles_after_warmup == 0


def test_speculative_decoding_keeps_the_golden_outputs(small_engine_options, golden, llm_batch):
    """n-gram speculative decoding: every golden case one at a time (all rows spare, the most
    drafts) and all at once gives the greedy tokens without it, log-probs included, many of
    the drafts accepted, and nothing compiles after warm-up."""
    spec = LLM(**small_engine_options, speculative_config={"method": "ngram", "num_speculative_tokens": 4,
                                                           "prompt_lookup_min": 2, "prompt_lookup_max": 4})
    cases = golden["cases"]
    for case in cases:
        (out,) = spec.generate([case["prompt_token_ids"]], greedy(case), use_tqdm=False)
        assert_matches_golden(case, out.outputs[0].token_ids)
    stats = spec.engine.scheduler.make_stats()
    assert stats.spec_num_accepted_tokens > 0.2 * stats.spec_num_draft_tokens > 0
    assert_same_greedy_outputs(greedy_batch(spec, cases), llm_batch, tol=1e-4)
    assert spec.engine.num_compiles_after_warmup == 0


def golden_prompt_logprobs(case, extra: int = 0) -> tuple[list[int], list[float]]:
    """A case's prompt (and `extra` tokens of its greedy completion) with transformers' log-prob
    of each token after the first (teacher-forced: the completion's steps continue the prompt's)."""
    ids = case["prompt_token_ids"] + case["completion_token_ids"][:extra]
    return ids, case["prompt_logprobs"] + [s["logprob"] for s in case["steps"][:extra]]


def assert_prompt_logprobs(plp, ids, want, k, tol=1e-3):
    """vLLM's prompt_logprobs: None first, then per position the prompt token's own log-prob
    (its dict holds only it for k = 0) and up to k alternatives, ranked."""
    assert plp is not None and len(plp) == len(ids) and plp[0] is None
    for j in range(1, len(ids)):
        entry = plp[j]
        assert entry is not None, f"prompt position {j} has no log-prob"
        assert next(iter(entry)) == ids[j]
        assert abs(entry[ids[j]].logprob - want[j - 1]) < tol, (j, entry[ids[j]].logprob, want[j - 1])
        assert sorted(v.rank for v in entry.values() if v.rank <= k) == list(range(1, k + 1)), (j, entry)
        assert len(entry) == k + (entry[ids[j]].rank > k), (j, entry)


@pytest.mark.parametrize("k", [0, 1, 5])
def test_prompt_logprobs_when_the_first_token_ends_the_request(llm, golden, k):
    """max_tokens=1 (lm-eval's log-likelihood requests): the request ends in the step that ends
    its prompt, and every prompt position still has its log-prob, equal to transformers'."""
    cases = golden["cases"]
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=k)
    outs = llm.generate([c["prompt_token_ids"] for c in cases], params, use_tqdm=False)
    for case, out in zip(cases, outs):
        assert out.outputs[0].finish_reason == "length" and len(out.outputs[0].token_ids) == 1
        assert_prompt_logprobs(out.prompt_logprobs, *golden_prompt_logprobs(case), k)


def test_prompt_logprobs_when_eos_a_stop_token_or_a_stop_string_ends_the_request(llm, golden):
    """The prompt runs up to just before the golden completion's end of turn, so the first
    generated token is EOS (or, as a stop token or a stop string, the first golden token)."""
    case = next(c for c in golden["cases"] if c["name"] == "chat_capital")
    eos_at = case["completion_token_ids"].index(2)
    ids, want = golden_prompt_logprobs(case, eos_at)
    first = case["completion_token_ids"][0]
    endings = [SamplingParams(temperature=0.0, max_tokens=8, prompt_logprobs=1),  # EOS next
               SamplingParams(temperature=0.0, max_tokens=8, prompt_logprobs=1, stop_token_ids=[first]),
               SamplingParams(temperature=0.0, max_tokens=8, prompt_logprobs=1,
                              stop=[llm.get_tokenizer().decode([first])])]
    prompts = [ids, case["prompt_token_ids"], case["prompt_token_ids"]]
    wants = [want, golden_prompt_logprobs(case)[1], golden_prompt_logprobs(case)[1]]
    outs = llm.generate(prompts, endings, use_tqdm=False)
    assert [(o.outputs[0].finish_reason, o.outputs[0].stop_reason) for o in outs] == [
        ("stop", None), ("stop", first), ("stop", llm.get_tokenizer().decode([first]))]
    assert [len(o.outputs[0].token_ids) for o in outs] == [1, 1, 1]
    for prompt, w, out in zip(prompts, wants, outs):
        assert_prompt_logprobs(out.prompt_logprobs, prompt, w, 1)


def test_prompt_logprobs_of_a_chunked_prompt_ending_at_once(tight_llm, golden):
    """A 279-token prompt in chunks of 32 tokens, max_tokens=1: every chunk's log-probs arrive."""
    case = next(c for c in golden["cases"] if c["name"] == "plain_long")
    (out,) = tight_llm.generate([case["prompt_token_ids"]], SamplingParams(temperature=0.0, max_tokens=1,
                                                                           prompt_logprobs=0), use_tqdm=False)
    assert_prompt_logprobs(out.prompt_logprobs, *golden_prompt_logprobs(case), 0)


def test_prompt_logprobs_skip_the_prefix_cache(llm, golden):
    """As in vLLM, a request that asks for prompt log-probs computes its whole prompt (it never
    reads the prefix cache, whose blocks hold KV but no logits): after the same prompt ran
    without them, its log-probs are all there and no token came from the cache."""
    case = next(c for c in golden["cases"] if c["name"] == "chat_multi_turn")
    (warm,) = llm.generate([case["prompt_token_ids"]], SamplingParams(temperature=0.0, max_tokens=1), use_tqdm=False)
    (again,) = llm.generate([case["prompt_token_ids"]], SamplingParams(temperature=0.0, max_tokens=1),
                            use_tqdm=False)
    assert again.num_cached_tokens > 0  # the prompt's blocks are cached
    (out,) = llm.generate([case["prompt_token_ids"]], SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1),
                          use_tqdm=False)
    assert out.num_cached_tokens == 0
    assert_prompt_logprobs(out.prompt_logprobs, *golden_prompt_logprobs(case), 1)
