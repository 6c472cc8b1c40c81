"""Quantized KV caches: float8_e4m3fn ("fp8") and int8 pages with a scale per KV head.

A page holds `round(x / scale)` (int8: rounded to nearest and clipped to [-127, 127]; fp8:
clipped to the format's +-448 and rounded by the conversion); `x ~= scale * page`. A scale per
tensor is the same scale for every KV head. The models give a layer's scales as an array, an
input of the compiled step beside the weights (models/layers/attention.py's `KVCacheScale`,
set by runner/kv_scales.py: from the checkpoint, or measured), so one compiled step serves any
scales; a direct caller of the ops may give them as static numbers (a tuple) instead.

The scales never enter a kernel. Attention is linear in each key and each value, so

    q . (s_k k_q) = (s_k q) . k_q        sum_j p_j (s_v v_q_j) = s_v sum_j p_j v_q_j

per KV head: the K scale is folded into the query before the kernel (`scale_query`) and the V
scale into its output (`scale_output`). A kernel only reads quantized pages and converts them
to the query's dtype (`upcast`) before its products; the cache write takes values already
quantized (`quantize`). The softmax, the accumulators and the products stay float32 (or the
query's dtype on the MXU / tensor cores), as for float pages.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

FP8_DTYPE = jnp.dtype(jnp.float8_e4m3fn)
INT8_DTYPE = jnp.dtype(jnp.int8)
# The largest magnitude a page holds: e4m3fn's largest finite value, int8's symmetric range.
QUANT_MAX = {FP8_DTYPE: 448.0, INT8_DTYPE: 127.0}

# Per KV head or one value (per tensor): static numbers, or an array (a step's input); None: 1.0.
Scale = Sequence[float] | jax.Array | None


def is_quantized(dtype) -> bool:
    """Whether a cache of `dtype` holds scaled values (fp8, int8) rather than floats."""
    return jnp.dtype(dtype) in QUANT_MAX


def head_scales(scale: Scale, num_kv_heads: int) -> np.ndarray:
    """[num_kv_heads] float32: `scale` per KV head (None: ones; one value: the same for all)."""
    if scale is None:
        return np.ones(num_kv_heads, np.float32)
    s = np.asarray(scale, np.float32).reshape(-1)
    if s.size == 1:
        return np.full(num_kv_heads, s[0], np.float32)
    if s.size != num_kv_heads:
        raise ValueError(f"a KV scale has {s.size} values for {num_kv_heads} KV heads; expected "
                         "one per tensor or one per KV head")
    return s


def head_scale_array(scale: Scale, num_kv_heads: int) -> jax.Array:
    """[num_kv_heads] float32 as `head_scales`, for static numbers or an array (traced too)."""
    if not isinstance(scale, jax.Array):
        return jnp.asarray(head_scales(scale, num_kv_heads))
    s = scale.astype(jnp.float32).reshape(-1)
    if s.size not in (1, num_kv_heads):
        raise ValueError(f"a KV scale has {s.size} values for {num_kv_heads} KV heads; expected "
                         "one per tensor or one per KV head")
    return jnp.broadcast_to(s, (num_kv_heads,))


def quantize(x: jax.Array, scale: Scale, dtype) -> jax.Array:
    """x: [T, Hkv, D] floats -> the page values of `dtype` (x / scale, rounded and clipped)."""
    return quantize_scaled(x, head_scale_array(scale, x.shape[-2])[:, None], dtype)


def quantize_scaled(x: jax.Array, scale: jax.Array, dtype) -> jax.Array:
    """x floats -> the page values of `dtype`: x / scale (float32, `scale` broadcast against x:
    per KV head, or per column of a multi-head latent attention row), rounded and clipped."""
    dtype = jnp.dtype(dtype)
    y = x.astype(jnp.float32) / scale
    if dtype == INT8_DTYPE:
        y = jnp.round(y)
    lim = QUANT_MAX[dtype]
    return jnp.clip(y, -lim, lim).astype(dtype)


def dequantize(xq: jax.Array, scale: Scale) -> jax.Array:
    """Page values [..., Hkv, D] -> float32 `xq * scale`."""
    s = head_scale_array(scale, xq.shape[-2])[:, None]
    return xq.astype(jnp.float32) * s


def _per_query_head(scale: Scale, num_heads: int, num_kv_heads: int) -> jax.Array:
    # Query head h reads KV head h // (Hq // Hkv).
    return jnp.repeat(head_scale_array(scale, num_kv_heads), num_heads // num_kv_heads)


def scale_query(q: jax.Array, k_scale: Scale, num_kv_heads: int, dtype) -> jax.Array:
    """q [T, Hq, D] times its KV head's K scale (computed in float32), as `dtype`."""
    if k_scale is None:
        return q.astype(dtype)
    s = _per_query_head(k_scale, q.shape[1], num_kv_heads)[:, None]
    return (q.astype(jnp.float32) * s).astype(dtype)


def scale_output(out: jax.Array, v_scale: Scale, num_kv_heads: int) -> jax.Array:
    """Attention output [T, Hq, D] over V pages times its KV head's V scale."""
    if v_scale is None:
        return out
    s = _per_query_head(v_scale, out.shape[1], num_kv_heads)[:, None]
    return (out.astype(jnp.float32) * s).astype(out.dtype)


def upcast(x, dtype):
    """A kernel's tile of quantized page values as `dtype` (a no-op for float pages)."""
    return x.astype(dtype) if is_quantized(x.dtype) else x


def attention_dtype(cache_dtype, model_dtype):
    """The dtype queries are given to attention in: the cache's for a float cache, the
    model's for a quantized one."""
    return model_dtype if is_quantized(cache_dtype) else cache_dtype
