"""--kv-cache-dtype fp8 / int8 end to end on a tiny Llama: smaller pages (more of them in the same
budget), scales from the checkpoint or measured, outputs close to the float cache's, prefix
caching unchanged, nothing compiled while serving. (The default model's drift against the
golden data: benchmarks/int8_quality.py, docs/performance.md.)"""

from __future__ import annotations

import logging

import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from jaxserve import LLM, SamplingParams
from jaxserve.config import CacheConfig
from jaxserve.models.arch_config import ArchConfig
from jaxserve.models.loader import load_checkpoint
from jaxserve.models.weights import create_model
from jaxserve.runner.kv_scales import (
    CALIBRATION_SPREAD,
    INT8_HEADROOM,
    checkpoint_scales,
    prepare_kv_scales,
)
from tests.model_dirs import write_model_dir
from tests.models.model_utils import PagedRunner

OPTIONS = dict(dtype="float32", max_model_len=64, max_num_seqs=4, token_buckets=(64,),
               request_buckets=(4,), kv_cache_memory_bytes=1 << 20, show_progress=False)
PROMPTS = [[1, *range(5, 5 + n)] for n in (7, 20, 33)]
SCORE = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)


# vLLM's names: a scale per tensor for layer 0, per KV head for layer 1.
SCALES = {"model.layers.0.self_attn.k_scale": np.asarray(0.5, np.float32),
          "model.layers.0.self_attn.v_scale": np.asarray(0.25, np.float32),
          "model.layers.1.self_attn.k_scale": np.asarray([0.5, 2.0], np.float32),
          "model.layers.1.self_attn.v_scale": np.asarray([1.0, 0.125], np.float32)}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_model_dir(tmp_path_factory.mktemp("kvq"), "llama")


@pytest.fixture(scope="module")
def scaled_dir(tmp_path_factory):
    """The same model with k/v scales in its checkpoint."""
    d = write_model_dir(tmp_path_factory.mktemp("kvq-scaled"), "llama")
    tensors = load_file(str(d / "model.safetensors"))
    save_file({**tensors, **SCALES}, str(d / "model.safetensors"))
    return d


@pytest.fixture(scope="module")
def engines(model_dir, scaled_dir, compile_cache_dir):
    """float32 and int8 (measured scales) caches of the model; fp8 with the checkpoint's."""
    dirs = {"float32": model_dir, "fp8_e4m3": scaled_dir, "int8": model_dir}
    return {kv: LLM(str(d), kv_cache_dtype=kv, compilation_cache_dir=compile_cache_dir, **OPTIONS)
            for kv, d in dirs.items()}


def prompt_logprobs(llm) -> np.ndarray:
    outs = llm.generate(PROMPTS, SCORE, use_tqdm=False)
    return np.asarray([lp[t].logprob for o, p in zip(outs, PROMPTS)
                       for lp, t in zip(o.prompt_logprobs[1:], p[1:])])


def test_vllm_spellings_and_refusals():
    assert CacheConfig(kv_cache_dtype="fp8_e4m3").kv_cache_dtype == "fp8"
    with pytest.raises(ValueError, match="fp8_e4m3"):
        CacheConfig(kv_cache_dtype="fp8_e5m2")


def test_pages_are_smaller_and_outputs_close_to_float(engines):
    kv = {name: llm.engine.runner.kv for name, llm in engines.items()}
    assert str(kv["fp8_e4m3"].k[0].dtype) == "float8_e4m3fn"
    assert str(kv["int8"].k[0].dtype) == "int8"
    # One byte a value instead of float32's four: the same budget holds 4x the pages.
    assert kv["fp8_e4m3"].num_pages == kv["int8"].num_pages == 4 * kv["float32"].num_pages
    want = prompt_logprobs(engines["float32"])
    for name, tol_max, tol_mean in (("fp8_e4m3", 0.15, 0.03), ("int8", 0.05, 0.01)):
        got = prompt_logprobs(engines[name])
        drift = np.abs(got - want)
        assert drift.max() < tol_max and drift.mean() < tol_mean, (name, drift.max(), drift.mean())
        assert np.any(drift > 0)  # the quantized pages were read
        assert engines[name].engine.num_compiles_after_warmup == 0


def test_int8_scales_are_measured_per_kv_head(model_dir, caplog):
    ckpt = load_checkpoint(model_dir)
    model = create_model(ArchConfig.from_hf(ckpt.config), dtype=jnp.float32,
                         get_tensor=ckpt.get_tensor)
    with caplog.at_level(logging.INFO, logger="jaxserve.runner.kv_scales"):
        prepare_kv_scales(model, jnp.float8_e4m3fn, ckpt, tokenize=None)  # fp8: 1.0, as vLLM
    assert all(layer.attn_spec.k_scale is None for layer in model.layers)
    assert "scales 1.0 (the checkpoint has none)" in caplog.text
    text = list(range(3, 60))
    prepare_kv_scales(model, jnp.int8, ckpt, tokenize=lambda: text)
    specs = [layer.attn_spec for layer in model.layers]
    assert all(len(s.k_scale) == len(s.v_scale) == 2 for s in specs)  # 2 KV heads
    assert len({s.k_scale for s in specs}) == 2  # each layer its own
    assert model.attn_spec == specs[0]
    # The largest |k| of the calibration forward (the text, then a sweep of the vocabulary)
    # maps to 127 / INT8_HEADROOM.
    fwd = PagedRunner(model, page_size=16, num_pages=16)
    ids = text + np.linspace(0, 127, CALIBRATION_SPREAD).astype(int).tolist()
    fwd.step([(0, ids, 0)], num_tokens=len(ids), num_reqs=1, pages_per_req=8)
    for layer, spec, kc in zip(model.layers, specs, fwd.kv.k):
        amax = np.abs(np.asarray(kc)).max(axis=(0, 1, 3))
        np.testing.assert_allclose(np.asarray(spec.k_scale), amax * INT8_HEADROOM / 127, rtol=1e-5)


def test_prefix_cache_hits_read_quantized_pages(engines):
    llm = engines["int8"]
    prompt = [1, *range(10, 50)]  # 41 tokens: two full pages of 16 to share
    params = SamplingParams(temperature=0.0, max_tokens=4)
    first = llm.generate([prompt], params, use_tqdm=False)[0]
    again = llm.generate([prompt], params, use_tqdm=False)[0]
    assert again.num_cached_tokens == 32
    assert again.outputs[0].token_ids == first.outputs[0].token_ids


def test_checkpoint_scales(model_dir, scaled_dir, tmp_path):
    assert checkpoint_scales(load_checkpoint(model_dir), 2, 2) is None
    assert checkpoint_scales(load_checkpoint(scaled_dir), 2, 2) == [((0.5,), (0.25,)),
                                                                    ((0.5, 2.0), (1.0, 0.125))]
    d = write_model_dir(tmp_path / "partial", "llama")
    tensors = load_file(str(d / "model.safetensors"))
    save_file({**tensors, **{k: v for k, v in SCALES.items() if "layers.0" in k}},
              str(d / "model.safetensors"))
    with pytest.raises(ValueError, match="1 of 2 layers"):
        checkpoint_scales(load_checkpoint(d), 2, 2)
