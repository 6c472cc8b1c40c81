"""jaxserve: an LLM inference server compiled with JAX/XLA.

`from jaxserve import LLM, SamplingParams` — the JAX-heavy parts are imported lazily so that
the pure-Python core (scheduler, allocator) stays importable without JAX.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from jaxserve.platform import pin_cpu_without_accelerator

pin_cpu_without_accelerator()  # before JAX starts: no accelerator plugin tracebacks on CPU hosts

from jaxserve.inputs import PromptType, TextPrompt, TokensPrompt
from jaxserve.lora_request import LoRARequest
from jaxserve.sampling_params import SamplingParams, StructuredOutputsParams

__version__ = "0.1.0"
__all__ = ["LLM", "LoRARequest", "SamplingParams", "StructuredOutputsParams", "RequestOutput",
           "CompletionOutput", "PromptType", "TextPrompt", "TokensPrompt", "__version__"]

if TYPE_CHECKING:
    from jaxserve.entrypoints.llm import LLM
    from jaxserve.outputs import CompletionOutput, RequestOutput


def __getattr__(name: str):
    if name == "LLM":
        from jaxserve.entrypoints.llm import LLM

        return LLM
    if name in ("RequestOutput", "CompletionOutput"):
        from jaxserve import outputs

        return getattr(outputs, name)
    raise AttributeError(f"module 'jaxserve' has no attribute {name!r}")
