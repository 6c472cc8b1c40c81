"""`sharding_rules` through the real engine (`LLM(..., sharding_rules=...)`, `--sharding-rules`):
a tiny Llama on a 2 x 2 mesh of simulated devices generates the single-device greedy tokens
over several steps (the KV cache and sampling state keep their shardings from step to step),
attention data parallelism (pages on the "data" axis) included."""

from __future__ import annotations

from jaxserve import LLM, SamplingParams
from jaxserve.server.cli import build_parser, engine_options
from tests.model_dirs import write_model_dir

PROMPTS = [[5, 6, 7, 8], [9, 10, 11]]


def _tokens(path, compile_cache_dir, **parallel):
    llm = LLM(str(path), dtype="float32", max_num_seqs=8, max_num_batched_tokens=16, token_buckets=(16,),
              request_buckets=(8,), compilation_cache_dir=compile_cache_dir, show_progress=False, **parallel)
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True), use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def test_sharding_rules_in_the_engine(tmp_path, compile_cache_dir):
    path = write_model_dir(tmp_path / "m")
    want = _tokens(path, compile_cache_dir)
    assert _tokens(path, compile_cache_dir, data_parallel_size=2, tensor_parallel_size=2, sharding_rules="fsdp") == want
    assert _tokens(path, compile_cache_dir, tensor_parallel_size=2, sharding_rules="tp-kv-replicated") == want
    # attention data parallelism: each "data" rank keeps its own requests' pages
    assert _tokens(path, compile_cache_dir, data_parallel_size=2, tensor_parallel_size=2, sharding_rules="attn-dp") == want


def test_sharding_rules_flag():
    args = build_parser().parse_args(["serve", "--sharding-rules", "tp-kv-replicated", "--tensor-parallel-size", "4"])
    assert engine_options(args)["sharding_rules"] == "tp-kv-replicated"
    assert engine_options(args)["tensor_parallel_size"] == 4  # model= is the model path
    from jaxserve.config import EngineConfig

    config = EngineConfig.from_kwargs(model="/m", **engine_options(args))
    assert (config.model.model, config.parallel.tensor_parallel_size, config.parallel.sharding_rules) == ("/m", 4, "tp-kv-replicated")
    assert engine_options(build_parser().parse_args(["serve"])).get("sharding_rules") is None
