"""Attention and KV-cache kernels: one entry point per op, several implementations each."""

from jaxserve.pallas_kernels.kv_cache_update.ops import write_kv
from jaxserve.pallas_kernels.ragged_paged_attention.metadata import AttentionMetadata
from jaxserve.pallas_kernels.ragged_paged_attention.ops import (
    ragged_paged_attention,
    write_kv_and_attend,
)

__all__ = ["AttentionMetadata", "ragged_paged_attention", "write_kv", "write_kv_and_attend"]
