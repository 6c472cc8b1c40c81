"""Pure-JAX reference for writing this step's new K/V into the paged, layer-stacked KV cache.

The cache layout is `[L, N, page_size, Hkv, D]` (see `ragged_paged_attention/metadata.py`).
The write is ONE `lax.scatter` on the full stacked array with the layer folded into the scatter
indices. That matters: inside a `lax.scan` whose carry holds the (donated) caches, XLA updates a
scatter's operand in place, whereas `cache[layer]` slicing followed by `.at[layer].set(...)`
makes it materialise a layer-sized temporary and, in some layouts, copy the whole cache.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

_DNUMS = lax.ScatterDimensionNumbers(
    update_window_dims=(1, 2),  # updates [T, Hkv, D]: Hkv and D are window dims
    inserted_window_dims=(0, 1, 2),  # layer, page and in-page offset are indexed, not windowed
    scatter_dims_to_operand_dims=(0, 1, 2),
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


def scatter_indices(layer, slot_mapping: jax.Array, page_size: int) -> jax.Array:
    """[T, 3] int32 (layer, page, offset) scatter indices for `slot_mapping`."""
    slots = slot_mapping.astype(jnp.int32)
    layer_col = jnp.broadcast_to(jnp.asarray(layer, jnp.int32), slots.shape)
    return jnp.stack([layer_col, slots // page_size, slots % page_size], axis=-1)


def write_kv_reference(
    k_cache: jax.Array,
    v_cache: jax.Array,
    layer,
    k: jax.Array,
    v: jax.Array,
    slot_mapping: jax.Array,
) -> tuple[jax.Array, jax.Array]:
    """Scatter `k`, `v` ([T, Hkv, D]) into `k_cache`, `v_cache` ([L, N, page_size, Hkv, D]).

    Token t goes to layer `layer`, page `slot_mapping[t] // page_size`, offset
    `slot_mapping[t] % page_size`. `layer` may be a Python int or a traced int32 scalar. New values
    are cast to the cache dtype. Slots outside the cache are dropped. If several tokens share a
    slot (padding tokens writing the null page) which one wins is unspecified.
    """
    if k_cache.ndim != 5 or v_cache.shape != k_cache.shape:
        raise ValueError(
            f"k_cache/v_cache must both be [L, N, page_size, Hkv, D]; got {k_cache.shape} and "
            f"{v_cache.shape}"
        )
    _, _, page_size, hkv, d = k_cache.shape
    t = slot_mapping.shape[0]
    if k.shape != (t, hkv, d) or v.shape != (t, hkv, d):
        raise ValueError(
            f"k and v must be [T={t}, Hkv={hkv}, D={d}] to match the cache and slot_mapping; "
            f"got {k.shape} and {v.shape}"
        )
    if isinstance(layer, int) and not 0 <= layer < k_cache.shape[0]:
        raise ValueError(f"layer {layer} out of range for a cache of {k_cache.shape[0]} layers")
    idx = scatter_indices(layer, slot_mapping, page_size)
    return _write_one(k_cache, idx, k), _write_one(v_cache, idx, v)
