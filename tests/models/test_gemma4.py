"""Gemma 4 (text) on the fixture with every attention feature (tests/data/arch/gemma4: E2B's
shape, per-layer inputs and KV-sharing layers, with 31B's k = v full-attention heads):
transformers' float32 logits through each paged-attention kernel (the reference, the TPU and
GPU kernels in interpret mode, the CPU kernel), and through chunked prefill and decode steps
tensor-parallel over 2 simulated devices; how config.json is read (also gemma4_moe: 26B-A4B's
shape) and what is refused. Both fixtures' logits: test_arch_parity; served: tests/server/
test_2026_models_serve.py."""

from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jaxserve.backends.cpu.kernels.attention  # noqa: F401 - registers the "cpu" kernel
from jaxserve.models.arch_config import ArchConfig
from jaxserve.models.layers.rotary import inverse_frequencies, layer_rope_spec
from jaxserve.models.weights import create_model
from jaxserve.parallel.mesh import make_mesh
from tests.models.model_utils import PagedRunner
from tests.models.test_arch_parity import load_fixture


def _seqs(expected) -> list[list[int]]:
    return [expected["tokens_0"].tolist(), expected["tokens_1"].tolist()]


def _assert_logits(out, expected) -> None:
    for i in range(2):
        np.testing.assert_allclose(out[i], expected[f"logits_{i}"], atol=1e-4, rtol=0)


# Each kernel on the fixture with every attention feature (gemma4: zero-padded narrow heads,
# a repeated KV head, k = v, the KV-sharing layers' read-only attention). The MoE fixture's
# attention is the same code: test_arch_parity and test_sharding_rules run it on "auto", the
# serving tests (tests/server/test_2026_models_serve.py) through decode steps.


@pytest.mark.parametrize("impl", ["reference", "tpu-interpret", "gpu-interpret", "cpu"])
def test_each_attention_kernel_matches_transformers(data_dir, impl):
    """Both prompts in one step (page size 8: the TPU kernel's float32 tile) give transformers'
    logits with each kernel."""
    cfg, tensors, expected = load_fixture(data_dir, "gemma4")
    model = create_model(
        cfg, dtype=jnp.float32, get_tensor=tensors.__getitem__, attention_impl=impl
    )
    runner = PagedRunner(model, page_size=8, num_pages=8)
    seqs = _seqs(expected)
    _assert_logits(
        runner.step([(0, seqs[0], 0), (1, seqs[1], 0)], num_tokens=32, num_reqs=4, pages_per_req=4),
        expected,
    )


def test_tensor_parallel_chunked_prefill_and_decode_match_transformers(data_dir):
    """Over 2 of the simulated devices (heads, MLPs and the KV cache's heads split; every
    preset on both fixtures: test_sharding_rules): the first sequence in chunks of 5, then
    token by token while the second prefills in chunks of 3 beside it. The sliding layers'
    windows and the KV-sharing layers' reads of their source layers' pages span earlier
    steps; the logits stay transformers'."""
    cfg, tensors, expected = load_fixture(data_dir, "gemma4")
    mesh = make_mesh(1, 2)
    model = create_model(cfg, dtype=jnp.float32, get_tensor=tensors.__getitem__, mesh=mesh)
    for layer in model.layers:
        assert layer.wq[...].sharding.spec == P(None, "model", None)
        assert layer.w_up[...].sharding.spec == P(None, "model")
    runner = PagedRunner(model, page_size=4, num_pages=16, seed=1, mesh=mesh)
    assert len(runner.kv.k) == cfg.num_kv_cache_layers
    assert runner.kv.k[0].sharding.spec[2] == "model"
    a, b = _seqs(expected)
    out = [[], []]
    plan = [
        [(0, 0, 5)],
        [(0, 5, 10)],
        [(0, 10, 11), (1, 0, 3)],
        [(0, 11, 12), (1, 3, 6)],
        [(0, 12, 13), (1, 6, 7)],
    ]
    for step in plan:
        chunks = [(s, (a, b)[s][lo:hi], lo) for s, lo, hi in step]
        for (s, _, _), logits in zip(
            chunks, runner.step(chunks, num_tokens=16, num_reqs=4, pages_per_req=4)
        ):
            out[s].append(logits)
    _assert_logits([np.concatenate(o) for o in out], expected)


def test_lora_and_quantized_kv_caches_are_refused_by_name(data_dir):
    from jaxserve.runner.kv_scales import prepare_kv_scales

    from jaxserve.models.gemma4 import Gemma4ForCausalLM

    cfg, _, _ = load_fixture(data_dir, "gemma4")
    model = Gemma4ForCausalLM(cfg, dtype=jnp.float32, rngs=None)  # zeros: no weights needed
    assert not model.supports_lora
    with pytest.raises(
        ValueError, match="float8_e4m3fn KV cache is not supported for Gemma4ForCausalLM"
    ):
        prepare_kv_scales(model, jnp.float8_e4m3fn, None, lambda: [])


