"""RMSNorm, computed in float32 like Hugging Face's LlamaRMSNorm."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def rms_norm(x: jax.Array, weight: jax.Array | None, eps: float) -> jax.Array:
    """x: [..., E] (any float dtype), weight: [E] or None (no scale, e.g. Gemma 4's value
    norm) -> float32 [..., E]."""
    x32 = x.astype(jnp.float32)
    var = jnp.mean(jnp.square(x32), axis=-1, keepdims=True)
    out = x32 * jax.lax.rsqrt(var + eps)
    return out if weight is None else out * weight.astype(jnp.float32)
