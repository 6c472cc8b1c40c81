"""The paged KV cache on the device: allocation with its sharding, and sizing from a budget."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from jaxserve.models.arch_config import ArchConfig
from jaxserve.models.interface import KV_CACHE_AXES, KVCache
from jaxserve.models.sharding import named_sharding


def kv_cache_shape(cfg: ArchConfig, num_pages: int, page_size: int) -> tuple[int, ...]:
    """The shape of one layer's K (or V) array."""
    return (num_pages, page_size, cfg.num_kv_heads, cfg.head_dim)


def bytes_per_page(cfg: ArchConfig, page_size: int, dtype) -> int:
    """Bytes of K and V for one page across all layers."""
    return 2 * cfg.num_layers * page_size * cfg.num_kv_heads * cfg.head_dim * jnp.dtype(dtype).itemsize


def num_pages_for_budget(cfg: ArchConfig, page_size: int, dtype, budget_bytes: int) -> int:
    n = int(budget_bytes // bytes_per_page(cfg, page_size, dtype))
    if n < 2:
        raise ValueError(
            f"a KV cache budget of {budget_bytes / 2**20:.1f} MiB holds fewer than 2 pages of "
            f"{page_size} tokens; raise the KV cache memory."
        )
    return n


def kv_cache_sharding(cfg: ArchConfig, num_pages: int, page_size: int, mesh: Mesh):
    return named_sharding(KV_CACHE_AXES, kv_cache_shape(cfg, num_pages, page_size), mesh)


def allocate_kv_cache(cfg: ArchConfig, num_pages: int, page_size: int, dtype, mesh: Mesh) -> KVCache:
    """Zeroed K and V pages (one array each per layer), created directly in their sharding."""
    shape = kv_cache_shape(cfg, num_pages, page_size)
    sharding = kv_cache_sharding(cfg, num_pages, page_size, mesh)
    zeros = jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=sharding)
    L = cfg.num_layers
    return KVCache(k=tuple(zeros() for _ in range(L)), v=tuple(zeros() for _ in range(L)))
