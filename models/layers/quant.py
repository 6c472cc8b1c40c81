"""Weight formats kept quantized on the device: FP8 (float8_e4m3fn), 4- and 8-bit integers.

A `WeightFormat` says how a model's matmul weights are stored: the values' kind and which
values share one scale. Scales (and int4 zeros) cover blocks of the weight as its checkpoint
laid them out ([out, in] rows): `in_block` values along the contracted dims and `out_block`
along the output dims (None: all of them; 1: one per channel). FP8 checkpoints publish
128x128 blocks (`fp8`), one scale per output channel or one per tensor (compressed-tensors);
AWQ and GPTQ one scale and one zero per group of `in_block` inputs and output channel.

int4 values (0..15, unsigned as AWQ and GPTQ store them) are packed two to a byte along the
weight's last contracted dim (element 2i in the low nibble, 2i + 1 in the high one), so a
device holds half a byte per weight; `unpack_int4` undoes it inside the compiled product.

MXFP4 (the OCP Microscaling format, as gpt-oss stores its MoE experts): 4-bit e2m1 codes
(sign, two exponent bits, one mantissa bit: +-{0, 0.5, 1, 1.5, 2, 3, 4, 6}) packed two to a
byte in the same nibble order as int4, and one e8m0 scale per block of `MXFP4_BLOCK` (32)
consecutive values along the contracted dim: a uint8 exponent e meaning 2^(e - 127), 255 NaN.
A weight is w = e2m1(code) * 2^(e - 127); no zeros. `decode_mxfp4` reads a checkpoint's
tensors as stored; `mxfp4_device_layout` lays them out as a `QuantizedWeight` keeps them
(codes and exponents stay uint8 on the device; `decode_e2m1` and `scale_by_e8m0`, defined with
the kernels in `pallas_kernels/mxfp4.py`, convert them inside the compiled product).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from jaxserve.models.weight_format import FP8_DTYPE, WeightFormat
from jaxserve.pallas_kernels.mxfp4 import MXFP4_BLOCK, decode_e2m1, scale_by_e8m0


FP8_MAX = float(ml_dtypes.finfo(ml_dtypes.float8_e4m3fn).max)  # 448
INT4_MAX = 15


# Values per group of `--quantization int4` (AWQ's usual 128 when it tiles the contracted dims).
INT4_GROUPS = (128, 64, 32)


def weight_format(cfg, quantization: str | None) -> WeightFormat | None:
    """The decoder layers' weight format: the checkpoint's own (`cfg.weight_format`), else
    `--quantization fp8` (float8_e4m3fn, a scale per output channel) or `int4` (a scale and
    zero per group of 128 inputs, or 64/32 where 128 does not tile every contracted dim),
    quantized as each tensor is placed; None for float and int8 weights."""
    if cfg.weight_format is not None:
        if quantization is not None and quantization != cfg.weight_format.kind:
            raise ValueError(f"this checkpoint is already quantized "
                             f"({cfg.weight_format.describe()}); --quantization {quantization} "
                             "does not apply to it: drop the option")
        return cfg.weight_format
    if quantization == "fp8":
        return WeightFormat("fp8", None, 1, source="load")
    if quantization == "int4":
        dims = (cfg.hidden_size, cfg.intermediate_size or cfg.hidden_size,
                cfg.num_heads * cfg.head_dim)
        group = next((g for g in INT4_GROUPS if all(d % g == 0 for d in dims)), None)
        if group is None:
            raise ValueError(f"--quantization int4 needs dims divisible by 32; got {dims}")
        return WeightFormat("int4", group, 1, source="load")
    return None


def pack_int4(values, axis: int):
    """uint8 values 0..15 -> two per byte along `axis` (numpy or jax; the axis' size is even)."""
    xp = np if isinstance(values, np.ndarray) else jnp
    n = values.shape[axis]
    if n % 2:
        raise ValueError(f"int4 packing needs an even dim; axis {axis} of {values.shape} is odd")
    v = xp.moveaxis(values.astype(xp.uint8), axis, -1)
    v = v.reshape(*v.shape[:-1], n // 2, 2)
    packed = v[..., 0] | (v[..., 1] << 4)
    return xp.moveaxis(packed.astype(xp.uint8), -1, axis)


def unpack_int4(packed, axis: int):
    """The inverse of `pack_int4` (uint8 0..15, the axis doubled). On jax arrays each byte is
    repeated and shifted by 0 or 4 by position, elementwise (no transposes), which XLA fuses
    into the product's operand: on v6e this halves the bytes the step's cost analysis counts
    for a stack and moveaxis of the two nibbles."""
    if isinstance(packed, np.ndarray):
        p = np.moveaxis(packed, axis, -1)
        both = np.stack([p & 15, p >> 4], axis=-1)
        return np.moveaxis(both.reshape(*p.shape[:-1], p.shape[-1] * 2), -1, axis)
    axis %= packed.ndim
    doubled = jnp.repeat(packed, 2, axis=axis)
    shift = (jax.lax.broadcasted_iota(jnp.uint8, doubled.shape, axis) % 2) * 4
    return (doubled >> shift) & 15


def quantize_fp8_blocks(w32, split: list[int]):
    """Scaled float8_e4m3fn values of float32 `w32` reshaped as `split` (each block's dims at
    odd positions): per block amax / 448. Returns (values, scales of the block grid)."""
    xp = np if isinstance(w32, np.ndarray) else jnp
    blocks = w32.reshape(split)
    amax = xp.max(xp.abs(blocks), axis=tuple(range(1, len(split), 2)), keepdims=True)
    scale = (amax / FP8_MAX).astype(xp.float32)
    safe = xp.where(scale == 0, xp.float32(1.0), scale)
    q = xp.clip(blocks / safe, -FP8_MAX, FP8_MAX).astype(FP8_DTYPE)
    return q.reshape(w32.shape), scale.reshape(split[0::2])


def quantize_int8_blocks(w32, split: list[int], asymmetric: bool = False):
    """8-bit values of `w32` per block: symmetric (scale = amax / 127, no zeros) or
    asymmetric (scale = (max - min) / 255, zero = round(-128 - min / scale)). Returns (int8
    values, scales, zeros as float32 or None)."""
    xp = np if isinstance(w32, np.ndarray) else jnp
    blocks = w32.reshape(split)
    axes = tuple(range(1, len(split), 2))
    grid = split[0::2]
    if not asymmetric:
        amax = xp.max(xp.abs(blocks), axis=axes, keepdims=True)
        scale = (amax / 127.0).astype(xp.float32)
        safe = xp.where(scale == 0, xp.float32(1.0), scale)
        q = xp.clip(xp.round(blocks / safe), -127, 127).astype(xp.int8)
        return q.reshape(w32.shape), scale.reshape(grid), None
    hi = xp.maximum(xp.max(blocks, axis=axes, keepdims=True), 0)
    lo = xp.minimum(xp.min(blocks, axis=axes, keepdims=True), 0)
    scale = ((hi - lo) / 255.0).astype(xp.float32)
    safe = xp.where(scale == 0, xp.float32(1.0), scale)
    zero = xp.clip(xp.round(-128 - lo / safe), -128, 127)
    q = xp.clip(xp.round(blocks / safe) + zero, -128, 127).astype(xp.int8)
    return q.reshape(w32.shape), scale.reshape(grid), zero.astype(xp.float32).reshape(grid)


def quantize_int4_blocks(w32, split: list[int]):
    """Asymmetric 4-bit values of `w32` per block (as AWQ quantizes: scale = (max - min) / 15,
    zero = round(-min / scale)). Returns (uint8 values 0..15, scales, zeros as float32)."""
    xp = np if isinstance(w32, np.ndarray) else jnp
    blocks = w32.reshape(split)
    axes = tuple(range(1, len(split), 2))
    hi = xp.max(blocks, axis=axes, keepdims=True)
    lo = xp.min(blocks, axis=axes, keepdims=True)
    scale = ((hi - lo) / INT4_MAX).astype(xp.float32)
    safe = xp.where(scale == 0, xp.float32(1.0), scale)
    zero = xp.clip(xp.round(-lo / safe), 0, INT4_MAX)
    q = xp.clip(xp.round(blocks / safe) + zero, 0, INT4_MAX).astype(xp.uint8)
    grid = split[0::2]
    return q.reshape(w32.shape), scale.reshape(grid), zero.astype(xp.float32).reshape(grid)


def decode_mxfp4(blocks, scales, dtype=np.float32):
    """A checkpoint's MXFP4 tensor pair -> its float weights [..., rows, in] in `dtype` (numpy
    or jax). `blocks`: uint8 [..., rows, in / 32, 16], each byte two e2m1 codes (value 2i in
    the low nibble, 2i + 1 in the high one); `scales`: uint8 [..., rows, in / 32], one e8m0
    exponent per block. gpt-oss stores its experts so: `mlp.experts.gate_up_proj_blocks`
    [experts, 2 * intermediate, hidden / 32, 16] with `gate_up_proj_scales` [experts,
    2 * intermediate, hidden / 32] (rows: gate and up interleaved, gate the even rows), and
    `down_proj_blocks` [experts, hidden, intermediate / 32, 16] with `down_proj_scales`; rows
    are output channels, as in a Linear weight (transformers transposes the result to [experts,
    in, out]). Every value is exact in float32 (an e2m1 value times a power of two) except
    beyond float32's range (inf) and, on jax arrays, below its normal range (zero). Exponent
    255 is NaN as the OCP spec says (transformers' `convert_moe_packed_tensors` ldexps by 128
    there: inf, or 0 for a zero code)."""
    _check_mxfp4(blocks, scales)
    codes = unpack_int4(blocks, axis=-1)  # [..., rows, in / 32, 32]
    w = scale_by_e8m0(decode_e2m1(codes), scales[..., None])
    return w.reshape(*blocks.shape[:-2], -1).astype(dtype)


def mxfp4_device_layout(blocks, scales):
    """A checkpoint's MXFP4 pair (`decode_mxfp4`'s layout) -> (codes uint8 [..., in / 2, rows],
    exponents uint8 [..., in / 32, rows]): the [..., in, out] weight a stacked expert's
    `dense` spec contracts over its second-last dim ("te,xef->txf"), packed along that dim
    (`packed_axis` -2, as int4 weights are) with one scale per block of 32 of it; the values
    of a `QuantizedWeight` with `mxfp4` set."""
    xp = np if isinstance(blocks, np.ndarray) else jnp
    _check_mxfp4(blocks, scales)
    packed = blocks.reshape(*blocks.shape[:-2], -1)  # [..., rows, in / 2]
    return (xp.swapaxes(packed, -1, -2).astype(xp.uint8),
            xp.swapaxes(scales, -1, -2).astype(xp.uint8))


def _check_mxfp4(blocks, scales) -> None:
    if blocks.ndim < 3 or blocks.shape[-1] != MXFP4_BLOCK // 2 or blocks.shape[:-1] != scales.shape:
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)} "
                         f"do not pair: blocks are [..., rows, in / 32, 16], scales "
                         f"[..., rows, in / 32]")


