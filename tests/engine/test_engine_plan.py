"""The engine's plan (engine/plan.py) resolved without devices: for this CPU, for a TPU slice and
for GPU hosts described as facts (`DeviceSet.described`), from the models' config.json alone.
Every "auto" gets a value and a reason, the plan writes the step's recipe, and `serve --help`
shows what the plan resolves."""

from __future__ import annotations

import dataclasses
import json

import pytest

from jaxserve.backends import select_backend
from jaxserve.backends.devices import DeviceSet
from jaxserve.config import EngineConfig
from jaxserve.engine.plan import PLAN_HELP, ModelFiles, plan_engine
from jaxserve.tools.shard_plan import PRESET_DIR


def _files(preset: str, **changes) -> ModelFiles:
    return ModelFiles(None, {**json.loads((PRESET_DIR / f"{preset}.json").read_text()), **changes})


def _check_reasons(plan) -> None:
    entries = dict(plan.entries())
    assert set(entries) <= set(plan.reasons), set(entries) - set(plan.reasons)
    line = plan.describe()
    for name, value in entries.items():
        assert f"{name} {value} ({plan.reasons[name]})" in line


def test_a_tpu_slice_is_planned_without_its_chips():
    devices = DeviceSet.described("tpu", "TPU v6 lite", 8, slice_shape=(2, 4), host_cores=16)
    config = EngineConfig.from_kwargs(model="llama3-8b", tensor_parallel_size=8)
    plan = plan_engine(config, _files("llama3-8b"), select_backend("tpu"), devices,
                       engine_core=("process", "auto: the faster on tpu"))
    d = plan.device
    assert (d.dtype, d.kv_dtype, d.matmul_impl, d.native_sampling, d.moe_impl) == (
        "bfloat16", "bfloat16", "xla", None, "ragged")
    assert plan.attention_impl == "tpu" and plan.reasons["attention"] == "auto: the tpu platform's kernel"
    assert d.quant_matmul_impl == "tpu" and not d.fp8_products
    assert plan.max_model_len == 8192 and "lowered to what the KV cache holds" in plan.reasons["max_model_len"]
    assert plan.scheduler.max_num_batched_tokens == 8192
    assert plan.grid.token_buckets == (16, 32, 64, 128, 256, 512, 1024, 4096, 8192)
    assert plan.grid.request_buckets == (8, 32)
    assert plan.kv_sizing == "programs" and plan.kv_budget is None
    assert plan.compile_target == {"kind": "tpu", "topology": "v6e:2x4"}
    assert plan.compile_workers == 4 and "16 cores" in plan.reasons["compile_workers"]
    assert plan.engine_core == "process"
    _check_reasons(plan)
    recipe = plan.recipe(num_pages=64, max_model_len=4096)
    assert recipe.target == plan.compile_target and recipe.mesh_shape == (1, 8) and recipe.plan["kv_dtype"] == "bfloat16"
    assert recipe.token_buckets == plan.grid.token_buckets and recipe.sampler_config == plan.sampler


def test_an_attention_kernel_the_shapes_do_not_fit_falls_back_with_its_reason():
    """SmolLM2 over 4 v5e chips with pages of 8 tokens: the TPU kernel's shape check refuses
    them (bfloat16 pages of whole 16-row tiles), as serving's "auto" would, the plan says why,
    and no KV heads are appended (they would not make the kernel run)."""
    devices = DeviceSet.described("tpu", "TPU v5 lite", 4, slice_shape=(2, 2))
    config = EngineConfig.from_kwargs(model="smollm2-135m", tensor_parallel_size=4, page_size=8)
    plan = plan_engine(config, _files("smollm2-135m"), select_backend("tpu"), devices)
    assert plan.attention_impl == "reference" and plan.arch.num_kv_heads == 3
    assert plan.reasons["attention"].startswith("auto: tpu kernel unsupported")
    assert plan.engine_core == "caller"  # offline: the core runs on the caller's thread


