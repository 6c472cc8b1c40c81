"""ArchConfig reads the hub's transformers 4.x configs as well as 5.x ones (the fixtures)."""

from __future__ import annotations

import pytest
from jaxserve.models import interface as features
from jaxserve.models.arch_config import ArchConfig
from jaxserve.models.registry import get_model_class

BASE = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=12,
            num_attention_heads=4, num_key_value_heads=2)


def test_gemma3_4x_layout():
    cfg = ArchConfig.from_hf({**BASE, "architectures": ["Gemma3ForCausalLM"], "head_dim": 16,
                              "rope_theta": 1e6, "rope_local_base_freq": 1e4, "sliding_window": 512,
                              "rope_scaling": {"rope_type": "linear", "factor": 8.0},
                              "hidden_activation": "gelu_pytorch_tanh", "query_pre_attn_scalar": 16})
    windows = [cfg.layer_window(i) for i in range(12)]
    assert windows == [512] * 5 + [None] + [512] * 5 + [None]  # 5 local : 1 global
    assert cfg.layer_rope(0)[0] == 1e4 and cfg.layer_rope(0)[1].rope_type == "default"
    assert cfg.layer_rope(5)[0] == 1e6 and cfg.layer_rope(5)[1].factor == 8.0
    assert cfg.tie_word_embeddings and cfg.qk_norm and cfg.hidden_act == "gelu_tanh"
    assert cfg.attn_logit_softcapping is None and cfg.final_logit_softcapping is None
    feats = get_model_class(cfg.architecture).features(cfg, None)
    assert {features.ONE_PLUS_W_NORM, features.POST_NORMS, features.GELU_TANH_GLU, features.EMBED_SCALE,
            features.PER_LAYER_ATTENTION, features.SLIDING_WINDOW} <= feats
    assert features.RMS_NORM not in feats and features.SILU_GLU not in feats


def test_gemma2_defaults_soft_caps():
    cfg = ArchConfig.from_hf({**BASE, "architectures": ["Gemma2ForCausalLM"], "sliding_window": 4096,
                              "hidden_act": "gelu_pytorch_tanh"})
    assert (cfg.attn_logit_softcapping, cfg.final_logit_softcapping) == (50.0, 30.0)
    assert [cfg.layer_window(i) for i in range(4)] == [4096, None, 4096, None]
    feats = get_model_class(cfg.architecture).features(cfg, "int8")
    assert {features.ATTN_SOFT_CAP, features.FINAL_SOFT_CAP, features.INT8_WEIGHTS} <= feats


@pytest.mark.parametrize("use", [False, True])
def test_qwen2_sliding_window_from_the_hub_config(use):
    cfg = ArchConfig.from_hf({**BASE, "architectures": ["Qwen2ForCausalLM"], "sliding_window": 32,
                              "use_sliding_window": use, "max_window_layers": 8})
    assert [cfg.layer_window(i) for i in range(12)] == ([None] * 8 + [32] * 4 if use else [None] * 12)


def test_phi3_4x_longrope():
    short = [1.0] * 6
    cfg = ArchConfig.from_hf({**BASE, "architectures": ["Phi3ForCausalLM"], "max_position_embeddings": 131072,
                              "original_max_position_embeddings": 4096, "partial_rotary_factor": 0.75,
                              "rope_scaling": {"type": "su", "short_factor": short, "long_factor": [2.0] * 6}})
    rs = cfg.rope_scaling
    assert rs.rope_type == "longrope" and rs.original_max_position_embeddings == 4096
    assert rs.factor == 32.0 and rs.short_factor == tuple(short) and cfg.rotary_dim == 12
    assert features.PARTIAL_ROTARY in get_model_class(cfg.architecture).features(cfg, None)


def test_moe_configs():
    mix = ArchConfig.from_hf({**BASE, "architectures": ["MixtralForCausalLM"], "num_local_experts": 8,
                              "num_experts_per_tok": 2})
    assert (mix.num_experts, mix.moe_intermediate_size, mix.norm_topk_prob) == (8, 96, True)
    assert all(mix.is_moe_layer(i) for i in range(12))
    qm = ArchConfig.from_hf({**BASE, "architectures": ["Qwen3MoeForCausalLM"], "num_experts": 128,
                             "num_experts_per_tok": 8, "moe_intermediate_size": 48, "decoder_sparse_step": 2,
                             "mlp_only_layers": [3]})
    assert qm.qk_norm and not qm.norm_topk_prob
    assert [qm.is_moe_layer(i) for i in range(6)] == [False, True, False, False, False, True]


def test_unsupported_rope_type():
    with pytest.raises(ValueError, match="rope type 'mrope'"):
        ArchConfig.from_hf({**BASE, "architectures": ["LlamaForCausalLM"], "rope_scaling": {"rope_type": "mrope"}})
