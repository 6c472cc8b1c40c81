"""Multi-step decode (runner/decode_block.py, Scheduler.schedule_block): an engine running
decode blocks of 4 steps gives the tokens, log-probs and finish reasons of one running single
steps, on a tiny random model: greedy and seeded, batched, with penalties, EOS, stop tokens and
max_tokens inside a block, stop strings, requests arriving and finishing while others are
inside a block; the cases that must run single steps (structured output, prefills) do; nothing
compiles after warm-up. The plan's choice of K and the scheduler's refusals are tested without
devices."""

from __future__ import annotations

import json

import pytest

from jaxserve import LLM, SamplingParams
from jaxserve.backends import select_backend
from jaxserve.backends.devices import DeviceSet
from jaxserve.config import EngineConfig, SchedulerConfig
from jaxserve.core.kv_cache_manager import KVCacheManager
from jaxserve.core.scheduler import Scheduler
from jaxserve.engine.plan import ModelFiles, plan_engine
from jaxserve.request import Request
from jaxserve.tools.shard_plan import PRESET_DIR
from tests.model_dirs import write_model_dir

K = 4
PROMPTS = [[5, 6, 7, 8], [9, 10, 11], [20, 21, 22, 23, 24], [30, 31]]
EOS = 2


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(write_model_dir(tmp_path_factory.mktemp("m")))


@pytest.fixture(scope="module")
def options(compile_cache_dir):
    # A KV cache of 10 pages of 16 tokens: 8 requests of ~45 tokens preempt one another.
    return dict(dtype="float32", max_num_seqs=8, max_num_batched_tokens=64, token_buckets=(16, 64),
                request_buckets=(8,), max_model_len=64, num_pages=11, compilation_cache_dir=compile_cache_dir,
                show_progress=False)


@pytest.fixture(scope="module")
def multi(model_dir, options):
    return LLM(model_dir, num_decode_steps=K, seed=1, **options)


@pytest.fixture(scope="module")
def single(model_dir, options):
    return LLM(model_dir, num_decode_steps=1, seed=2, **options)


def outputs(llm, prompts, params):
    return [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]


def tokens(llm, prompts, params):
    return [o.token_ids for o in outputs(llm, prompts, params)]


def blocks(llm) -> int:
    return llm.engine.core.num_blocks


def test_the_engine_runs_blocks_of_the_planned_steps(multi, single):
    assert multi.engine.core.num_decode_steps == K and multi.engine.runner.num_decode_steps == K
    assert single.engine.core.num_decode_steps == 1
    assert multi.engine.runner.recipe.num_decode_steps == K and not single.engine.runner.recipe.block_buckets()


def test_greedy_and_seeded_outputs_are_those_of_single_steps(multi, single):
    before = blocks(multi)
    greedy = SamplingParams(temperature=0.0, max_tokens=19, ignore_eos=True)
    assert tokens(multi, PROMPTS, greedy) == tokens(single, PROMPTS, greedy)
    assert tokens(multi, PROMPTS[:1], greedy) == tokens(single, PROMPTS[:1], greedy)  # one row of a bucket
    # Seeded draws (the random number of each output position is hashed on the host for the
    # block's K positions), with penalties folded on the device each step, bad words and
    # min_tokens keeping EOS out inside a block.
    seeded = [SamplingParams(temperature=t, top_p=tp, top_k=tk, seed=s, max_tokens=18, min_tokens=6, **extra)
              for s, (t, tp, tk, extra) in enumerate([
                  (0.8, 1.0, 0, {"presence_penalty": 0.8, "frequency_penalty": 0.4}),
                  (1.0, 0.9, 0, {"repetition_penalty": 1.3}),
                  (0.7, 1.0, 20, {"bad_words": ["w41 w3", "w18"]}),
                  (1.2, 0.95, 5, {})])]
    assert tokens(multi, PROMPTS, seeded) == tokens(single, PROMPTS, seeded)
    greedy_pen = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, repetition_penalty=1.5,
                                frequency_penalty=0.7)
    assert tokens(multi, PROMPTS, greedy_pen) == tokens(single, PROMPTS, greedy_pen)
    assert blocks(multi) - before >= 4 * 3  # most of each request's tokens came from blocks


