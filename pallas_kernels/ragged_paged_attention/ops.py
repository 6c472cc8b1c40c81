"""Attention's entry points, dispatching by implementation name: `write_kv_and_attend` (what the
models call: write the step's K/V into the cache, then attend; one call where an implementation
fuses the two), `ragged_paged_attention` (attend over a cache that already holds them) and
`fused_rope_kernel` (the whole attention block with the rotary embedding, for the CPU backend's
fused layer).

Implementations are looked up by name in a registry (`pallas_kernels/registry.py`). A kernel registers itself with
`register_impl("tpu", fn)` (or "gpu", or any new name); `fn` must accept the same arguments as
`ragged_paged_attention_reference`: `(q, k_cache, v_cache, md, *, sm_scale,
sliding_window, soft_cap, chunk_pages)` (a kernel may ignore `chunk_pages`), plus `sinks=`
([Hq] float32 attention-sink logits, an array) when it takes attention sinks: the op passes
`sinks` only when it is not None, so a kernel without them runs as before. `impl="auto"` picks
the kernel registered under the name of JAX's default backend (on a GPU, by compute capability:
`auto_candidates`), and falls back to the pure-JAX reference (the CPU default) when there is
none, or when no candidate kernel can take these shapes (e.g. a head dim that is not a power
of two on GPU).

Registered here: "reference"; "tpu" (Pallas Mosaic, `tpu.py`); "gpu-mosaic" (Pallas Mosaic
GPU, `gpu_mosaic.py`: what "auto" takes on Hopper, compute capability 9.x; DESIGN §5 says
why); "gpu" (Pallas Triton, `gpu.py`: "auto" on other GPUs, and on Hopper for what the Mosaic
GPU kernel cannot take, such as float32 caches); and
"tpu-interpret" / "gpu-interpret" / "gpu-mosaic-interpret", the same kernels run by the Pallas
interpreters, which work on any backend (CPU included: tests, and
`ModelConfig.attention_impl="gpu-interpret"` to serve through a kernel on a CPU host; slow, for
checking only). `interpret=True` on the op maps a kernel (or "auto" resolving to one) to its
interpret variant. "cpu", the native CPU kernel (C++ through the XLA FFI, not Pallas),
registers itself from the CPU backend (`jaxserve/backends/cpu/kernels/attention.py`), which
loads it; in a process without that backend, "auto" on the CPU is the reference.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp

from jaxserve.pallas_kernels.kv_cache_update.ops import impl_for_attention, write_kv
from jaxserve.pallas_kernels.kv_quant import is_quantized
from jaxserve.pallas_kernels.ragged_paged_attention.metadata import (
    AttentionMetadata,
    num_kv_heads,
)
from jaxserve.pallas_kernels.ragged_paged_attention.reference import (
    ragged_paged_attention_reference,
)
from jaxserve.pallas_kernels.registry import ImplRegistry

_REGISTRY = ImplRegistry(
    "ragged_paged_attention",
    {"reference": ragged_paged_attention_reference},
    known_kernels=("cpu", "tpu", "gpu", "gpu-mosaic", "tpu-interpret", "gpu-interpret",
                   "gpu-mosaic-interpret"),
)
# Shape checks of the kernels that "auto" consults before picking one: name -> fn(q, k_cache)
# raising ValueError when the kernel cannot take those shapes.
_SUPPORTS: dict[str, Callable] = {}
# Implementations that write the new K/V and attend in one call (see write_kv_and_attend).
_FUSED_WRITE: dict[str, Callable] = {}
# Implementations that also apply the rotary embedding (see rope_write_kv_and_attend).
_FUSED_ROPE: dict[str, Callable] = {}


def register_impl(name: str, fn: Callable, supports: Callable | None = None, *,
                  fused_write: Callable | None = None, fused_rope: Callable | None = None) -> None:
    """Register (or replace) implementation `name` of `ragged_paged_attention`.

    `supports(q, k_cache)`, optional, raises ValueError when the kernel cannot take those
    shapes; `impl="auto"` then falls back to the reference. `fused_write`, optional: the same
    kernel writing the step's K/V and attending in one call (`write_kv_and_attend`'s
    signature); `fused_rope`: also applying the rotary embedding (`fused_rope_kernel`).
    """
    _REGISTRY.register(name, fn)
    if supports is not None:
        _SUPPORTS[name] = supports
    if fused_write is not None:
        _FUSED_WRITE[name] = fused_write
    if fused_rope is not None:
        _FUSED_ROPE[name] = fused_rope


def supports_check(name: str) -> Callable | None:
    """The shape check of kernel `name` (fn(q, k_cache) raising ValueError), None if it has none."""
    return _SUPPORTS.get(name)


def available_impls() -> tuple[str, ...]:
    return _REGISTRY.available()


def implementation(name: str) -> Callable:
    """The function registered as implementation `name` (KeyError if none is): for a caller
    that passes it arguments of its own, such as the CPU kernel's `context_only`."""
    return _REGISTRY.impls[name]


