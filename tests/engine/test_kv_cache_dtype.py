"""--kv-cache-dtype fp8 / int8 end to end on a tiny Llama: smaller pages (more of them in the same
budget), scales from the checkpoint (vLLM's names, a compressed-tensors kv_cache_scheme) or
measured per layer and KV head, outputs close to the float cache's, prefix caching unchanged,
nothing compiled while serving. (The default model's drift against the golden data:
benchmarks/kv_fp8_drift.py, benchmarks/int8_quality.py, docs/performance.md.)"""

from __future__ import annotations

import dataclasses
import json
import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from jaxserve import LLM, SamplingParams
from jaxserve.config import CacheConfig
from jaxserve.models.arch_config import ArchConfig
from jaxserve.models.loader import load_checkpoint
from jaxserve.models.weights import create_model
from jaxserve.pallas_kernels.kv_quant import QUANT_MAX
from jaxserve.runner.kv_scales import (
    CALIBRATION_SPREAD,
    HEADROOM,
    checkpoint_scales,
    kv_scales_of,
    prepare_kv_scales,
    set_kv_scales,
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
    # The checkpoint's scales win over measuring; int8 without them is measured.
    assert engines["fp8_e4m3"].engine.runner.kv_scales == (((0.5,), (0.25,)),
                                                            ((0.5, 2.0), (1.0, 0.125)))
    assert engines["int8"].engine.runner.kv_scales is not None


def tiny_model(model_dir):
    ckpt = load_checkpoint(model_dir)
    return ckpt, create_model(ArchConfig.from_hf(ckpt.config), dtype=jnp.float32,
                              get_tensor=ckpt.get_tensor)


@pytest.mark.parametrize("kv_dtype", [jnp.int8, jnp.float8_e4m3fn])
def test_scales_are_measured_per_layer_and_kv_head(model_dir, kv_dtype, caplog):
    ckpt, model = tiny_model(model_dir)
    text = list(range(3, 60))
    with caplog.at_level(logging.INFO, logger="jaxserve.runner.kv_scales"):
        prepare_kv_scales(model, kv_dtype, ckpt, tokenize=lambda: text)
    assert f"scales measured on {len(text) + CALIBRATION_SPREAD} calibration tokens" in caplog.text
    specs = kv_scales_of(model)  # per layer (k, v), as the steps take them
    assert all(len(k) == len(v) == 2 for k, v in specs)  # 2 KV heads
    assert len({k for k, _ in specs}) == 2  # each layer its own
    # The largest |k| and |v| of the calibration forward (the text, then a sweep of the
    # vocabulary) map to the dtype's largest value / its headroom.
    fwd = PagedRunner(model, page_size=16, num_pages=16)  # a float cache ignores the scales
    ids = text + np.linspace(0, 127, CALIBRATION_SPREAD).astype(int).tolist()
    fwd.step([(0, ids, 0)], num_tokens=len(ids), num_reqs=1, pages_per_req=8)
    factor = HEADROOM[jnp.dtype(kv_dtype)] / QUANT_MAX[jnp.dtype(kv_dtype)]
    for (k_scale, v_scale), kc, vc in zip(specs, fwd.kv.k, fwd.kv.v):
        for got, cache in ((k_scale, kc), (v_scale, vc)):
            per_head = np.asarray(cache).reshape(*cache.shape[:2], model.config.num_kv_heads, -1)
            amax = np.abs(per_head).max(axis=(0, 1, 3))
            np.testing.assert_allclose(np.asarray(got), amax * factor, rtol=1e-5)


def test_scales_are_measured_on_a_tensor_parallel_model(model_dir):
    """The calibration forward runs where the weights are (a 2-device mesh, the serving rules):
    the scales of the single-device model."""
    from jaxserve.models.sharding import load_rules, serving_rules
    from jaxserve.parallel.mesh import make_mesh

    ckpt, model = tiny_model(model_dir)
    text = list(range(3, 60))
    prepare_kv_scales(model, jnp.int8, ckpt, tokenize=lambda: text)
    split = create_model(ArchConfig.from_hf(ckpt.config), dtype=jnp.float32, get_tensor=ckpt.get_tensor,
                         mesh=make_mesh(1, 2), rules=serving_rules(load_rules("tp"), 1))
    prepare_kv_scales(split, jnp.int8, ckpt, tokenize=lambda: text)
    assert split.layers[0].kv_scale[...].sharding.is_fully_replicated
    for (k1, v1), (k2, v2) in zip(kv_scales_of(model), kv_scales_of(split)):
        np.testing.assert_allclose(k2, k1, rtol=1e-6)
        np.testing.assert_allclose(v2, v1, rtol=1e-6)


def test_checkpoint_scales_win_over_measuring(scaled_dir, caplog):
    """vLLM's k_scale / v_scale are fp8's (the largest value becomes 448): an int8 cache maps
    the same value to 127. Nothing is measured (tokenize is never called)."""
    ckpt, model = tiny_model(scaled_dir)
    with caplog.at_level(logging.INFO, logger="jaxserve.runner.kv_scales"):
        prepare_kv_scales(model, jnp.float8_e4m3fn, ckpt, tokenize=None)
    assert "scales from the checkpoint (k" in caplog.text
    assert list(kv_scales_of(model)) == [((0.5,), (0.25,)), ((0.5, 2.0), (1.0, 0.125))]
    with caplog.at_level(logging.INFO, logger="jaxserve.runner.kv_scales"):
        prepare_kv_scales(model, jnp.int8, ckpt, tokenize=None)
    np.testing.assert_allclose(kv_scales_of(model)[1][1], np.asarray([1.0, 0.125]) * 448 / 127)
    assert "from the checkpoint, calibrated for float8_e4m3fn" in caplog.text


def scheme_dir(path, scheme: dict | None, scales: bool = True):
    """The tiny model as llm-compressor saves a KV-cache-only recipe: float weights, config.json's
    quantization_config with `kv_cache_scheme`, one k_scale / v_scale a layer (per KV head:
    [Hkv, 1, 1])."""
    d = write_model_dir(path, "llama")
    config = json.loads((d / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "compressed-tensors", "config_groups": {},
                                     "format": "dense", "kv_cache_scheme": scheme}
    (d / "config.json").write_text(json.dumps(config))
    if scales:
        tensors = load_file(str(d / "model.safetensors"))
        for i in range(2):
            tensors[f"model.layers.{i}.self_attn.k_scale"] = np.asarray([[[0.5]], [[2.0]]], np.float32)
            tensors[f"model.layers.{i}.self_attn.v_scale"] = np.asarray([[[0.25]], [[4.0]]], np.float32)
        save_file(tensors, str(d / "model.safetensors"))
    return d


CT_SCHEME = {"type": "float", "num_bits": 8, "strategy": "attn_head", "dynamic": False,
             "symmetric": True}


def test_kv_cache_scheme(tmp_path, caplog):
    ckpt, model = tiny_model(scheme_dir(tmp_path / "fp8", CT_SCHEME))
    with caplog.at_level(logging.INFO, logger="jaxserve.runner.kv_scales"):
        prepare_kv_scales(model, jnp.float8_e4m3fn, ckpt, tokenize=None)
    assert "from the checkpoint (kv_cache_scheme: float 8-bit, attn_head)" in caplog.text
    assert kv_scales_of(model)[1][0] == (0.5, 2.0)
    assert kv_scales_of(model)[1][1] == (0.25, 4.0)
    # Scales calibrated for an int8 cache (127) serve an fp8 one at 448.
    ckpt, model = tiny_model(scheme_dir(tmp_path / "int", {**CT_SCHEME, "type": "int"}))
    prepare_kv_scales(model, jnp.float8_e4m3fn, ckpt, tokenize=None)
    np.testing.assert_allclose(kv_scales_of(model)[0][0], np.asarray([0.5, 2.0]) * 127 / 448)
    prepare_kv_scales(model, jnp.int8, ckpt, tokenize=None)
    assert kv_scales_of(model)[0][0] == (0.5, 2.0)
    with pytest.raises(ValueError, match="kv_cache_scheme but no"):
        checkpoint_scales(load_checkpoint(scheme_dir(tmp_path / "none", CT_SCHEME, False)), 2, 2)
    with pytest.raises(ValueError, match="dynamic True.* is not supported"):
        checkpoint_scales(load_checkpoint(scheme_dir(tmp_path / "dyn", {**CT_SCHEME, "dynamic": True})), 2, 2)


def test_fp8_measured_scales_keep_small_values(tmp_path):
    """The same function with V 1000x smaller (v_proj / 1000, o_proj x 1000): at scale 1.0
    e4m3 flushes most of V to zero or to a few subnormal steps (its smallest normal is 2^-6);
    measured scales keep it within e4m3's rounding of the float cache (the engine test's bound)."""
    d = write_model_dir(tmp_path / "small-v", "llama")
    tensors = load_file(str(d / "model.safetensors"))
    for name in list(tensors):
        if name.endswith(("v_proj.weight", "o_proj.weight")):
            tensors[name] = tensors[name] * (1e-3 if "v_proj" in name else 1e3)
    save_file(tensors, str(d / "model.safetensors"))
    ckpt, model = tiny_model(d)
    ids = PROMPTS[2]

    def logprobs(kv_dtype):
        fwd = PagedRunner(model, page_size=16, num_pages=8, dtype=kv_dtype)
        (logits,) = fwd.step([(0, ids, 0)], num_tokens=len(ids), num_reqs=1, pages_per_req=3)
        return np.asarray(jax.nn.log_softmax(jnp.asarray(logits), axis=-1))

    want = logprobs(jnp.float32)
    unscaled = np.abs(logprobs(jnp.float8_e4m3fn) - want).max()
    prepare_kv_scales(model, jnp.float8_e4m3fn, ckpt, tokenize=lambda: ids)
    measured = np.abs(logprobs(jnp.float8_e4m3fn) - want).max()
    # (every log-prob of the vocabulary at every position: 0.09 against 2.0 here)
    assert measured < 0.15 and unscaled > 1.0, (measured, unscaled)


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


def test_scales_as_step_inputs_give_the_logits_of_static_scales(model_dir):
    """Each layer's KVCacheScale array (an input of the step) gives, bit for bit, the logits of
    the same scales (per KV head) as static numbers of its AttentionSpec."""
    _, model = tiny_model(model_dir)
    scales = ((0.05, 0.1), (0.02, 0.03))
    set_kv_scales(model, [scales] * len(model.layers))
    ids = list(range(3, 40))

    def logits():
        fwd = PagedRunner(model, page_size=8, num_pages=8, dtype=jnp.int8)
        return fwd.step([(0, ids, 0)], num_tokens=len(ids), num_reqs=1, pages_per_req=5)[0]

    as_inputs = logits()
    for layer in model.layers:
        layer.attn_spec = dataclasses.replace(layer.attn_spec, k_scale=scales[0], v_scale=scales[1])
        del layer.kv_scale
    np.testing.assert_array_equal(as_inputs, logits())
