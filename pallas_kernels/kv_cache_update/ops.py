"""The single entry point for writing new K/V into one layer's paged KV cache.

Implementations are looked up by name in a registry (`pallas_kernels/registry.py`). Kernels register themselves with
`register_impl("tpu", fn)` / `register_impl("gpu", fn)`; `fn` takes the same positional
arguments as `write_kv` (k_cache, v_cache, k, v, slot_mapping).

The reference is one XLA scatter of T rows of `Hkv * D` elements into the donated per-layer
cache `[N, page_size, Hkv * D]`. Where XLA updates it in place (tests/pallas_kernels/
test_kv_write.py checks the HLO has no cache copy) it moves exactly the new bytes, which is all
a kernel could do: "gpu" (and "gpu-interpret") are the reference, and so is "tpu" for 16- and
32-bit caches. For one-byte caches, whose page rows XLA:TPU packs four to a 32-bit word
(`Hkv * D` a multiple of 128, pages of a multiple of 32), XLA's scatter rewrites the whole layer
array: "tpu" is then the Pallas write kernel (`kv_cache_update/tpu.py`), which touches only the
quads of rows it writes; "tpu-interpret" runs that kernel in Pallas interpret mode (any
backend). (Where `Hkv * D` is not a multiple of 128, e.g. 3 heads of 64, XLA:TPU puts the pages
in the lanes, and its scatter rewrites the layer array whatever the dtype; no row DMA reaches a
token there: the reference stays.) The attention op passes its own
implementation's name (`impl_for_attention`), so that a step compiled for TPUs on another host
(`shard-plan`) writes with the TPU kernel too.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax

from jaxserve.pallas_kernels.kv_cache_update import tpu
from jaxserve.pallas_kernels.kv_cache_update.reference import write_kv_reference
from jaxserve.pallas_kernels.registry import ImplRegistry


def _write_kv_tpu(k_cache, v_cache, k, v, slot_mapping, *, interpret: bool = False):
    """The TPU kernel where XLA's scatter is not in place (`tpu.supports`), else the scatter."""
    try:
        tpu.supports(k_cache)
    except ValueError:
        return write_kv_reference(k_cache, v_cache, k, v, slot_mapping)
    return tpu.write_kv_tpu(k_cache, v_cache, k, v, slot_mapping, interpret=interpret)


_REGISTRY = ImplRegistry(
    "write_kv",
    {
        "reference": write_kv_reference,
        "tpu": _write_kv_tpu,
        "tpu-interpret": functools.partial(_write_kv_tpu, interpret=True),
        # The reference scatter (see the module docstring).
        "gpu": write_kv_reference,
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


def impl_for_attention(attention_impl: str) -> str:
    """The write implementation that goes with the attention implementation `attention_impl`
    (a resolved name): the same name where the write has one ("tpu", "tpu-interpret", ...),
    else "auto"."""
    return attention_impl if attention_impl in _REGISTRY.impls else "auto"


def write_kv(
    k_cache: jax.Array,
    v_cache: jax.Array,
    k: jax.Array,
    v: jax.Array,
    slot_mapping: jax.Array,
    *,
    impl: str = "auto",
) -> tuple[jax.Array, jax.Array]:
    """Write `k`, `v` ([T, Hkv, D]) into one layer's caches ([N, page_size, Hkv * D]).

    Token t goes to `slot_mapping[t] = page * page_size + offset`. Returns the updated
    `(k_cache, v_cache)`; the update is in place when the caches are donated (or are a loop
    carry). See `kv_cache_update/reference.py` for the exact semantics.
    """
    return _REGISTRY.impls[resolve_impl(impl)](k_cache, v_cache, k, v, slot_mapping)