def test_gpu_hosts_are_planned_with_their_fp8_products():
    devices = DeviceSet.described("gpu", "NVIDIA H100 80GB HBM3", 8, compute_capability="9.0")
    config = EngineConfig.from_kwargs(model="llama3-8b", data_parallel_size=2, tensor_parallel_size=4,
                                      compile_workers=4)
    plan = plan_engine(config, _files("llama3-8b"), select_backend("gpu"), devices)
    # Hopper: the Mosaic GPU kernel
    assert plan.device.fp8_products and plan.attention_impl == "gpu-mosaic" and plan.device.quant_matmul_impl == "xla"
    assert plan.mesh_shape == (2, 4) and plan.scheduler.max_num_batched_tokens == 16384  # 8192 a rank
    assert plan.grid.token_buckets[-1] == 8192  # one rank's buckets
    assert plan.compile_target == {} and plan.compile_workers == 1  # no compile-only GPU target
    assert "no compile-only target" in plan.reasons["compile_workers"]
    _check_reasons(plan)
    older = DeviceSet.described("gpu", "NVIDIA A100-SXM4-80GB", 8, compute_capability="8.0")
    older_plan = plan_engine(config, _files("llama3-8b"), select_backend("gpu"), older)
    assert not older_plan.device.fp8_products and older_plan.attention_impl == "gpu"  # Triton before Hopper


def test_this_cpu_is_planned_with_a_fixed_budget_and_capped_context(monkeypatch):
    monkeypatch.setenv("JAXSERVE_CPU_KVCACHE_SPACE", "0.25")
    config = EngineConfig.from_kwargs(model=None, dtype="float32", kv_cache_dtype="fp8", max_logprobs=5,
                                      speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    backend = select_backend("cpu")
    plan = plan_engine(config, _files("smollm2-135m"), backend, DeviceSet.described("cpu", "cpu", 1))
    assert plan.name == "SmolLM2-135M-Instruct" and not plan.pooling
    assert plan.device.dtype == "float32" and plan.reasons["dtype"] == "given"
    assert plan.device.kv_dtype == "fp8" and plan.reasons["kv_dtype"] == "given"
    assert plan.max_model_len == 2048 and plan.reasons["max_model_len"] == "the model's 8192, capped at 2048 on cpu"
    assert plan.scheduler.max_num_batched_tokens == 512 and plan.grid.token_buckets == (16, 32, 64, 128, 256, 512)
    assert plan.kv_sizing == "budget" and plan.kv_budget == 2**28
    assert plan.compile_target == {"kind": "cpu"} and plan.compile_workers == 1
    assert plan.sampler.max_logprobs == 5
    _check_reasons(plan)
    recipe = plan.recipe(num_pages=10, max_model_len=plan.max_model_len)
    assert recipe.num_speculative_tokens == 3 and recipe.sampler_config.max_logprobs == 5
    auto = plan_engine(dataclasses.replace(config, model=dataclasses.replace(config.model, dtype="auto")),
                       _files("smollm2-135m"), backend, DeviceSet.described("cpu", "cpu", 1))
    assert auto.device.dtype in ("float32", "bfloat16") and "measured" in auto.reasons["dtype"]


def test_a_base_models_checkpoint_plans_the_pooling_runner():
    files = ModelFiles(None, _files("smollm2-135m").config, ["LlamaModel"])
    config = EngineConfig.from_kwargs(model=None, dtype="float32", max_model_len=1000)
    plan = plan_engine(config, files, select_backend("cpu"), DeviceSet.described("cpu", "cpu", 1))
    assert plan.pooling and plan.reasons["runner"].startswith("auto: a base model's")
    assert plan.grid.token_buckets[-1] == 1000  # a prompt is never split
    with pytest.raises(ValueError, match="--enable-lora serves generation"):
        plan_engine(EngineConfig.from_kwargs(model=None, enable_lora=True), files, select_backend("cpu"),
                    DeviceSet.described("cpu", "cpu", 1))
    with pytest.raises(ValueError, match="needs 2 devices"):
        plan_engine(EngineConfig.from_kwargs(model=None, tensor_parallel_size=2), files, select_backend("cpu"),
                    DeviceSet.described("cpu", "cpu", 1))


def test_serve_help_shows_what_the_plan_resolves():
    from jaxserve.server.cli import build_parser

    parser = build_parser()
    serve = next(a for a in parser._subparsers._group_actions[0].choices.values() if a.prog.endswith("serve"))
    text = serve.format_help()
    assert PLAN_HELP.splitlines()[0] in text
    for entry in ("dtype", "kv dtype", "attention", "max model len", "buckets", "engine core", "compile workers"):
        assert f"\n  {entry} " in text, entry
