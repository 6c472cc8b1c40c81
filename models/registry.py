"""Model registry: HF `architectures` name -> model class (imported lazily)."""

from __future__ import annotations

import importlib

_REGISTRY: dict[str, tuple[str, str]] = {
    "LlamaForCausalLM": ("jaxserve.models.llama", "LlamaForCausalLM"),
    "Qwen2ForCausalLM": ("jaxserve.models.qwen2", "Qwen2ForCausalLM"),
    "Qwen3ForCausalLM": ("jaxserve.models.qwen3", "Qwen3ForCausalLM"),
    "MistralForCausalLM": ("jaxserve.models.mistral", "MistralForCausalLM"),
    "Phi3ForCausalLM": ("jaxserve.models.phi3", "Phi3ForCausalLM"),
    "Gemma2ForCausalLM": ("jaxserve.models.gemma", "Gemma2ForCausalLM"),
    "Gemma3ForCausalLM": ("jaxserve.models.gemma", "Gemma3ForCausalLM"),
    "Gemma4ForCausalLM": ("jaxserve.models.gemma4", "Gemma4ForCausalLM"),
    "MixtralForCausalLM": ("jaxserve.models.moe", "MixtralForCausalLM"),
    "Qwen3MoeForCausalLM": ("jaxserve.models.moe", "Qwen3MoeForCausalLM"),
    "GptOssForCausalLM": ("jaxserve.models.gpt_oss", "GptOssForCausalLM"),
    "DeepseekV3ForCausalLM": ("jaxserve.models.deepseek_v3", "DeepseekV3ForCausalLM"),
}


def supported_architectures() -> list[str]:
    return sorted(_REGISTRY)


def get_model_class(architecture: str) -> type:
    if architecture not in _REGISTRY:
        raise ValueError(
            f"Model architecture {architecture!r} is not supported. "
            f"Supported architectures: {', '.join(supported_architectures())}."
        )
    module, name = _REGISTRY[architecture]
    return getattr(importlib.import_module(module), name)
