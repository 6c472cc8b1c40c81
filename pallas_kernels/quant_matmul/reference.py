"""The quantized product's semantics in plain JAX: dequantize the weight, then one dot (what
XLA runs on every backend without the kernel; on TPU it writes the dequantized weight to HBM
first, see `tpu.py`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxserve.pallas_kernels.mxfp4 import decode_e2m1, scale_by_e8m0


def unpack_rows(q: jax.Array) -> jax.Array:
    """[K / 2, N] uint8 -> [K, N] values 0..15: row 2r is byte r's low nibble, 2r + 1 its
    high nibble (each byte repeated and shifted by position: no transposes)."""
    doubled = jnp.repeat(q, 2, axis=0)
    shift = (jax.lax.broadcasted_iota(jnp.uint8, doubled.shape, 0) % 2) * 4
    return (doubled >> shift) & 15


def dequantize_rows(values: jax.Array, scale: jax.Array, zero: jax.Array | None,
                    dtype) -> jax.Array:
    """(values - zero) * scale in float32, each [G, N] scale row over K / G consecutive rows,
    then cast to `dtype`."""
    K, N = values.shape
    G = scale.shape[0]
    w = values.reshape(G, K // G, N).astype(jnp.float32)
    if zero is not None:
        w = w - zero.astype(jnp.float32)[:, None, :]
    return (w * scale.astype(jnp.float32)[:, None, :]).reshape(K, N).astype(dtype)


def decode_mxfp4_rows(codes: jax.Array, exponents: jax.Array, dtype) -> jax.Array:
    """e2m1 codes [K, N] (0..15) times 2^(e - 127) of their [G, N] e8m0 exponents' rows (each
    over K / G consecutive rows), exact, then cast to `dtype`."""
    K, N = codes.shape
    G = exponents.shape[0]
    w = scale_by_e8m0(decode_e2m1(codes).reshape(G, K // G, N), exponents[:, None, :])
    return w.reshape(K, N).astype(dtype)


def quant_matmul_reference(x: jax.Array, q: jax.Array, scale: jax.Array,
                           zero: jax.Array | None = None, *, packed: bool,
                           compute_dtype=jnp.bfloat16, mxfp4: bool = False) -> jax.Array:
    """x [M, K] @ dequant(q) -> float32 [M, N] (operands as in `ops.quant_matmul`). Per-channel
    scales without zeros (G = 1, unpacked) multiply the float32 result instead."""
    cdt = jnp.dtype(compute_dtype)
    values = unpack_rows(q) if packed else q
    if mxfp4:
        return jnp.dot(x.astype(cdt), decode_mxfp4_rows(values, scale, cdt),
                       preferred_element_type=jnp.float32)
    if not packed and zero is None and scale.shape[0] == 1:
        y = jnp.dot(x.astype(cdt), values.astype(cdt), preferred_element_type=jnp.float32)
        return y * scale.astype(jnp.float32)
    w = dequantize_rows(values, scale, zero, cdt)
    return jnp.dot(x.astype(cdt), w, preferred_element_type=jnp.float32)
