"""The attention metadata pytree: what one step tells attention about its ragged batch.

It lives with the kernels (the lowest layer) so that kernels, models and the runner share one
definition; `jaxserve.models.interface` re-exports it.

Conventions (T = padded token count, R = padded request count, P = pages per request row):

- The step's tokens are laid out flat: request r owns tokens
  `query_start_loc[r] : query_start_loc[r + 1]`. Requests `r >= num_seqs` are padding: their
  query range is empty (`query_start_loc[r] == query_start_loc[r + 1] == total live tokens`) and
  their `kv_lens` are 0. Tokens past `query_start_loc[num_seqs]` are padding tokens.
- `kv_lens[r]` counts every token of request r whose K/V is in the cache once this step's
  tokens are written: the cached context plus this step's queries. A query at flat index t of
  request r sits at sequence position `kv_lens[r] - (query_start_loc[r+1] - t)`, and attends
  causally to positions `<= ` its own.
- `block_tables[r, i]` is the physical page holding positions `[i*page_size, (i+1)*page_size)`
  of request r. Unused entries are 0 (the reserved null page).
- `slot_mapping[t] = page * page_size + offset` is where token t's new K/V is written.
  Padding tokens write into the null page (slots `0 .. page_size-1`), which nobody reads.

The KV cache is one pair of arrays per layer, `k_cache, v_cache: [N, page_size, Hkv * D]` (N
pages; a token's row holds its KV heads one after the other); the ops take one layer's pair.
Rows are lane-dense on a TPU: XLA:TPU tiles the two minor dimensions (page rows, Hkv * D) in
(8, 128) tiles, so a page is whole tiles, contiguous in HBM, which the TPU kernel DMAs as they
are, and a token's row is written in place. (A `[N, page_size, Hkv, D]` array is tiled on
(Hkv, D) instead, one token a tile: reading it as pages of `Hkv * D` lanes is a relayout of
the whole cache.) On GPUs and CPUs the arrays are row-major, so the per-head view
`head_view(cache, D)`, `[N, page_size, Hkv, D]`, is a free reshape. Separate arrays (not one
[L, ...] stack indexed by layer) let XLA update each in place: on XLA:CPU, slicing or updating
a stack at a layer index copies it.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class AttentionMetadata:
    block_tables: jax.Array  # [R, P] int32
    kv_lens: jax.Array  # [R] int32
    query_start_loc: jax.Array  # [R + 1] int32
    num_seqs: jax.Array  # [] int32
    slot_mapping: jax.Array  # [T] int32

    @property
    def num_tokens(self) -> int:
        return self.slot_mapping.shape[0]

    @property
    def max_num_seqs(self) -> int:
        return self.kv_lens.shape[0]


def token_request_index(md: AttentionMetadata) -> jax.Array:
    """[T] int32: the request each flat token belongs to (padding tokens map to num_seqs-1 or 0)."""
    t = jnp.arange(md.num_tokens, dtype=jnp.int32)
    # query_start_loc is non-decreasing; the request of token t is the last r with qsl[r] <= t.
    idx = jnp.searchsorted(md.query_start_loc[1:], t, side="right").astype(jnp.int32)
    return jnp.minimum(idx, md.max_num_seqs - 1)


def num_kv_heads(cache: jax.Array, head_dim: int) -> int:
    """The KV heads of a layer's cache `[N, page_size, Hkv * D]` whose heads are `head_dim`
    wide; ValueError when its rows are not whole heads."""
    if getattr(cache, "ndim", None) != 3:
        raise ValueError(f"a KV cache is [N, page_size, Hkv * D] (one layer); got shape "
                         f"{getattr(cache, 'shape', None)}")
    width = cache.shape[2]
    if head_dim < 1 or width % head_dim:
        raise ValueError(f"the cache's rows ({width} wide, shape {cache.shape}) are not whole "
                         f"heads of {head_dim}")
    return width // head_dim


def head_view(cache: jax.Array, head_dim: int) -> jax.Array:
    """The cache `[N, page_size, Hkv * D]` as `[N, page_size, Hkv, D]`: a free reshape of a
    row-major array (GPU, CPU); on a TPU a relayout of the whole array, which no step takes
    on a cache (only on pages gathered from it)."""
    n, ps, _ = cache.shape
    return cache.reshape(n, ps, num_kv_heads(cache, head_dim), head_dim)
