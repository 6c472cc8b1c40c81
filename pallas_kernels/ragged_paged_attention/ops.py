"""The single attention entry point the models call: `ragged_paged_attention(..., impl=...)`.

Implementations are looked up by name in `_IMPLS`. A kernel registers itself with
`register_impl("tpu", fn)` (or "gpu", or any new name); `fn` must accept the same arguments as
`ragged_paged_attention_reference`: `(q, k_cache, v_cache, layer, md, *, sm_scale,
sliding_window, soft_cap, chunk_pages)` (a kernel may ignore `chunk_pages`). `impl="auto"` picks
the kernel registered under the name of JAX's default backend, and falls back to the
pure-JAX reference (the CPU default) when there is none.
"""

from __future__ import annotations

import logging
from typing import Callable

import jax

from jaxserve.pallas_kernels.ragged_paged_attention.metadata import AttentionMetadata
from jaxserve.pallas_kernels.ragged_paged_attention.reference import (
    ragged_paged_attention_reference,
)

log = logging.getLogger(__name__)

_IMPLS: dict[str, Callable] = {"reference": ragged_paged_attention_reference}
_KNOWN_KERNELS = ("tpu", "gpu")
_warned_fallback: set[str] = set()


def register_impl(name: str, fn: Callable) -> None:
    """Register (or replace) implementation `name` of `ragged_paged_attention`."""
    if name == "auto":
        raise ValueError("'auto' is a dispatch mode, not an implementation name")
    _IMPLS[name] = fn


def available_impls() -> tuple[str, ...]:
    return tuple(_IMPLS)


def resolve_impl(impl: str, backend: str | None = None) -> str:
    """The implementation name `impl` dispatches to on `backend` (default: JAX's default)."""
    if impl == "auto":
        backend = backend or jax.default_backend()
        if backend in _IMPLS:
            return backend
        if backend != "cpu" and backend not in _warned_fallback:
            _warned_fallback.add(backend)
            log.warning(
                "ragged_paged_attention: no %r kernel registered; using the pure-JAX reference",
                backend,
            )
        return "reference"
    if impl in _IMPLS:
        return impl
    if impl in _KNOWN_KERNELS:
        raise ValueError(
            f"ragged_paged_attention impl={impl!r}: the {impl} kernel is not available yet "
            f"(not implemented); available: {sorted(_IMPLS)} or 'auto'"
        )
    raise ValueError(
        f"ragged_paged_attention: unknown impl {impl!r}; available: {sorted(_IMPLS)} or 'auto'"
    )


def ragged_paged_attention(
    q: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    layer,
    md: AttentionMetadata,
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    impl: str = "auto",
    chunk_pages: int | None = None,
) -> jax.Array:
    """Attention of a flat ragged batch of queries over the paged, layer-stacked KV cache.

    q: [T, Hq, D] (Hq a multiple of Hkv; query head h reads KV head h // (Hq // Hkv)).
    k_cache, v_cache: [L, N, page_size, Hkv, D], already holding this step's K/V (`write_kv`).
    layer: Python int or traced int32 scalar. Returns [T, Hq, D] in q.dtype; padding tokens get
    zeros. `sliding_window=W`: a token sees itself and the W - 1 previous positions (HF
    convention). `soft_cap`: scores = soft_cap * tanh(scores / soft_cap) after scaling.
    Exact semantics: `reference.py`.
    """
    return _IMPLS[resolve_impl(impl)](
        q,
        k_cache,
        v_cache,
        layer,
        md,
        sm_scale=sm_scale,
        sliding_window=sliding_window,
        soft_cap=soft_cap,
        chunk_pages=chunk_pages,
    )
