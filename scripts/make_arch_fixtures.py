"""Regenerate the architecture-parity fixtures in tests/data/arch/ (needs torch + transformers).

For each registered architecture this builds a tiny random Hugging Face model, saves it as an HF
directory (config.json + model.safetensors) and records transformers' own float32 logits for
a few fixed token sequences (expected.safetensors). The test suite compares jaxserve's logits
with these files and needs no torch.

    pip install torch==2.13.0 'transformers>=5.20,<6' safetensors
    python scripts/make_arch_fixtures.py [case ...]   # all cases, or the ones named

The EAGLE-3 drafter case (`eagle3_llama`, a draft head for the `llama` target) also needs the
`speculators` package (pip install --no-deps speculators==0.9.0), whose model writes it.
"""

from __future__ import annotations

import json
import shutil
import sys
import zlib
import pathlib

import numpy as np
import torch
from safetensors.numpy import save_file
from transformers import AutoConfig, AutoModelForCausalLM

OUT = pathlib.Path(__file__).resolve().parent.parent / "tests" / "data" / "arch"

BASE = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
    bos_token_id=1,
    eos_token_id=2,
)

CASES: dict[str, dict] = {
    "llama": dict(model_type="llama", architectures=["LlamaForCausalLM"], tie_word_embeddings=False,
                  rope_theta=500000.0,
                  rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                                    high_freq_factor=4.0, original_max_position_embeddings=16)),
    "llama_tied": dict(model_type="llama", architectures=["LlamaForCausalLM"], tie_word_embeddings=True,
                       rope_theta=100000.0, num_key_value_heads=1),
    "qwen2": dict(model_type="qwen2", architectures=["Qwen2ForCausalLM"], tie_word_embeddings=False,
                  rope_theta=1000000.0),
    "qwen3": dict(model_type="qwen3", architectures=["Qwen3ForCausalLM"], tie_word_embeddings=True,
                  head_dim=32, rope_theta=1000000.0),
    "mistral": dict(model_type="mistral", architectures=["MistralForCausalLM"], tie_word_embeddings=False,
                    sliding_window=5, rope_theta=10000.0, head_dim=16),
    # Qwen2 with its upper layers sliding (max_window_layers) and yarn RoPE
    "qwen2_sliding": dict(model_type="qwen2", architectures=["Qwen2ForCausalLM"], tie_word_embeddings=True,
                          num_hidden_layers=3, use_sliding_window=True, sliding_window=4, max_window_layers=1,
                          max_position_embeddings=64, rope_theta=10000.0,
                          rope_scaling=dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=16)),
    # dynamic NTK: the 13-token sequence is past max_position_embeddings, the 7-token one is not
    "llama_dynamic": dict(model_type="llama", architectures=["LlamaForCausalLM"], tie_word_embeddings=False,
                          max_position_embeddings=8, rope_theta=10000.0,
                          rope_scaling=dict(rope_type="dynamic", factor=2.0)),
    # Phi-3: fused qkv / gate_up, longrope (long factors for the 13-token sequence, short for the
    # 7-token one), partial rotary (Phi-4-mini), a sliding window
    "phi3": dict(model_type="phi3", architectures=["Phi3ForCausalLM"], tie_word_embeddings=False, pad_token_id=0,
                 max_position_embeddings=32, original_max_position_embeddings=8, sliding_window=9,
                 partial_rotary_factor=0.75, rope_theta=10000.0,
                 rope_scaling=dict(rope_type="longrope", short_factor=[1.0, 1.1, 1.3, 1.6, 2.0, 2.5],
                                   long_factor=[1.0, 1.5, 2.5, 4.0, 6.0, 9.0])),
    "gemma2": dict(model_type="gemma2", architectures=["Gemma2ForCausalLM"], tie_word_embeddings=True,
                   head_dim=16, query_pre_attn_scalar=24, sliding_window=4, attn_logit_softcapping=1.0,
                   final_logit_softcapping=3.0, hidden_activation="gelu_pytorch_tanh", rope_theta=10000.0),
    # Gemma 3: 5 sliding layers with their own RoPE base, then a global one with linear scaling
    "gemma3": dict(model_type="gemma3_text", architectures=["Gemma3ForCausalLM"], tie_word_embeddings=True,
                   num_hidden_layers=6, head_dim=16, query_pre_attn_scalar=16, sliding_window=4,
                   rope_theta=1000000.0, rope_local_base_freq=10000.0,
                   rope_scaling=dict(rope_type="linear", factor=8.0), hidden_activation="gelu_pytorch_tanh"),
    "mixtral": dict(model_type="mixtral", architectures=["MixtralForCausalLM"], tie_word_embeddings=False,
                    intermediate_size=32, num_local_experts=8, num_experts_per_tok=2, rope_theta=1000000.0,
                    sliding_window=None),
    # Qwen3-MoE: top-2 of 8 without renormalisation, a dense MLP in layer 1 (mlp_only_layers)
    "qwen3_moe": dict(model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"], tie_word_embeddings=False,
                      num_hidden_layers=3, head_dim=16, moe_intermediate_size=32, num_experts=8,
                      num_experts_per_tok=2, norm_topk_prob=False, mlp_only_layers=[1], rope_theta=1000000.0),
    # Gemma 4 with every attention feature (E2B's shape, plus 31B's full-attention heads): per-layer
    # input embeddings, wider heads in the full-attention layers (proportional RoPE rotating a
    # quarter of them), one KV head there whose values are its keys, the last two layers reading
    # the KV of the last earlier layer of their type, with double-wide MLPs
    "gemma4": dict(model_type="gemma4_text", architectures=["Gemma4ForCausalLM"], tie_word_embeddings=True,
                   num_hidden_layers=6, head_dim=32, global_head_dim=64, num_global_key_value_heads=1,
                   attention_k_eq_v=True, sliding_window=4,
                   layer_types=["sliding_attention", "sliding_attention", "full_attention",
                                "sliding_attention", "sliding_attention", "full_attention"],
                   rope_parameters=dict(
                       sliding_attention=dict(rope_type="default", rope_theta=10000.0),
                       full_attention=dict(rope_type="proportional", partial_rotary_factor=0.25,
                                           rope_theta=1000000.0)),
                   hidden_size_per_layer_input=8, vocab_size_per_layer_input=128, num_kv_shared_layers=2,
                   use_double_wide_mlp=True, final_logit_softcapping=3.0,
                   hidden_activation="gelu_pytorch_tanh"),
    # Gemma 4 MoE (26B-A4B's shape): a dense MLP and 8 routed experts side by side in every
    # layer; full-attention layers with one wider KV head whose values are its keys
    "gemma4_moe": dict(model_type="gemma4_text", architectures=["Gemma4ForCausalLM"], tie_word_embeddings=True,
                       num_hidden_layers=4, head_dim=32, global_head_dim=64, num_global_key_value_heads=1,
                       attention_k_eq_v=True, sliding_window=4,
                       layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
                       rope_parameters=dict(
                           sliding_attention=dict(rope_type="default", rope_theta=10000.0),
                           full_attention=dict(rope_type="proportional", partial_rotary_factor=0.25,
                                               rope_theta=1000000.0)),
                       hidden_size_per_layer_input=0, enable_moe_block=True, num_experts=8, top_k_experts=2,
                       moe_intermediate_size=32, final_logit_softcapping=30.0,
                       hidden_activation="gelu_pytorch_tanh"),
    # gpt-oss: q/k/v/o biases, a learned sink per head, sliding and full layers alternating
    # (the window smaller than the sequences), yarn RoPE without truncation, top-2 of 8 experts
    # with biases and the clamped SwiGLU (a small limit, so both clamps act); the router's own
    # bias skews routing. Also written MXFP4-quantized (gpt_oss_mxfp4: `write_mxfp4_case`).
    "gpt_oss": dict(model_type="gpt_oss", architectures=["GptOssForCausalLM"], tie_word_embeddings=False,
                    intermediate_size=64, head_dim=64, num_local_experts=8, num_experts_per_tok=2,
                    sliding_window=4, layer_types=["sliding_attention", "full_attention"], max_position_embeddings=64,
                    rope_parameters=dict(rope_type="yarn", rope_theta=150000.0, factor=4.0, beta_fast=32.0,
                                         beta_slow=1.0, truncate=False, original_max_position_embeddings=16),
                    swiglu_limit=0.5, attention_bias=True),
    # DeepSeek V3 (MLA): queries through a low-rank bottleneck, a 112-wide latent beside a
    # 16-wide shared roped key (cache rows of 128: lane-dense, as the TPU kernels take them), interleaved RoPE with YaRN (mscale and mscale_all_dim both
    # counting), one dense layer then 8 routed experts in 4 groups (2 eligible) and a shared
    # one, random score-correction biases, the attention biases (q_a, kv_a, o); no MTP layer
    "deepseek_v3": dict(model_type="deepseek_v3", architectures=["DeepseekV3ForCausalLM"],
                        tie_word_embeddings=False, num_hidden_layers=3, num_key_value_heads=4,
                        q_lora_rank=48, kv_lora_rank=112, qk_rope_head_dim=16, qk_nope_head_dim=16,
                        v_head_dim=16, first_k_dense_replace=1, n_routed_experts=8, n_group=4,
                        topk_group=2, num_experts_per_tok=2, n_shared_experts=1,
                        moe_intermediate_size=32, routed_scaling_factor=2.5, norm_topk_prob=True,
                        rope_interleave=True, num_nextn_predict_layers=0, attention_bias=True,
                        rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0,
                                             original_max_position_embeddings=64, mscale=1.0,
                                             mscale_all_dim=0.8, beta_fast=32.0, beta_slow=1.0)),
    # DeepSeek-V2-Lite's shape on the V3 architecture: one query projection (q_lora_rank None),
    # rotary dims not interleaved, ungrouped routing without renormalisation, two shared experts
    "deepseek_v3_lite": dict(model_type="deepseek_v3", architectures=["DeepseekV3ForCausalLM"],
                             tie_word_embeddings=False, num_hidden_layers=2, num_key_value_heads=4,
                             q_lora_rank=None, kv_lora_rank=32, qk_rope_head_dim=16,
                             qk_nope_head_dim=16, v_head_dim=16, first_k_dense_replace=1,
                             n_routed_experts=8, n_group=1, topk_group=1, num_experts_per_tok=3,
                             n_shared_experts=2, moe_intermediate_size=16,
                             routed_scaling_factor=1.0, norm_topk_prob=False,
                             rope_interleave=False, num_nextn_predict_layers=0,
                             rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0,
                                                  original_max_position_embeddings=64,
                                                  mscale=0.707, mscale_all_dim=0.707)),
}
# MoE fixtures: router biases that make routing uneven (added along each layer's mean router
# input, so expert 0 takes many tokens and expert 7 few), and the per-expert counts recorded.
ROUTER_BIAS = [2.5, 1.5, 0.5, 0.0, 0.0, -0.5, -1.5, -3.0]
GEMMA4_BIAS = 0.12  # Gemma 4's routers see normed, scaled-down inputs: a gentler push
# Hub checkpoints store MoE experts one tensor each; transformers 5 saves them stacked. The
# fixture of each family is written in the hub layout (the loader reads both).
HUB_EXPERT_NAMES = {"mixtral": ("block_sparse_moe", ("w1", "w3", "w2")),
                    "qwen3_moe": ("mlp", ("gate_proj", "up_proj", "down_proj"))}
