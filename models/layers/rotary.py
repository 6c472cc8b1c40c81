"""Rotary position embeddings (HF "rotate_half" layout) and the RoPE scalings transformers
applies to the families here: linear, llama3, yarn, dynamic (NTK), longrope and proportional
(Gemma 4's full-attention layers: the whole head's pairs, the first fraction of them with
the usual frequencies, the others with frequency zero, i.e. passed through).

Static recipes (default, linear, llama3, yarn) are one table of inverse frequencies, a
compile-time constant. Two recipes depend on the length of the sequence, as transformers
computes them in `generate` (`dynamic_rope_update`: from the largest position + 1 in the
forward call): longrope takes its long factors once a sequence is longer than the original
pretraining length, dynamic NTK raises the base beyond `max_position_embeddings`. Here that
length is the request's `kv_lens` entry in the step (its cached context plus this step's
tokens), so a full prefill of a sequence gives transformers' own angles, and later tokens of a
request that crosses the length switch as transformers' cached generation does (earlier keys
stay as they were cached).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from jaxserve.models.arch_config import ArchConfig, RopeScaling
from jaxserve.pallas_kernels.ragged_paged_attention.metadata import (
    AttentionMetadata,
    token_request_index,
)


@dataclasses.dataclass(frozen=True)
class RopeSpec:
    """One RoPE table's recipe (static, hashable): a layer names the one it uses."""

    theta: float
    scaling: RopeScaling
    rotary_dim: int  # rotated dims of each head (head_dim unless partial)
    max_position_embeddings: int
    freq_factors: tuple[float, ...] = ()  # divisors of the inverse frequencies (GGUF rope_freqs)

    @property
    def per_request(self) -> bool:
        """Whether the angles depend on the request's length (longrope, dynamic)."""
        return self.scaling.rope_type in ("longrope", "dynamic")


def layer_rope_spec(cfg: ArchConfig, i: int) -> RopeSpec:
    theta, scaling = cfg.layer_rope(i)
    rotary_dim = int(cfg.layer_head_dim(i) * cfg.partial_rotary_factor)
    return RopeSpec(theta, scaling, rotary_dim, cfg.max_position_embeddings, cfg.rope_freq_factors)


def _base_inv_freq(theta: float | np.ndarray, dim: int) -> np.ndarray:
    exponent = np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / np.float32(dim)
    return (np.float32(1.0) / (np.float32(theta) ** exponent)).astype(np.float32)