# Compute capabilities whose "auto" kernel is the Mosaic GPU one: Hopper (sm_90a: its wgmma
# and TMA; Blackwell's tensor cores take other instructions, tcgen05, that the kernel does not
# use). DESIGN §5 says why the default moved.
MOSAIC_GPU_CAPABILITIES = ((9, 0), (10, 0))  # [from, to)


def gpu_capability(devices=None) -> tuple[int, int] | None:
    """The lowest CUDA compute capability of `devices` (default: JAX's GPU devices when GPU is
    JAX's default backend), None where none reports one (CPU devices, ROCm)."""
    if devices is None:
        if jax.default_backend() != "gpu":
            return None
        devices = jax.devices()
    caps = []
    for d in devices:
        c = getattr(d, "compute_capability", None)
        if not c:
            return None
        caps.append(tuple(int(x) for x in str(c).split(".")[:2]))
    return min(caps) if caps else None


def auto_candidates(backend: str | None = None, devices=None) -> tuple[str, ...]:
    """The kernels "auto" tries on `backend`, in order (the first whose shape check passes
    runs; the reference when none does): on a GPU of compute capability 9.x the Mosaic GPU
    kernel, then the Triton one; on other GPUs the Triton one; elsewhere the backend's own."""
    backend = backend or jax.default_backend()
    name = _REGISTRY.resolve("auto", backend)
    if name != "gpu":
        return (name,)
    cap = gpu_capability(devices)
    lo, hi = MOSAIC_GPU_CAPABILITIES
    if cap is not None and lo <= cap < hi and "gpu-mosaic" in _REGISTRY.impls:
        return ("gpu-mosaic", "gpu")
    return ("gpu",)


def auto_for_dtypes(backend: str | None, devices, cache_dtype, model_dtype, *,
                    head_dim: int = 128, page_size: int = 16) -> str:
    """The first of `auto_candidates` whose shape check takes a cache of `cache_dtype` with
    queries in the dtype attention computes in (a common head dim and page size): what "auto"
    runs for that cache (on Hopper, a float32 cache runs the Triton kernel); the first
    candidate when none takes it."""
    from jaxserve.pallas_kernels.kv_quant import attention_dtype

    candidates = auto_candidates(backend, devices)
    q = jax.ShapeDtypeStruct((1, 1, head_dim), attention_dtype(cache_dtype, model_dtype))
    cache = jax.ShapeDtypeStruct((1, page_size, head_dim), cache_dtype)
    for name in candidates:
        try:
            if name in _SUPPORTS:
                _SUPPORTS[name](q, cache)
            return name
        except ValueError:
            continue
    return candidates[0]


# The implementations whose pages must be lane-dense: a row of `Hkv * D` values a multiple of
# 128 lanes (the TPU kernel's DMAs; `tpu.validate_tpu_shapes`).
LANE_DENSE_IMPLS = ("tpu", "tpu-interpret")
LANE_WIDTH = 128


