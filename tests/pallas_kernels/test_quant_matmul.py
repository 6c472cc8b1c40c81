"""The quantized product kernel (pallas_kernels/quant_matmul/tpu.py) against the reference
(dequantize, then one dot) and a float64 product, in Pallas' interpreter on the CPU: int4
packed two a byte with groups of 32, 64 and 128 (scales on the output per group, or the tile
dequantized), token counts that are not a multiple of the tile, several K and N blocks; FP8
with a scale per output channel and per 128 x 128 block. The kernel uses no DMA or semaphore
of its own (only BlockSpecs), so the plain interpreter checks what it computes; Mosaic's
lowering is checked by the v6e compile in tests/tools/test_tpu_topology.py."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.models.layers.quant import pack_int4
from jaxserve.pallas_kernels.quant_matmul import ops, tpu
from jaxserve.pallas_kernels.quant_matmul.reference import quant_matmul_reference

KNOBS = ("packed", "compute_dtype", "block_m", "block_n", "block_k", "mode", "interpret")
kernel = jax.jit(tpu.quant_matmul_tpu, static_argnames=KNOBS)
reference = jax.jit(quant_matmul_reference, static_argnames=("packed", "compute_dtype"))


def int4_case(M, K, N, group, seed):
    rng = np.random.default_rng(seed)
    values = rng.integers(0, 16, (K, N)).astype(np.uint8)
    G = K // group
    scale = rng.uniform(0.01, 0.1, (G, N)).astype(np.float32)
    zero = rng.integers(0, 16, (G, N)).astype(np.float32)
    x = rng.standard_normal((M, K)).astype(np.float32)
    w = (values.reshape(G, group, N) - zero[:, None]) * scale[:, None]
    exact = x.astype(np.float64) @ w.reshape(K, N).astype(np.float64)
    return x, pack_int4(values, 0), scale, zero, exact


def assert_close(got, want, exact, rtol):
    scale = np.abs(exact).max()
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5 * scale, rtol=0)
    np.testing.assert_allclose(np.asarray(got), exact, atol=rtol * scale, rtol=0)


@pytest.mark.parametrize("M,K,N,group,blocks", [
    # decode-sized, 20 rows padded to 24: per-group scales on the output, 2 N blocks
    (20, 256, 256, 32, dict(block_n=128)),
    # the tile dequantized, 3 row blocks of 8 (the last padded), 2 K blocks, 2 N blocks
    (20, 1024, 256, 64, dict(block_m=8, block_n=128, block_k=512, mode=tpu.DEQUANTIZE)),
    # groups of 128 in tiles of 1024: 2 K blocks of 8 groups each, scales on the output
    (8, 2048, 128, 128, dict()),
])
def test_int4_kernel_matches_the_reference(M, K, N, group, blocks):
    x, q, scale, zero, exact = int4_case(M, K, N, group, seed=K + group)
    args = (jnp.asarray(x), jnp.asarray(q), jnp.asarray(scale), jnp.asarray(zero))
    got = kernel(*args, packed=True, compute_dtype=jnp.float32, interpret=True, **blocks)
    want = reference(*args, packed=True, compute_dtype=jnp.float32)
    assert got.shape == (M, N) and got.dtype == jnp.float32
    assert_close(got, want, exact, 1e-5)
    mode = blocks.get("mode") or tpu.tiling(M, K, N, K // group, True, True, **blocks).mode
    assert mode == (tpu.DEQUANTIZE if "mode" in blocks else tpu.GROUP_SUMS)


def test_int4_kernel_in_bfloat16():
    """bfloat16 activations on the MXU path: within bfloat16's rounding of the exact product."""
    x, q, scale, zero, exact = int4_case(16, 256, 128, 64, seed=3)
    args = (jnp.asarray(x), jnp.asarray(q), jnp.asarray(scale), jnp.asarray(zero))
    got = kernel(*args, packed=True, compute_dtype=jnp.bfloat16, interpret=True)
    want = reference(*args, packed=True, compute_dtype=jnp.bfloat16)
    np.testing.assert_allclose(np.asarray(got), exact, atol=2e-2 * np.abs(exact).max(), rtol=0)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-2 * np.abs(exact).max(),
                               rtol=0)


@pytest.mark.parametrize("blocks", [(1, 1), (128, 128)])
def test_fp8_kernel_matches_the_reference(blocks):
    """FP8 with a scale per output channel (applied to the output at the last K step) and per
    128 x 128 block (the model's scales expanded to [K / 128, N]: one row per group)."""
    rng = np.random.default_rng(blocks[0])
    M, K, N = 12, 1024, 256
    values = rng.standard_normal((K, N)).astype(jnp.float8_e4m3fn)
    G = 1 if blocks[0] == 1 else K // blocks[0]
    scale = rng.uniform(0.01, 0.1, (G, N // blocks[1])).astype(np.float32).repeat(blocks[1], axis=1)
    x = rng.standard_normal((M, K)).astype(np.float32)
    w = values.astype(np.float32).reshape(G, K // G, N) * scale[:, None]
    exact = x.astype(np.float64) @ w.reshape(K, N)
    args = (jnp.asarray(x), jnp.asarray(values), jnp.asarray(scale))
    tiles = dict(block_k=512) if G == 1 else {}  # per channel: 2 K blocks, scaled after the last
    got = kernel(*args, packed=False, compute_dtype=jnp.float32, interpret=True, **tiles)
    assert_close(got, reference(*args, packed=False, compute_dtype=jnp.float32), exact, 1e-5)


def test_dispatch_and_the_reference_for_large_steps():
    """"auto" on the CPU is the reference, a TPU backend takes the kernel; past
    KERNEL_MAX_ROWS rows (prefill chunks) the reference whatever the name."""
    assert ops.dispatch_name("auto", 8) == "reference"
    assert ops.dispatch_name("auto", 8, backend="tpu") == "tpu"
    assert ops.dispatch_name("tpu", ops.KERNEL_MAX_ROWS) == "tpu"
    assert ops.dispatch_name("tpu", ops.KERNEL_MAX_ROWS + 1) == "reference"
    with pytest.raises(ValueError, match="unknown impl"):
        ops.resolve_impl("gpu-triton")


def test_blocks_that_break_the_tiling_are_refused():
    x = jnp.zeros((8, 1024), jnp.float32)
    q = jnp.zeros((512, 256), jnp.uint8)
    s = jnp.zeros((16, 256), jnp.float32)
    run = functools.partial(tpu.quant_matmul_tpu, x, q, s, s, packed=True, interpret=True)
    with pytest.raises(ValueError, match="multiple of 8 groups"):
        run(block_k=256)  # 4 groups of 64 in a K block: not whole scale sublanes
    with pytest.raises(ValueError, match="multiple of 128"):
        run(block_n=64)
