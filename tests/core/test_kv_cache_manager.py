import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxserve.core.kv_cache_manager import KVCacheManager, hash_block_tokens
from jaxserve.request import Request
from jaxserve.sampling_params import SamplingParams

BS = 4


def req(rid: str, prompt, **kw) -> Request:
    return Request(rid, list(prompt), SamplingParams(max_tokens=8), **kw)


def admit(kv: KVCacheManager, r: Request, num_new: int | None = None) -> list[int] | None:
    """What the scheduler does for a waiting request: take the prefix hit, allocate the rest."""
    hits, num_hit = kv.get_computed_blocks(r)
    n = r.num_tokens - num_hit if num_new is None else num_new
    got = kv.allocate_slots(r, n, hits)
    if got is not None:
        r.num_computed_tokens = num_hit + n
    return got


def snapshot(kv: KVCacheManager):
    pool = kv.pool
    return (
        pool.free_block_ids(),
        [(b.ref_cnt, b.block_hash) for b in pool.blocks],
        {rid: kv.get_block_ids(rid) for rid in kv._req_to_blocks},
        kv.prefix_cache_queries,
        kv.prefix_cache_hits,
    )


def test_capacity_check():
    with pytest.raises(ValueError, match="max_model_len"):
        KVCacheManager(BS, num_blocks=4, max_model_len=13)
    KVCacheManager(BS, num_blocks=4, max_model_len=12)


@pytest.mark.parametrize(
    "prompt_len,expected_hit",
    [(1, 0), (4, 0), (5, 4), (8, 4), (9, 8), (12, 8), (13, 12)],
)
def test_hit_length_and_last_token_rule(prompt_len, expected_hit):
    kv = KVCacheManager(BS, num_blocks=16)
    prompt = list(range(100, 100 + prompt_len))
    a = req("a", prompt + [0] * 8)  # a longer request with the same prefix fills the cache
    assert admit(kv, a) is not None
    b = req("b", prompt)
    blocks, n = kv.get_computed_blocks(b)
    assert n == expected_hit == len(blocks) * BS
    assert [x.block_id for x in blocks] == kv.get_block_ids("a")[: len(blocks)]


def test_hit_needs_whole_chain_and_same_salt():
    kv = KVCacheManager(BS, num_blocks=16)
    assert admit(kv, req("a", range(12))) is not None
    # Same second block, different first block: no hit at all.
    assert kv.get_computed_blocks(req("b", [99, 1, 2, 3] + list(range(4, 12))))[1] == 0
    # Same first block, different second: one block.
    assert kv.get_computed_blocks(req("c", [0, 1, 2, 3, 99, 5, 6, 7, 8]))[1] == 4
    assert kv.get_computed_blocks(req("d", range(12), cache_salt="x"))[1] == 0
    assert kv.get_computed_blocks(req("e", range(12)))[1] == 8


def test_skip_prefix_cache_and_disabled_cache():
    kv = KVCacheManager(BS, num_blocks=16)
    s = req("s", range(12), skip_prefix_cache=True)
    assert admit(kv, s) is not None
    assert kv.prefix_cache_queries == 0
    # Its blocks are still cached for others...
    assert kv.get_computed_blocks(req("t", range(12)))[1] == 8
    # ...but it never reads the cache itself.
    assert kv.get_computed_blocks(req("u", range(12), skip_prefix_cache=True)) == ([], 0)

    off = KVCacheManager(BS, num_blocks=16, enable_caching=False)
    assert admit(off, req("a", range(12))) is not None
    assert off.get_computed_blocks(req("b", range(12))) == ([], 0)
    assert off.pool.num_cached_blocks == 0


