"""Qwen3: the Llama decoder with a per-head RMSNorm on q and k before RoPE (ArchConfig.qk_norm)."""

from __future__ import annotations

from jaxserve.models.llama import LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    """Qwen3 dense models. q_norm / k_norm are switched on by ArchConfig.from_hf."""
