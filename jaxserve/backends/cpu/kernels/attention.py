"""Ragged paged attention on XLA:CPU: the native kernel `attention.cc`, registered as the
attention op's implementation "cpu" (what "auto" takes on the CPU) when this module loads.

The pure-JAX reference spends most of a CPU decode step gathering and transposing K/V for
small batched products (about 150 ms of a 250 ms SmolLM2 step at 32 requests). The kernel
reads each key and value row once per (request, KV head, block of up to 16 queries) straight
from the paged cache, keeps an online softmax per row in float32 with AVX-512 or AVX2 inner loops
(portable loops elsewhere), and spreads its work items over the cores (`parallel.h`).
Semantics are the reference's (`reference.py`), sliding window, soft cap and attention sinks
(`sinks=`, [Hq] float32: the kernel's optional last argument, absent without sinks) included;
a second entry point (`LSE_TARGET`) also returns each row's log-sum-exp and can read the cached
context only (multi-head latent attention's split prefill). q may be float32 or bfloat16
(computed in float32), the caches float32 or bfloat16, or fp8 (e4m3) or int8
pages, widened to float32 as they are read. How the library is
built and loaded: `__init__.py`; without a C++ compiler, `supports()` raises and `impl="auto"`
falls back to the reference with a warning. The caches are `[N, page_size, Hkv * D]`, as
stored (the kernel takes D from q; a reshape around the aliased custom call would make XLA:CPU
copy the caches). `target` (the entry points' keyword) names the
kernel build to call (`BUILD_TARGETS`; None: the process's). The CPU backend loads this module
(`jaxserve.backends.cpu`); without it, "auto" on the CPU is the pure-JAX reference.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.backends.cpu import kernels
from jaxserve.pallas_kernels.kv_quant import is_quantized
from jaxserve.pallas_kernels.ragged_paged_attention.metadata import (
    AttentionMetadata,
    num_kv_heads,
)
from jaxserve.pallas_kernels.ragged_paged_attention.ops import register_impl

TARGET = "jaxserve_ragged_paged_attention"
LSE_TARGET = "jaxserve_ragged_paged_attention_lse"  # the same, also each row's log-sum-exp
FUSED_TARGET = "jaxserve_write_kv_and_attend"
ROPE_TARGET = "jaxserve_rope_write_kv_and_attend"
# The caches the kernel reads; the one-byte ones are quantized pages (pallas_kernels/kv_quant.py:
# their scales are folded into q and the output by the caller). The rotary entry point writes
# float caches only.
CACHE_DTYPES = tuple(map(jnp.dtype, (jnp.float32, jnp.bfloat16, jnp.float8_e4m3fn, jnp.int8)))


def supports(q: jax.Array, k_cache: jax.Array, target: str | None = None) -> None:
    """Raise ValueError when the kernel cannot take these inputs on this host."""
    if k_cache.dtype not in CACHE_DTYPES:
        raise ValueError(f"the cpu kernel takes float32, bfloat16, float8_e4m3fn or int8 caches, "
                         f"not {k_cache.dtype}")
    if q.dtype not in (jnp.float32, jnp.bfloat16):
        raise ValueError(f"the cpu kernel takes float32 or bfloat16 queries, not {q.dtype}")
    kernels.ensure_loaded(target)


def ragged_paged_attention_cpu(
    q: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    md: AttentionMetadata,
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    chunk_pages: int | None = None,  # noqa: ARG001 - the kernel picks its own chunking
    target: str | None = None,
    sinks: jax.Array | None = None,
    context_only: bool = False,
    return_lse: bool = False,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """The op on the native CPU kernel. Same arguments and result as the reference
    (`context_only`, `return_lse` included: multi-head latent attention's split prefill)."""
    supports(q, k_cache, target)
    if context_only or return_lse:
        out, lse = jax.ffi.ffi_call(kernels.ffi_target(LSE_TARGET, target),
                                    (jax.ShapeDtypeStruct(q.shape, jnp.float32),
                                     jax.ShapeDtypeStruct(q.shape[:2], jnp.float32)))(
            q.astype(jnp.float32), k_cache, v_cache, *_metadata(md), *_sinks(sinks),
            **_attrs(sm_scale, sliding_window, soft_cap), context_only=np.int32(context_only))
        return (out.astype(q.dtype), lse) if return_lse else out.astype(q.dtype)
    out = jax.ffi.ffi_call(kernels.ffi_target(TARGET, target),
                           jax.ShapeDtypeStruct(q.shape, jnp.float32))(
        q.astype(jnp.float32), k_cache, v_cache, *_metadata(md), *_sinks(sinks),
        **_attrs(sm_scale, sliding_window, soft_cap))
    return out.astype(q.dtype)


def write_kv_and_attend_cpu(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    md: AttentionMetadata,
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    target: str | None = None,
    sinks: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """`write_kv` then the op, in one kernel call that updates the caches in place (aliased).

    XLA never scatters into the caches, so they can be bfloat16 on the CPU (XLA:CPU's bfloat16
    scatter converts the whole array). k, v: [T, Hkv, D], cast to the caches' dtype.
    """
    supports(q, k_cache, target)
    num_kv_heads(k_cache, q.shape[-1])  # rows of whole heads, else ValueError
    out, k_cache, v_cache = jax.ffi.ffi_call(
        kernels.ffi_target(FUSED_TARGET, target),
        (jax.ShapeDtypeStruct(q.shape, jnp.float32),
         jax.ShapeDtypeStruct(k_cache.shape, k_cache.dtype),
         jax.ShapeDtypeStruct(v_cache.shape, v_cache.dtype)),
        input_output_aliases={3: 1, 4: 2},
    )(q.astype(jnp.float32), k.astype(k_cache.dtype), v.astype(v_cache.dtype), k_cache, v_cache,
      *_metadata(md), md.slot_mapping.astype(jnp.int32), *_sinks(sinks),
      **_attrs(sm_scale, sliding_window, soft_cap))
    return out.astype(q.dtype), k_cache, v_cache


def rope_write_kv_and_attend_cpu(
    qkv: jax.Array,
    cos: jax.Array,
    sin: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    md: AttentionMetadata,
    *,
    num_heads: int,
    sm_scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    target: str | None = None,
    sinks: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """A decoder layer's attention after its fused q/k/v product, in one kernel call.

    qkv: [T, (Hq + 2 Hkv) * D] float32 (q heads, then k, then v); cos, sin: [T, D/2] (from
    `models/layers/rotary.py: rotary_tables`). Same result as `apply_rotary` on q and k, q
    cast to the caches' dtype, then `write_kv_and_attend_cpu`: (out [T, Hq, D] float32, caches).
    """
    supports(qkv, k_cache, target)
    if is_quantized(k_cache.dtype):
        raise ValueError("rope_write_kv_and_attend writes float caches; quantized pages take "
                         "write_kv_and_attend_cpu")
    T = qkv.shape[0]
    d = 2 * cos.shape[-1]  # the rotary tables are half a head wide
    hkv = num_kv_heads(k_cache, d)
    if qkv.shape[1] != (num_heads + 2 * hkv) * d or cos.shape != (T, d // 2) or sin.shape != cos.shape:
        raise ValueError(f"rope_write_kv_and_attend: qkv {qkv.shape}, cos {cos.shape} do not fit "
                         f"{num_heads} + 2 x {hkv} heads of {d}")
    out, k_cache, v_cache = jax.ffi.ffi_call(
        kernels.ffi_target(ROPE_TARGET, target),
        (jax.ShapeDtypeStruct((T, num_heads, d), jnp.float32),
         jax.ShapeDtypeStruct(k_cache.shape, k_cache.dtype),
         jax.ShapeDtypeStruct(v_cache.shape, v_cache.dtype)),
        input_output_aliases={3: 1, 4: 2},
    )(qkv.astype(jnp.float32).reshape(T, num_heads + 2 * hkv, d), cos.astype(jnp.float32),
      sin.astype(jnp.float32), k_cache, v_cache, *_metadata(md), md.slot_mapping.astype(jnp.int32),
      *_sinks(sinks), **_attrs(sm_scale, sliding_window, soft_cap))
    return out, k_cache, v_cache


def _metadata(md: AttentionMetadata) -> tuple[jax.Array, ...]:
    i32 = lambda x: x.astype(jnp.int32)  # noqa: E731
    return (i32(md.block_tables), i32(md.kv_lens), i32(md.query_start_loc),
            i32(md.num_seqs).reshape(()))


def _sinks(sinks) -> tuple[jax.Array, ...]:
    """The kernel's optional last argument: (sinks [Hq] float32,), or nothing at all."""
    return () if sinks is None else (sinks.astype(jnp.float32),)


def _attrs(sm_scale, sliding_window, soft_cap) -> dict:
    return dict(sm_scale=np.float32(sm_scale), sliding_window=np.int32(sliding_window or 0),
                soft_cap=np.float32(soft_cap or 0.0))


register_impl("cpu", ragged_paged_attention_cpu, supports, fused_write=write_kv_and_attend_cpu,
              fused_rope=rope_write_kv_and_attend_cpu)
