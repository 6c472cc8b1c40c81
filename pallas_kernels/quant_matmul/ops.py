"""The product with weights kept quantized, y = x @ dequant(W), dispatching by implementation
name (`pallas_kernels/registry.py`).

Operands, in a 2-D form every weight of a `dense` product maps onto (`models/layers/linear.py`):
  x      [M, K]   activations (cast to `compute_dtype`)
  q      [K/2, N] uint8 holding two int4 values a byte along K (`packed=True`: row r holds K
         index 2r in its low nibble, 2r + 1 in its high one), or [K, N] float8_e4m3fn / int8
  scale  [G, N]   float32: one scale per group of K / G consecutive K indices and output column
                  (G = 1: one per output channel)
  zero   [G, N]   float32 zero points (int4), or None
With `mxfp4=True` (gpt-oss's experts, `models/layers/quant.py`) q holds packed e2m1 codes (as
int4 is packed) and scale the uint8 e8m0 exponents [G, N] (2^(e - 127), groups of 32); no
zeros.
Returns float32 [M, N] = x @ ((values - zero) * scale) with the dequantized weight rounded to
`compute_dtype` (per-channel scales without zeros multiply the float32 result instead).

Registered: "reference" (`reference.py`: dequantize, then one dot: what XLA runs); "tpu"
(Pallas Mosaic, `tpu.py`: reads the quantized bytes and dequantizes tiles in VMEM) and
"tpu-interpret" (the same kernel in Pallas' TPU interpreter, on any backend). "auto" takes the
kernel registered under JAX's backend name, else the reference.

Steps of more than `KERNEL_MAX_ROWS` rows take the reference whatever the implementation: the
kernel exists for decode, where the product is bound by reading the weight and XLA's separate
dequantizing fusion multiplies the bytes; a prefill chunk of hundreds of tokens is bound by
the MXU, the dequantized weight's extra round trip through HBM is shared by all its rows, and
the kernel would re-read the weight once per block of `tpu.MAX_BLOCK_M` rows.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxserve.pallas_kernels.quant_matmul.reference import quant_matmul_reference
from jaxserve.pallas_kernels.registry import ImplRegistry

KERNEL_MAX_ROWS = 512

_REGISTRY = ImplRegistry("quant_matmul", {"reference": quant_matmul_reference},
                         known_kernels=("tpu", "tpu-interpret"))


def register_impl(name: str, fn) -> None:
    """Register (or replace) implementation `name`; `fn` takes `quant_matmul`'s arguments."""
    _REGISTRY.register(name, fn)


def available_impls() -> tuple[str, ...]:
    return _REGISTRY.available()


def resolve_impl(impl: str, backend: str | None = None) -> str:
    """The implementation name `impl` dispatches to on `backend` (default: JAX's default)."""
    return _REGISTRY.resolve(impl, backend)


def dispatch_name(impl: str, rows: int, backend: str | None = None) -> str:
    """What `impl` runs for a product of `rows` rows: the reference past `KERNEL_MAX_ROWS`."""
    name = resolve_impl(impl, backend)
    return "reference" if rows > KERNEL_MAX_ROWS else name


def quant_matmul(x: jax.Array, q: jax.Array, scale: jax.Array, zero: jax.Array | None = None, *,
                 packed: bool, compute_dtype=jnp.bfloat16, impl: str = "auto",
                 mxfp4: bool = False) -> jax.Array:
    """x @ dequant(q, scale, zero) as float32 [M, N] (operands: the module docstring)."""
    if mxfp4 and (not packed or zero is not None or scale.dtype != jnp.uint8):
        raise ValueError("MXFP4 operands are packed codes and uint8 exponents, without zeros")
    name = dispatch_name(impl, x.shape[0])
    extra = {"mxfp4": True} if mxfp4 else {}
    return _REGISTRY.impls[name](x, q, scale, zero, packed=packed, compute_dtype=compute_dtype,
                                 **extra)


def _register_kernels() -> None:
    from jaxserve.pallas_kernels.quant_matmul import tpu

    register_impl("tpu", tpu.quant_matmul_tpu)
    register_impl("tpu-interpret", functools.partial(tpu.quant_matmul_tpu, interpret=True))


_register_kernels()
