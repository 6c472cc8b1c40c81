"""bfloat16 matrix products on Intel AMX (`matmul.cc`), for the CPU serving path.

XLA:CPU runs SmolLM2's bfloat16 decode products at about 130 GFLOP/s on two cores; the AMX
tile unit does several times that, and at small batch the product is bound by reading the
weights, which AMX streams once per 32 rows. The kernel wants each weight pre-packed into tile
order (`pack_weight`, done once at load time by `models/layers/linear.py: pack_linear_weights`);
activations are cast to bfloat16 and the result is float32 (the products' accumulator dtype
everywhere in the models). The ops around a decoder layer's products (RMSNorm before, residual
add or silu(gate) * up after) can run inside the kernel (`amx_matmul`'s keyword arguments).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from jaxserve.pallas_kernels import cpu

TARGET = "jaxserve_amx_matmul"


@functools.cache
def amx_available() -> bool:
    """True when this CPU has AMX-BF16, the kernels build, and the OS grants AMX tile state."""
    flags = cpu.cpu_flags().split()
    if "amx_bf16" not in flags or "amx_tile" not in flags:
        return False
    try:
        lib = cpu.ensure_loaded()
    except cpu.KernelUnavailable:
        return False
    return bool(lib.JaxserveAmxAvailable())


def packable(k: int, n: int) -> bool:
    return k % 32 == 0 and n % 32 == 0 and k > 0 and n > 0


def pack_weight(w: np.ndarray) -> np.ndarray:
    """[K, N] -> the kernel's bfloat16 tile layout [N/16, K/32, 16, 32] (K, N multiples of 32).

    Block (nb, kb), row p, holds for each of its 16 columns c the pair
    (w[32 kb + 2 p, 16 nb + c], w[32 kb + 2 p + 1, 16 nb + c]).
    """
    k, n = w.shape
    if not packable(k, n):
        raise ValueError(f"pack_weight: K={k} and N={n} must be positive multiples of 32")
    w = np.asarray(w).astype(ml_dtypes.bfloat16)
    # [kb, p, e, nb, c] -> [nb, kb, p, c, e]
    return np.ascontiguousarray(w.reshape(k // 32, 16, 2, n // 16, 16).transpose(3, 0, 1, 4, 2)
                                .reshape(n // 16, k // 32, 16, 32))


def amx_matmul(
    x: jax.Array,
    packed: jax.Array,
    *,
    norm: jax.Array | None = None,
    eps: float = 0.0,
    residual: jax.Array | None = None,
    glu: bool = False,
) -> jax.Array:
    """x [M, K] @ the packed weight ([N/16, K/32, 16, 32] bfloat16) -> float32 [M, N].

    x may be float32 or bfloat16 (cast to bfloat16 in the kernel). With `norm` ([K]) the
    product takes RMSNorm(x) * norm (float32, `eps`, as `models/layers/norm.py`) instead of x.
    With `residual` ([M, N]) the result is residual + product. With `glu` the weight holds
    [gate | up] (N/2 columns each, N/2 a multiple of 32) and the result is silu(gate) * up,
    float32 [M, N/2].
    """
    cpu.ensure_loaded()
    m, k = x.shape
    nb, kb, p, c = packed.shape
    n = nb * 16
    if (kb * 32, p, c) != (k, 16, 32) or packed.dtype != jnp.bfloat16:
        raise ValueError(f"amx_matmul: x {x.shape} does not match the packed weight "
                         f"{packed.shape} {packed.dtype}")
    if norm is not None and norm.shape != (k,):
        raise ValueError(f"amx_matmul: norm must be [{k}], got {norm.shape}")
    if residual is not None and (glu or residual.shape != (m, n)):
        raise ValueError(f"amx_matmul: residual must be [{m}, {n}] (and not with glu), "
                         f"got {residual.shape}")
    if glu and n % 64:
        raise ValueError(f"amx_matmul: glu needs N/2 a multiple of 32, got N={n}")
    if x.dtype not in (jnp.float32, jnp.bfloat16):
        x = x.astype(jnp.float32)
    empty = jnp.zeros((0,), jnp.float32)
    out_n = n // 2 if glu else n
    return jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct((m, out_n), jnp.float32))(
        x, packed,
        empty if norm is None else norm.astype(jnp.float32),
        empty if residual is None else residual.astype(jnp.float32),
        eps=np.float32(eps), glu=np.int32(bool(glu)))


def resolve_matmul_impl(impl: str, backend: str, dtype, mesh) -> str:
    """"amx" or "xla" for ModelConfig.matmul_impl `impl` ("auto" | "xla" | "amx").

    AMX needs the CPU backend, bfloat16 weights, a one-device mesh (the packed weights are not
    sharded) and a CPU that has it; "auto" falls back to "xla", "amx" raises ValueError.
    """
    if impl not in ("auto", "xla", "amx"):
        raise ValueError(f"matmul_impl must be 'auto', 'xla' or 'amx'; got {impl!r}")
    if impl == "xla":
        return "xla"
    reasons = []
    if backend != "cpu":
        reasons.append(f"the backend is {backend}, not cpu")
    if jnp.dtype(dtype) != jnp.bfloat16:
        reasons.append(f"the weights are {jnp.dtype(dtype).name}, not bfloat16")
    if mesh is not None and mesh.size != 1:
        reasons.append(f"the mesh has {mesh.size} devices")
    if not reasons and not amx_available():
        reasons.append("this CPU has no usable AMX-BF16 (or the kernels cannot be built)")
    if reasons:
        if impl == "amx":
            raise ValueError("matmul_impl='amx' cannot run here: " + "; ".join(reasons))
        return "xla"
    return "amx"