# Gemma 4's checkpoints keep the stacked experts (`experts.gate_up_proj`, `experts.down_proj`).
STACKED_MOE = ("gemma4_moe",)
# Parameters (and buffers) that multiply rather than add: drawn near one like the norms.
NEAR_ONE = ("norm", "router.scale", "per_expert_scale", "layer_scalar")

# Cases whose expected files also hold transformers' greedy continuation of each sequence
# (`generate`, through its KV cache) and each step's top-1 / top-2 log-prob margin.
GREEDY = ("gemma4", "gemma4_moe", "gpt_oss", "deepseek_v3", "deepseek_v3_lite")
GREEDY_TOKENS = 8

# Two token sequences of different lengths (the test feeds them as one ragged batch).
SEQUENCES = [[1, 17, 45, 3, 99, 100, 7, 7, 64, 12, 120, 5, 33], [1, 8, 9, 127, 44, 2, 60]]


def main(names: list[str]) -> None:
    torch.manual_seed(0)
    if not names or EAGLE3_CASE in names:
        write_eagle3_case(OUT / EAGLE3_TARGET, OUT / EAGLE3_CASE)
    for name, extra in CASES.items():
        if names and name not in names:
            continue
        cfg_dict = {**BASE, **extra}
        model_type = cfg_dict.pop("model_type")
        config = AutoConfig.for_model(model_type, **cfg_dict)
        config._attn_implementation = "eager"
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
        gen = torch.Generator().manual_seed(zlib.crc32(name.encode()))
        with torch.no_grad():
            scalars = [(n, b) for n, b in model.named_buffers()
                       if n.endswith(("layer_scalar", "e_score_correction_bias"))]
            for pname, p in [*model.named_parameters(), *scalars]:
                if any(k in pname for k in NEAR_ONE):
                    p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
                else:
                    p.copy_(0.08 * torch.randn(p.shape, generator=gen))
        out_dir = OUT / name
        out_dir.mkdir(parents=True, exist_ok=True)
        counts = (skew_routers(model) if name in HUB_EXPERT_NAMES
                  else skew_gemma4_routers(model) if name in STACKED_MOE
                  else skew_gpt_oss_routers(model) if name == "gpt_oss" else None)
        model.save_pretrained(out_dir, safe_serialization=True)
        if name in HUB_EXPERT_NAMES:
            to_hub_expert_layout(out_dir / "model.safetensors", *HUB_EXPERT_NAMES[name])
        expected = {}
        if counts is not None:
            expected["expert_counts"] = counts
        with torch.no_grad():
            for i, seq in enumerate(SEQUENCES):
                ids = torch.tensor([seq])
                logits = model(input_ids=ids).logits[0].float().numpy()
                expected[f"logits_{i}"] = np.ascontiguousarray(logits)
                expected[f"tokens_{i}"] = np.asarray(seq, dtype=np.int32)
                if name in GREEDY:  # transformers' own greedy continuation (with its KV cache)
                    out = model.generate(ids, max_new_tokens=GREEDY_TOKENS, do_sample=False, min_new_tokens=GREEDY_TOKENS,
                                         output_scores=True, return_dict_in_generate=True)
                    expected[f"greedy_{i}"] = out.sequences[0, len(seq):].numpy().astype(np.int32)
                    top2 = torch.stack([torch.topk(torch.log_softmax(s[0].float(), -1), 2).values for s in out.scores])
                    expected[f"greedy_margin_{i}"] = (top2[:, 0] - top2[:, 1]).numpy()
        save_file(expected, str(out_dir / "expected.safetensors"))
        cfg = json.loads((out_dir / "config.json").read_text())
        print(name, cfg["architectures"], {k: v.shape for k, v in expected.items()})
        if name == "gpt_oss":
            write_mxfp4_case(model, out_dir, OUT / "gpt_oss_mxfp4")


