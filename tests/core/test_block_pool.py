import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxserve.core.block_pool import NULL_BLOCK_ID, BlockPool


def check_pool(pool: BlockPool) -> None:
    free = set(pool.free_block_ids())
    assert NULL_BLOCK_ID not in free
    assert pool.null_block.ref_cnt == 0 and pool.null_block.block_hash is None
    for b in pool.blocks[1:]:
        assert b.ref_cnt >= 0
        assert (b.block_id in free) == (b.ref_cnt == 0)
        if b.block_hash is not None:
            assert pool.get_cached_block(b.block_hash) is b


def test_rejects_too_small():
    with pytest.raises(ValueError):
        BlockPool(1)


def test_null_block_never_handed_out():
    pool = BlockPool(5)
    assert pool.free_block_ids() == [1, 2, 3, 4]
    blocks = pool.get_new_blocks(4)
    assert sorted(b.block_id for b in blocks) == [1, 2, 3, 4]
    assert pool.get_num_free_blocks() == 0 and pool.usage == 1.0
    with pytest.raises(RuntimeError):
        pool.get_new_blocks(1)
    pool.free_blocks(blocks)
    assert pool.get_num_free_blocks() == 4 and pool.usage == 0.0
    check_pool(pool)


def test_lru_eviction_order_of_cached_blocks():
    pool = BlockPool(6)
    blocks = pool.get_new_blocks(5)
    pool.cache_full_blocks(blocks, [101, 102, 103, 104, 105], 0, 5)
    # Free in the order 3, 1, 5, 2, 4: the first freed is evicted first.
    order = [blocks[i] for i in (2, 0, 4, 1, 3)]
    for b in order:
        pool.free_blocks([b])
    assert pool.free_block_ids() == [b.block_id for b in order]
    assert pool.num_cached_blocks == 5
    got = pool.get_new_blocks(2)
    assert got == order[:2]
    assert all(b.block_hash is None for b in got)  # evicted
    assert pool.get_cached_block(103) is None and pool.get_cached_block(101) is None
    assert pool.get_cached_block(105) is order[2]
    check_pool(pool)


def test_uncached_free_blocks_are_reused_before_cached_ones():
    pool = BlockPool(5)
    a, b, c, d = pool.get_new_blocks(4)
    pool.cache_full_blocks([a, b], [1, 2], 0, 2)
    pool.free_blocks([a, b])  # cached: to the tail
    pool.free_blocks([c])  # not cached: to the head
    pool.free_blocks([d])
    assert pool.free_block_ids() == [d.block_id, c.block_id, a.block_id, b.block_id]
    assert pool.get_new_blocks(2) == [d, c]
    assert pool.num_cached_blocks == 2


def test_touch_takes_cached_block_out_of_free_queue():
    pool = BlockPool(4)
    a, b = pool.get_new_blocks(2)
    pool.cache_full_blocks([a, b], [11, 12], 0, 2)
    pool.free_blocks([b, a])
    assert pool.get_num_free_blocks() == 3
    hit = pool.get_cached_block(11)
    assert hit is a
    pool.touch([hit])
    assert a.ref_cnt == 1 and not pool.is_free(a)
    assert pool.get_num_free_blocks() == 2
    pool.touch([a])  # second sharer
    assert a.ref_cnt == 2
    pool.free_blocks([a])
    assert a.ref_cnt == 1 and not pool.is_free(a)
    pool.free_blocks([a])
    assert a.ref_cnt == 0 and pool.is_free(a) and pool.get_cached_block(11) is a
    check_pool(pool)


def test_duplicate_hash_keeps_first_block():
    pool = BlockPool(4)
    a, b = pool.get_new_blocks(2)
    pool.cache_full_blocks([a], [7], 0, 1)
    pool.cache_full_blocks([b], [7], 0, 1)
    assert pool.get_cached_block(7) is a and b.block_hash is None
    pool.free_blocks([a, b])
    check_pool(pool)


def test_reset_prefix_cache():
    pool = BlockPool(4)
    a, b = pool.get_new_blocks(2)
    pool.cache_full_blocks([a, b], [1, 2], 0, 2)
    assert not pool.reset_prefix_cache()
    pool.free_blocks([a])
    assert not pool.reset_prefix_cache()
    pool.free_blocks([b])
    assert pool.reset_prefix_cache()
    assert pool.num_cached_blocks == 0 and a.block_hash is None
    check_pool(pool)


def test_caching_disabled_registers_nothing():
    pool = BlockPool(4, enable_caching=False)
    blocks = pool.get_new_blocks(2)
    pool.cache_full_blocks(blocks, [1, 2], 0, 2)
    assert pool.num_cached_blocks == 0


@settings(max_examples=150, derandomize=True, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.integers(0, 7)), max_size=60))
def test_random_operations_keep_pool_consistent(ops):
    pool = BlockPool(8)
    held: list = []  # one entry per reference
    for op, arg in ops:
        if op == 0:
            n = min(arg % 4, pool.get_num_free_blocks())
            held.extend(pool.get_new_blocks(n))
        elif op == 1 and held:
            pool.free_blocks([held.pop(arg % len(held))])
        elif op == 2 and held:
            blk = held[arg % len(held)]
            pool.cache_full_blocks([blk], [arg], 0, 1)
        elif op == 3:
            blk = pool.get_cached_block(arg)
            if blk is not None:
                pool.touch([blk])
                held.append(blk)
        check_pool(pool)
        for b in pool.blocks[1:]:
            assert b.ref_cnt == sum(h is b for h in held)
    pool.free_blocks(held)
    assert pool.get_num_free_blocks() == 7
    check_pool(pool)
