"""Pallas Mosaic TPU product on weights kept quantized: y = x @ dequant(W), reading the
quantized bytes from HBM and dequantizing them in VMEM.

Why a kernel. For a few rows of activations (decode), XLA's TPU compiler converts a quantized
weight in a fusion of its own before the dot: it writes the dequantized weight to HBM and
reads it back, so the product moves more bytes than a bfloat16 weight would
(docs/performance.md, "FP8 and int4 weights"). Here each grid step DMAs a tile of the stored
weight (uint8 bytes holding two int4 values, or float8_e4m3fn values) with its scales and zeros
into VMEM, converts it there and accumulates the product in the float32 output block, which
stays in VMEM across the contracted axis: HBM traffic is the stored bytes once per block of
rows, plus x once per block of outputs (`hbm_bytes`).

Operands (the op's 2-D form, `ops.quant_matmul`):
  x      [M, K]        activations
  q      [K/2, N] uint8, packed along K (row r: K index 2r in the low nibble, 2r + 1 in the
         high one, as `models/layers/quant.pack_int4` packs the last contracted dim), or
         [K, N] float8_e4m3fn (or int8)
  scale  [G, N] float32, a scale per group of g = K / G consecutive K indices and output column
  zero   [G, N] float32 or None (int4's zero points)
  MXFP4 (`mxfp4=True`): q packed as int4, holding e2m1 codes; scale uint8 e8m0 exponents,
         converted to float32 powers of two before the call (a [G, N] elementwise op; the
         exponent 0, 2^-127, a subnormal, reads as 0 on the chip). In the tile each nibble
         becomes its e2m1 value (selects on its fields, exact in bfloat16) where int4 converts
         its integer; the scaling modes are int4's, without zeros.

Nibbles without interleaving. A packed tile holds K's even indices in its low nibbles and the
odd ones in its high nibbles. Rather than interleave the two [tk/2, tn] halves back into K
order inside the kernel (a sublane shuffle), x's columns are split once outside it into its
even and odd columns (`[2, M, K/2]`, a few KiB for decode), and the tile contributes
x_even @ low + x_odd @ high. A group of g K indices is g/2 packed rows of both halves.

Scales, three ways (`tiling` picks; `mode` overrides):
- SCALE_OUTPUT (one scale per output channel, no zeros, unpacked: FP8 per channel): the tile
  is only converted; the float32 output is scaled once, after the last K step (as XLA's path).
- GROUP_SUMS (groups, few rows: decode): per weight value only a convert (and the nibble's
  mask or shift), no scale or zero. x's rows are laid out block-diagonally, one row block per
  group of the tile ([groups * tm, tk] with zeros outside each block's group), so one MXU
  product gives every group's partial sums; those are scaled and their zero terms
  (sum of x over the group times zero) subtracted on the [groups, tm, tn] result:
  y = sum_j s_j * (x_j @ q_j - sum(x_j) * z_j). The MXU takes groups x more rows, which a
  decode step's 8-32 rows leave room for (`GROUP_SUM_ROWS`); the VPU, which would otherwise
  bound the kernel (a subtract, a multiply and a cast per weight value), does a few ops per
  value.
- DEQUANTIZE (more rows): each weight value is dequantized, (q - zero) * scale in float32
  rounded to the compute dtype (as XLA's path rounds it), then one product.
Products take the compute dtype (bfloat16 on the MXU; float32 at HIGHEST precision) and
accumulate in float32.

Grid: (M / tm, N / tn, K / tk), the contracted axis last ("arbitrary"), the others
"parallel". Blocks respect Mosaic's tiling: tn a multiple of 128 lanes, tk / 2 (x's lane dim)
a multiple of 128 (so the packed uint8 rows, tiled by 32, are too), tk / g a multiple of 8
(the scales' sublanes); a dim that no such block divides is taken whole (always legal). tm is
M itself up to `MAX_BLOCK_M` rows (padded to a multiple of 8 for group sums), else
`MAX_BLOCK_M` with M padded. Block sizes are untuned: no TPU has run the kernel yet.

HBM operands. The weight, scales and zeros are constrained to HBM
(`pltpu.with_memory_space_constraint`): the kernel streams their tiles itself, overlapping
the DMAs with its products. Left free, XLA's memory-space assignment copies each whole weight
into VMEM ahead of the call (seen in a compiled Llama-3-8B layer for v6e): the same HBM reads,
but tens of MiB of VMEM held, and XLA's cost analysis counts the copy besides the kernel.
XLA's cost analysis cannot see inside a Mosaic call: the kernel states its bytes and flops
(`pl.CostEstimate`, from `hbm_bytes`).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from jaxserve.pallas_kernels.mxfp4 import scale_by_e8m0

_F32 = jnp.float32
LANES = 128
# Default tiles. tn: up to 2048 output columns (1024 where the whole tile is dequantized, whose
# float32 temporaries grow with it); tk: up to 1024 K indices (512 KiB of packed int4 or 1 MiB
# of FP8 in a 1024 x 1024 tile).
BLOCK_N = 2048
BLOCK_N_DEQUANTIZE = 1024
BLOCK_K = 1024
MAX_BLOCK_M = 512
# Group sums (below) while the block-diagonal activations have at most this many rows.
GROUP_SUM_ROWS = 512

# How a tile's products take their scales:
SCALE_OUTPUT = "scale_output"  # one scale per channel: on the output, after the last K step
GROUP_SUMS = "group_sums"  # one product row per group, each scaled on the output (decode)
DEQUANTIZE = "dequantize"  # the tile dequantized element by element, then one product


def _divisor_block(n: int, preferred: int, multiple: int) -> int:
    """The largest multiple of `multiple` dividing `n` and at most `preferred`; `n` (the whole
    dim: always a legal block) when there is none."""
    b = (min(preferred, n) // multiple) * multiple
    while b >= multiple:
        if n % b == 0:
            return b
        b -= multiple
    return n


@dataclasses.dataclass(frozen=True)
class Tiling:
    tm: int  # rows of x per block (M is padded to a multiple)
    tn: int  # output columns per block
    tk: int  # K indices per block (tk / 2 packed rows)
    mode: str  # SCALE_OUTPUT, GROUP_SUMS or DEQUANTIZE
    group_rows: int  # q rows (packed rows for int4) a scale row covers inside one tile
    packed: bool  # int4, two values a byte

    @property
    def q_rows(self) -> int:
        return self.tk // 2 if self.packed else self.tk

    @property
    def groups_per_tile(self) -> int:
        return self.q_rows // self.group_rows


def tiling(M: int, K: int, N: int, groups: int, packed: bool, has_zero: bool, *,
           block_m: int | None = None, block_n: int | None = None,
           block_k: int | None = None, mode: str | None = None) -> Tiling:
    """The blocks and the scaling mode for these shapes (each knob overrides its default)."""
    g = K // groups
    # x's K block is tk / 2 (packed) or tk lanes: a multiple of 128; 8 groups (scale sublanes).
    lane_k = 2 * LANES if packed else LANES
    step = math.lcm(lane_k, 8 * g) if groups > 1 else lane_k
    tk = block_k or _divisor_block(K, max(BLOCK_K, step), step)
    grouped = groups > 1 and tk > g  # several scale rows inside one tile
    q_rows = tk // 2 if packed else tk
    group_rows = (g // 2 if packed else g) if grouped else q_rows
    if mode is None:
        if not packed and not has_zero and groups == 1:
            mode = SCALE_OUTPUT
        else:
            rows = -(-min(M, MAX_BLOCK_M) // 8) * 8 * (q_rows // group_rows)
            mode = GROUP_SUMS if rows <= GROUP_SUM_ROWS else DEQUANTIZE
    if block_m:
        tm = block_m
    elif mode == GROUP_SUMS:  # block-diagonal rows are stacked in whole sublane tiles
        tm = -(-M // 8) * 8
    else:
        tm = M if M <= MAX_BLOCK_M else MAX_BLOCK_M
    tn = block_n or _divisor_block(N, BLOCK_N_DEQUANTIZE if mode == DEQUANTIZE else BLOCK_N,
                                   LANES)
    return Tiling(tm, tn, tk, mode, group_rows, packed)


def validate(M: int, K: int, N: int, groups: int, t: Tiling) -> None:
    """Raise ValueError for blocks the kernel (or Mosaic's tiling) cannot take."""
    tm, tn, tk, packed = t.tm, t.tn, t.tk, t.packed
    if K % groups or N % tn or K % tk or (packed and (tk % 2 or K % 2)):
        raise ValueError(f"blocks (tk={tk}, tn={tn}) do not tile K={K}, N={N} ({groups} groups)")
    g = K // groups
    if groups > 1 and tk % g:
        raise ValueError(f"tk={tk} must hold whole groups of {g}")
    if packed and g % 2:
        raise ValueError(f"int4 groups must be even (two values a byte); got {g}")
    if tn != N and tn % LANES:
        raise ValueError(f"tn={tn} must be a multiple of {LANES} or N={N}")
    if tk != K and t.q_rows % LANES:
        raise ValueError(f"tk={tk} must give x blocks of a multiple of {LANES} lanes")
    if groups > 1 and tk != K and t.groups_per_tile > 1 and t.groups_per_tile % 8:
        raise ValueError(f"tk={tk} must hold a multiple of 8 groups of {g} (scale sublanes)")
    if t.mode == SCALE_OUTPUT and (packed or groups > 1):
        raise ValueError("scales on the output need one scale per channel and no packing")
    if t.mode == GROUP_SUMS and tm % 8:
        raise ValueError(f"group sums need tm={tm} to be a multiple of 8")
    if tm != M and tm % 8:
        raise ValueError(f"tm={tm} must be a multiple of 8 or M={M}")


def _dequantize(v, s, z, group_rows: int, cdt):
    """(v - zero) * scale for a [rows, tn] float32 tile whose row groups of `group_rows` share
    a row of the [rows / group_rows, tn] scales `s` (and zeros `z`), in `cdt`."""
    rows, tn = v.shape
    if group_rows == rows:  # one scale row for the tile: a row broadcast
        return ((v if z is None else v - z) * s).astype(cdt)
    v = v.reshape(rows // group_rows, group_rows, tn)
    if z is not None:
        v = v - z[:, None, :]
    return (v * s[:, None, :]).reshape(rows, tn).astype(cdt)


def _block_diagonal(x, groups: int, group_rows: int):
    """[tm, kq] activations -> float32 [groups * tm, kq]: row block j keeps only the columns of
    K group j (zeros elsewhere), so one product with the tile gives each group's partial sums."""
    tm, kq = x.shape
    xb = jnp.broadcast_to(x.astype(_F32)[None], (groups, tm, kq))
    j = lax.broadcasted_iota(jnp.int32, xb.shape, 0) * group_rows
    col = lax.broadcasted_iota(jnp.int32, xb.shape, 2)
    keep = (col >= j) & (col < j + group_rows)
    return jnp.where(keep, xb, 0.0).reshape(groups * tm, kq)


def _e2m1(codes):
    """int32 e2m1 codes 0..15 -> float32 values (+-{0, 0.5, 1, 1.5, 2, 3, 4, 6}), with selects
    and integer ops only (no table, no bitcast) inside the kernel."""
    exp = (codes >> 1) & 3
    half = (codes & 1).astype(_F32) * 0.5
    power = jnp.where(exp == 3, 4.0, jnp.where(exp == 2, 2.0, 1.0)).astype(_F32)
    magnitude = jnp.where(exp == 0, half, (1.0 + half) * power)
    return jnp.where((codes & 8) != 0, -magnitude, magnitude)


def _kernel(x_ref, q_ref, s_ref, *rest, packed: bool, has_zero: bool, t: Tiling, cdt,
            mxfp4: bool = False):
    z_ref = rest[0] if has_zero else None
    o_ref = rest[-1]
    k = pl.program_id(2)
    precision = lax.Precision.HIGHEST if cdt == _F32 else None
    dot = functools.partial(lax.dot_general, dimension_numbers=(((1,), (0,)), ((), ())),
                            precision=precision, preferred_element_type=_F32)

    @pl.when(k == 0)
    def _():
        o_ref[...] = jnp.zeros(o_ref.shape, _F32)

    if packed:  # (x's even columns, low nibbles), (x's odd columns, high nibbles)
        p = q_ref[...].astype(jnp.int32)  # [tk / 2, tn], bytes 0..255
        halves = ((x_ref[0], p & 15), (x_ref[1], p >> 4))
        if mxfp4:
            halves = tuple((xh, _e2m1(qh)) for xh, qh in halves)
    else:
        halves = ((x_ref[...], q_ref[...]),)
    s = s_ref[...]
    z = None if z_ref is None else z_ref[...]

    if t.mode == SCALE_OUTPUT:
        o_ref[...] += dot(halves[0][0].astype(cdt), halves[0][1].astype(cdt))

        @pl.when(k == pl.num_programs(2) - 1)
        def _():
            o_ref[...] *= s
    elif t.mode == DEQUANTIZE:
        for xh, qh in halves:
            o_ref[...] += dot(xh.astype(cdt), _dequantize(qh.astype(_F32), s, z, t.group_rows, cdt))
    else:  # GROUP_SUMS: sum_j s_j * (x_j @ q_j - sum(x_j) * z_j), per weight value only a convert
        G, tm, tn = t.groups_per_tile, x_ref.shape[-2], o_ref.shape[1]
        part = jnp.zeros((G * tm, tn), _F32)
        xsum = jnp.zeros((G * tm, 1), _F32)
        for xh, qh in halves:
            xd = _block_diagonal(xh, G, t.group_rows)
            part += dot(xd.astype(cdt), qh.astype(cdt))
            if z is not None:
                xsum += jnp.sum(xd, axis=1, keepdims=True)  # x is in cdt already
        part = part.reshape(G, tm, tn)
        if z is not None:
            part = part - xsum.reshape(G, tm, 1) * z[:, None, :]
        o_ref[...] += jnp.sum(part * s[:, None, :], axis=0)


def quant_matmul_tpu(x: jax.Array, q: jax.Array, scale: jax.Array, zero: jax.Array | None = None,
                     *, packed: bool, compute_dtype=jnp.bfloat16, block_m: int | None = None,
                     block_n: int | None = None, block_k: int | None = None,
                     mode: str | None = None, vmem_limit_bytes: int | None = None,
                     interpret: bool = False, mxfp4: bool = False) -> jax.Array:
    """The op (see `ops.quant_matmul`) as a Pallas Mosaic TPU kernel: float32 [M, N].

    Tuning: `block_m`, `block_n`, `block_k` (tk in K indices), `mode` (see `tiling`),
    `vmem_limit_bytes`. `interpret=True` runs it in TPU interpret mode (any backend)."""
    cdt = jnp.dtype(compute_dtype)
    if mxfp4:
        if not packed or zero is not None:
            raise ValueError("MXFP4 operands are packed codes and exponents, without zeros")
        scale = scale_by_e8m0(jnp.ones(scale.shape, _F32), scale)
    M, K = x.shape
    N = q.shape[1]
    G = scale.shape[0]
    if q.shape[0] * (2 if packed else 1) != K or scale.shape != (G, N) or (
            zero is not None and zero.shape != (G, N)) or K % G:
        raise ValueError(f"shapes do not match: x {x.shape}, q {q.shape} (packed={packed}), "
                         f"scale {scale.shape}, zero {None if zero is None else zero.shape}")
    t = tiling(M, K, N, G, packed, zero is not None, block_m=block_m, block_n=block_n,
               block_k=block_k, mode=mode)
    validate(M, K, N, G, t)
    tm, tn, tk, kq = t.tm, t.tn, t.tk, t.q_rows
    Mp = pl.cdiv(M, tm) * tm
    x = x.astype(cdt)
    if Mp != M:
        x = jnp.pad(x, ((0, Mp - M), (0, 0)))
    if packed:  # x's even and odd columns, matching the low and high nibbles
        x = jnp.stack([x[:, 0::2], x[:, 1::2]])  # [2, Mp, K / 2]
        x_spec = pl.BlockSpec((2, tm, kq), lambda i, j, k: (0, i, k))
    else:
        x_spec = pl.BlockSpec((tm, tk), lambda i, j, k: (i, k))
    if G > 1:  # the scale rows of the block's groups
        sz_spec = pl.BlockSpec((tk // (K // G), tn), lambda i, j, k: (k, j))
    else:
        sz_spec = pl.BlockSpec((1, tn), lambda i, j, k: (0, j))
    in_specs = [x_spec, pl.BlockSpec((kq, tn), lambda i, j, k: (k, j)), sz_spec]
    operands = [x, q, scale.astype(_F32)]
    if zero is not None:
        in_specs.append(sz_spec)
        operands.append(zero.astype(_F32))
    if not interpret:  # the kernel streams them (module docstring: HBM operands)
        operands[1:] = [pltpu.with_memory_space_constraint(a, pltpu.HBM) for a in operands[1:]]
    kernel = functools.partial(_kernel, packed=packed, has_zero=zero is not None, t=t, cdt=cdt,
                               mxfp4=mxfp4)
    y = pl.pallas_call(
        kernel,
        grid=(Mp // tm, N // tn, K // tk),
        in_specs=in_specs,
        out_specs=pl.BlockSpec((tm, tn), lambda i, j, k: (i, j)),
        out_shape=jax.ShapeDtypeStruct((Mp, N), _F32),
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "arbitrary"),
            vmem_limit_bytes=vmem_limit_bytes),
        interpret=interpret,
        # XLA's cost analysis cannot see inside a Mosaic call: the kernel states its own.
        cost_estimate=pl.CostEstimate(
            flops=2 * Mp * K * N, transcendentals=0,
            bytes_accessed=hbm_bytes(t, Mp, K, N, G, q.dtype.itemsize, cdt.itemsize,
                                     zero is not None)),
        name="quant_matmul_tpu",
    )(*operands)
    return y[:M] if Mp != M else y


def hbm_bytes(t: Tiling, M: int, K: int, N: int, groups: int, q_itemsize: int,
              x_itemsize: int, has_zero: bool) -> int:
    """The bytes the kernel's block DMAs move between HBM and VMEM: the weight, its scales and
    zeros once per block of rows, x once per block of outputs, the float32 output once."""
    m_blocks, n_blocks = pl.cdiv(M, t.tm), N // t.tn
    weight = (K // 2 if t.packed else K) * N * q_itemsize
    scales = groups * N * 4 * (2 if has_zero else 1)
    return (m_blocks * (weight + scales) + n_blocks * m_blocks * t.tm * K * x_itemsize
            + m_blocks * t.tm * N * 4)