EAGLE3_CASE, EAGLE3_TARGET = "eagle3_llama", "llama"
# The draft vocabulary: this many of the target's 128 tokens (every third one from 2 on, so the
# draft -> target offsets grow along the draft ids), and the chain depth of the expected logits.
EAGLE3_DRAFT_VOCAB = 42
EAGLE3_STEPS = 3


def write_eagle3_case(target_dir: pathlib.Path, out_dir: pathlib.Path) -> None:
    """A tiny random EAGLE-3 drafter for the `llama` fixture, written by speculators' own
    `Eagle3DraftModel.save_pretrained` (its `speculators` layout: config.json with a
    `transformer_layer_config`, tensors `fc`, `layers.0.*`, `norm`, `lm_head`, `d2t`, `t2d`,
    `embed_tokens` copied from the target), and the expected outputs of speculators' forward
    on the reloaded checkpoint: `EAGLE3_STEPS` draft steps over every position of a sequence
    at once (step 0 attends causally over the sequence; step k's query at position i also sees
    the keys steps 1..k-1 wrote at i: the chain drafted from i), the inputs of steps k > 0
    being the sequence shifted by k (teacher forcing). Recorded: the inputs (`input_ids`,
    `positions`, random `aux_hidden` [T, 3H] standing for the target's three taps), per step
    the logits over the draft vocabulary and the decoder layer's output (the hidden state the
    next step takes); the same with both norm options on; the target's hidden states on the
    sequence (`target_hidden`, transformers' `output_hidden_states`)."""
    from safetensors.numpy import load_file
    from speculators import SpeculatorsConfig, VerifierConfig
    from speculators.models import Eagle3DraftModel, Eagle3SpeculatorConfig
    from speculators.models.attention import create_float_mask
    from speculators.proposals.greedy import GreedyTokenProposalConfig
    from transformers import LlamaConfig

    target_cfg = json.loads((target_dir / "config.json").read_text())
    layer_cfg = LlamaConfig(**{k: v for k, v in target_cfg.items() if k not in (
        "architectures", "model_type", "transformers_version", "dtype")})
    layer_cfg.num_hidden_layers = 1
    layer_cfg._attn_implementation = "eager"
    draft_ids = np.arange(2, 128, 3)[:EAGLE3_DRAFT_VOCAB]
    config = Eagle3SpeculatorConfig(
        transformer_layer_config=layer_cfg, draft_vocab_size=EAGLE3_DRAFT_VOCAB,
        norm_before_residual=False, eagle_aux_hidden_state_layer_ids=[0, 1, 2],
        speculators_config=SpeculatorsConfig(
            algorithm="eagle3", default_proposal_method="greedy",
            proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=EAGLE3_STEPS)],
            verifier=VerifierConfig(name_or_path=None, architectures=target_cfg["architectures"])))
    model = Eagle3DraftModel(config).eval()
    t2d = torch.zeros(target_cfg["vocab_size"], dtype=torch.bool)
    t2d[torch.from_numpy(draft_ids)] = True
    model.load_vocab_mappings(t2d, torch.from_numpy(draft_ids - np.arange(EAGLE3_DRAFT_VOCAB)))
    gen = torch.Generator().manual_seed(zlib.crc32(EAGLE3_CASE.encode()))
    target = load_file(str(target_dir / "model.safetensors"))
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if pname.startswith("verifier_"):
                continue
            if pname == "embed_tokens.weight":  # the target's table, as speculators copies it
                p.copy_(torch.from_numpy(target["model.embed_tokens.weight"]))
            elif "norm" in pname:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(0.08 * torch.randn(p.shape, generator=gen))
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir)
    for extra in out_dir.iterdir():  # only config.json and the weights describe the drafter
        if extra.name not in ("config.json", "model.safetensors"):
            extra.unlink()

    # Reloaded as written (the checkpoint names no verifier to take weights from: it has them all).
    load_verifier = Eagle3DraftModel.load_verifier_weights
    Eagle3DraftModel.load_verifier_weights = lambda self: None
    try:
        reloaded = Eagle3DraftModel.from_pretrained(out_dir).eval()
    finally:
        Eagle3DraftModel.load_verifier_weights = load_verifier
    # Eager attention with dense float masks (speculators' default is flex attention's BlockMask).
    reloaded.config.transformer_layer_config._attn_implementation = "eager"
    reloaded._attn_impl, reloaded._create_mask_fn = "eager", create_float_mask
    seq = SEQUENCES[0]
    n, hidden = len(seq), layer_cfg.hidden_size
    aux = (0.5 * torch.randn((1, n, 3 * hidden), generator=gen)).float()

    def run():
        logits, layer_out = [], []
        hooks = [reloaded.lm_head.register_forward_hook(lambda m, a, o: logits.append(o[0])),
                 reloaded.layers[0].register_forward_hook(lambda m, a, o: layer_out.append(o[0]))]
        with torch.no_grad():
            drafts = reloaded(hidden_states=aux, input_ids=torch.tensor([seq]),
                              document_ids=torch.zeros((1, n), dtype=torch.long),
                              position_ids=torch.arange(n)[None], ttt_steps=EAGLE3_STEPS)
        for h in hooks:
            h.remove()
        return (torch.stack(logits).numpy(), torch.stack(layer_out).numpy(),
                torch.cat(drafts).numpy())

    logits, layer_out, drafts = run()
    expected = {
        "input_ids": np.asarray(seq, np.int32), "positions": np.arange(n, dtype=np.int32),
        "aux_hidden": aux[0].numpy(), "logits": logits, "layer_out": layer_out,
        "draft_ids": drafts.astype(np.int32),
    }
    # The same weights with both norm options on (norm_before_residual: the layer's residual is
    # the normed hidden state; norm_output, EAGLE 3.1: the next step takes the normed output).
    reloaded.layers[0].norm_before_residual = True
    reloaded.config.norm_output = True
    expected["logits_norm_options"] = run()[0]
    # The target's hidden states on the same sequence (transformers' `output_hidden_states`:
    # the embeddings, then each layer's output, the last one after the final norm), for the
    # target's taps.
    target_model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        states = target_model(input_ids=torch.tensor([seq]),
                              output_hidden_states=True).hidden_states
    expected["target_hidden"] = torch.cat(states).numpy()
    save_file(expected, str(out_dir / "expected.safetensors"))
    print(EAGLE3_CASE, {k: v.shape for k, v in expected.items()})


