"""What a compiled step needs of each device's memory, from XLA's own buffer assignment.

`compiled.memory_analysis()` reports, per device, the bytes of the program's arguments (the
weights, the KV cache, the sampling state, the packed inputs), its outputs (and how many of
them alias donated arguments: the KV cache and the sampling state come back in place), its
temporaries and its generated code. These are the figures XLA allocates with, not an estimate:
the KV budget on accelerators is what is left of the device after them (backends/base.py).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import numpy as np


@dataclasses.dataclass(frozen=True)
class StepMemory:
    """One compiled step's bytes per device (`memory_analysis()`), with the KV cache it took."""

    bucket: tuple[int, int]  # (T, R)
    weights: int  # the weights' share of the arguments
    arguments: int  # everything the step takes: weights, KV cache, sampling state, inputs
    kv: int  # the KV cache's share of the arguments
    outputs: int  # outputs that do not alias a donated argument (tokens, logprobs)
    temp: int  # temporaries: activations, logits, attention's scratch
    code: int  # generated code

    @classmethod
    def of(
        cls, compiled: jax.stages.Compiled, bucket: tuple[int, int], weights: int, kv: int
    ) -> StepMemory:
        m = compiled.memory_analysis()
        get = lambda name: int(getattr(m, f"{name}_size_in_bytes", 0) or 0)  # noqa: E731
        return cls(
            bucket=tuple(bucket),
            weights=weights,
            arguments=get("argument"),
            kv=kv,
            outputs=max(get("output") - get("alias"), 0),
            temp=get("temp"),
            code=get("generated_code"),
        )

    @property
    def other_arguments(self) -> int:
        """The sampling state and the step's packed inputs."""
        return max(self.arguments - self.kv - self.weights, 0)

    @property
    def peak(self) -> int:
        """Bytes of the device the step holds while it runs (its donated KV cache included)."""
        return self.arguments + self.outputs + self.temp + self.code

    @property
    def besides_kv(self) -> int:
        """Everything but the KV cache: what a KV budget must leave of the device."""
        return self.peak - self.kv


def bytes_on_device(arrays) -> int:
    """Bytes of one device's shard of each array (abstract or real; evenly sharded or
    replicated arrays: every device holds as much)."""
    total = 0
    for x in arrays:
        shape = (
            x.sharding.shard_shape(x.shape) if getattr(x, "sharding", None) is not None else x.shape
        )
        total += math.prod(shape) * np.dtype(x.dtype).itemsize
    return int(total)
