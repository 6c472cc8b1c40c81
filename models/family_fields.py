"""What each model family's config.json adds to the common fields (models/arch_config.py's
`ArchConfig.from_hf` reads those): Gemma 4's layer shapes and KV sharing, DeepSeek V3's latent
attention and routing, and every mixture of experts' expert counts, each with transformers'
defaults for the keys a config.json leaves out, and the refusals of what is not served."""

from __future__ import annotations

from typing import Any

# A layer's kind in `ArchConfig.layer_types` (transformers' names).
FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"
# The families whose config.json has fields of their own.
GEMMA4 = "Gemma4ForCausalLM"
GPT_OSS = "GptOssForCausalLM"
DEEPSEEK_V3 = "DeepseekV3ForCausalLM"


def opt_float(x) -> float | None:
    return None if x is None else float(x)


def gemma4_fields(hf: dict[str, Any], layer_types: tuple[str, ...], num_layers: int, num_kv: int,
                   head_dim: int) -> dict[str, Any]:
    """Gemma 4's fields, with transformers' defaults for the keys config.json leaves out."""
    if hf.get("use_bidirectional_attention") == "all":
        raise ValueError("Gemma4ForCausalLM with use_bidirectional_attention='all' (an encoder) "
                         "is not supported: jaxserve serves causal decoders")
    global_dim, global_kv = gemma4_global_heads(hf, layer_types, num_layers)
    if global_kv is not None and num_kv % global_kv and global_kv % num_kv:
        raise ValueError(f"Gemma4ForCausalLM: the full-attention layers' {global_kv} KV heads "
                         f"and the others' {num_kv} must divide one another (the cache holds "
                         "the most of them)")
    shared = int(hf.get("num_kv_shared_layers") or 0)
    if shared:
        first = num_layers - shared
        kinds = set(layer_types) if layer_types else {FULL_ATTENTION}
        if first <= 0 or set(layer_types[:first] if layer_types else kinds) != kinds:
            raise ValueError(f"Gemma4ForCausalLM: num_kv_shared_layers={shared} leaves no "
                             "earlier layer of each attention type to read the KV of")
    return dict(
        query_pre_attn_scalar=1.0,  # scores scaled by 1: the q/k norms set their size
        final_logit_softcapping=opt_float(hf.get("final_logit_softcapping")),
        attn_logit_softcapping=None,
        global_head_dim=global_dim if global_dim != head_dim else None,
        global_kv_heads=global_kv if global_kv not in (None, num_kv) else None,
        global_k_eq_v=bool(hf.get("attention_k_eq_v", False)),
        per_layer_input_size=int(hf.get("hidden_size_per_layer_input", 256) or 0),
        per_layer_vocab_size=int(hf.get("vocab_size_per_layer_input", 262_144) or 0),
        num_kv_shared_layers=shared,
        double_wide_mlp=bool(hf.get("use_double_wide_mlp", False)),
    )


def gemma4_global_heads(hf: dict[str, Any], layer_types: tuple[str, ...], num_layers: int
                         ) -> tuple[int, int | None]:
    """(head dim, KV heads or None) of Gemma 4's full-attention layers: from `per_layer_config`
    (transformers 5.25's config.json) or `global_head_dim` / `num_global_key_value_heads`."""
    full = [i for i in range(num_layers) if not layer_types or layer_types[i] == FULL_ATTENTION]
    per_layer = hf.get("per_layer_config")
    if isinstance(per_layer, dict):
        overrides = {int(k): v or {} for k, v in per_layer.items() if str(k).isdigit()}
        if set(overrides) - set(full):
            raise ValueError("Gemma4ForCausalLM: per_layer_config overrides sliding-window "
                             f"layers {sorted(set(overrides) - set(full))}; only the "
                             "full-attention layers may differ")
        found = {(o.get("head_dim"), o.get("num_key_value_heads")) for o in overrides.values()}
        found |= {(None, None)} if set(full) - set(overrides) else set()
        keys = {k for o in overrides.values() for k in o}
        if len(found) > 1 or keys - {"head_dim", "num_key_value_heads"}:
            raise ValueError(f"Gemma4ForCausalLM: per_layer_config {per_layer} is not supported "
                             "(the full-attention layers must share one head_dim and KV head "
                             "count)")
        dim, kv = found.pop()
        return int(dim or hf.get("head_dim") or 256), (None if kv is None else int(kv))
    dim = int(hf.get("global_head_dim", 512))
    kv = hf.get("num_global_key_value_heads") if hf.get("attention_k_eq_v", True) else None
    return dim, (None if kv is None else int(kv))