def router_inputs(model):
    """Per MoE layer, the router's inputs over all sequences: {layer: [N, E]}."""
    seen = {}
    hooks = []
    for i, layer in enumerate(model.model.layers):
        block = getattr(layer, "block_sparse_moe", None) or layer.mlp
        gate = getattr(block, "gate", None)
        if gate is None or not hasattr(gate, "top_k"):
            continue
        hooks.append(gate.register_forward_hook(
            lambda mod, args, out, i=i: seen.setdefault(i, []).append((args[0].reshape(-1, args[0].shape[-1]), out[2]))))
    with torch.no_grad():
        for seq in SEQUENCES:
            model(input_ids=torch.tensor([seq]))
    for h in hooks:
        h.remove()
    return seen


def skew_routers(model) -> np.ndarray:
    """Bias each router towards low-numbered experts, layer by layer; returns the tokens each
    expert of each MoE layer gets, [layers, experts]."""
    bias = torch.tensor(ROUTER_BIAS)
    for i in sorted(router_inputs(model)):
        x = torch.cat([a for a, _ in router_inputs(model)[i]])
        mean = x.mean(0)
        layer = model.model.layers[i]
        block = getattr(layer, "block_sparse_moe", None) or layer.mlp
        with torch.no_grad():
            block.gate.weight += bias[:, None] * mean[None, :] / mean.dot(mean)
    seen = router_inputs(model)
    n = model.config.num_local_experts if hasattr(model.config, "num_local_experts") else model.config.num_experts
    counts = np.zeros((len(seen), n), np.int32)
    for row, i in enumerate(sorted(seen)):
        ids = torch.cat([b for _, b in seen[i]]).reshape(-1).numpy()
        counts[row] = np.bincount(ids, minlength=n)
    print("tokens per expert:", counts.tolist())
    return counts