def lane_dense_kv_heads(impl: str, num_kv_heads: int, head_dim: int, kv_split: int = 1) -> int:
    """The KV heads a model of `num_kv_heads` heads of `head_dim` is served with when attention
    runs implementation `impl` (a resolved name, not "auto"): for the implementations that need
    lane-dense pages (LANE_DENSE_IMPLS), the smallest count >= num_kv_heads that `kv_split`
    devices split evenly with each device's row (its heads x head_dim) a multiple of 128 lanes;
    else num_kv_heads. The heads added are zero heads appended by the model's loader
    (`ArchConfig.with_kv_heads`: DESIGN §9, "Lane-dense KV pages"). `kv_split`: the devices the
    sharding rules ask to split the KV heads over (1: none). A head dim whose rows could never
    be lane-dense within 128 heads per device gives num_kv_heads."""
    if impl not in LANE_DENSE_IMPLS:
        return num_kv_heads
    heads = num_kv_heads
    while heads % kv_split or (heads // kv_split * head_dim) % LANE_WIDTH:
        heads += 1
        if heads // kv_split > LANE_WIDTH:
            return num_kv_heads
    return heads


def resolve_impl(impl: str, backend: str | None = None, devices=None) -> str:
    """The implementation name `impl` dispatches to on `backend` (default: JAX's default) for
    shapes every kernel takes; `devices`: the GPUs it will run on, when they are not JAX's
    default devices (compile-only targets)."""
    if impl == "auto":
        return auto_candidates(backend, devices)[0]
    return _REGISTRY.resolve(impl, backend)


def _is_int(dtype) -> bool:
    return jnp.issubdtype(dtype, jnp.integer)


def validate_inputs(q, k_cache, v_cache, md: AttentionMetadata, *, sliding_window=None,
                    soft_cap=None, chunk_pages=None, sinks=None) -> None:
    """Static shape / dtype checks of the op's arguments; raises ValueError with the reason."""
    if getattr(q, "ndim", None) != 3:
        raise ValueError(f"q must be [T, Hq, D]; got shape {getattr(q, 'shape', None)}")
    if getattr(k_cache, "ndim", None) != 3 or getattr(v_cache, "shape", None) != k_cache.shape:
        raise ValueError(
            f"k_cache/v_cache must both be [N, page_size, Hkv * D] (one layer); got "
            f"{getattr(k_cache, 'shape', None)} and {getattr(v_cache, 'shape', None)}"
        )
    T, Hq, D = q.shape
    Hkv = num_kv_heads(k_cache, D)
    if Hq % Hkv:
        raise ValueError(f"Hq={Hq} (q {q.shape}) must be a multiple of Hkv={Hkv} (cache "
                         f"{k_cache.shape})")
    if not jnp.issubdtype(q.dtype, jnp.floating):
        raise ValueError(f"q must be floating point; got {q.dtype}")
    if k_cache.dtype != v_cache.dtype or not (jnp.issubdtype(k_cache.dtype, jnp.floating)
                                               or is_quantized(k_cache.dtype)):
        raise ValueError(f"k_cache and v_cache must share one floating (or fp8, int8) dtype; "
                         f"got {k_cache.dtype} and {v_cache.dtype}")
    bt, kvl, qsl, ns, sm = (md.block_tables, md.kv_lens, md.query_start_loc, md.num_seqs,
                            md.slot_mapping)
    if bt.ndim != 2:
        raise ValueError(f"block_tables must be [R, P]; got {bt.shape}")
    R = bt.shape[0]
    if kvl.shape != (R,):
        raise ValueError(f"kv_lens must be [R={R}]; got {kvl.shape}")
    if qsl.shape != (R + 1,):
        raise ValueError(f"query_start_loc must be [R + 1 = {R + 1}]; got {qsl.shape}")
    if ns.shape not in ((), (1,)):
        raise ValueError(f"num_seqs must be a scalar; got shape {ns.shape}")
    if sm.shape != (T,):
        raise ValueError(f"slot_mapping must be [T={T}] like q's tokens; got {sm.shape}")
    for name, x in (("block_tables", bt), ("kv_lens", kvl), ("query_start_loc", qsl),
                    ("num_seqs", ns), ("slot_mapping", sm)):
        if not _is_int(x.dtype):
            raise ValueError(f"{name} must be an integer array; got {x.dtype}")
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be >= 1, got {sliding_window}")
    if soft_cap is not None and not soft_cap > 0:
        raise ValueError(f"soft_cap must be > 0, got {soft_cap}")
    if chunk_pages is not None and chunk_pages < 1:
        raise ValueError(f"chunk_pages must be >= 1, got {chunk_pages}")
    if sinks is not None and (getattr(sinks, "shape", None) != (Hq,)
                              or not jnp.issubdtype(sinks.dtype, jnp.floating)):
        raise ValueError(f"sinks must be a floating [Hq={Hq}] array (one logit per query head); "
                         f"got {getattr(sinks, 'shape', None)} "
                         f"{getattr(sinks, 'dtype', type(sinks).__name__)}")


def dispatch_name(impl: str, q, k_cache, *, interpret: bool = False,
                  backend: str | None = None, devices=None) -> str:
    """The implementation `impl` runs for these inputs on `backend` (default: JAX's): "auto"
    takes the first of the backend's kernels (`auto_candidates`) that supports them, else the
    reference, logging each refusal once (a warning)."""
    name = resolve_impl(impl, backend, devices)
    if impl == "auto":
        candidates = auto_candidates(backend, devices)
        for i, name in enumerate(candidates):
            try:
                if name in _SUPPORTS:
                    _SUPPORTS[name](q, k_cache)
                break
            except ValueError as e:
                then = candidates[i + 1] if i + 1 < len(candidates) else "the pure-JAX reference"
                _REGISTRY.warn_once(f"unsupported-{name}", "ragged_paged_attention: %s kernel "
                                    "unsupported here (%s); using %s", name, e, then)
        else:
            name = "reference"
    if interpret and name in ("tpu", "gpu", "gpu-mosaic"):
        name = f"{name}-interpret"
    return name


def write_kv_and_attend(
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
    impl: str = "auto",
    sinks: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """`write_kv(k_cache, v_cache, k, v, md.slot_mapping)` then `ragged_paged_attention`;
    returns (out, k_cache, v_cache). One fused call where the implementation has one (the CPU
    kernel, which writes in place), else the two ops."""
    validate_inputs(q, k_cache, v_cache, md, sliding_window=sliding_window, soft_cap=soft_cap,
                    sinks=sinks)
    name = dispatch_name(impl, q, k_cache)
    if name in _FUSED_WRITE:
        return _FUSED_WRITE[name](q, k, v, k_cache, v_cache, md, sm_scale=sm_scale,
                                  sliding_window=sliding_window, soft_cap=soft_cap,
                                  **_sinks_arg(sinks))
    k_cache, v_cache = write_kv(k_cache, v_cache, k, v, md.slot_mapping,
                                impl=impl_for_attention(name))
    out = ragged_paged_attention(q, k_cache, v_cache, md, sm_scale=sm_scale,
                                 sliding_window=sliding_window, soft_cap=soft_cap, impl=impl,
                                 sinks=sinks)
    return out, k_cache, v_cache


def fused_rope_kernel(impl: str, q: jax.Array, k_cache: jax.Array) -> Callable | None:
    """The kernel `impl` dispatches to for these inputs when it also applies the rotary
    embedding to a layer's fused q/k/v product, writes K/V and attends, in one call (the
    signature of the CPU backend's `rope_write_kv_and_attend_cpu`); None when it has no such
    entry point
    (the model then composes `apply_rotary` and `write_kv_and_attend`)."""
    return _FUSED_ROPE.get(dispatch_name(impl, q, k_cache))


def ragged_paged_attention(
    q: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    md: AttentionMetadata,
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    impl: str = "auto",
    chunk_pages: int | None = None,
    interpret: bool = False,
    sinks: jax.Array | None = None,
) -> jax.Array:
    """Attention of a flat ragged batch of queries over one layer's paged KV cache.

    q: [T, Hq, D] (Hq a multiple of Hkv; query head h reads KV head h // (Hq // Hkv)).
    k_cache, v_cache: [N, page_size, Hkv * D], this layer's cache (`metadata.py`: the one
    layout every implementation reads and writes), already holding this step's
    K/V (`write_kv`); fp8 or int8 pages are read as they are, their scales folded into q and
    the output by the caller (`kv_quant.py`). Returns [T, Hq, D] in q.dtype; padding tokens get
    zeros.
    `sliding_window=W`: a token sees itself and the W - 1 previous positions (HF convention).
    `soft_cap`: scores = soft_cap * tanh(scores / soft_cap) after scaling.
    `sinks`: [Hq] float32 attention-sink logits (gpt-oss), an array like the weights, or None:
    head h's sink joins the softmax's denominator and has no value (`reference.py`).
    Exact semantics: `reference.py`. `impl`: "auto" | "reference" | "tpu" | "gpu" |
    "tpu-interpret" | "gpu-interpret"; `interpret=True` runs a kernel impl in interpret mode.
    Kernels need q and float caches to share one dtype. Raises ValueError on bad shapes/dtypes.
    """
    validate_inputs(q, k_cache, v_cache, md, sliding_window=sliding_window,
                    soft_cap=soft_cap, chunk_pages=chunk_pages, sinks=sinks)
    name = dispatch_name(impl, q, k_cache, interpret=interpret)
    if name not in ("reference", "cpu") and q.dtype != k_cache.dtype and not is_quantized(
            k_cache.dtype):
        raise ValueError(f"the {name} kernel needs q and the caches in one dtype; got q "
                         f"{q.dtype}, cache {k_cache.dtype}")
    return _REGISTRY.impls[name](
        q,
        k_cache,
        v_cache,
        md,
        sm_scale=sm_scale,
        sliding_window=sliding_window,
        soft_cap=soft_cap,
        chunk_pages=chunk_pages,
        **_sinks_arg(sinks),
    )


def _sinks_arg(sinks) -> dict:
    """The `sinks=` keyword an implementation gets: none at all without sinks (its call, and
    so its compiled code, is what it was before sinks existed), else the logits in float32."""
    return {} if sinks is None else {"sinks": sinks.astype(jnp.float32)}


def _register_kernels() -> None:
    from jaxserve.pallas_kernels.ragged_paged_attention import gpu, gpu_mosaic, tpu

    register_impl("tpu", tpu.ragged_paged_attention_tpu, tpu.supports)
    register_impl("gpu", gpu.ragged_paged_attention_gpu, gpu.supports)
    register_impl("gpu-mosaic", gpu_mosaic.ragged_paged_attention_gpu_mosaic, gpu_mosaic.supports)
    register_impl("tpu-interpret",
                  functools.partial(tpu.ragged_paged_attention_tpu, interpret=True), tpu.supports)
    register_impl("gpu-interpret",
                  functools.partial(gpu.ragged_paged_attention_gpu, interpret=True), gpu.supports)
    register_impl("gpu-mosaic-interpret",
                  functools.partial(gpu_mosaic.ragged_paged_attention_gpu_mosaic, interpret=True),
                  gpu_mosaic.supports)


_register_kernels()
