"""The engine's start on an accelerator's memory policy, run on this CPU: the CPU backend with
the accelerators' sizing (`sizes_kv_from_programs`, no context cap) and a stated device memory
(a CPU device reports none). The KV cache gets what the largest compiled step leaves; the
model's context is lowered to what that cache holds, with a warning, or refused when the user
gave it; a device too small for the weights and the step is refused with the figures. And the
steps compiled in worker processes (runner/compile_pool.py) load and generate."""

from __future__ import annotations

import logging

import pytest

from jaxserve import SamplingParams
from jaxserve.backends.base import InsufficientMemoryError
from jaxserve.backends.cpu import CpuBackend
from jaxserve.engine import setup

GiB = 2**30


class _SizedLikeAnAccelerator(CpuBackend):
    sizes_kv_from_programs = True
    default_max_model_len = None

    def __init__(self, memory: int):
        super().__init__()
        self.memory = memory

    def device_memory(self):
        return self.memory, 0


def _options(small_engine_options, **kw) -> dict:
    # One bucket: the largest step is the only one.
    return {
        **small_engine_options,
        "token_buckets": (16,),
        "request_buckets": (8,),
        "max_num_batched_tokens": 16,
        **kw,
    }


def _llm(monkeypatch, options, memory: int):
    from jaxserve import LLM

    monkeypatch.setattr(setup, "select_backend", lambda: _SizedLikeAnAccelerator(memory))
    return LLM(**options)


def test_the_cache_takes_what_the_step_leaves_and_the_context_is_fitted_to_it(
    monkeypatch, caplog, small_engine_options
):
    with caplog.at_level(logging.INFO, logger="jaxserve.engine"):
        llm = _llm(monkeypatch, _options(small_engine_options), int(0.9 * GiB))
    text = caplog.text
    assert "memory per device: 0.90 GiB per device x 0.9 = 0.81 GiB; weights" in text, text
    assert "max_model_len lowered from the model's 8192 to" in text, text
    info = llm.engine.info
    assert 1024 < info.max_model_len < 8192
    assert info.kv_cache_tokens >= info.max_model_len  # one sequence that long fits
    assert "of the 0.81 GiB allowed per device" in text  # the served step's own figures checked
    out = llm.generate(["The capital of France is"], SamplingParams(max_tokens=4, temperature=0.0))
    assert len(out[0].outputs[0].token_ids) == 4


def test_a_given_context_the_cache_cannot_hold_is_refused(monkeypatch, small_engine_options):
    with pytest.raises(
        InsufficientMemoryError, match="max_model_len 8192 is more than the KV cache holds"
    ):
        _llm(monkeypatch, _options(small_engine_options, max_model_len=8192), int(0.9 * GiB))


def test_a_device_too_small_for_the_weights_and_the_step_is_refused_with_the_figures(
    monkeypatch, small_engine_options
):
    with pytest.raises(InsufficientMemoryError) as e:
        _llm(monkeypatch, _options(small_engine_options), int(0.5 * GiB))
    for figure in (
        "0.50 GiB per device x 0.9 = 0.45 GiB",
        "weights 0.",
        "largest step (16 tokens x 8 requests)",
        "temporaries",
        "left for the KV cache -",
    ):
        assert figure in str(e.value), str(e.value)


def test_steps_compiled_in_worker_processes_load_and_generate(
    caplog, tmp_path, small_engine_options, small_llm
):
    from jaxserve import LLM

    options = {
        **small_engine_options,
        "token_buckets": (16, 32),
        "request_buckets": (8,),
        "max_num_batched_tokens": 32,
        "compile_workers": 2,
        "compilation_cache_dir": str(tmp_path),
    }
    with caplog.at_level(logging.INFO, logger="jaxserve.runner"):
        llm = LLM(**options)
    assert "compiling 2 steps in 2 processes" in caplog.text, caplog.text
    assert "1 left" in caplog.text and "0 left" in caplog.text
    runner = llm.engine.parts.model_runner
    assert runner.executables_loaded == 2  # both steps came from the workers, through the cache
    params = SamplingParams(max_tokens=6, temperature=0.0)
    prompt = ["The capital of France is"]
    assert (
        llm.generate(prompt, params)[0].outputs[0].token_ids
        == small_llm.generate(prompt, params)[0].outputs[0].token_ids
    )


def test_quantized_and_lora_models_are_sized_from_their_programs_and_compiled_in_workers(
    monkeypatch, caplog, tmp_path
):
    """int8 weights, an fp8 KV cache and LoRA slots: the step's recipe describes them
    (runner/recipe.py), so the memory probe sizes their KV cache from their own programs and
    the compile workers compile their steps, which the engine loads and serves (a tiny model)."""
    from jaxserve import LLM

    from tests.model_dirs import write_model_dir

    monkeypatch.setattr(setup, "select_backend", lambda: _SizedLikeAnAccelerator(GiB // 4))
    options = dict(model=str(write_model_dir(tmp_path / "m")), dtype="float32", quantization="int8",
                   kv_cache_dtype="fp8", enable_lora=True, max_loras=2, max_lora_rank=8, max_num_seqs=8,
                   token_buckets=(16, 32), request_buckets=(8,), compile_workers=2,
                   compilation_cache_dir=str(tmp_path / "cache"), show_progress=False)
    with caplog.at_level(logging.INFO, logger="jaxserve"):
        llm = LLM(**options)
    text = caplog.text
    assert "memory per device: 0.25 GiB per device x 0.9" in text, text
    assert "compiling 2 steps in 2 processes" in text, text
    runner = llm.engine.parts.model_runner
    assert runner.executables_loaded >= 2 and runner.recipe.quantization == "int8" and runner.lora is not None
    out = llm.generate(["w5 w6 w7"], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 4