def gemma4_router_inputs(model):
    """Per layer, Gemma 4's router projection inputs and chosen experts: {layer: [(x, ids)]}."""
    seen, hooks = {}, []
    for i, layer in enumerate(model.model.layers):
        hooks.append(layer.router.proj.register_forward_hook(
            lambda mod, args, out, i=i: seen.setdefault(i, []).append([args[0].reshape(-1, args[0].shape[-1])])))
        hooks.append(layer.router.register_forward_hook(
            lambda mod, args, out, i=i: seen[i][-1].append(out[2])))
    with torch.no_grad():
        for seq in SEQUENCES:
            model(input_ids=torch.tensor([seq]))
    for h in hooks:
        h.remove()
    return seen


def skew_gemma4_routers(model) -> np.ndarray:
    """`skew_routers` for Gemma 4's routers (a projection after their own norm and scale)."""
    bias = torch.tensor(ROUTER_BIAS) * GEMMA4_BIAS
    for i, layer in enumerate(model.model.layers):
        x = torch.cat([a for a, _ in gemma4_router_inputs(model)[i]])
        mean = x.mean(0)
        with torch.no_grad():
            layer.router.proj.weight += bias[:, None] * mean[None, :] / mean.dot(mean)
    seen = gemma4_router_inputs(model)
    n = model.config.num_experts
    counts = np.zeros((len(seen), n), np.int32)
    for row, i in enumerate(sorted(seen)):
        ids = torch.cat([b for _, b in seen[i]]).reshape(-1).numpy()
        counts[row] = np.bincount(ids, minlength=n)
    print("tokens per expert:", counts.tolist())
    return counts


