"""A model's weight format as its checkpoint states it (FP8, int4), without JAX: the
configuration (`arch_config`) and the checkpoint readers name it, the layers
(`models/layers/quant.py`) compute with it."""

from __future__ import annotations

import dataclasses

import ml_dtypes
import numpy as np

FP8_DTYPE = np.dtype(ml_dtypes.float8_e4m3fn)


@dataclasses.dataclass(frozen=True)
class WeightFormat:
    """How the decoder layers' matmul weights are kept on the device (the embedding and the
    LM head stay float, as the FP8/AWQ/GPTQ checkpoints leave them)."""

    kind: str  # "fp8" (float8_e4m3fn values) or "int4" (0..15 with zeros, packed)
    in_block: int | None  # values sharing a scale along the contracted dims (None: all)
    out_block: int | None  # ... along the output dims (1: per channel, None: all)
    source: str  # the checkpoint's quant_method: "fp8", "compressed-tensors", "awq", "gptq"
    # GPTQ's v1 layout stores each zero minus one (auto-gptq's historical offset).
    zero_offset: int = 0

    def __post_init__(self):
        if self.kind not in ("fp8", "int4"):
            raise ValueError(f"weight format kind must be fp8 or int4; got {self.kind!r}")

    @property
    def has_zeros(self) -> bool:
        return self.kind == "int4"

    def describe(self) -> str:
        blocks = {None: "tensor", 1: "channel"}
        out = blocks.get(self.out_block, str(self.out_block))
        inn = blocks.get(self.in_block, str(self.in_block))
        return f"{self.kind} ({self.source}; scale per {out} x {inn})"
