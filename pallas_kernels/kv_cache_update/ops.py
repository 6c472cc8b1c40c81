"""The single entry point for writing new K/V into one layer's paged KV cache.

Implementations are looked up by name in a registry (`pallas_kernels/registry.py`). Kernels register themselves with
`register_impl("tpu", fn)` / `register_impl("gpu", fn)`; `fn` takes the same positional
arguments as `write_kv` (k_cache, v_cache, k, v, slot_mapping).

No Pallas write kernel, on purpose: "tpu", "gpu" (and their "-interpret" names, so that one
`attention_impl` string can name both ops) are registered as the reference scatter. The write is
one XLA scatter of T rows of `Hkv * D` contiguous elements into the donated per-layer cache,
updated in place (tests/pallas_kernels/test_kv_write.py checks the HLO has no cache copy): it
moves exactly the new bytes, which is all a kernel could do, and XLA fuses the index
computation. A Pallas kernel would need `input_output_aliases` on the cache plus per-token DMAs,
and would break XLA's in-place scatter buffer sharing analysis for no bandwidth gain. A fused
write inside the attention kernel is the one variant that could save a launch; it is left for
when profiles show the scatter matters.
"""

from __future__ import annotations

from collections.abc import Callable

import jax

from jaxserve.pallas_kernels.kv_cache_update.reference import write_kv_reference
from jaxserve.pallas_kernels.registry import ImplRegistry

_REGISTRY = ImplRegistry(
    "write_kv",
    {
        "reference": write_kv_reference,
        # Explicit fallbacks to the reference scatter (see the module docstring for why).
        "tpu": write_kv_reference,
        "gpu": write_kv_reference,
        "tpu-interpret": write_kv_reference,
        "gpu-interpret": write_kv_reference,
    },
    known_kernels=("tpu", "gpu"),
)


def register_impl(name: str, fn: Callable) -> None:
    """Register (or replace) implementation `name` of `write_kv`."""
    _REGISTRY.register(name, fn)


def available_impls() -> tuple[str, ...]:
    return _REGISTRY.available()


def resolve_impl(impl: str, backend: str | None = None) -> str:
    """The implementation name `impl` dispatches to on `backend` (default: JAX's default)."""
    return _REGISTRY.resolve(impl, backend)


def write_kv(
    k_cache: jax.Array,
    v_cache: jax.Array,
    k: jax.Array,
    v: jax.Array,
    slot_mapping: jax.Array,
    *,
    impl: str = "auto",
) -> tuple[jax.Array, jax.Array]:
    """Write `k`, `v` ([T, Hkv, D]) into one layer's caches ([N, page_size, Hkv, D]).

    Token t goes to `slot_mapping[t] = page * page_size + offset`. Returns the updated
    `(k_cache, v_cache)`; the update is in place when the caches are donated (or are a loop
    carry). See `kv_cache_update/reference.py` for the exact semantics.
    """
    return _REGISTRY.impls[resolve_impl(impl)](k_cache, v_cache, k, v, slot_mapping)
