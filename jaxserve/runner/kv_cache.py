"""The paged KV cache on the device: allocation with its sharding, and sizing from a budget."""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding

from jaxserve.models.arch_config import ArchConfig
from jaxserve.models.interface import KV_CACHE_AXES, KVCache
from jaxserve.models.sharding import (
    DEFAULT_RULES,
    Rules,
    logical_to_spec,
    merge_minor_dims,
    mesh_axes_size,
)


def kv_cache_shape(cfg: ArchConfig, num_pages: int, page_size: int) -> tuple[int, ...]:
    """The shape of one layer's K (or V) array: `[N, page_size, Hkv * D]`, a token's KV heads in
    one row (the layout every attention implementation reads and the KV write writes:
    `ragged_paged_attention/metadata.py`); the same for every layer (see
    `ArchConfig.kv_cache_heads` for models whose layers differ). An MLA model (DeepSeek) has
    one such array per layer, its rows the latent rows (one "head" of `kv_cache_head_dim`),
    and no V arrays (`ArchConfig.kv_cache_arrays`)."""
    return (num_pages, page_size, cfg.kv_cache_heads * cfg.kv_cache_head_dim)


def kv_head_shape(cfg: ArchConfig, num_pages: int, page_size: int) -> tuple[int, ...]:
    """The per-head view of one layer's array, `[N, page_size, Hkv, D]`: the shape
    `KV_CACHE_AXES` name (how the rules split the cache is decided on heads)."""
    return (num_pages, page_size, cfg.kv_cache_heads, cfg.kv_cache_head_dim)


def kv_cache_spec(cfg: ArchConfig, num_pages: int, page_size: int, mesh: Mesh, rules: Rules | None = None):
    """The PartitionSpec of one layer's array of `num_pages` pages: the rules' split of the
    per-head view (the pages over "data" with data parallelism, when they divide), its heads and
    head_dim merged into the row (a head split stays whole heads on each device)."""
    return merge_minor_dims(logical_to_spec(KV_CACHE_AXES, kv_head_shape(cfg, num_pages, page_size),
                                            mesh, _rules(rules)))


def bytes_per_page(cfg: ArchConfig, page_size: int, dtype, mesh: Mesh | None = None,
                   rules: Rules | None = None) -> int:
    """Bytes of K and V (MLA: the latent rows) for one page across all layers: on one device
    of `mesh` (the KV heads split as the rules say), or in all (no mesh)."""
    heads = cfg.kv_cache_heads
    if mesh is not None:
        spec = logical_to_spec(KV_CACHE_AXES, kv_head_shape(cfg, 1, page_size), mesh, _rules(rules))
        heads //= mesh_axes_size(mesh, spec[2])
    itemsize = jnp.dtype(dtype).itemsize
    return (cfg.kv_cache_arrays * cfg.num_kv_cache_layers * page_size * heads
            * cfg.kv_cache_head_dim * itemsize)


def num_pages_for_budget(cfg: ArchConfig, page_size: int, dtype, budget_bytes: int, mesh: Mesh | None = None,
                         rules: Rules | None = None, extra_bytes_per_page: int = 0) -> int:
    """Pages that fit a per-device budget (each device holds its KV heads of every page, and
    `extra_bytes_per_page` more: an EAGLE-3 head's layer)."""
    n = int(budget_bytes // (bytes_per_page(cfg, page_size, dtype, mesh, rules) + extra_bytes_per_page))
    if n < 2:
        raise ValueError(
            f"a KV cache budget of {budget_bytes / 2**20:.1f} MiB holds fewer than 2 pages of "
            f"{page_size} tokens; raise the KV cache memory."
        )
    return n


def _rules(rules: Rules | None) -> Rules:
    return DEFAULT_RULES if rules is None else rules


def kv_cache_sharding(cfg: ArchConfig, num_pages: int, page_size: int, mesh: Mesh, rules: Rules | None = None):
    return NamedSharding(mesh, kv_cache_spec(cfg, num_pages, page_size, mesh, rules))


def abstract_kv_cache(cfg: ArchConfig, num_pages: int, page_size: int, dtype, mesh: Mesh,
                      rules: Rules | None = None) -> KVCache:
    """The KV cache `allocate_kv_cache` would make, as ShapeDtypeStructs (no memory)."""
    shape = kv_cache_shape(cfg, num_pages, page_size)
    one = jax.ShapeDtypeStruct(shape, jnp.dtype(dtype), sharding=kv_cache_sharding(cfg, num_pages, page_size,
                                                                                   mesh, rules))
    L = cfg.num_kv_cache_layers
    return KVCache(k=(one,) * L, v=(one,) * L if cfg.kv_cache_arrays == 2 else ())


def zeros_compiler(one: jax.ShapeDtypeStruct) -> Callable[[], jax.stages.Compiled]:
    """Compiles the function that makes one zeroed layer array like `one` (shape, dtype, sharding)."""
    return lambda: jax.jit(lambda: jnp.zeros(one.shape, one.dtype), out_shardings=one.sharding).lower().compile()


def allocate_kv_cache(cfg: ArchConfig, num_pages: int, page_size: int, dtype, mesh: Mesh,
                      rules: Rules | None = None, zeros: Callable[[], jax.Array] | None = None) -> KVCache:
    """Zeroed K and V pages (one array each per layer; MLA: K only), created directly in their
    sharding.
    `zeros`: the compiled function making one (`zeros_compiler`; compiled here when not given)."""
    if zeros is None:
        zeros = zeros_compiler(abstract_kv_cache(cfg, num_pages, page_size, dtype, mesh, rules).k[0])()
    L = cfg.num_kv_cache_layers
    v = tuple(zeros() for _ in range(L)) if cfg.kv_cache_arrays == 2 else ()
    return KVCache(k=tuple(zeros() for _ in range(L)), v=v)