# ------------------------------------------------------------------ config.json


def test_fixture_configs_read_as_transformers_builds_them(data_dir):
    cfg, _, _ = load_fixture(data_dir, "gemma4")
    assert [cfg.layer_head_dim(i) for i in range(6)] == [32, 32, 64, 32, 32, 64]
    assert [cfg.layer_kv_heads(i) for i in range(6)] == [2, 2, 1, 2, 2, 1]
    assert [cfg.layer_k_eq_v(i) for i in range(6)] == [False, False, True, False, False, True]
    assert [cfg.kv_source(i) for i in range(6)] == [0, 1, 2, 3, 3, 2]  # the last of each type
    assert cfg.num_kv_cache_layers == 4 and (cfg.kv_cache_heads, cfg.kv_cache_head_dim) == (2, 64)
    assert [cfg.layer_intermediate_size(i) for i in range(6)] == [96] * 4 + [192] * 2
    assert (cfg.per_layer_input_size, cfg.final_logit_softcapping) == (8, 3.0)
    assert cfg.query_pre_attn_scalar == 1.0 and cfg.qk_norm and cfg.tie_word_embeddings
    moe, _, _ = load_fixture(data_dir, "gemma4_moe")
    assert [moe.layer_kv_heads(i) for i in range(4)] == [2, 1, 2, 1]
    assert [moe.layer_k_eq_v(i) for i in range(4)] == [False, True, False, True]
    assert (moe.num_experts, moe.num_experts_per_tok, moe.moe_intermediate_size) == (8, 2, 32)
    assert all(moe.is_moe_layer(i) for i in range(4)) and moe.per_layer_input_size == 0


HUB = dict(
    architectures=["Gemma4ForCausalLM"],
    vocab_size=128,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=6,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
)


def test_hub_style_keys_and_transformers_defaults():
    """`global_head_dim` / `num_global_key_value_heads` (no per_layer_config), and what
    transformers assumes for keys left out: 5 sliding layers per full one, the last one full,
    window 512, proportional RoPE on a quarter of the full layers' 512-wide heads, per-layer
    inputs of 256."""
    cfg = ArchConfig.from_hf(
        {
            **HUB,
            "global_head_dim": 64,
            "num_global_key_value_heads": 1,
            "attention_k_eq_v": True,
            "layer_types": ["sliding_attention"] * 6,
        }
    )
    assert cfg.layer_types[-1] == "full_attention" and cfg.layer_head_dim(5) == 64
    assert cfg.layer_kv_heads(5) == 1 and cfg.layer_k_eq_v(5) and not cfg.layer_k_eq_v(0)
    plain = ArchConfig.from_hf(HUB)
    assert plain.layer_types == ("sliding_attention",) * 5 + ("full_attention",)
    assert (plain.sliding_window, plain.global_head_dim, plain.per_layer_input_size) == (
        512,
        512,
        256,
    )
    assert plain.global_kv_heads is None and plain.final_logit_softcapping is None
    spec = layer_rope_spec(plain, 5)
    assert spec.rotary_dim == 512 and spec.theta == 1e6
    inv = inverse_frequencies(spec)  # 64 rotated pairs of 256, the rest still
    expected = 1.0 / (1e6 ** (np.arange(0, 128, 2, dtype=np.float32) / 512))
    np.testing.assert_allclose(inv[:64], expected, rtol=1e-6)
    assert inv.shape == (256,) and not inv[64:].any()
    assert layer_rope_spec(plain, 0).theta == 1e4 and layer_rope_spec(plain, 0).rotary_dim == 16


@pytest.mark.parametrize(
    "extra, message",
    [
        ({"use_bidirectional_attention": "all"}, "bidirectional"),
        ({"num_kv_shared_layers": 6}, "no earlier layer"),
        ({"per_layer_config": {"0": {"head_dim": 32}}}, "sliding-window layers"),
        (
            {
                "attention_k_eq_v": True,
                "num_key_value_heads": 3,
                "num_attention_heads": 6,
                "num_global_key_value_heads": 2,
            },
            "divide one another",
        ),
    ],
)
def test_configs_it_cannot_serve_are_refused_by_name(extra, message):
    with pytest.raises(ValueError, match=message):
        ArchConfig.from_hf({**HUB, **extra})


def test_fixture_config_round_trips_through_json(data_dir):
    """config.json as transformers 5.25 writes it (per_layer_config keyed by layer) is read."""
    raw = json.loads((data_dir / "arch" / "gemma4_moe" / "config.json").read_text())
    assert raw["per_layer_config"]["1"] == {"head_dim": 64, "num_key_value_heads": 1}
    assert ArchConfig.from_hf(raw).global_kv_heads == 1