def test_logprobs_of_every_token_of_a_block(multi, single):
    params = SamplingParams(temperature=0.0, max_tokens=11, ignore_eos=True, logprobs=3)
    for a, b in zip(outputs(multi, PROMPTS, params), outputs(single, PROMPTS, params)):
        assert a.token_ids == b.token_ids and len(a.logprobs) == len(a.token_ids) == 11
        for x, y, tok in zip(a.logprobs, b.logprobs, a.token_ids):
            assert list(x) == list(y) and tok in x
            for t in x:
                assert x[t].logprob == pytest.approx(y[t].logprob, abs=1e-5) and x[t].rank == y[t].rank
        assert a.cumulative_logprob == pytest.approx(b.cumulative_logprob, abs=1e-4)


def test_eos_stop_tokens_and_max_tokens_inside_a_block(multi, single):
    # EOS made certain once min_tokens allows it: the 7th token (inside the second block).
    eos = SamplingParams(temperature=0.0, max_tokens=30, min_tokens=6, logit_bias={EOS: 100.0})
    (a,), (b,) = outputs(multi, PROMPTS[:1], eos), outputs(single, PROMPTS[:1], eos)
    assert a.token_ids == b.token_ids and len(a.token_ids) == 7 and a.token_ids[-1] == EOS
    assert a.finish_reason == b.finish_reason == "stop" and a.stop_reason is None
    # A stop token id that greedy decoding reaches mid-block; max_tokens ending rows mid-block
    # (1, 2, 6 and 9 tokens), in one batch.
    free = tokens(single, PROMPTS, SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True))
    stop_at = free[1][5]
    first = free[1].index(stop_at)
    params = [SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, stop_token_ids=[stop_at]),
              SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True)]
    got, want = outputs(multi, PROMPTS, params), outputs(single, PROMPTS, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert [len(o.token_ids) for o in got] == [1, first + 1, 6, 9]
    assert [(o.finish_reason, o.stop_reason) for o in got] == [(o.finish_reason, o.stop_reason) for o in want]
    assert got[1].finish_reason == "stop" and got[1].stop_reason == stop_at and got[0].finish_reason == "length"
    # The context's end inside a block: max_model_len (64) caps the row's steps.
    long = SamplingParams(temperature=0.0, max_tokens=None, ignore_eos=True)
    got, want = outputs(multi, [PROMPTS[1]], long), outputs(single, [PROMPTS[1]], long)
    assert got[0].token_ids == want[0].token_ids and len(got[0].token_ids) == 64 - 3
    assert got[0].finish_reason == want[0].finish_reason == "length"


def test_stop_strings_end_a_request_inside_a_block(multi, single):
    free = outputs(single, PROMPTS[:2], SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True))
    words = free[0].text.split()
    stop = " ".join(words[6:8])  # found in the second block, with tokens after it
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, stop=[stop])
    got, want = outputs(multi, PROMPTS[:2], params), outputs(single, PROMPTS[:2], params)
    assert [(o.text, o.token_ids, o.finish_reason, o.stop_reason) for o in got] == [
        (o.text, o.token_ids, o.finish_reason, o.stop_reason) for o in want]
    assert got[0].finish_reason == "stop" and got[0].stop_reason == stop and stop not in got[0].text


def test_requests_arriving_and_finishing_while_others_are_inside_blocks(multi, single):
    """Requests added between engine steps (with overlapped steps, one is always in flight):
    an arrival makes the next step an ordinary one that admits it, then blocks resume; each
    greedy request gives its tokens alone (a row's tokens do not depend on the batch)."""
    engine = multi.engine
    lengths = {"a": 23, "b": 9, "c": 14, "d": 5}
    arrivals = {0: ["a"], 3: ["b"], 5: ["c"], 9: ["d"]}
    prompt = {"a": PROMPTS[0], "b": PROMPTS[1], "c": PROMPTS[2], "d": PROMPTS[3]}
    done, before, step = {}, blocks(multi), 0
    while step <= max(arrivals) or engine.has_unfinished_requests():
        for rid in arrivals.get(step, []):
            engine.add_request(rid, prompt[rid], SamplingParams(temperature=0.0, max_tokens=lengths[rid],
                                                                ignore_eos=True))
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
        step += 1
    assert blocks(multi) - before >= 4
    for rid, n in lengths.items():
        alone = tokens(single, [prompt[rid]], SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))[0]
        assert done[rid] == alone, rid


