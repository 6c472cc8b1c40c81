"""The LoRA adapters the server offers as models (vLLM's --lora-modules and its runtime
loading routes): name -> LoRARequest, each with an id of its own (ids are never reused, so an
adapter loaded again under the same name is never served from a stale device slot or cached
blocks)."""

from __future__ import annotations

import itertools

from jaxserve.engine.client import EngineClient, check_lora
from jaxserve.lora_request import LoRARequest


class LoRARegistry:
    def __init__(self, engine: EngineClient):
        self.engine = engine
        self.adapters: dict[str, LoRARequest] = {}
        self._ids = itertools.count(1)

    def add(self, name: str, path: str) -> LoRARequest:
        """Offer the adapter at `path` as model `name`; ValueError names what is wrong (LoRA
        off, a name in use, an adapter the engine cannot serve)."""
        if name in self.adapters:
            raise ValueError(f"The lora adapter '{name}' has already been loaded.")
        lora = LoRARequest(name, next(self._ids), path)
        check_lora(self.engine.info, lora)
        self.adapters[name] = lora
        return lora

    def remove(self, name: str) -> bool:
        return self.adapters.pop(name, None) is not None

    def get(self, name: str | None) -> LoRARequest | None:
        return self.adapters.get(name) if name else None
