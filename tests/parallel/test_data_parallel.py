"""Data parallelism through the served engine: `LLM(data_parallel_size=2)` (each rank its own
KV pages, sampling slots and scheduler, one compiled step over both) gives the single-rank
engine's tokens and log-probs, greedy and seeded, with tensor parallelism inside each rank too,
prefix hits on the rank that holds the prefix, and nothing compiled after warm-up."""

from __future__ import annotations

import re

import pytest

from jaxserve import LLM, SamplingParams
from tests.model_dirs import write_model_dir

OPTIONS = dict(dtype="float32", token_buckets=(16,), request_buckets=(8,), show_progress=False, num_pages=64)
SHARED = list(range(20, 60))  # 40 tokens: the second request with it finds 2 full pages of 16
PROMPTS = [[5, 6, 7, 8], [9, 10, 11], SHARED, SHARED, [30, 31], [40, 41, 42, 43, 44]]


def _run(llm: LLM):
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=2)
    seeded = SamplingParams(max_tokens=8, temperature=0.8, seed=7, n=2, ignore_eos=True, logprobs=1)
    outs = llm.generate(PROMPTS, greedy, use_tqdm=False) + llm.generate([[9, 10, 11]], seeded, use_tqdm=False)
    return [(c.token_ids, [d[t].logprob for t, d in zip(c.token_ids, c.logprobs)]) for o in outs for c in o.outputs]


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    return str(write_model_dir(tmp_path_factory.mktemp("dp") / "llama", "llama"))


@pytest.fixture(scope="module")
def single(model, compile_cache_dir):
    llm = LLM(model, max_num_seqs=8, max_num_batched_tokens=16, compilation_cache_dir=compile_cache_dir, **OPTIONS)
    return _run(llm)


# Data parallelism beside tensor parallelism (a 2 x 2 mesh) runs through the engine in
# tests/engine/test_sharding_rules_engine.py and across processes in tests/parallel/test_multihost.py.
@pytest.mark.parametrize("tp", [1])
def test_dp2_matches_one_rank(model, single, tp, compile_cache_dir):
    llm = LLM(model, data_parallel_size=2, tensor_parallel_size=tp, max_num_seqs=16, max_num_batched_tokens=32,
              compilation_cache_dir=compile_cache_dir, **OPTIONS)
    mesh = llm.engine.runner.mesh
    assert (mesh.shape["data"], mesh.shape["model"]) == (2, tp)
    # Each rank's pages live on its own devices.
    k = llm.engine.runner.kv.k[0]
    assert k.sharding.spec[0] == "data" and k.shape[0] == 64
    got = _run(llm)
    for (ta, la), (tb, lb) in zip(got, single):
        assert ta == tb
        assert max(abs(x - y) for x, y in zip(la, lb)) < 1e-4
    sched = llm.engine.scheduler
    assert sched.make_stats().prefix_cache_hits >= 32  # the second SHARED, queued on the same rank
    assert not sched.rank_of and not sched.requests
    assert llm.engine.num_compiles_after_warmup == 0


def test_dp_limits_must_split_evenly(model):
    with pytest.raises(ValueError, match="max_num_seqs .* multiple of data_parallel_size"):
        LLM(model, data_parallel_size=2, max_num_seqs=7, max_num_batched_tokens=32, **OPTIONS)


def test_structured_output_rows_reach_their_rank(default_model_dir, compile_cache_dir):
    """Constrained and free requests spread over two data-parallel ranks: each rank's step gets
    its own rows of the grammar bitmask (the default model: the grammar engine needs a real
    tokenizer), and the outputs are the single-rank engine's."""
    from jaxserve.sampling_params import StructuredOutputsParams

    code = SamplingParams(max_tokens=8, temperature=0.0,
                          structured_outputs=StructuredOutputsParams(regex="[0-9]{3}-[a-z]{2}"))
    choice = SamplingParams(max_tokens=8, temperature=0.0, structured_outputs=StructuredOutputsParams(choice=["yes", "no"]))
    free = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    prompts = ["The code is", "Once upon a time", "Is the sky blue?", "Hello there", "Numbers:"]
    params = [code, free, choice, free, code]
    options = dict(OPTIONS, model=str(default_model_dir), max_model_len=256, compilation_cache_dir=compile_cache_dir)
    runs = []
    for dp in (1, 2):
        llm = LLM(data_parallel_size=dp, max_num_seqs=8 * dp, max_num_batched_tokens=16 * dp, **options)
        runs.append([o.outputs[0].text for o in llm.generate(prompts, params, use_tqdm=False)])
        assert llm.engine.num_compiles_after_warmup == 0
    one, two = runs
    assert two == one
    assert re.fullmatch("[0-9]{3}-[a-z]{2}", two[0]) and re.fullmatch("[0-9]{3}-[a-z]{2}", two[4])
    assert two[2] in ("yes", "no")