def test_a_request_with_penalties_that_joins_plain_ones_counts_its_tokens(multi, single):
    """The sampling state keeps token counts only for the requests with penalties, in every
    step their tokens are in: a greedy request with penalties that arrives while plain greedy
    ones decode (in single steps and blocks), and shares its steps with them and with a
    later plain arrival, gets the tokens it gets alone, which its penalties change; the plain
    ones get theirs."""
    pen = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, repetition_penalty=1.5,
                         frequency_penalty=0.7, presence_penalty=0.5)
    plain = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    arrivals = {0: [("a", 0, plain), ("b", 1, plain)], 3: [("pen", 2, pen)], 6: [("c", 3, plain)]}
    for llm in (multi, single):
        engine, done, step = llm.engine, {}, 0
        while step <= max(arrivals) or engine.has_unfinished_requests():
            for rid, i, params in arrivals.get(step, []):
                engine.add_request(rid, PROMPTS[i], params)
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = out.outputs[0].token_ids
            step += 1
        for rid, i, params in (x for xs in arrivals.values() for x in xs):
            assert done[rid] == tokens(single, [PROMPTS[i]], params)[0], rid
    unpenalised = pen.clone(repetition_penalty=1.0, frequency_penalty=0.0, presence_penalty=0.0)
    assert done["pen"] != tokens(single, [PROMPTS[2]], unpenalised)[0]


def test_prompt_logprobs_belong_to_single_steps_and_blocks_follow(multi, single):
    """Prompt log-probs are computed by prefill rows, which never run in a block; the request's
    decode rows do."""
    before = blocks(multi)
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, prompt_logprobs=2)
    got, want = multi.generate(PROMPTS, params, use_tqdm=False), single.generate(PROMPTS, params, use_tqdm=False)
    for a, b in zip(got, want):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert len(a.prompt_logprobs) == len(b.prompt_logprobs) == len(a.prompt_token_ids)
        for x, y in zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:]):
            assert list(x) == list(y)
            assert all(x[t].logprob == pytest.approx(y[t].logprob, abs=1e-5) for t in x)
    assert blocks(multi) > before


def test_requests_that_may_draft_or_follow_a_grammar_run_single_steps():
    """The engine core asks for a block only while no running request may draft (drafts need
    each token on the host) and none follows a grammar (its next bitmask does)."""
    from tests.engine.fakes import fake_parts

    core = fake_parts().core
    core.num_decode_steps = K
    core.scheduler.add_request(_req("a"))
    core.step()
    core.step()  # a's prompt computed; its first token in flight
    core._may_draft.add("a")
    assert core._schedule_block(False) is None
    core._may_draft.clear()
    assert core._schedule_block(True) is None
    out = core._schedule_block(False)
    assert out is not None and out.num_steps == K and out.scheduled[0].num_steps == K


def test_preemption_between_blocks(multi, single):
    """More requests than the KV cache holds: a block that does not fit is refused and the
    ordinary step that follows preempts, as with single steps; the greedy tokens are the same."""
    stats = lambda llm: llm.engine.scheduler.make_stats().num_preemptions  # noqa: E731
    before, blocks_before = stats(multi), blocks(multi)
    prompts = [[5 + i, 6, 7 + i, 8] for i in range(8)]
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    assert tokens(multi, prompts, params) == tokens(single, prompts, params)
    assert stats(multi) > before and blocks(multi) > blocks_before
    assert multi.engine.scheduler.kv.get_num_free_blocks() == multi.engine.scheduler.kv.num_blocks - 1


def test_nothing_compiles_after_warm_up(multi, single):
    assert multi.engine.runner.counter.recompiles == 0
    assert single.engine.runner.counter.recompiles == 0
    assert multi.engine.runner.num_buckets == single.engine.runner.num_buckets


# ---------------------------------------------------------------------------- the scheduler
def _scheduler(*, seqs=4, blocks_=64, max_len=64, budget=64) -> Scheduler:
    return Scheduler(SchedulerConfig(seqs, budget, max_len), KVCacheManager(4, blocks_, True, max_len))


def _decoding(s: Scheduler, *requests: Request) -> None:
    """Add the requests and run one synchronous step: each has its prompt computed and one token."""
    for r in requests:
        s.add_request(r)
    out = s.schedule()
    s.update_from_output(out, {x.request_id: [7] for x in out.scheduled if x.sample})


def _req(rid: str, n: int = 5, first: int = 10, **params) -> Request:
    return Request(rid, list(range(first, first + n)), SamplingParams(**{"max_tokens": 20, **params}),
                   eos_token_id=EOS)