def test_shared_prefix_ref_counts_and_stats():
    kv = KVCacheManager(BS, num_blocks=16)
    a = req("a", range(10))
    assert admit(kv, a) == [1, 2, 3]
    assert (kv.prefix_cache_queries, kv.prefix_cache_hits) == (10, 0)
    b = req("b", list(range(8)) + [50, 51, 52])
    assert admit(kv, b) == [4]
    assert (kv.prefix_cache_queries, kv.prefix_cache_hits) == (21, 8)
    assert kv.get_block_ids("b") == [1, 2, 4]
    blocks = kv.pool.blocks
    assert [blocks[i].ref_cnt for i in (1, 2, 3, 4)] == [2, 2, 1, 1]
    kv.free(a)
    assert [blocks[i].ref_cnt for i in (1, 2, 3, 4)] == [1, 1, 0, 1]
    kv.free(b)
    assert all(x.ref_cnt == 0 for x in blocks)
    assert kv.get_num_free_blocks() == 15
    # Still cached after everyone left: a third request hits.
    c = req("c", range(9))
    assert kv.get_computed_blocks(c)[1] == 8
    # Uncached partial blocks (3, 4) go to the head; the shared head blocks are freed in
    # reverse order (2, then 1), so the first block of the prefix is evicted last.
    assert kv.pool.free_block_ids()[:2] == [4, 3]
    assert kv.pool.free_block_ids()[-2:] == [2, 1]


def test_same_step_sharing_before_parent_finishes():
    """n > 1: children with the parent's prompt hit its blocks as soon as it is allocated."""
    kv = KVCacheManager(BS, num_blocks=16)
    parent = req("p", range(9))
    assert admit(kv, parent) is not None  # the parent's KV is not even computed yet
    for i in range(3):
        child = req(f"c{i}", range(9))
        assert admit(kv, child) is not None
        assert child.num_computed_tokens == 9
        assert kv.get_block_ids(child.request_id)[:2] == kv.get_block_ids("p")[:2]
    assert [kv.pool.blocks[i].ref_cnt for i in kv.get_block_ids("p")] == [4, 4, 1]


def test_chunked_allocation_caches_blocks_as_they_fill():
    kv = KVCacheManager(BS, num_blocks=16)
    a = req("a", range(11))
    assert admit(kv, a, num_new=3) == [1]
    assert kv.pool.num_cached_blocks == 0
    assert kv.allocate_slots(a, 3) == [2]
    a.num_computed_tokens += 3
    assert kv.pool.num_cached_blocks == 1
    assert kv.allocate_slots(a, 5) == [3]
    a.num_computed_tokens += 5
    assert kv.pool.num_cached_blocks == 2
    # Decode tokens fill blocks too, and those get cached.
    a.append_output_token_ids(70)
    assert kv.allocate_slots(a, 1) == []
    a.num_computed_tokens += 1
    assert kv.pool.num_cached_blocks == 3
    a.append_output_token_ids(71)
    assert kv.allocate_slots(a, 1) == [4]


def test_allocate_failure_leaves_state_unchanged():
    kv = KVCacheManager(BS, num_blocks=6)  # 5 usable
    a = req("a", range(8))
    assert admit(kv, a) is not None
    kv.free(a)  # blocks 1, 2: free but cached
    c = req("c", [90])
    assert admit(kv, c) is not None  # holds one block: 4 free, 2 of them a's cached blocks
    b = req("b", list(range(8)) + list(range(200, 212)))  # 20 tokens: 5 blocks, 2 hits
    before = snapshot(kv)
    hits, n = kv.get_computed_blocks(b)
    assert n == 8
    # 3 new + 2 hits taken out of the free queue > 4 free: must fail, without side effects.
    assert kv.allocate_slots(b, b.num_tokens - n, hits) is None
    assert snapshot(kv) == before
    assert kv.get_block_ids("b") == []
    kv.free(c)
    assert admit(kv, b) == [3, 4, 5]  # uncached blocks are reused first; hits are kept
    assert kv.get_block_ids("b")[:2] == [1, 2]


