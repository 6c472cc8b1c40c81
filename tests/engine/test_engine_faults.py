"""Failures inside an engine step. A request the runner cannot take (it names it with
RequestFailedError while preparing a step) fails alone: the step's other requests are
recomputed and finish with the tokens they would have had, the blocks the step was to fill
leave the prefix cache, nothing leaks (the server's side: test_serving_failures.py)."""

from __future__ import annotations

import pytest

from jaxserve import LLM, SamplingParams
from jaxserve.engine.llm_engine import LLMEngine
from jaxserve.sampling.config import SamplerConfig
from tests.engine.fakes import CharTokenizer, fake_parts
from tests.engine.test_engine_core import expected_tokens
from tests.model_dirs import write_model_dir

POISON = "~"  # the fake runner is told it cannot take this character's token
POISON_ID = CharTokenizer().encode(POISON)[0]


def assert_idle(core) -> None:
    """No request left in the core, every KV block free (cached or not), no reference held."""
    sched = core.scheduler
    assert not sched.requests and not sched.running and not len(sched.waiting)
    pool = sched.kv.pool
    assert pool.get_num_free_blocks() == pool.num_blocks - 1
    assert all(b.ref_cnt == 0 for b in pool.blocks)


def run(engine: LLMEngine) -> dict[str, list[int]]:
    done, steps = {}, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
        steps += 1
        assert steps < 1000
    return done


@pytest.mark.parametrize("async_scheduling", [True, False], ids=["overlapped", "plain"])
def test_a_request_the_runner_rejects_fails_alone(async_scheduling):
    engine = LLMEngine(fake_parts(async_scheduling=async_scheduling, block_size=4))
    core = engine.core
    core.runner.reject_token = POISON_ID
    greedy = SamplingParams(max_tokens=12, temperature=0.0)
    prompts = {"a": "the first prompt", "b": "another one, longer than the first", "c": "the first prompt, again"}
    engine.add_request("a", prompts["a"], greedy)
    engine.add_request("b", prompts["b"], greedy)
    for _ in range(3):  # a and b are running (with a token in flight when overlapped)
        engine.step()
    engine.add_request("c", prompts["c"], greedy)  # shares a's cached prefix
    engine.add_request("bad", "a prompt with a " + POISON, greedy)
    done = run(engine)
    assert core.runner.num_failed_prepares == 1
    (rid, error), = engine.failures
    assert rid == "bad" and isinstance(error, ValueError) and "cannot take token" in str(error)
    assert set(done) == {"a", "b", "c"}
    for rid, prompt in prompts.items():  # recomputed where needed, and unchanged
        assert done[rid] == expected_tokens(CharTokenizer().encode(prompt), 12), rid
    assert core.scheduler.make_stats().num_preemptions >= 2  # the discarded step's requests
    assert_idle(core)
    assert not engine.output_processor.unfinished()


def test_a_discarded_step_leaves_nothing_in_the_prefix_cache():
    """The blocks a discarded step was to fill hold no KV: a later request must not find them."""
    engine = LLMEngine(fake_parts(block_size=4))
    core = engine.core
    core.runner.reject_token = POISON_ID
    kv = core.scheduler.kv
    greedy = SamplingParams(max_tokens=2, temperature=0.0)
    engine.add_request("x", "twelve chars", greedy)  # three full blocks, cached when allocated
    engine.add_request("bad", POISON * 9, greedy)  # two full blocks
    assert engine.step() == [] and engine.failures  # the first step: discarded
    assert kv.pool.num_cached_blocks == 0
    run(engine)
    assert kv.pool.num_cached_blocks == 3  # x's blocks, cached by the step that computed them
    assert_idle(core)


def test_the_real_runner_fails_a_request_it_cannot_take_alone(tmp_path, compile_cache_dir, monkeypatch):
    """On the real runner (a tiny model): a request whose parameters slipped past validation
    (more stop ids under min_tokens than the sampler holds) fails when it is admitted; the other
    requests of its step finish with the tokens they have alone, and its sampler slot is free."""
    llm = LLM(str(write_model_dir(tmp_path)), dtype="float32", max_num_seqs=8, max_num_batched_tokens=16,
              token_buckets=(16,), request_buckets=(8,), compilation_cache_dir=compile_cache_dir,
              show_progress=False)
    greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    prompts = [[5, 6, 7, 8], [9, 10, 11]]
    alone = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
    engine = llm.engine
    monkeypatch.setattr(SamplerConfig, "check_request", lambda *args, **kwargs: None)  # the validation gap
    too_many = list(range(3, 4 + engine.info.sampler_config.max_stop_ids))
    engine.add_request("a", prompts[0], greedy)
    engine.add_request("bad", [12, 13], SamplingParams(max_tokens=4, min_tokens=2, stop_token_ids=too_many))
    engine.add_request("b", prompts[1], greedy)
    done = run(engine)
    assert [rid for rid, _ in engine.failures] == ["bad"]
    assert [done["a"], done["b"]] == alone
    assert_idle(engine.core)
    runner = engine.core.runner
    # no slot lost (finished requests hand theirs back at the next step)
    assert sum(map(len, runner.slots.free)) + len(runner.slot_of) == runner.max_num_seqs and "bad" not in runner.slot_of
    engine.failures.clear()
    # The offline API raises for the batch that holds such a request, and stays usable.
    with pytest.raises(ValueError, match="prompt 1"):
        llm.generate([prompts[0], [12, 13]], [greedy, SamplingParams(max_tokens=4, min_tokens=2,
                                                                      stop_token_ids=too_many)], use_tqdm=False)
    assert_idle(engine.core)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)] == alone
