"""Matrix products on pre-packed weights (`matmul.cc`), for the CPU serving path: bfloat16 on
Intel AMX (tiles), float32 or bfloat16 weights (column strips, computed in float32) with AVX-512
FMAs, or with AVX2 FMAs in a build without AVX-512 (an AVX2-only CPU's "native" build, or build
target "haswell" anywhere; `cpu.BUILD_TARGETS`).

XLA:CPU runs SmolLM2's bfloat16 decode products at about 130 GFLOP/s on two cores; the AMX
tile unit does several times that, and at small batch the product is bound by reading the
weights, which AMX streams once per 32 rows. XLA's float32 products with 8-32 rows run at
35-80 GFLOP/s here, about half of what a register-blocked AVX-512 loop does; limited to AVX2
(`--xla_cpu_max_isa=AVX2`), XLA's 32-row LM-head product runs at ~30 GFLOP/s. The kernel wants
each weight pre-packed (`pack_weight`, done once at load time by the backend's
`packing.pack_linear_weights`); the result is float32 (the products' accumulator dtype everywhere in
the models). The ops around a decoder layer's products (RMSNorm before, residual
add or silu(gate) * up after) can run inside the kernel (`packed_matmul`'s keyword arguments).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from jaxserve.backends.cpu import kernels as cpu

TARGET = "jaxserve_packed_matmul"


def _library_says(symbol: str, cpu_flags: tuple[str, ...], target: str | None) -> bool:
    if not set(cpu_flags) <= set(cpu.cpu_flags().split()):
        return False
    try:
        lib = cpu.ensure_loaded(target)
    except cpu.KernelUnavailable:
        return False
    return bool(getattr(lib, symbol)())


# `target`: the kernel build asked about (`cpu.BUILD_TARGETS`); None: the process's.
@functools.cache
def amx_available(target: str | None = None) -> bool:
    """True when this CPU has AMX-BF16, the kernels build with it, and the OS grants AMX tile
    state (the bfloat16 product)."""
    return _library_says("JaxserveAmxAvailable", ("amx_bf16", "amx_tile"), target)


@functools.cache
def avx512_available(target: str | None = None) -> bool:
    """True when this CPU has AVX-512F and the kernels build with it (the strips' product)."""
    return _library_says("JaxserveAvx512Available", ("avx512f",), target)


@functools.cache
def avx2_available(target: str | None = None) -> bool:
    """True when this CPU has AVX2 and FMA and the kernels' strips' product is the AVX2 one:
    a build without AVX-512 (target "haswell", or "native" on an AVX2-only CPU)."""
    return _library_says("JaxserveAvx2Available", ("avx2", "fma"), target)


def strips_kernel(target: str | None = None) -> str | None:
    """The strips' product a build runs here: "avx512", "avx2", or None."""
    return "avx512" if avx512_available(target) else "avx2" if avx2_available(target) else None


def packable(k: int, n: int) -> bool:
    return k % 32 == 0 and n % 32 == 0 and k > 0 and n > 0


def packed_weight_shape(k: int, n: int, tiles: bool) -> tuple[int, ...]:
    """The shape `pack_weight` gives a [K, N] weight (its dtype stays)."""
    return (n // 16, k // 32, 16, 32) if tiles else (n // 32, k, 32)


def pack_weight(w: np.ndarray, tiles: bool) -> np.ndarray:
    """[K, N] (K, N multiples of 32, bfloat16 or float32) -> the kernel's layout.

    tiles (bfloat16 only, for AMX): tile order [N/16, K/32, 16, 32]; block (nb, kb), row p,
    holds for each of its 16 columns c the pair (w[32 kb + 2 p, 16 nb + c],
    w[32 kb + 2 p + 1, 16 nb + c]). Otherwise column strips [N/32, K, 32] of w's dtype (the
    AVX-512 and AVX2 products).
    """
    k, n = w.shape
    if not packable(k, n):
        raise ValueError(f"pack_weight: K={k} and N={n} must be positive multiples of 32")
    if w.dtype not in (np.float32, ml_dtypes.bfloat16):
        raise ValueError(f"pack_weight: weights must be float32 or bfloat16, not {w.dtype}")
    if not tiles:
        return np.ascontiguousarray(np.asarray(w).reshape(k, n // 32, 32).transpose(1, 0, 2))
    if w.dtype != ml_dtypes.bfloat16:
        raise ValueError("pack_weight: AMX tiles hold bfloat16 weights")
    # [kb, p, e, nb, c] -> [nb, kb, p, c, e], in two contiguous passes: rows 2i and 2i + 1 side
    # by side (a uint32 pair per column), then 16-pair runs moved as blocks. (One transpose with
    # e innermost copies element by element: 3-6x slower, ~0.4 s of a start of the default model.)
    bits = np.asarray(w, dtype=ml_dtypes.bfloat16).view(np.uint16)
    pairs = np.empty((k // 2, n, 2), np.uint16)
    pairs[:, :, 0] = bits[0::2]
    pairs[:, :, 1] = bits[1::2]
    blocks = pairs.view(np.uint32).reshape(k // 32, 16, n // 16, 16).transpose(2, 0, 1, 3)
    return np.ascontiguousarray(blocks).view(ml_dtypes.bfloat16).reshape(n // 16, k // 32, 16, 32)


def packed_shape(packed: jax.Array) -> tuple[int, int]:
    """(K, N) of a packed weight."""
    if packed.dtype == jnp.bfloat16 and packed.ndim == 4 and packed.shape[2:] == (16, 32):
        return packed.shape[1] * 32, packed.shape[0] * 16
    if packed.dtype in (jnp.float32, jnp.bfloat16) and packed.ndim == 3 and packed.shape[2] == 32:
        return packed.shape[1], packed.shape[0] * 32
    raise ValueError(f"not a packed weight: {packed.shape} {packed.dtype}")


def packed_matmul(
    x: jax.Array,
    packed: jax.Array,
    *,
    norm: jax.Array | None = None,
    eps: float = 0.0,
    residual: jax.Array | None = None,
    glu: bool = False,
    live: jax.Array | None = None,
    target: str | None = None,
) -> jax.Array:
    """x [M, K] @ a packed weight (`pack_weight`) -> float32 [M, N].

    x may be float32 or bfloat16 (cast to bfloat16 in the kernel for AMX tiles, to float32
    for strips). With
    `norm` ([K]) the product takes RMSNorm(x) * norm (float32, `eps`, as
    `models/layers/norm.py`) instead of x. With `residual` ([M, N]) the result is residual +
    product. With `glu` the weight holds [gate | up] (N/2 columns each, N/2 a multiple of 32)
    and the result is silu(gate) * up, float32 [M, N/2]. With `live` (an int32 scalar, traced)
    only rows [0, live) are computed; the others are zeros (the residual's rows with one): a
    padded bucket's padding tokens cost nothing. `target`: the kernel build to call
    (`cpu.BUILD_TARGETS`; None: the process's).
    """
    name = cpu.ffi_target(TARGET, target)
    m, k = x.shape
    try:
        pk, n = packed_shape(packed)
    except ValueError:
        pk = n = None
    if pk != k:
        raise ValueError(f"packed_matmul: x {x.shape} does not match the packed weight "
                         f"{packed.shape} {packed.dtype}")
    if norm is not None and norm.shape != (k,):
        raise ValueError(f"packed_matmul: norm must be [{k}], got {norm.shape}")
    if residual is not None and (glu or residual.shape != (m, n)):
        raise ValueError(f"packed_matmul: residual must be [{m}, {n}] (and not with glu), "
                         f"got {residual.shape}")
    if glu and n % 64:
        raise ValueError(f"packed_matmul: glu needs N/2 a multiple of 32, got N={n}")
    if x.dtype not in (jnp.float32, jnp.bfloat16):
        x = x.astype(jnp.float32)
    empty = jnp.zeros((0,), jnp.float32)
    out_n = n // 2 if glu else n
    return jax.ffi.ffi_call(name, jax.ShapeDtypeStruct((m, out_n), jnp.float32))(
        x, packed,
        empty if norm is None else norm.astype(jnp.float32),
        empty if residual is None else residual.astype(jnp.float32),
        jnp.zeros((0,), jnp.int32) if live is None else jnp.reshape(live, (1,)).astype(jnp.int32),
        eps=np.float32(eps), glu=np.int32(bool(glu)))
