"""Rotary position embeddings (HF "rotate_half" layout), with Llama 3 and linear scaling."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.models.arch_config import ArchConfig


def inverse_frequencies(cfg: ArchConfig) -> np.ndarray:
    """[D/2] float32, computed as Hugging Face computes them (float32 throughout)."""
    dim = cfg.head_dim
    exponent = np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / np.float32(dim)
    inv_freq = (np.float32(1.0) / (np.float32(cfg.rope_theta) ** exponent)).astype(np.float32)
    rs = cfg.rope_scaling
    if rs.rope_type == "linear":
        inv_freq = (inv_freq / np.float32(rs.factor)).astype(np.float32)
    elif rs.rope_type == "llama3":
        old_len = rs.original_max_position_embeddings
        low_wavelen = old_len / rs.low_freq_factor
        high_wavelen = old_len / rs.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = np.where(wavelen > low_wavelen, inv_freq / rs.factor, inv_freq)
        smooth = (old_len / wavelen - rs.low_freq_factor) / (rs.high_freq_factor - rs.low_freq_factor)
        smoothed = (1 - smooth) * scaled / rs.factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        inv_freq = np.where(medium, smoothed, scaled).astype(np.float32)
    return inv_freq


def rotary_tables(positions: jax.Array, inv_freq: jax.Array) -> tuple[jax.Array, jax.Array]:
    """cos, sin of each token's angles: [T, 1, D/2] float32 each. Computed once per step and
    shared by every layer (recomputing them per layer costs a sin/cos per element each time)."""
    freqs = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]  # [T, D/2]
    return jnp.cos(freqs)[:, None, :], jnp.sin(freqs)[:, None, :]


def apply_rotary(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """x: [T, H, D]; cos, sin: [T, 1, D/2] from `rotary_tables` -> float32 [T, H, D]."""
    x = x.astype(jnp.float32)
    x1, x2 = jnp.split(x, 2, axis=-1)  # [T, H, D/2] each
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
