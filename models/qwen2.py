"""Qwen2: the Llama decoder with biases on the q/k/v projections (ArchConfig.qkv_bias)."""

from __future__ import annotations

from jaxserve.models.llama import LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    """Qwen2 / Qwen2.5. The q/k/v biases are switched on by ArchConfig.from_hf."""
