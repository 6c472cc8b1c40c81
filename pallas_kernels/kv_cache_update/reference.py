"""Pure-JAX reference for writing this step's new K/V into one layer's paged KV cache.

The cache is one pair of arrays per layer, each `[N, page_size, Hkv * D]` (see
`ragged_paged_attention/metadata.py`). The write is ONE `lax.scatter` of the step's T rows
(`Hkv * D` elements each) at their (page, offset) slots. When the caches are donated (or are a loop carry), XLA updates the
scatter's operand in place, so the write moves only the new bytes.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

_DNUMS = lax.ScatterDimensionNumbers(
    update_window_dims=(1,),  # updates [T, Hkv * D]: a token's row is the window
    inserted_window_dims=(0, 1),  # page and in-page offset are indexed, not windowed
    scatter_dims_to_operand_dims=(0, 1),
)


def _write_one(cache: jax.Array, indices: jax.Array, new: jax.Array) -> jax.Array:
    return lax.scatter(
        cache,
        indices,
        new.astype(cache.dtype),
        _DNUMS,
        indices_are_sorted=False,
        # Padding tokens all write to the null page and may share a slot: not unique.
        unique_indices=False,
        # Out-of-range slots are dropped rather than clamped onto a live page.
        mode=lax.GatherScatterMode.FILL_OR_DROP,
    )


def scatter_indices(slot_mapping: jax.Array, page_size: int) -> jax.Array:
    """[T, 2] int32 (page, offset) scatter indices for `slot_mapping`."""
    slots = slot_mapping.astype(jnp.int32)
    return jnp.stack([slots // page_size, slots % page_size], axis=-1)


def write_kv_reference(
    k_cache: jax.Array,
    v_cache: jax.Array,
    k: jax.Array,
    v: jax.Array,
    slot_mapping: jax.Array,
) -> tuple[jax.Array, jax.Array]:
    """Scatter `k`, `v` ([T, Hkv, D]) into `k_cache`, `v_cache` ([N, page_size, Hkv * D]).

    Token t goes to page `slot_mapping[t] // page_size`, offset `slot_mapping[t] % page_size`.
    New values are cast to the cache dtype. Slots outside the cache are dropped. If several
    tokens share a slot (padding tokens writing the null page) which one wins is unspecified.
    """
    if k_cache.ndim != 3 or v_cache.shape != k_cache.shape:
        raise ValueError(
            f"k_cache/v_cache must both be [N, page_size, Hkv * D] (one layer); got "
            f"{k_cache.shape} and {v_cache.shape}"
        )
    _, page_size, width = k_cache.shape
    t = slot_mapping.shape[0]
    if k.ndim != 3 or k.shape[0] != t or k.shape[1] * k.shape[2] != width or v.shape != k.shape:
        raise ValueError(
            f"k and v must be [T={t}, Hkv, D] with Hkv * D = {width} to match the cache and "
            f"slot_mapping; got {k.shape} and {v.shape}"
        )
    idx = scatter_indices(slot_mapping, page_size)
    return (_write_one(k_cache, idx, k.reshape(t, width)),
            _write_one(v_cache, idx, v.reshape(t, width)))