def test_eviction_drops_hash():
    kv = KVCacheManager(BS, num_blocks=3)  # 2 usable
    a = req("a", range(8))
    assert admit(kv, a) is not None
    kv.free(a)
    z = req("z", range(50, 58))
    assert admit(kv, z) is not None  # evicts both of a's blocks
    kv.free(z)
    assert kv.get_computed_blocks(req("a2", range(9)))[1] == 0
    assert kv.get_computed_blocks(req("z2", range(50, 59)))[1] == 8


def test_free_unknown_and_get_block_ids():
    kv = KVCacheManager(BS, num_blocks=4)
    kv.free(req("nobody", [1]))
    assert kv.get_block_ids("nobody") == []
    assert kv.max_num_blocks_per_request is None
    assert KVCacheManager(BS, 9, max_model_len=30).max_num_blocks_per_request == 8


@settings(max_examples=100, derandomize=True, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.integers(0, 2),
            st.integers(0, 5),
            st.lists(st.integers(0, 2), min_size=1, max_size=14),
        ),
        max_size=40,
    )
)
def test_random_admit_grow_free(ops):
    """Allocation either succeeds or changes nothing; ref counts always match the tables."""
    kv = KVCacheManager(2, num_blocks=10)
    live: dict[str, Request] = {}
    for k, (op, pick, prompt) in enumerate(ops):
        if op == 0:
            r = req(f"r{k}", prompt)
            before = snapshot(kv)
            if admit(kv, r) is None:
                assert snapshot(kv) == before
            else:
                live[r.request_id] = r
        elif op == 1 and live:
            r = live[sorted(live)[pick % len(live)]]
            r.append_output_token_ids(pick)
            before = snapshot(kv)
            if kv.allocate_slots(r, 1) is None:
                assert snapshot(kv) == before
            else:
                r.num_computed_tokens += 1
        elif op == 2 and live:
            kv.free(live.pop(sorted(live)[pick % len(live)]))
        for b in kv.pool.blocks[1:]:
            holders = sum(b.block_id in kv.get_block_ids(rid) for rid in live)
            assert b.ref_cnt == holders
            assert holders < 2 or b.block_hash is not None
        for r in live.values():
            ids = kv.get_block_ids(r.request_id)
            assert 0 not in ids and len(set(ids)) == len(ids)
            assert len(ids) * 2 >= r.num_computed_tokens
    for r in live.values():
        kv.free(r)
    assert kv.get_num_free_blocks() == 9
    assert all(b.ref_cnt == 0 for b in kv.pool.blocks)


def test_block_hash_is_a_sha256_chain():
    a = hash_block_tokens(None, [1, 2, 3, 4], None)
    assert isinstance(a, bytes) and len(a) == 32
    assert hash_block_tokens(None, (1, 2, 3, 4), None) == a  # any sequence, same digest
    b = hash_block_tokens(a, [5, 6, 7, 8], None)
    # Every input counts: parent, tokens, their order, the salt (None differs from "").
    others = [
        hash_block_tokens(None, [5, 6, 7, 8], None),
        hash_block_tokens(b, [5, 6, 7, 8], None),
        hash_block_tokens(a, [5, 6, 8, 7], None),
        hash_block_tokens(a, [5, 6, 7, 8], ""),
        hash_block_tokens(a, [5, 6, 7, 8], "salt"),
    ]
    assert len({b, *others}) == 6


def test_blocks_that_collide_under_builtin_hash_do_not_share():
    # Python's hash maps 0 and 2**61 - 1 to the same value, so the old hash((parent, tokens,
    # salt)) gave these two prompts the same chain; a hit would have served one the other's KV.
    big = 2**61 - 1
    assert hash((None, (0,) * BS, None)) == hash((None, (big,) * BS, None))
    assert hash_block_tokens(None, [0] * BS, None) != hash_block_tokens(None, [big] * BS, None)
    kv = KVCacheManager(BS, 16)
    assert admit(kv, req("a", [0] * (2 * BS))) is not None
    assert kv.get_computed_blocks(req("b", [big] * (2 * BS)))[1] == 0
    assert kv.get_computed_blocks(req("c", [0] * (2 * BS)))[1] == BS