GPT_OSS_BIAS = 0.25  # times ROUTER_BIAS: the routers' own bias


def gpt_oss_routing(model) -> np.ndarray:
    """The tokens each expert of each layer gets over all sequences, [layers, experts]."""
    seen, hooks = {}, []
    for i, layer in enumerate(model.model.layers):
        hooks.append(layer.mlp.router.register_forward_hook(
            lambda mod, args, out, i=i: seen.setdefault(i, []).append(out[2].reshape(-1))))
    with torch.no_grad():
        for seq in SEQUENCES:
            model(input_ids=torch.tensor([seq]))
    for h in hooks:
        h.remove()
    n = model.config.num_local_experts
    return np.stack([np.bincount(torch.cat(seen[i]).numpy(), minlength=n) for i in sorted(seen)]
                    ).astype(np.int32)


def skew_gpt_oss_routers(model) -> np.ndarray:
    """gpt-oss's routers have a bias: set it to skew routing towards low-numbered experts."""
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.router.bias.copy_(torch.tensor(ROUTER_BIAS) * GPT_OSS_BIAS)
    counts = gpt_oss_routing(model)
    print("tokens per expert:", counts.tolist())
    return counts


# e2m1 magnitudes (code 0..7) and the OCP rounding to them: nearest, ties to the even code.
E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], np.float32)


