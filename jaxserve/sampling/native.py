"""Native implementations of the sampler's steps 5-7 (temperature, min_p, top_k, top_p, the
draw) and of the raw logprobs, by name: a backend registers its own when it loads (the CPU
backend: "cpu", backends/cpu/kernels/sample.py) and its plan names the one the sampler runs
(`SamplerConfig.native`, from `DevicePlan.native_sampling`). The sampler itself never asks for
the platform."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable


@dataclasses.dataclass(frozen=True)
class NativeSampling:
    # (x [R, V], temperature, top_k, top_p, min_p, u, active [R], with_mask) ->
    # (tokens [R] int32, mask [R, V] or None)
    sample_rows: Callable
    # (raw [T, V] float32, tok [T] int32, k) -> (logprob [T], topk_ids [T, k],
    # topk_logprobs [T, k], rank [T])
    raw_logprobs: Callable


_REGISTERED: dict[str, NativeSampling] = {}


def register(name: str, sample_rows: Callable, raw_logprobs: Callable) -> None:
    """Register (or replace) the native sampling implementation `name`."""
    _REGISTERED[name] = NativeSampling(sample_rows, raw_logprobs)


def get(name: str) -> NativeSampling:
    """The implementation registered as `name`; ValueError when none is."""
    try:
        return _REGISTERED[name]
    except KeyError:
        raise ValueError(f"no native sampling implementation {name!r} is registered (have "
                         f"{sorted(_REGISTERED)}; a backend registers its own when it "
                         f"loads)") from None