def inverse_frequencies(cfg_or_spec: ArchConfig | RopeSpec, long: bool = False) -> np.ndarray:
    """[rotary_dim / 2] float32, computed as Hugging Face computes them (float32 throughout).
    `long`: longrope's table for sequences beyond the original length (else the short one);
    dynamic NTK gives its table within `max_position_embeddings` (see `rope_tables`)."""
    spec = cfg_or_spec if isinstance(cfg_or_spec, RopeSpec) else layer_rope_spec(cfg_or_spec, 0)
    dim, rs = spec.rotary_dim, spec.scaling
    inv_freq = _base_inv_freq(spec.theta, dim)
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
    elif rs.rope_type == "yarn":
        inv_freq = _yarn_inv_freq(spec)
    elif rs.rope_type == "proportional":  # the first fraction rotates; zero frequencies after it
        angles = int(rs.partial_rotary_factor * dim // 2)
        inv_freq = np.concatenate([inv_freq[:angles], np.zeros(dim // 2 - angles, np.float32)])
        inv_freq = (inv_freq / np.float32(rs.factor)).astype(np.float32)
    elif rs.rope_type == "longrope":
        factors = rs.long_factor if long else rs.short_factor
        if len(factors) != dim // 2:
            raise ValueError(f"longrope needs {dim // 2} short and long factors; got {len(factors)}")
        exponent = np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / np.float32(dim)
        inv_freq = (np.float32(1.0) / (np.asarray(factors, np.float32) * np.float32(spec.theta) ** exponent))
        inv_freq = inv_freq.astype(np.float32)
    if spec.freq_factors:
        if len(spec.freq_factors) != dim // 2:
            raise ValueError(f"rope_freq_factors has {len(spec.freq_factors)} entries; the RoPE has {dim // 2}")
        inv_freq = (inv_freq / np.asarray(spec.freq_factors, np.float32)).astype(np.float32)
    return inv_freq


def _yarn_inv_freq(spec: RopeSpec) -> np.ndarray:
    """transformers' `_compute_yarn_parameters` (inverse frequencies)."""
    rs, dim, base = spec.scaling, spec.rotary_dim, spec.theta

    def correction_dim(num_rotations: float) -> float:
        return (dim * math.log(rs.original_max_position_embeddings / (num_rotations * 2 * math.pi))) / (
            2 * math.log(base))

    low, high = correction_dim(rs.beta_fast), correction_dim(rs.beta_slow)
    if rs.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1).astype(np.float32)
    extrapolation = (1 - ramp).astype(np.float32)
    pos_freqs = (np.float32(base) ** (np.arange(0, dim, 2).astype(np.float32) / np.float32(dim))).astype(np.float32)
    inv_extra = (np.float32(1.0) / pos_freqs).astype(np.float32)
    inv_inter = (np.float32(1.0) / (np.float32(rs.factor) * pos_freqs)).astype(np.float32)
    return (inv_inter * (1 - extrapolation) + inv_extra * extrapolation).astype(np.float32)


def attention_factor(spec: RopeSpec) -> float:
    """The cos/sin multiplier of yarn and longrope (1 for the others)."""
    rs = spec.scaling
    if rs.attention_factor is not None and rs.rope_type in ("yarn", "longrope"):
        return float(rs.attention_factor)
    if rs.rope_type == "yarn":
        def mscale(scale: float, m: float = 1.0) -> float:
            return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

        if rs.mscale and rs.mscale_all_dim:
            return float(mscale(rs.factor, rs.mscale) / mscale(rs.factor, rs.mscale_all_dim))
        return mscale(rs.factor)
    if rs.rope_type == "longrope":
        if rs.factor <= 1.0:
            return 1.0
        return math.sqrt(1 + math.log(rs.factor) / math.log(rs.original_max_position_embeddings))
    return 1.0


def token_seq_lens(md: AttentionMetadata) -> jax.Array:
    """[T] int32: the length of each token's request once this step's tokens are in (its
    `kv_lens` entry)."""
    return md.kv_lens[token_request_index(md)]


def rope_tables(spec: RopeSpec, positions: jax.Array, md: AttentionMetadata | None = None
                ) -> tuple[jax.Array, jax.Array]:
    """cos, sin of each token's angles: [T, 1, rotary_dim / 2] float32 each, with yarn's and
    longrope's attention factor folded in. Computed once per step per distinct spec and shared
    by the layers using it (recomputing them per layer costs a sin/cos per element each time)."""
    pos = positions.astype(jnp.float32)[:, None]  # [T, 1]
    rs = spec.scaling
    if spec.per_request and md is None:
        raise ValueError(f"{rs.rope_type} RoPE needs the attention metadata (request lengths)")
    if rs.rope_type == "longrope":
        short, long = (jnp.asarray(inverse_frequencies(spec, long=b)) for b in (False, True))
        is_long = (token_seq_lens(md) > rs.original_max_position_embeddings)[:, None]
        freqs = pos * jnp.where(is_long, long[None, :], short[None, :])  # [T, R/2]
    elif rs.rope_type == "dynamic":
        dim, max_pos = spec.rotary_dim, spec.max_position_embeddings
        seq = jnp.maximum(token_seq_lens(md), max_pos).astype(jnp.float32)[:, None]  # [T, 1]
        base = np.float32(spec.theta) * ((np.float32(rs.factor) * seq / np.float32(max_pos))
                                         - np.float32(rs.factor - 1)) ** np.float32(dim / (dim - 2))
        exponent = jnp.asarray(np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / np.float32(dim))
        freqs = pos * (1.0 / base ** exponent[None, :])
    else:
        freqs = pos * jnp.asarray(inverse_frequencies(spec))[None, :]
    scale = attention_factor(spec)
    cos, sin = jnp.cos(freqs), jnp.sin(freqs)
    if scale != 1.0:
        cos, sin = cos * np.float32(scale), sin * np.float32(scale)
    return cos[:, None, :], sin[:, None, :]


def rotary_tables(positions: jax.Array, inv_freq: jax.Array) -> tuple[jax.Array, jax.Array]:
    """cos, sin of each token's angles for a fixed table: [T, 1, D/2] float32 each."""
    freqs = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]  # [T, D/2]
    return jnp.cos(freqs)[:, None, :], jnp.sin(freqs)[:, None, :]


def apply_rotary(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """x: [T, H, D]; cos, sin: [T, 1, R/2] (R <= D: only the first R dims of each head
    rotate, the rest pass through) -> float32 [T, H, D]."""
    x = x.astype(jnp.float32)
    rot = 2 * cos.shape[-1]
    x_rot, x_pass = (x, None) if rot == x.shape[-1] else (x[..., :rot], x[..., rot:])
    x1, x2 = jnp.split(x_rot, 2, axis=-1)  # [T, H, R/2] each
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out if x_pass is None else jnp.concatenate([out, x_pass], axis=-1)