def test_a_block_allocates_each_rows_steps_and_the_tokens_come_back_trimmed():
    s = _scheduler()
    _decoding(s, _req("a"), _req("b", max_tokens=3), _req("c", stop_token_ids=[9]))
    out = s.schedule_block(K)
    assert out is not None and out.num_steps == K and out.batch().num_steps == K
    rows = {x.request_id: x for x in out.scheduled}
    assert {rid: x.num_steps for rid, x in rows.items()} == {"a": 4, "b": 2, "c": 4}  # b: 1 of 3 done
    a = s.get_request("a")
    assert a.num_output_placeholders == 4 and a.num_computed_tokens == 5 + 4 == rows["a"].end_pos
    assert len(s.kv.get_block_ids("a")) * 4 >= a.num_computed_tokens
    done = s.update_from_output(out, {"a": [11, 12, 13, 14], "b": [5, 6], "c": [8, 9, 10, 11]})
    taken = {r.request_id: n for r, n in done}
    assert taken == {"a": 4, "b": 2, "c": 2}  # c stops at its stop token; what follows is dropped
    assert s.get_request("a").output_token_ids == [7, 11, 12, 13, 14] and s.get_request("a").num_output_placeholders == 0
    assert s.get_request("b") is None and s.get_request("c") is None


def test_the_scheduler_refuses_blocks_that_would_not_be_exact_or_worth_it():
    s = _scheduler(seqs=4)
    s.add_request(_req("p", n=9))
    assert s.schedule_block(K) is None  # a prompt to compute (nothing runs yet: it waits)
    s = _scheduler(seqs=4)
    _decoding(s, _req("a"))
    s.add_request(_req("w"))
    assert s.schedule_block(K) is None  # a waiting request could be admitted
    s = _scheduler(seqs=4, budget=8)
    _decoding(s, _req("a", n=12))  # a chunked prompt: 8 of its 12 tokens computed
    assert s.schedule_block(K) is None
    s = _scheduler()
    _decoding(s, _req("a"))
    s.get_request("a").spec_token_ids = [3, 4]
    assert s.schedule_block(K) is None  # drafts proposed
    s = _scheduler()
    _decoding(s, _req("a", max_tokens=2))
    assert s.schedule_block(K) is None  # one token left: an ordinary step
    # Too few free blocks for every row's steps: no block (the ordinary step preempts).
    s = _scheduler(blocks_=6, max_len=16)
    _decoding(s, _req("a", n=8), _req("b", n=8, first=30))  # 2 blocks each of the 5 usable
    assert s.kv.get_num_free_blocks() == 1
    assert s.schedule_block(K) is None
    assert s.get_request("a").num_output_placeholders == 0 and s.get_request("a").num_computed_tokens == 8
    out = s.schedule()
    assert out.preempted_request_ids == ("b",)


def test_a_waiting_request_that_cannot_be_admitted_does_not_stop_blocks():
    s = _scheduler(seqs=1)
    _decoding(s, _req("a"))
    s.add_request(_req("w"))
    assert s.schedule_block(K) is not None


# ---------------------------------------------------------------------------- the plan
def _plan(platform: str, devices, **kwargs):
    files = ModelFiles(None, json.loads((PRESET_DIR / "llama3-8b.json").read_text()))
    return plan_engine(EngineConfig.from_kwargs(model="llama3-8b", **kwargs), files, select_backend(platform),
                       devices)


def test_the_plan_chooses_k():
    gpu = DeviceSet.described("gpu", "NVIDIA H100 80GB HBM3", 1)
    plan = _plan("gpu", gpu)
    assert plan.num_decode_steps == 4 and plan.reasons["num_decode_steps"] == "auto: gpu's default"
    assert plan.recipe(num_pages=64, max_model_len=4096).num_decode_steps == 4
    assert _plan("gpu", gpu, num_decode_steps=8).num_decode_steps == 8
    cpu = DeviceSet.described("cpu", "cpu", 1)
    assert _plan("cpu", cpu).num_decode_steps == 1
    two = DeviceSet.described("gpu", "NVIDIA H100 80GB HBM3", 2)
    assert _plan("gpu", two, data_parallel_size=2).num_decode_steps == 1
    with pytest.raises(ValueError, match="without data parallelism"):
        _plan("gpu", two, data_parallel_size=2, num_decode_steps=4)
    for bad in (0, 9):
        with pytest.raises(ValueError, match="num_decode_steps"):
            SchedulerConfig(num_decode_steps=bad)
