"""LoRARequest: which LoRA adapter a request runs with (vLLM's `vllm.lora.request.LoRARequest`).

An adapter is known by its integer id (`lora_int_id`, > 0; 0 is the base model): the engine
keeps one device slot and one host copy per id, and the prefix cache keys blocks by it.
`lora_path` is a PEFT adapter directory (adapter_config.json + adapter_model.safetensors).
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class LoRARequest:
    lora_name: str
    lora_int_id: int
    lora_path: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be a positive integer, got {self.lora_int_id!r}")
        if not self.lora_name:
            raise ValueError("lora_name must not be empty")
        if not self.lora_path:
            raise ValueError(f"LoRA adapter {self.lora_name!r} has no lora_path")

    # vLLM's short names
    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def adapter_id(self) -> int:
        return self.lora_int_id

    @property
    def path(self) -> str:
        return self.lora_path
