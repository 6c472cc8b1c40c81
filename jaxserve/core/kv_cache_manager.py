"""KVCacheManager: the scheduler's view of the KV cache — block tables and the prefix cache.

Each request owns a list of blocks (its block table row): token at position `p` lives in
slot `p % block_size` of block `blocks[p // block_size]`. Full blocks are identified by a hash
chain, SHA-256 over (parent digest, the block's token ids, cache_salt), so equal hashes mean
equal prefixes; a request admitted later whose prefix hashes match takes those blocks by reference
(`get_computed_blocks`, then `allocate_slots(..., new_computed_blocks)`).

Blocks are registered in the prefix cache at allocation time, for every block that will be
full once the step being scheduled has run and whose tokens are all known (with overlapped
steps the last token may still be in flight: its block is registered at the next allocation). A request scheduled later *in the same step* may
therefore read a block that another request of that step is writing. Runner contract: in each
layer, write the KV of every scheduled token into the cache before any attention reads it
(this is what lets `n > 1` samples of one prompt, added together, share the prompt's blocks
from their first step).

Sharing is by reference count only: a shared block is always full and never written again.
A later `fork(parent, child)` for parallel sampling fits the same scheme (touch the parent's
full blocks into the child's table); until then the prefix cache gives the same sharing.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

from jaxserve.core.block_pool import BlockPool, KVCacheBlock
from jaxserve.request import Request


_NO_PARENT = bytes(32)


def hash_block_tokens(
    parent_hash: bytes | None, token_ids: Sequence[int], extra_key: str | None, lora_id: int = 0
) -> bytes:
    """SHA-256 digest of one full block, chained on the digest of the block before it (None for
    the first) and keyed by `extra_key` (the request's cache_salt).

    A cryptographic hash because a hit hands over another request's KV: with a 64-bit hash such
    as Python's `hash`, a client could craft a prompt whose blocks collide with someone else's
    and be served (or leak) their context. vLLM hashes blocks with SHA-256 for the same reason.
    The encoding is unambiguous: 32 bytes of parent, 8 bytes per token, the LoRA adapter's id
    when there is one (tagged, 8 bytes), then the salt, tagged: a block computed with an adapter
    is never served to a request of another adapter or of the base model.
    """
    h = hashlib.sha256(parent_hash if parent_hash is not None else _NO_PARENT)
    h.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    if lora_id:
        h.update(b"\x02" + struct.pack("<q", lora_id))
    if extra_key is None:
        h.update(b"\x00")
    else:
        h.update(b"\x01" + extra_key.encode("utf-8"))
    return h.digest()


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    def __init__(
        self,
        block_size: int,
        num_blocks: int,
        enable_caching: bool = True,
        max_model_len: int | None = None,
    ) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}.")
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.max_model_len = max_model_len
        self.pool = BlockPool(num_blocks, enable_caching)
        if max_model_len is not None and (num_blocks - 1) * block_size < max_model_len:
            raise ValueError(
                f"The KV cache ({num_blocks - 1} usable blocks of {block_size} tokens) cannot "
                f"hold one sequence of max_model_len={max_model_len} tokens; give it more "
                "memory or lower max_model_len."
            )
        self._req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # How many leading blocks of each request are registered in the prefix cache.
        self._num_cached_blocks: dict[str, int] = {}
        # Prefix-cache statistics, in tokens, counted once per admission of a request.
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

    # ------------------------------------------------------------------ queries
    @property
    def usage(self) -> float:
        return self.pool.usage

    def get_num_free_blocks(self) -> int:
        return self.pool.get_num_free_blocks()

    @property
    def max_num_blocks_per_request(self) -> int | None:
        """Width of a block table row (None without max_model_len)."""
        if self.max_model_len is None:
            return None
        return cdiv(self.max_model_len, self.block_size)

    def get_block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self._req_to_blocks.get(request_id, ())]

    # ------------------------------------------------------------------ prefix cache
    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """The longest cached prefix of `request`, as (blocks, number of tokens).

        Only full blocks hit, and the last known token is always recomputed (its logits are
        needed to sample), so at most `(num_tokens - 1) // block_size` blocks hit. For a new
        request num_tokens is the prompt length; a request resumed after preemption may also
        hit blocks that hold its earlier output. No side effects: the blocks are only taken
        (and statistics counted) by a successful `allocate_slots`.
        """
        if not self.enable_caching or request.skip_prefix_cache:
            return [], 0
        max_hit_blocks = (request.num_tokens - 1) // self.block_size
        self._update_block_hashes(request, max_hit_blocks)
        hits: list[KVCacheBlock] = []
        for h in request.block_hashes[:max_hit_blocks]:
            block = self.pool.get_cached_block(h)
            if block is None:
                break
            hits.append(block)
        return hits, len(hits) * self.block_size

    def reset_prefix_cache(self) -> bool:
        return self.pool.reset_prefix_cache()

    # ------------------------------------------------------------------ allocation
    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: list[KVCacheBlock] | None = None,
        num_draft_tokens: int = 0,
        num_lookahead_tokens: int = 0,
    ) -> list[int] | None:
        """Make room for `num_new_tokens` more tokens after the request's computed ones, the
        last `num_draft_tokens` of them speculative drafts (never registered in the prefix
        cache: only blocks of known tokens are), or the last `num_lookahead_tokens` of them
        tokens not sampled yet (a decode block's later steps, which the device feeds back).

        `new_computed_blocks` (a prefix-cache hit from `get_computed_blocks`) may only be given
        when the request holds no blocks yet, i.e. at admission; the tokens they cover come
        before the new ones. Returns the ids of the newly allocated blocks (possibly empty), or
        None when the free blocks do not suffice — then nothing has changed.
        """
        rid = request.request_id
        if not new_computed_blocks:  # the common case: a running request's next tokens
            held = self._req_to_blocks.get(rid)
            if held is not None:
                num_total = request.num_computed_tokens + num_new_tokens
                if num_total <= len(held) * self.block_size:  # nothing to allocate
                    if (self.enable_caching and min(num_total, request.num_tokens) // self.block_size
                            > self._num_cached_blocks[rid]):
                        self._cache_full_blocks(request, held, num_total)
                    return []
        assert num_new_tokens >= 0
        hits = new_computed_blocks or []
        req_blocks = self._req_to_blocks.get(rid)
        assert not hits or not req_blocks, "prefix hits are only taken at admission"
        num_computed = request.num_computed_tokens + len(hits) * self.block_size
        num_total = num_computed + num_new_tokens  # tokens with KV after this step
        assert num_total <= (request.num_tokens + request.num_output_placeholders + num_draft_tokens
                             + num_lookahead_tokens), (
            num_total, request.num_tokens)
        if self.max_model_len is not None:
            assert num_total <= self.max_model_len, (num_total, self.max_model_len)

        num_held = len(req_blocks or ()) + len(hits)
        num_new_blocks = max(0, cdiv(num_total, self.block_size) - num_held)
        # Hit blocks that are free (cached, ref 0) leave the free queue when taken.
        num_free_hits = sum(1 for b in hits if b.ref_cnt == 0)
        if num_new_blocks + num_free_hits > self.pool.get_num_free_blocks():
            return None

        if req_blocks is None:
            req_blocks = self._req_to_blocks[rid] = []
            self._num_cached_blocks[rid] = 0
            if self.enable_caching and not request.skip_prefix_cache:
                self.prefix_cache_queries += request.num_tokens
                self.prefix_cache_hits += len(hits) * self.block_size
        self.pool.touch(hits)
        req_blocks.extend(hits)
        self._num_cached_blocks[rid] += len(hits)
        new_blocks = self.pool.get_new_blocks(num_new_blocks)
        req_blocks.extend(new_blocks)
        if self.enable_caching:
            self._cache_full_blocks(request, req_blocks, num_total)
        return [b.block_id for b in new_blocks]

    def num_new_blocks(self, request: Request, num_new_tokens: int) -> int:
        """Blocks `allocate_slots(request, num_new_tokens)` would take from the free queue (a
        running request's: no prefix hits)."""
        num_total = request.num_computed_tokens + num_new_tokens
        return max(0, cdiv(num_total, self.block_size) - len(self._req_to_blocks.get(request.request_id, ())))

    def free(self, request: Request) -> None:
        """Release the request's blocks (no-op when it holds none). Its tail blocks are
        evicted before its head blocks, which are the more likely to be shared prefixes."""
        rid = request.request_id
        blocks = self._req_to_blocks.pop(rid, None)
        self._num_cached_blocks.pop(rid, None)
        if blocks:
            self.pool.free_blocks(reversed(blocks))

    # ------------------------------------------------------------------ internals
    def _cache_full_blocks(
        self, request: Request, req_blocks: list[KVCacheBlock], num_total: int
    ) -> None:
        rid = request.request_id
        # Only blocks whose tokens are all known can be hashed (a token sampled by a step in
        # flight is not); such a block is cached at a later allocation.
        num_full = min(num_total, request.num_tokens) // self.block_size
        num_cached = self._num_cached_blocks[rid]
        if num_full <= num_cached:
            return
        self._update_block_hashes(request, num_full)
        self.pool.cache_full_blocks(req_blocks, request.block_hashes, num_cached, num_full)
        self._num_cached_blocks[rid] = num_full

    def _update_block_hashes(self, request: Request, num_blocks: int) -> None:
        """Extend the request's hash chain to cover its first `num_blocks` blocks."""
        hashes = request.block_hashes
        bs = self.block_size
        parent = hashes[-1] if hashes else None
        for i in range(len(hashes), num_blocks):
            tokens = request.get_token_ids(i * bs, (i + 1) * bs)
            assert len(tokens) == bs
            parent = hash_block_tokens(parent, tokens, request.cache_salt, request.lora_int_id)
            hashes.append(parent)
