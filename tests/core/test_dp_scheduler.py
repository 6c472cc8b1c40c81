"""The data-parallel scheduler: requests pinned to a rank (prefix hit, then a rank already
queueing the same prompt, then the least loaded), each rank's own share of the step limits and
its own KV pages, and the runner's view of a step (one SchedulerOutput per rank)."""

from __future__ import annotations

import pytest

from jaxserve.core.dp_scheduler import DataParallelScheduler, rank_config
from jaxserve.core.kv_cache_manager import KVCacheManager
from jaxserve.core.scheduler import SchedulerConfig
from jaxserve.request import Request
from jaxserve.sampling_params import SamplingParams


def make(D=2, *, seqs=8, budget=32, blocks=32, bs=4, max_len=64) -> DataParallelScheduler:
    kvs = [KVCacheManager(bs, blocks, True, max_len) for _ in range(D)]
    return DataParallelScheduler(SchedulerConfig(seqs, budget, max_len), kvs)


def mk(rid: str, prompt: list[int], max_tokens: int = 2) -> Request:
    return Request(rid, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True), arrival_time=0.0)


def run_to_end(s: DataParallelScheduler, token: int = 5) -> None:
    while s.has_unfinished_requests():
        out = s.schedule()
        s.update_from_output(out, {x.request_id: [token] for x in out.scheduled if x.sample})


def test_rank_config_splits_the_limits_evenly():
    share = rank_config(SchedulerConfig(8, 64, 64), 4)
    assert (share.max_num_seqs, share.max_num_batched_tokens) == (2, 16)
    with pytest.raises(ValueError, match="max_num_seqs .* multiple of data_parallel_size"):
        rank_config(SchedulerConfig(6, 64, 64), 4)
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        rank_config(SchedulerConfig(8, 66, 64), 4)


def test_least_loaded_rank_takes_a_new_request():
    s = make()
    s.add_request(mk("a", list(range(10, 30))))  # 20 tokens on rank 0
    s.add_request(mk("b", list(range(40, 44))))  # the emptier rank 1
    s.add_request(mk("c", list(range(50, 54))))  # rank 1 holds 4 tokens, rank 0 20
    assert [s.rank_of[r] for r in "abc"] == [0, 1, 1]
    out = s.schedule()
    assert [[x.request_id for x in so.scheduled] for so in out.ranks] == [["a"], ["b", "c"]]
    # Each rank's step stays within its share of the token budget (32 / 2).
    assert all(so.total_num_scheduled_tokens <= 16 for so in out.ranks)
    assert out.total_num_scheduled_tokens == 16 + 8


def test_prefix_hit_wins_over_load():
    s = make(budget=64)
    shared = list(range(10, 26))  # four full blocks
    s.add_request(mk("warm", shared))
    assert s.rank_of["warm"] == 0
    run_to_end(s)
    s.add_request(mk("load", list(range(60, 90))))  # both ranks empty: rank 0 takes 30 tokens
    s.add_request(mk("hit", shared + [99]))  # rank 1 is emptier, rank 0 holds the prefix
    assert (s.rank_of["load"], s.rank_of["hit"]) == (0, 0)
    out = s.schedule()
    hit = next(x for x in out.ranks[0].scheduled if x.request_id == "hit")
    assert hit.start_pos == 16  # the cached blocks were found on its own rank
    assert s.make_stats().prefix_cache_hits == 16


def test_same_prompt_queued_goes_to_the_same_rank():
    s = make()
    prompt = list(range(10, 30))
    s.add_request(mk("x0", prompt))
    s.add_request(mk("other", list(range(40, 42))))  # rank 1, lighter
    s.add_request(mk("x1", prompt))  # rank 0 queues the same prompt: its samples share blocks
    assert s.rank_of["x0"] == s.rank_of["x1"] == 0


def test_pages_are_per_rank_and_nothing_leaks():
    s = make(blocks=8, max_len=24)  # 7 usable blocks of 4 per rank
    for i in range(4):
        s.add_request(mk(f"r{i}", [10 + i] * 20, max_tokens=3))
    assert sorted(s.rank_of.values()) == [0, 0, 1, 1]
    run_to_end(s)
    assert not s.rank_of and not s.requests
    assert s.make_stats().num_free_blocks == 2 * 7
    assert s.cache_tokens == 2 * 7 * 4


def test_abort_and_duplicate_ids():
    s = make()
    s.add_request(mk("a", [1, 2, 3]))
    with pytest.raises(ValueError, match="already"):
        s.add_request(mk("a", [4, 5]))
    s.schedule()
    assert [r.request_id for r in s.abort_requests("a")] == ["a"]
    assert s.get_request("a") is None and not s.rank_of
    out = s.schedule()
    assert "a" in out.finished_request_ids and out.is_empty
