"""The model's generation_config.json through the real engine (a tiny random Llama): every EOS id
it lists ends generation, and its sampling settings are the defaults (`--generation-config`)."""

from __future__ import annotations

import pytest

from jaxserve import LLM, SamplingParams
from tests.model_dirs import write_model_dir

PROMPT = [5, 6, 7, 8]


@pytest.fixture(scope="module")
def options(compile_cache_dir):
    return dict(dtype="float32", max_num_seqs=8, max_num_batched_tokens=16, token_buckets=(16,),
                request_buckets=(8,), compilation_cache_dir=compile_cache_dir, show_progress=False)


@pytest.fixture(scope="module")
def free_run(tmp_path_factory, options):
    """The tiny model's greedy tokens with EOS ignored."""
    llm = LLM(str(write_model_dir(tmp_path_factory.mktemp("m"))), **options)
    out = llm.generate([PROMPT], SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True), use_tqdm=False)
    return out[0].outputs[0].token_ids


def test_every_eos_id_of_the_generation_config_stops(tmp_path, options, free_run):
    k = next(i for i in range(2, len(free_run)) if free_run[i] not in free_run[:i] and free_run[i] != 2)
    second_eos = free_run[k]
    path = write_model_dir(tmp_path, generation_config={"eos_token_id": [2, second_eos], "bos_token_id": 1})
    llm = LLM(str(path), **options)
    greedy = SamplingParams(max_tokens=10, temperature=0.0)
    (out,) = llm.generate([PROMPT], greedy, use_tqdm=False)
    o = out.outputs[0]
    assert o.token_ids == free_run[: k + 1]
    assert (o.finish_reason, o.stop_reason) == ("stop", second_eos)  # as vLLM reports it
    # ignore_eos runs through it.
    (out,) = llm.generate([PROMPT], greedy.clone(ignore_eos=True), use_tqdm=False)
    assert out.outputs[0].token_ids == free_run and out.outputs[0].finish_reason == "length"


def test_sampling_defaults_come_from_the_generation_config(tmp_path, options, free_run):
    gen = {"eos_token_id": 2, "temperature": 0.0, "max_new_tokens": 3}
    path = write_model_dir(tmp_path, generation_config=gen)
    llm = LLM(str(path), **options)
    params = llm.get_default_sampling_params()
    assert params.temperature == 0.0
    (out,) = llm.generate([PROMPT], use_tqdm=False)  # no params: the model's defaults
    assert out.outputs[0].token_ids == free_run[:3] and out.outputs[0].finish_reason == "length"
    vllm = LLM(str(path), generation_config="vllm", **options)
    assert vllm.get_default_sampling_params().temperature == 1.0