# e2m1 magnitudes' rounding boundaries (code k + 1 from the k-th on), and whether a value on
# one rounds up: ties go to the even code (0.75 -> 1.0, 1.75 -> 2, 3.5 -> 4; 2.5 -> 2, 5 -> 4).
_E2M1_BOUNDS = ((0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False),
                (3.5, True), (5.0, False))


def quantize_mxfp4(w32):
    """float32 weights [..., rows, in] (numpy or jax) -> MXFP4 in a checkpoint's layout
    (`decode_mxfp4`'s: blocks uint8 [..., rows, in / 32, 16], scales uint8 [..., rows,
    in / 32]), as the OCP spec quantizes: each block's exponent is floor(log2(amax)) - 2 (the
    largest e2m1 exponent), each value divided by it (exactly) and rounded to the nearest e2m1
    value, ties to even, magnitudes past 6 to 6. For weights made at random (tests, models
    created without a checkpoint); finite inputs only."""
    xp = np if isinstance(w32, np.ndarray) else jnp
    if w32.shape[-1] % MXFP4_BLOCK:
        raise ValueError(f"MXFP4 needs the last dim in blocks of {MXFP4_BLOCK}; got {w32.shape}")
    blocks = w32.astype(xp.float32).reshape(*w32.shape[:-1], -1, MXFP4_BLOCK)
    amax = xp.max(xp.abs(blocks), axis=-1)
    _, exp2 = xp.frexp(amax)  # amax = m * 2^exp2, m in [0.5, 1): floor(log2(amax)) = exp2 - 1
    e = xp.where(amax > 0, xp.clip(exp2.astype(xp.int32) - 1 - 2 + 127, 0, 254), 127)
    scaled = scale_by_e8m0(blocks, (254 - e).astype(xp.uint8)[..., None])  # / 2^(e - 127)
    mag = xp.abs(scaled)
    code = sum(((mag >= b) if up else (mag > b)).astype(xp.uint8) for b, up in _E2M1_BOUNDS)
    code = code | xp.where(xp.signbit(scaled), 8, 0).astype(xp.uint8)  # -0 stays -0
    return pack_int4(code, axis=code.ndim - 1), e.astype(xp.uint8)
