"""Tensor parallelism through the served engine: `LLM(tensor_parallel_size=N)` on N of the 8
simulated CPU devices gives the single-device engine's greedy tokens and log-probs for a Llama
fixture, and transformers' for the default model in float32, with nothing compiled after
warm-up."""

from __future__ import annotations

import logging

import pytest

from jaxserve import LLM, SamplingParams
from tests.model_dirs import write_model_dir

# (fixture, the tensor-parallel sizes it runs at): 2 splits the fixture's 2 KV heads (the
# default model's 3 KV heads are replicated at 4 below). One architecture through the engine:
# every fixture's sharded model under the rules presets is compared with the unsharded one in
# tests/models/test_sharding_rules.py.
FIXTURES = [("llama", (1, 2))]
OPTIONS = dict(dtype="float32", token_buckets=(16,), request_buckets=(8,), show_progress=False)


def _run(llm: LLM, prompts, params) -> list[tuple[list[int], list[float]]]:
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [(o.outputs[0].token_ids, [d[t].logprob for t, d in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)])
            for o in outs]


def _assert_same(a, b) -> None:
    for (ta, la), (tb, lb) in zip(a, b):
        assert ta == tb
        assert max(abs(x - y) for x, y in zip(la, lb)) < 1e-4


@pytest.mark.parametrize("fixture, sizes", FIXTURES)
def test_fixture_tensor_parallel_agrees(fixture, sizes, tmp_path, compile_cache_dir):
    model = str(write_model_dir(tmp_path / fixture, fixture))
    prompts = [[5, 6, 7, 8, 9], [10, 11, 12], list(range(20, 45))]
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, logprobs=1)
    runs = {}
    for tp in sizes:
        llm = LLM(model, tensor_parallel_size=tp, compilation_cache_dir=compile_cache_dir, **OPTIONS)
        assert llm.engine.runner.mesh.shape["model"] == tp
        runs[tp] = _run(llm, prompts, params)
        assert llm.engine.num_compiles_after_warmup == 0
    for tp in sizes[1:]:
        _assert_same(runs[tp], runs[1])


@pytest.mark.slow
def test_default_model_tp_4_matches_transformers(default_model_dir, golden, compile_cache_dir, caplog):
    """SmolLM2 (3 KV heads: replicated on 4 devices, which the start-up log says) on golden
    prompts whose top-1/top-2 margin exceeds 1e-3 at every step: transformers' greedy tokens and
    their log-probs (the single-device engine's own match: tests/engine/test_llm_golden.py)."""
    cases = golden["cases"][:4]
    prompts = [c["prompt_token_ids"] for c in cases]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=1)
    with caplog.at_level(logging.INFO, logger="jaxserve.engine.setup"):
        llm = LLM(str(default_model_dir), tensor_parallel_size=4, compilation_cache_dir=compile_cache_dir,
                  max_num_seqs=8, max_model_len=512, **OPTIONS)
    assert llm.engine.runner.mesh.shape["model"] == 4
    runs = _run(llm, prompts, params)
    assert llm.engine.num_compiles_after_warmup == 0
    assert "kv_heads (3) over model=4 does not divide" in caplog.text
    assert "MiB per device" in caplog.text
    for case, (tokens, logprobs) in zip(cases, runs):
        assert tokens == case["completion_token_ids"][:12]
        want = [step["logprob"] for step in case["steps"][:12]]
        assert max(abs(x - y) for x, y in zip(logprobs, want)) < 2e-4
