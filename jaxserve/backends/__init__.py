"""Device backends: one `Backend` per engine owns every policy that depends on the device kind
(see base.py); `select_backend` picks it once from JAX's platform."""

from __future__ import annotations

import jax

from jaxserve.backends.base import Backend, DevicePlan, LayerImpl, layer_features_covered

__all__ = ["Backend", "DevicePlan", "LayerImpl", "layer_features_covered", "select_backend"]


def select_backend(platform: str | None = None) -> Backend:
    """The backend of `platform` ("cpu", "tpu", "gpu"/"cuda"/"rocm"; default: JAX's default)."""
    platform = platform or jax.default_backend()
    if platform == "cpu":
        from jaxserve.backends.cpu import CpuBackend

        return CpuBackend()
    if platform in ("tpu", "gpu", "cuda", "rocm"):
        return Backend("gpu" if platform in ("cuda", "rocm") else platform)
    raise ValueError(f"no jaxserve backend for the JAX platform {platform!r}")
