"""BlockPool: every KV-cache block, its reference count, its prefix-cache hash, the free queue.

- Block 0 is the null block: padding slots write into it. It is never allocated, never freed
  and never appears in the free queue.
- A block is *in use* while `ref_cnt > 0` (one reference per request whose block table holds
  it) and *free* when `ref_cnt == 0`. Every free block sits in the free queue.
- A free block may still be *cached* (it has a `block_hash` and is registered in the hash
  map): a later request with the same prefix can take it back with `touch`, which removes it
  from the free queue. Allocation takes free blocks from the head of the queue and evicts
  (drops the hash of) a cached one it takes.
- Eviction order: freed cached blocks go to the tail, so the least recently freed cached block
  is evicted first (LRU). Freed blocks without a hash hold nothing reusable and go to the head,
  to be reused before any cached block.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Iterable
from dataclasses import dataclass

NULL_BLOCK_ID = 0


@dataclass(slots=True, eq=False)
class KVCacheBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: Hashable | None = None  # set while the block is registered in the prefix cache

    @property
    def is_null(self) -> bool:
        return self.block_id == NULL_BLOCK_ID


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 2:
            raise ValueError(
                f"num_blocks must be at least 2 (block 0 is reserved), got {num_blocks}."
            )
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks: list[KVCacheBlock] = [KVCacheBlock(i) for i in range(num_blocks)]
        self.null_block = self.blocks[NULL_BLOCK_ID]
        # Head = next to be allocated (and evicted). Holds exactly the blocks with ref_cnt 0.
        self._free: OrderedDict[int, KVCacheBlock] = OrderedDict(
            (b.block_id, b) for b in self.blocks[1:]
        )
        self._cached: dict[Hashable, KVCacheBlock] = {}  # block hash -> block

    # ------------------------------------------------------------------ queries
    def get_num_free_blocks(self) -> int:
        """Blocks that can be allocated now (including cached ones that would be evicted)."""
        return len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of allocatable blocks in use (0.0 … 1.0)."""
        return 1.0 - len(self._free) / (self.num_blocks - 1)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    def get_cached_block(self, block_hash: Hashable) -> KVCacheBlock | None:
        return self._cached.get(block_hash)

    def is_free(self, block: KVCacheBlock) -> bool:
        return block.block_id in self._free

    def free_block_ids(self) -> list[int]:
        """Free block ids in allocation order (head first). For tests and debugging."""
        return list(self._free)

    # ------------------------------------------------------------------ allocation
    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Take `num_blocks` blocks from the head of the free queue (evicting cached ones)."""
        if num_blocks > len(self._free):
            raise RuntimeError(f"cannot allocate {num_blocks} blocks: {len(self._free)} free")
        out = []
        for _ in range(num_blocks):
            _, block = self._free.popitem(last=False)
            assert block.ref_cnt == 0, block
            self._evict(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take one more reference on each block (a prefix-cache hit); a free cached block
        leaves the free queue."""
        for block in blocks:
            assert not block.is_null
            if block.ref_cnt == 0:
                del self._free[block.block_id]
            block.ref_cnt += 1

    def free_blocks(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference on each block. Blocks reaching zero join the free queue in the
        order given: earlier ones are evicted first (pass a request's blocks reversed)."""
        for block in blocks:
            assert not block.is_null and block.ref_cnt > 0, block
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._free[block.block_id] = block
                if block.block_hash is None:
                    self._free.move_to_end(block.block_id, last=False)

    # ------------------------------------------------------------------ prefix cache
    def cache_full_blocks(
        self,
        blocks: list[KVCacheBlock],
        block_hashes: list[Hashable],
        num_cached_blocks: int,
        num_full_blocks: int,
    ) -> None:
        """Register blocks[num_cached_blocks:num_full_blocks] under their hashes.

        `blocks` is a request's block table, `block_hashes` its hash chain (at least
        `num_full_blocks` long). When another block already holds the same hash (two requests
        computed the same content concurrently) the newcomer stays uncached.
        """
        if not self.enable_caching:
            return
        for i in range(num_cached_blocks, num_full_blocks):
            block, h = blocks[i], block_hashes[i]
            if block.block_hash is not None:
                assert block.block_hash == h, (block, h)
                continue
            if h not in self._cached:
                block.block_hash = h
                self._cached[h] = block

    def uncache(self, block_ids: Iterable[int]) -> None:
        """Drop these blocks from the prefix cache (their KV was never written: the step that
        was to fill them did not run); their references are untouched."""
        for block_id in block_ids:
            self._evict(self.blocks[block_id])

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block. Only possible when no block is in use; returns success."""
        if len(self._free) != self.num_blocks - 1:
            return False
        for block in self._cached.values():
            block.block_hash = None
        self._cached.clear()
        return True

    def _evict(self, block: KVCacheBlock) -> None:
        if block.block_hash is None:
            return
        if self._cached.get(block.block_hash) is block:
            del self._cached[block.block_hash]
        block.block_hash = None
