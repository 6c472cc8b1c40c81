"""The bundled default model's GGUF: conversion into the cache, its config, and weights equal to
ggml's block formulas on the file's own bytes."""

from __future__ import annotations

import os
import time

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT

from jaxserve.models import gguf_loader, loader
from tests.models.ggml_reference import reference_dequantize


@pytest.fixture(scope="module")
def default_model(tmp_path_factory):
    cache = tmp_path_factory.mktemp("jaxserve-cache")
    start = time.perf_counter()
    first = loader.resolve_model(None, cache_dir=cache)
    t_first = time.perf_counter() - start
    start = time.perf_counter()
    second = loader.resolve_model(None, cache_dir=cache)
    t_second = time.perf_counter() - start
    print(
        f"\ndefault model: first resolve (GGUF -> cache) {t_first:.2f} s, "
        f"cached {t_second * 1e3:.1f} ms"
    )
    return first, second, t_first, t_second


@pytest.mark.slow
def test_default_model_config_and_cache(default_model):
    first, second, _, t_second = default_model
    assert first == second and t_second < 0.5
    cfg = loader.load_checkpoint(first).config
    assert cfg["architectures"] == ["LlamaForCausalLM"]
    assert cfg["num_hidden_layers"] == 30 and cfg["hidden_size"] == 576
    assert (
        cfg["num_attention_heads"] == 9
        and cfg["num_key_value_heads"] == 3
        and cfg["head_dim"] == 64
    )
    assert cfg["vocab_size"] == 49152 and cfg["tie_word_embeddings"] is True
    assert cfg["rope_theta"] == 1e5 and cfg["intermediate_size"] == 1536
    assert cfg["max_position_embeddings"] == 8192 and cfg["eos_token_id"] == 2
    names = set(os.listdir(first))
    assert {
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
        "generation_config.json",
    } <= names
    assert not any(n.startswith(".tmp") for n in os.listdir(first.parent))


@pytest.mark.slow
def test_default_model_weights_bit_exact(default_model):
    """Converted weights == ggml's block formulas on the file's own bytes, Q/K un-permuted."""
    ckpt = loader.load_checkpoint(default_model[0])
    reader = gguf_loader.open_gguf(loader.default_gguf_path())
    by_name = {t.name: t for t in reader.tensors}
    assert {t.tensor_type for t in reader.tensors} == {QT.F32, QT.Q4_1, QT.Q8_0}  # no K-quants here
    assert len(ckpt.tensor_names()) == 272 and "lm_head.weight" not in ckpt.tensor_names()
    cases = {
        "token_embd.weight": "model.embed_tokens.weight",  # Q8_0
        "blk.0.attn_q.weight": "model.layers.0.self_attn.q_proj.weight",  # Q4_1, permuted
        "blk.7.attn_k.weight": "model.layers.7.self_attn.k_proj.weight",  # Q4_1, permuted
        "blk.29.ffn_down.weight": "model.layers.29.mlp.down_proj.weight",  # Q4_1, [576, 1536]
        "blk.3.attn_norm.weight": "model.layers.3.input_layernorm.weight",  # F32
    }
    for gname, hname in cases.items():
        t = by_name[gname]
        shape = tuple(reversed(t.shape.tolist()))
        if t.tensor_type == QT.F32:
            expected = np.asarray(t.data, np.float32).reshape(shape)
        else:
            rows = 128  # the first rows (two heads of Q/K) keep the Python reference quick
            raw = np.asarray(t.data)[:rows]
            expected = reference_dequantize(t.tensor_type, raw, rows, shape[1])
        got = ckpt.get_tensor(hname)
        assert got.shape == shape and got.dtype == np.float32
        if "attn_q" in gname or "attn_k" in gname:
            hd = 64
            n_head = expected.shape[0] // hd  # heads are permuted independently
            unpermuted = np.empty_like(expected)
            for h in range(n_head):
                for j in range(hd // 2):
                    for s in range(2):
                        unpermuted[h * hd + s * hd // 2 + j] = expected[h * hd + 2 * j + s]
            expected = unpermuted
        np.testing.assert_array_equal(got[: expected.shape[0]], expected, err_msg=gname)
