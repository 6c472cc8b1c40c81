"""A model's weight format as its checkpoint states it (FP8, int4, int8), without JAX: the
configuration (`arch_config`) and the checkpoint readers name it, the layers
(`models/layers/quant.py`) compute with it."""

from __future__ import annotations

import dataclasses

import ml_dtypes
import numpy as np

FP8_DTYPE = np.dtype(ml_dtypes.float8_e4m3fn)

# Activation schemes a checkpoint states (`WeightFormat.activations`): quantized per token at
# run time ("dynamic") or with the checkpoint's own per-tensor `input_scale` ("static").
ACTIVATION_SCHEMES = ("int8-dynamic", "int8-static", "fp8-dynamic", "fp8-static")


@dataclasses.dataclass(frozen=True)
class WeightFormat:
    """How the decoder layers' matmul weights are kept on the device (the embedding and the
    LM head stay float, as the FP8/AWQ/GPTQ/compressed-tensors checkpoints leave them)."""

    kind: str  # "fp8" (float8_e4m3fn), "int4" (0..15 with zeros, packed), "int8" (-128..127)
    in_block: int | None  # values sharing a scale along the contracted dims (None: all)
    out_block: int | None  # ... along the output dims (1: per channel, None: all)
    source: str  # the checkpoint's quant_method: "fp8", "compressed-tensors", "awq", "gptq"
    # GPTQ's v1 layout stores each zero minus one (auto-gptq's historical offset).
    zero_offset: int = 0
    # int8 with zero points (asymmetric); int4 always has zeros (0..15 stored unsigned).
    asymmetric: bool = False
    # Input rows assigned to groups out of order (GPTQ's act-order, compressed-tensors'
    # actorder "group": a `g_idx` per input): the rows are reordered at load so that each
    # group is contiguous, and the activations are gathered in that order in the product.
    act_order: bool = False
    # The checkpoint's activation quantization (ACTIVATION_SCHEMES), or None: weight-only.
    # Used where the chip multiplies in that dtype; elsewhere the activations stay floats.
    activations: str | None = None

    def __post_init__(self):
        if self.kind not in ("fp8", "int4", "int8"):
            raise ValueError(f"weight format kind must be fp8, int4 or int8; got {self.kind!r}")
        if self.activations is not None and self.activations not in ACTIVATION_SCHEMES:
            raise ValueError(f"activations must be one of {ACTIVATION_SCHEMES}; got {self.activations!r}")

    @property
    def has_zeros(self) -> bool:
        return self.kind == "int4" or (self.kind == "int8" and self.asymmetric)

    @property
    def static_activations(self) -> bool:
        return self.activations is not None and self.activations.endswith("-static")

    def describe(self) -> str:
        if self.out_block is None and self.in_block is None:
            scales = "one scale"
        elif self.out_block == 1:
            scales = "a scale per channel" + (
                "" if self.in_block is None else f" and group of {self.in_block}")
        else:
            scales = f"a scale per {self.out_block} x {self.in_block} block"
        extra = "".join([", asymmetric" if self.kind == "int8" and self.asymmetric else "",
                         ", act-order" if self.act_order else "",
                         f", activations {self.activations}" if self.activations else ""])
        return f"{self.kind} ({self.source}; {scales}{extra})"
