"""Mistral: the Llama decoder with sliding-window attention (ArchConfig.sliding_window)."""

from __future__ import annotations

from jaxserve.models.llama import LlamaForCausalLM


class MistralForCausalLM(LlamaForCausalLM):
    """Mistral 7B-style models; the window reaches the attention op through AttentionSpec."""
