"""MXFP4 weights (gpt-oss's experts): the decoder against a table-driven reference written from
the OCP Microscaling spec, over every code in both nibbles and every e8m0 exponent; the packed
device weight's product against the decoded weights' product; the experts of the MoE layer
kept as MXFP4 against the dense MoE on the decoded weights; the quantized product's Pallas
kernel (TPU interpreter) on MXFP4 operands against the reference; the quantizer (floats to
MXFP4) against a brute-force nearest value."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flax import nnx
from jaxserve.models.layers.linear import (
    SCALE_SUFFIX,
    QuantizedParam,
    QuantizedProduct,
    QuantizedWeight,
    dense,
    mxfp4_weight,
    param_weight,
)
from jaxserve.models.layers.moe import experts_dense, experts_grouped, moe_mlp, route
from jaxserve.models.layers.quant import decode_mxfp4, mxfp4_device_layout, quantize_mxfp4
from jaxserve.pallas_kernels.quant_matmul import ops, tpu
from jaxserve.parallel.mesh import make_mesh

# OCP MX spec v1.0: FP4 E2M1 magnitudes by code 0..7 (code 8..15: the same, negative) and the
# E8M0 scale 2^(e - 127) with 255 NaN; written out here, independent of the decoder's table.
SPEC_E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def spec_value(code: int, exponent: int) -> float:
    magnitude = SPEC_E2M1[code & 7]
    value = -magnitude if code & 8 else magnitude
    if exponent == 255:
        return float("nan")
    return value * 2.0 ** (exponent - 127)  # exact in float64


def spec_decode(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """[..., rows, in / 32, 16] bytes (value 2i: low nibble, 2i + 1: high) -> float32 [..., rows,
    in], one value at a time (float64, then rounded once to float32: inf past its range)."""
    out = np.empty(blocks.shape[:-1] + (32,), np.float64)
    for idx in np.ndindex(blocks.shape):
        byte, e = int(blocks[idx]), int(scales[idx[:-1]])
        out[idx[:-1] + (2 * idx[-1],)] = spec_value(byte & 15, e)
        out[idx[:-1] + (2 * idx[-1] + 1,)] = spec_value(byte >> 4, e)
    with np.errstate(over="ignore"):
        return out.astype(np.float32).reshape(*blocks.shape[:-2], -1)


def every_code_and_exponent():
    """Blocks [256, 2, 16] and scales [256, 2]: row e's first block has exponent e, its second
    (e + 101) % 256; each block holds all 16 codes in the low nibbles and all 16 in the high
    ones (in different pairings)."""
    j = np.arange(16)
    first = j | (((7 * j + 3) % 16) << 4)
    second = ((5 * j + 1) % 16) | (j << 4)
    blocks = np.broadcast_to(np.stack([first, second]), (256, 2, 16)).astype(np.uint8)
    e = np.arange(256)
    scales = np.stack([e, (e + 101) % 256], axis=1).astype(np.uint8)
    return blocks, scales


def assert_bits_equal(got: np.ndarray, want: np.ndarray) -> None:
    """Equal bit for bit (the sign of zero included); NaN where NaN (any payload)."""
    assert got.dtype == want.dtype == np.float32 and got.shape == want.shape
    nan = np.isnan(want)
    np.testing.assert_array_equal(np.isnan(got), nan)
    np.testing.assert_array_equal(got.view(np.uint32)[~nan], want.view(np.uint32)[~nan])


def flushed(want: np.ndarray) -> np.ndarray:
    """`want` with subnormals flushed to (signed) zero, as the devices compute."""
    tiny = np.finfo(np.float32).tiny
    sub = (want != 0) & (np.abs(want) < tiny)
    return np.where(sub, np.copysign(np.float32(0), want), want).astype(np.float32)


def test_numpy_decoder_is_the_spec_bit_for_bit():
    blocks, scales = every_code_and_exponent()
    want = spec_decode(blocks, scales)
    assert want.shape == (256, 64)
    # the table covers the corners: NaN, inf past float32's range, subnormals, signed zeros
    assert np.isnan(want).any() and np.isinf(want).any() and (np.signbit(want) & (want == 0)).any()
    assert ((want != 0) & (np.abs(want) < np.finfo(np.float32).tiny)).any()
    assert_bits_equal(decode_mxfp4(blocks, scales), want)


def test_jax_decoder_is_the_spec_bit_for_bit():
    """Jitted, on jax arrays: bit-exact except subnormals, which the device flushes to zero."""
    blocks, scales = every_code_and_exponent()
    want = spec_decode(blocks, scales)
    got = np.asarray(jax.jit(decode_mxfp4)(jnp.asarray(blocks), jnp.asarray(scales)))
    assert_bits_equal(got, flushed(want))
    # gpt-oss's scales sit far inside the normal range: there nothing is flushed
    normal = (scales >= 2).all(axis=1)
    assert_bits_equal(got[normal], want[normal])


def test_decoder_layouts_and_dtypes():
    """A stacked tensor [experts, rows, in / 32, 16] decodes to [experts, rows, in] (row r's
    block b holds inputs 32b .. 32b + 31); bfloat16 holds every value of the normal range
    exactly; mismatched blocks and scales are refused."""
    rng = np.random.default_rng(0)
    blocks = rng.integers(0, 256, (3, 5, 2, 16), dtype=np.uint8)
    scales = rng.integers(118, 134, (3, 5, 2), dtype=np.uint8)
    want = spec_decode(blocks, scales)
    assert want.shape == (3, 5, 64)
    assert_bits_equal(decode_mxfp4(blocks, scales), want)
    to_bfloat16 = jax.jit(lambda b, s: decode_mxfp4(b, s, jnp.bfloat16))
    got = to_bfloat16(jnp.asarray(blocks), jnp.asarray(scales))
    assert got.dtype == jnp.bfloat16
    assert_bits_equal(np.asarray(got.astype(jnp.float32)), want)
    q, e = mxfp4_device_layout(blocks, scales)
    assert q.shape == (3, 32, 5) and e.shape == (3, 2, 5) and q.dtype == e.dtype == np.uint8
    np.testing.assert_array_equal(q[1, 7, 4], blocks[1, 4, 0, 7])
    np.testing.assert_array_equal(e[2, 1, 3], scales[2, 3, 1])
    with pytest.raises(ValueError, match="do not pair"):
        decode_mxfp4(blocks, scales[..., :1])
    with pytest.raises(ValueError, match="do not pair"):
        decode_mxfp4(blocks[..., :8], scales)


def checkpoint_pair(rng, lead, rows, inputs, exponents=(119, 128)):
    """Random `*_blocks` [*lead, rows, inputs / 32, 16] and `*_scales` as a checkpoint holds."""
    blocks = rng.integers(0, 256, (*lead, rows, inputs // 32, 16), dtype=np.uint8)
    scales = rng.integers(*exponents, (*lead, rows, inputs // 32), dtype=np.uint8)
    return blocks, scales


def device_weight(blocks, scales, compute_dtype="float32"):
    """(the packed device weight [*lead, in, out], its decoded float32 weights)."""
    q, e = mxfp4_device_layout(blocks, scales)
    w = mxfp4_weight(jnp.asarray(q), jnp.asarray(e), compute_dtype)
    return w, np.swapaxes(decode_mxfp4(blocks, scales), -1, -2)


def test_packed_weight_product_equals_the_decoded_weights_product():
    """A [K, N] and a stacked [X, K, N] MXFP4 weight keep their uint8 bytes (4.25 bits a
    weight); `dense` on them equals the product on the decoded float32 weights exactly (and
    in bfloat16, the decoded weights cast to bfloat16: every value is exact there)."""
    rng = np.random.default_rng(1)
    w, w32 = device_weight(*checkpoint_pair(rng, (), 48, 96))
    assert w.shape == (96, 48) and w.q.shape == (48, 48) and w.scale.shape == (3, 48)
    assert w.q.dtype == w.scale.dtype == jnp.uint8 and w.packed_axis == 0 and w.mxfp4
    np.testing.assert_array_equal(np.asarray(jax.jit(QuantizedWeight.dequantize)(w)), w32)
    x = jnp.asarray(rng.standard_normal((5, 96)), jnp.float32)
    got = jax.jit(lambda x, w: dense("te,ef->tf", x, w))(x, w)
    want = jnp.einsum("te,ef->tf", x, jnp.asarray(w32), preferred_element_type=jnp.float32)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))

    wb, wb32 = device_weight(*checkpoint_pair(rng, (3,), 32, 64), compute_dtype="bfloat16")
    assert wb.shape == (3, 64, 32) and wb.packed_axis == 1
    xs = jnp.asarray(rng.standard_normal((7, 64)), jnp.float32)
    got = jax.jit(lambda x, w: dense("te,xef->txf", x, w))(xs, wb)
    want = jnp.einsum("te,xef->txf", xs.astype(jnp.bfloat16), jnp.asarray(wb32, jnp.bfloat16),
                      preferred_element_type=jnp.float32)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    with pytest.raises(ValueError, match="do not match"):
        mxfp4_weight(wb.q, wb.scale[:, :1])


def test_a_module_parameter_reads_back_as_an_mxfp4_weight():
    """A `QuantizedParam` with metadata `mxfp4` and its uint8 exponents as the scale parameter
    (what a loader places) reads back, through `param_weight`, as the same packed weight."""
    rng = np.random.default_rng(2)
    w, w32 = device_weight(*checkpoint_pair(rng, (2,), 16, 32))
    module = nnx.Module()
    module.w_down = QuantizedParam(w.q, spec="txf,xfe->txe", compute_dtype="float32",
                                   packed_axis=1, mxfp4=True)
    setattr(module, "w_down" + SCALE_SUFFIX, nnx.Param(w.scale))
    got = param_weight(module, "w_down")
    assert isinstance(got, QuantizedWeight) and got.mxfp4 and got.packed_axis == 1
    np.testing.assert_array_equal(np.asarray(jax.jit(QuantizedWeight.dequantize)(got)), w32)


def moe_problem(seed, T=19, E=64, F=64, X=8, k=2):
    """Tokens, routing and the experts as gpt-oss stores them (gate and up [X, F, E / 32, 16],
    down [X, E, F / 32, 16]): (x, weights, ids, packed weights, decoded float32 weights)."""
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((T, E)), jnp.float32)
    logits = jnp.asarray(rng.standard_normal((T, X)), jnp.float32)
    weights, ids = route(logits, k, normalize=True)
    pairs = [checkpoint_pair(rng, (X,), rows, inputs, (118, 124))
             for rows, inputs in ((F, E), (F, E), (E, F))]
    packed, decoded = zip(*(device_weight(*p) for p in pairs))
    return x, weights, ids, packed, [jnp.asarray(d) for d in decoded], logits


def test_moe_experts_as_mxfp4_equal_the_dense_moe_on_the_decoded_weights():
    """gate, up and down kept as MXFP4: the dense form equals the dense MoE on the decoded
    weights exactly; the grouped forms (ragged, tiled: one expert's bytes decoded per pair)
    agree with it to float32 rounding."""
    x, weights, ids, packed, decoded, _ = moe_problem(0)
    assert packed[0].q.shape == (8, 32, 64) and packed[2].scale.shape == (8, 2, 64)
    dense_both = jax.jit(lambda *a: (experts_dense(*a[:3], *a[3:6]), experts_dense(*a[:3], *a[6:])))
    got, want = (np.asarray(y) for y in dense_both(x, weights, ids, *packed, *decoded))
    assert np.abs(want).max() > 0.05
    np.testing.assert_array_equal(got, want)
    grouped = jax.jit(lambda *a: [experts_grouped(*a, impl=impl) for impl in ("ragged", "tiled")])
    for got in grouped(x, weights, ids, *packed):
        np.testing.assert_allclose(np.asarray(got), want, atol=2e-5, rtol=1e-5)


def test_sharded_mxfp4_moe_equals_one_device():
    """8 simulated devices: the packed experts split over their expert dim (one each), or
    each expert's intermediate dim split (the exponents' blocks with it: F / 32 = 8 blocks);
    the MoE block equals the unsharded one on the decoded weights."""
    assert len(jax.devices()) >= 8
    x, _, _, packed, decoded, logits = moe_problem(1, F=256)
    mesh = make_mesh(1, 8)
    run = dict(top_k=2, normalize=True, impl="dense")
    want = jax.jit(lambda x, logits, *w: moe_mlp(x, logits, *w, mesh=None, expert_axis=None,
                                                 mlp_axis=None, **run))(x, logits, *decoded)

    def both(x, logits, *w):
        return [moe_mlp(x, logits, *w, mesh=mesh, expert_axis=e, mlp_axis=m, **run)
                for e, m in (("model", None), (None, "model"))]

    for got in jax.jit(both)(x, logits, *packed):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("M,blocks", [
    (8, dict(block_n=128)),  # decode rows: group sums, 2 N blocks
    (20, dict(block_m=8, block_k=256, mode=tpu.DEQUANTIZE)),  # tiles dequantized, 3 x 2 blocks
])
def test_quant_matmul_kernel_takes_mxfp4(M, blocks):
    """The Pallas kernel (interpreted) on packed codes and uint8 exponents equals the reference
    (the decoded weights' dot) and a float64 product of the decoded weights; `dense` on a weight
    marked with the kernel takes it (the product's plumbing: exponents as [G, N] rows)."""
    rng = np.random.default_rng(M)
    w, w32 = device_weight(*checkpoint_pair(rng, (), 256, 512, (118, 124)))
    x = jnp.asarray(rng.standard_normal((M, 512)), jnp.float32)
    exact = np.asarray(x, np.float64) @ w32.astype(np.float64)
    args = (x, w.q, w.scale)
    run = jax.jit(lambda *a: ops.quant_matmul(*a, packed=True, compute_dtype=jnp.float32,
                                              impl="reference", mxfp4=True))
    want = np.asarray(run(*args))
    got = np.asarray(jax.jit(lambda *a: tpu.quant_matmul_tpu(
        *a, packed=True, compute_dtype=jnp.float32, interpret=True, mxfp4=True, **blocks))(*args))
    scale = np.abs(exact).max()
    np.testing.assert_allclose(want, exact, atol=1e-5 * scale, rtol=0)
    np.testing.assert_allclose(got, want, atol=1e-5 * scale, rtol=0)
    if M == 8:
        assert tpu.tiling(M, 512, 256, 16, True, False, **blocks).mode == tpu.GROUP_SUMS
        marked = QuantizedWeight(w.q, w.scale, "float32", packed_axis=0, mxfp4=True,
                                 product=QuantizedProduct("tpu-interpret"))
        got = jax.jit(lambda x, w: dense("te,ef->tf", x, w))(x, marked)
        np.testing.assert_allclose(np.asarray(got), want, atol=1e-5 * scale, rtol=0)
        with pytest.raises(ValueError, match="MXFP4 operands"):
            ops.quant_matmul(*args[:2], w.scale.astype(jnp.float32), packed=True, mxfp4=True)


def test_quantizer_rounds_to_the_nearest_value_and_keeps_decoded_weights():
    """`quantize_mxfp4` (numpy and jax alike): each block's exponent floor(log2(amax)) - 2,
    each value the nearest of the block's 16 (brute force over the spec's table, past 6:
    6); decoded MXFP4 weights quantize back to the same values."""
    rng = np.random.default_rng(5)
    spread = np.exp(rng.uniform(-6, 3, (4, 6, 1)))  # rows of very different magnitudes
    w = (rng.standard_normal((4, 6, 128)) * spread).astype(np.float32)
    blocks, scales = quantize_mxfp4(w)
    assert blocks.shape == (4, 6, 4, 16) and scales.shape == (4, 6, 4)
    jb, js = jax.jit(quantize_mxfp4)(jnp.asarray(w))
    np.testing.assert_array_equal(np.asarray(jb), blocks)
    np.testing.assert_array_equal(np.asarray(js), scales)
    amax = np.abs(w.reshape(4, 6, 4, 32)).max(-1)
    np.testing.assert_array_equal(scales.astype(int) - 127, np.floor(np.log2(amax)).astype(int) - 2)
    unit = 2.0 ** (scales.astype(np.float64) - 127)[..., None]
    x = w.reshape(4, 6, 4, 32) / unit
    table = np.array(SPEC_E2M1)
    nearest = table[np.abs(np.abs(x)[..., None] - table).argmin(-1)] * np.sign(x)
    np.testing.assert_array_equal(decode_mxfp4(blocks, scales).reshape(x.shape), nearest * unit)

    d = decode_mxfp4(*checkpoint_pair(rng, (3,), 8, 64))
    assert_bits_equal(decode_mxfp4(*quantize_mxfp4(d)), d)


def test_quantizer_rounds_ties_to_even():
    """Halfway values go to the even code (OCP's round to nearest even), in numpy and jax."""
    ties = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.75, -5.0, 6.0], np.float32)
    w = np.zeros((1, 32), np.float32)
    w[0, :10] = ties
    want = np.array([0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, -1.0, -4.0, 6.0], np.float32)
    for got in (decode_mxfp4(*quantize_mxfp4(w)),
                np.asarray(decode_mxfp4(*jax.jit(quantize_mxfp4)(jnp.asarray(w))))):
        np.testing.assert_array_equal(got[0, :10], want)