def quantize_mxfp4(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """float32 [..., rows, in] -> (blocks uint8 [..., rows, in / 32, 16], scales uint8
    [..., rows, in / 32]) as gpt-oss checkpoints store them: per 32 values the exponent
    floor(log2(amax)) - 2 (e8m0, bias 127), each value rounded to the nearest e2m1 value."""
    blocks = w.astype(np.float32).reshape(*w.shape[:-1], -1, 32)
    amax = np.abs(blocks).max(-1)
    e = np.where(amax > 0, np.floor(np.log2(np.maximum(amax, 1e-30))) - 2, 0).astype(np.int32)
    scaled = blocks / np.ldexp(np.float32(1), e)[..., None]
    mag = np.minimum(np.abs(scaled), 6.0)
    dist = np.abs(mag[..., None] - E2M1)
    code = np.argmin(dist + 1e-6 * (np.arange(8) % 2), axis=-1).astype(np.uint8)  # ties: even
    code |= np.where(np.signbit(scaled), 8, 0).astype(np.uint8)
    packed = code[..., 0::2] | (code[..., 1::2] << 4)
    return packed.astype(np.uint8), (e + 127).astype(np.uint8)


def write_mxfp4_case(model, float_dir: pathlib.Path, out_dir: pathlib.Path) -> None:
    """The gpt_oss fixture with its experts quantized to MXFP4 in the hub's layout
    (`mlp.experts.{gate_up,down}_proj_{blocks,scales}`, rows = output channels, quantization_config
    mxfp4). Expected: transformers' own decoding of the blocks (`convert_moe_packed_tensors`, its
    [experts, in, out] float32 weights of layer 0), the logits of the model running on the
    decoded weights and its greedy continuations."""
    from safetensors.numpy import load_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    out_dir.mkdir(parents=True, exist_ok=True)
    tensors = load_file(str(float_dir / "model.safetensors"))
    expected = {}
    for i, layer in enumerate(model.model.layers):
        experts = layer.mlp.experts
        for proj in ("gate_up_proj", "down_proj"):
            w = getattr(experts, proj).detach().numpy()  # [X, in, out]
            blocks, scales = quantize_mxfp4(np.ascontiguousarray(np.swapaxes(w, 1, 2)))
            key = f"model.layers.{i}.mlp.experts.{proj}"
            del tensors[key]
            tensors[key + "_blocks"], tensors[key + "_scales"] = blocks, scales
            decoded = convert_moe_packed_tensors(torch.from_numpy(blocks), torch.from_numpy(scales),
                                                 dtype=torch.float32)
            with torch.no_grad():
                getattr(experts, proj).copy_(decoded)
            if i == 0:
                expected[f"decoded_{proj}"] = np.ascontiguousarray(decoded.numpy())
    cfg = json.loads((float_dir / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (out_dir / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    with torch.no_grad():
        for i, seq in enumerate(SEQUENCES):
            ids = torch.tensor([seq])
            logits = model(input_ids=ids).logits[0].float().numpy()
            expected[f"logits_{i}"] = np.ascontiguousarray(logits)
            expected[f"tokens_{i}"] = np.asarray(seq, dtype=np.int32)
            out = model.generate(ids, max_new_tokens=GREEDY_TOKENS, do_sample=False,
                                 min_new_tokens=GREEDY_TOKENS)
            expected[f"greedy_{i}"] = out[0, len(seq):].numpy().astype(np.int32)
    save_file(expected, str(out_dir / "expected.safetensors"))
    shutil.copy(float_dir / "generation_config.json", out_dir / "generation_config.json")
    print("gpt_oss_mxfp4", {k: v.shape for k, v in expected.items()})


def to_hub_expert_layout(path: pathlib.Path, block: str, names: tuple[str, str, str]) -> None:
    """Rewrite transformers 5's stacked experts (`experts.gate_up_proj` [X, 2F, E],
    `experts.down_proj` [X, E, F]) into the hub's per-expert [out, in] tensors."""
    from safetensors.numpy import load_file

    tensors = load_file(str(path))
    out = {}
    for key, value in tensors.items():
        if key.endswith("experts.gate_up_proj"):
            prefix = key.removesuffix("experts.gate_up_proj").replace(".mlp.", f".{block}.")
            f = value.shape[1] // 2
            for j in range(value.shape[0]):
                out[f"{prefix}experts.{j}.{names[0]}.weight"] = np.ascontiguousarray(value[j, :f])
                out[f"{prefix}experts.{j}.{names[1]}.weight"] = np.ascontiguousarray(value[j, f:])
        elif key.endswith("experts.down_proj"):
            prefix = key.removesuffix("experts.down_proj").replace(".mlp.", f".{block}.")
            for j in range(value.shape[0]):
                out[f"{prefix}experts.{j}.{names[2]}.weight"] = np.ascontiguousarray(value[j])
        elif key.endswith("mlp.gate.weight") and block != "mlp":
            out[key.replace(".mlp.", f".{block}.")] = value
        else:
            out[key] = value
    save_file(out, str(path), metadata={"format": "pt"})


if __name__ == "__main__":
    main(sys.argv[1:])
