"""Host-side scheduling and KV-block allocation: pure Python, no JAX (see docs/DESIGN.md §3)."""

from jaxserve.core.block_pool import NULL_BLOCK_ID, BlockPool, KVCacheBlock
from jaxserve.core.kv_cache_manager import KVCacheManager, hash_block_tokens
from jaxserve.core.sched_output import ScheduledRequest, SchedulerOutput
from jaxserve.core.scheduler import Scheduler, SchedulerConfig, SchedulerStats

__all__ = [
    "NULL_BLOCK_ID",
    "BlockPool",
    "KVCacheBlock",
    "KVCacheManager",
    "ScheduledRequest",
    "Scheduler",
    "SchedulerConfig",
    "SchedulerOutput",
    "SchedulerStats",
    "hash_block_tokens",
]
