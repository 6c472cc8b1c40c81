"""MXFP4's primitives (the OCP Microscaling FP4 format: gpt-oss's MoE experts), numpy or JAX:
e2m1 codes to their values and e8m0 exponents to their powers of two. They sit with the
kernels, the lowest layer, so that the quantized product's reference and its Pallas kernel
decode as the model layers do (`models/layers/quant.py` builds the checkpoint layouts on
them).

An e2m1 code is 4 bits: a sign (bit 3), two exponent bits and one mantissa bit, the values
+-{0, 0.5, 1, 1.5, 2, 3, 4, 6}; an e8m0 exponent e is a uint8 meaning 2^(e - 127), 255 NaN;
one exponent covers `MXFP4_BLOCK` consecutive values.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

MXFP4_BLOCK = 32
E8M0_BIAS = 127
E8M0_NAN = 255
# The value of each e2m1 code (bit 3 the sign).
E2M1_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                        -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], np.float32)


def decode_e2m1(codes):
    """e2m1 codes (uint8 0..15; numpy or jax) -> their float32 values (E2M1_VALUES). On jax
    arrays the value's float32 bits are built from the code's fields, elementwise (no table
    gather), so XLA fuses the decoding into the product's operand."""
    if isinstance(codes, np.ndarray):
        return E2M1_VALUES[codes & 15]
    c = codes.astype(jnp.uint32) & 15
    sign = (c >> 3) << 31
    exp = (c >> 1) & 3
    man = c & 1
    # exponent field 0: 0 or 0.5 (0x3F000000); else 2^(exp - 1) * (1 + man / 2)
    normal = ((exp + 126) << 23) | (man << 22)
    magnitude = jnp.where(exp == 0, man * jnp.uint32(0x3F000000), normal)
    return jax.lax.bitcast_convert_type(sign | magnitude, jnp.float32)


def scale_by_e8m0(values, exponents):
    """float32 `values` times 2^(e - 127) for e8m0 exponents (uint8, broadcast against them;
    numpy or jax), NaN where e is 255: exact wherever the result is a float32 (inf past its
    range). On jax arrays the power of two is built from its bits (e << 23) and e = 0 takes
    2^-126 times a halved value, since the devices flush the subnormal 2^-127 (and any
    subnormal result: XLA:CPU, TPUs and GPUs alike) to zero."""
    if isinstance(values, np.ndarray):
        e = np.asarray(exponents).astype(np.int32)
        with np.errstate(over="ignore", invalid="ignore"):  # inf past float32; 255: NaN below
            w = values * np.ldexp(np.float32(1.0), e - E8M0_BIAS).astype(np.float32)
        return np.where(e == E8M0_NAN, np.float32(np.nan), w).astype(np.float32)
    e = exponents.astype(jnp.uint32)
    power = jax.lax.bitcast_convert_type(jnp.maximum(e, 1) << 23, jnp.float32)
    w = (values * jnp.where(e == 0, jnp.float32(0.5), jnp.float32(1.0))) * power
    return jnp.where(e == E8M0_NAN, jnp.float32(jnp.nan), w)