def deepseek_fields(hf: dict[str, Any]) -> dict[str, Any]:
    """DeepSeek V3's MLA and routing fields, with transformers' defaults."""
    q_rank = hf.get("q_lora_rank", 1536)
    scoring = hf.get("scoring_func", "sigmoid")
    topk = hf.get("topk_method", "noaux_tc")
    if scoring != "sigmoid" or topk != "noaux_tc":
        raise ValueError(f"DeepseekV3ForCausalLM with scoring_func={scoring!r}, topk_method="
                         f"{topk!r} is not supported (only sigmoid scores, 'noaux_tc')")
    n_group = int(hf.get("n_group") or 1)
    experts = int(hf.get("n_routed_experts", 256))
    if experts % n_group:
        raise ValueError(f"DeepseekV3ForCausalLM: n_routed_experts={experts} must split into "
                         f"n_group={n_group} equal groups")
    return dict(
        q_lora_rank=None if q_rank is None else int(q_rank),
        kv_lora_rank=int(hf.get("kv_lora_rank", 512)),
        qk_nope_head_dim=int(hf.get("qk_nope_head_dim", 128)),
        qk_rope_head_dim=int(hf.get("qk_rope_head_dim", 64)),
        v_head_dim=int(hf.get("v_head_dim", 128)),
        rope_interleave=bool(hf.get("rope_interleave", True)),
        n_group=n_group,
        topk_group=int(hf.get("topk_group") or 1),
        routed_scaling_factor=float(hf.get("routed_scaling_factor", 2.5)),
        n_shared_experts=int(hf.get("n_shared_experts") or 0),
        num_mtp_layers=int(hf.get("num_nextn_predict_layers", hf.get("num_mtp_layers", 1)) or 0),
    )


def moe_fields(arch: str, hf: dict[str, Any], num_layers: int) -> dict[str, Any]:
    if arch == "MixtralForCausalLM":
        return dict(num_experts=int(hf["num_local_experts"]), num_experts_per_tok=int(hf["num_experts_per_tok"]),
                    moe_intermediate_size=int(hf["intermediate_size"]), norm_topk_prob=True)
    if arch == "Qwen3MoeForCausalLM":
        step = int(hf.get("decoder_sparse_step", 1))
        dense_only = set(hf.get("mlp_only_layers") or ())
        n = int(hf.get("num_experts") or hf.get("num_local_experts") or 0)  # 4.x / 5.x name
        layers = tuple(i not in dense_only and n > 0 and (i + 1) % step == 0 for i in range(num_layers))
        return dict(num_experts=n, num_experts_per_tok=int(hf["num_experts_per_tok"]),
                    moe_intermediate_size=int(hf["moe_intermediate_size"]),
                    norm_topk_prob=bool(hf.get("norm_topk_prob", False)), moe_layers=layers)
    if arch == GPT_OSS:  # top-k of the router's logits, softmax over them: normalised
        return dict(num_experts=int(hf.get("num_local_experts", 128)),
                    num_experts_per_tok=int(hf.get("num_experts_per_tok")
                                            or hf.get("experts_per_token") or 4),
                    moe_intermediate_size=int(hf["intermediate_size"]), norm_topk_prob=True)
    if arch == DEEPSEEK_V3:  # dense MLPs in the first `first_k_dense_replace` layers
        first_moe = int(hf.get("first_k_dense_replace") or 0)
        return dict(num_experts=int(hf.get("n_routed_experts", 256)),
                    num_experts_per_tok=int(hf.get("num_experts_per_tok") or 8),
                    moe_intermediate_size=int(hf.get("moe_intermediate_size", 2048)),
                    norm_topk_prob=bool(hf.get("norm_topk_prob", True)),
                    moe_layers=tuple(i >= first_moe for i in range(num_layers)))
    if arch == GEMMA4 and hf.get("enable_moe_block"):  # experts beside the dense MLP, every layer
        return dict(num_experts=int(hf["num_experts"]),
                    num_experts_per_tok=int(hf["top_k_experts"]),
                    moe_intermediate_size=int(hf["moe_intermediate_size"]), norm_topk_prob=True)
    return {}
