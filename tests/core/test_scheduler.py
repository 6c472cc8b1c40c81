from collections.abc import Callable

import pytest

from jaxserve.core.kv_cache_manager import KVCacheManager
from jaxserve.core.sched_output import SchedulerOutput
from jaxserve.core.scheduler import Scheduler, SchedulerConfig
from jaxserve.request import Request, RequestStatus
from jaxserve.sampling_params import SamplingParams

S = RequestStatus


def make(
    *, seqs=8, budget=64, max_len=64, chunked=True, policy="fcfs", bs=4, blocks=64, caching=True
) -> Scheduler:
    kv = KVCacheManager(bs, blocks, caching, max_len)
    cfg = SchedulerConfig(seqs, budget, max_len, chunked, policy)
    return Scheduler(cfg, kv)


# A distinct token offset per request id (7 is coprime with 50: the first 50 ids differ), so
# that requests' prompts never share a prefix by accident. (Python's str hash is salted per
# process, which made prompts collide in about one run in fifty.)
_OFFSETS: dict[str, int] = {}


def mk(rid, prompt, *, max_tokens=4, priority=0, arrival=0.0, eos=None, **sp) -> Request:
    if isinstance(prompt, int):
        off = _OFFSETS.setdefault(rid, 7 * len(_OFFSETS))
        prompt = [(off + i) % 50 + 10 for i in range(prompt)]
    params = SamplingParams(max_tokens=max_tokens, **sp)
    return Request(rid, prompt, params, arrival_time=arrival, priority=priority, eos_token_id=eos)


def step(
    s: Scheduler, token: int | Callable[[str], int] = 5
) -> tuple[SchedulerOutput, list[Request]]:
    """One synchronous step; returns the output and the requests that finished."""
    out = s.schedule()
    tok = token if callable(token) else (lambda _rid: token)
    sampled = {x.request_id: [tok(x.request_id)] for x in out.scheduled if x.sample}
    return out, [r for r, _ in s.update_from_output(out, sampled) if r.is_finished]


def sched_map(out: SchedulerOutput) -> dict[str, int]:
    return {x.request_id: x.num_scheduled_tokens for x in out.scheduled}


# ---------------------------------------------------------------------- config and admission
def test_config_validation():
    with pytest.raises(ValueError):
        SchedulerConfig(policy="lifo")  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        SchedulerConfig(max_num_seqs=0)
    with pytest.raises(ValueError, match="chunked"):
        SchedulerConfig(max_num_batched_tokens=100, max_model_len=200, enable_chunked_prefill=False)
    with pytest.raises(ValueError, match="max_model_len"):
        make(max_len=64, blocks=10)  # 9 blocks * 4 tokens < 64
    with pytest.raises(ValueError, match="differs"):
        Scheduler(SchedulerConfig(max_model_len=64), KVCacheManager(4, 64, True, 32))


def test_add_request_rejects_bad_requests():
    s = make(max_len=16)
    with pytest.raises(ValueError, match="maximum context length"):
        s.add_request(mk("a", 17))
    with pytest.raises(ValueError, match="at least one token"):
        s.add_request(mk("b", []))
    s.add_request(mk("c", 16))
    with pytest.raises(ValueError, match="already"):
        s.add_request(mk("c", 3))


# ---------------------------------------------------------------------- the basic step loop
def test_single_request_lifecycle():
    s = make()
    r = mk("a", 5, max_tokens=3)
    s.add_request(r)
    out, fin = step(s, 7)
    (x,) = out.scheduled
    assert (x.start_pos, x.num_scheduled_tokens, x.sample) == (0, 5, True)
    assert x.is_new and not x.is_resumed
    assert list(x.token_ids) == r.prompt_token_ids and out.requests == (r,)
    assert x.new.prompt_token_ids == tuple(r.prompt_token_ids) and x.new.sampling_params is r.sampling_params
    assert x.new_block_ids == (1, 2) and x.new.num_prompt_tokens == 5 and x.end_pos == 5
    assert out.total_num_scheduled_tokens == 5 and not fin
    assert r.output_token_ids == [7] and r.num_computed_tokens == 5 and r.status == S.RUNNING

    out, fin = step(s, 8)
    (x,) = out.scheduled
    assert (x.token_ids, x.start_pos, x.sample) == ((7,), 5, True)
    assert not x.is_new and x.new_block_ids == () and s.kv.get_block_ids("a") == [1, 2]
    out, fin = step(s, 9)
    assert out.scheduled[0].token_ids == (8,) and out.scheduled[0].new_block_ids == ()
    assert fin == [r] and r.status == S.FINISHED_LENGTH_CAPPED
    assert r.get_finished_reason() == "length"
    assert r.output_token_ids == [7, 8, 9]
    assert not s.has_unfinished_requests() and s.kv.get_num_free_blocks() == 63
    out = s.schedule()
    assert out.is_empty and out.finished_request_ids == {"a"}
    assert s.schedule().finished_request_ids == frozenset()


def test_chunked_prefill_splits_prompt():
    s = make(budget=4)
    r = mk("a", 10, max_tokens=2)
    s.add_request(r)
    chunks = []
    for _ in range(3):
        out, _ = step(s, 1)
        (x,) = out.scheduled
        chunks.append((x.start_pos, x.num_scheduled_tokens, x.sample, x.is_new))
        assert list(x.token_ids) == r.prompt_token_ids[x.start_pos : x.end_pos]
    assert chunks == [(0, 4, False, True), (4, 4, False, False), (8, 2, True, False)]
    assert r.output_token_ids == [1]


def test_partial_chunk_ignores_runner_tokens():
    s = make(budget=4)
    r = mk("a", 10)
    s.add_request(r)
    out = s.schedule()
    assert not out.scheduled[0].sample
    s.update_from_output(out, {"a": [3]})  # fused sampling returns something: ignored
    assert r.output_token_ids == []


def test_missing_sampled_token_is_an_error():
    s = make()
    s.add_request(mk("a", 3))
    out = s.schedule()
    with pytest.raises(RuntimeError, match="no token"):
        s.update_from_output(out, {})


def test_budget_running_first_then_waiting():
    s = make(budget=10)
    s.add_request(mk("a", 6, max_tokens=10))
    s.add_request(mk("b", 6, max_tokens=10))
    out, _ = step(s)
    assert sched_map(out) == {"a": 6, "b": 4}
    s.add_request(mk("c", 20, max_tokens=10))
    out, _ = step(s)
    # a decodes (1), b finishes its prompt (2), c gets what is left.
    assert sched_map(out) == {"a": 1, "b": 2, "c": 7}
    assert [x.sample for x in out.scheduled] == [True, True, False]
    out, _ = step(s)
    assert sched_map(out) == {"a": 1, "b": 1, "c": 8}
    assert out.total_num_scheduled_tokens == 10


def test_max_num_seqs():
    s = make(seqs=2)
    for rid in "abc":
        s.add_request(mk(rid, 3, max_tokens=2))
    out, _ = step(s)
    assert sched_map(out) == {"a": 3, "b": 3}
    out, fin = step(s)
    assert sched_map(out) == {"a": 1, "b": 1} and len(fin) == 2
    out, _ = step(s)
    assert sched_map(out) == {"c": 3}


def test_no_chunking_prompt_waits_for_budget():
    s = make(budget=16, max_len=16, chunked=False)
    s.add_request(mk("a", 10, max_tokens=5))
    s.add_request(mk("b", 10, max_tokens=5))
    s.add_request(mk("c", 2, max_tokens=5))
    out, _ = step(s)
    assert sched_map(out) == {"a": 10}  # b does not fit in 6; c waits behind it (FCFS)
    out, _ = step(s)
    assert sched_map(out) == {"a": 1, "b": 10, "c": 2}


# ---------------------------------------------------------------------- prefix caching
def test_prefix_hit_in_scheduler_and_stats():
    s = make()
    prompt = list(range(10, 23))  # 13 tokens: 3 full blocks
    a = mk("a", prompt, max_tokens=2)
    s.add_request(a)
    step(s)
    b = mk("b", prompt, max_tokens=2)
    s.add_request(b)
    out, _ = step(s)
    x = out.scheduled[-1]
    assert (x.request_id, x.start_pos, x.num_scheduled_tokens, x.sample) == ("b", 12, 1, True)
    assert x.token_ids == (22,) and x.is_new and x.new.prompt_token_ids == tuple(prompt)
    assert b.num_cached_tokens == 12
    assert x.new_block_ids[:3] == (1, 2, 3)  # its whole table: first the blocks a filled
    st = s.make_stats()
    assert (st.prefix_cache_queries, st.prefix_cache_hits) == (26, 12)
    assert st.prefix_cache_hit_rate == pytest.approx(12 / 26)
    assert (st.num_running, st.num_waiting, st.num_preemptions) == (1, 0, 0)  # a finished
    assert 0 < st.kv_cache_usage < 1 and st.num_free_blocks == 63 - 4


def test_parallel_samples_share_prompt_in_first_step():
    s = make()
    prompt = list(range(30, 39))  # 9 tokens
    for i in range(3):
        s.add_request(mk(f"p{i}", prompt, max_tokens=2, temperature=1.0))
    out, _ = step(s)
    assert sched_map(out) == {"p0": 9, "p1": 1, "p2": 1}
    rows = [x.new_block_ids for x in out.scheduled]  # new requests: their whole tables
    assert rows[0][:2] == rows[1][:2] == rows[2][:2]
    assert len({r[2] for r in rows}) == 3  # each its own partial block
    assert [x.start_pos for x in out.scheduled] == [0, 8, 8]


def test_skip_prefix_cache_request_computes_whole_prompt():
    s = make()
    prompt = list(range(30, 39))
    s.add_request(mk("a", prompt))
    step(s)
    s.add_request(mk("b", prompt, prompt_logprobs=1))
    out, _ = step(s)
    assert sched_map(out)["b"] == 9


# ---------------------------------------------------------------------- preemption
def _fill_cache_scheduler(policy="fcfs", priorities=(0, 0, 0)):
    # 6 usable blocks of 4 tokens; three requests of 8 tokens take all of them.
    s = make(blocks=7, max_len=24, policy=policy, caching=False)
    reqs = [mk(rid, 8, max_tokens=20, priority=p, arrival=float(i))
            for i, (rid, p) in enumerate(zip("abc", priorities))]
    for r in reqs:
        s.add_request(r)
    out, _ = step(s)
    assert sched_map(out) == {"a": 8, "b": 8, "c": 8}
    assert s.kv.get_num_free_blocks() == 0
    return s, reqs


def test_preemption_picks_newest_and_requeues_it_first():
    s, (a, b, c) = _fill_cache_scheduler()
    s.add_request(mk("d", 2))
    out, _ = step(s)  # a needs a 3rd block: c (newest) is preempted; b fits in c's blocks
    assert out.preempted_request_ids == ("c",)
    assert sched_map(out) == {"a": 1, "b": 1}  # no admission in a preempting step
    assert c.status == S.PREEMPTED and c.num_computed_tokens == 0 and c.num_preemptions == 1
    assert s.kv.get_block_ids("c") == []
    assert [r.request_id for r in s.waiting] == ["c", "d"]
    assert s.make_stats().num_preemptions == 1
    assert c.output_token_ids == [5]  # its output survives
    # Resuming recomputes prompt + output and samples from there.
    s.finish_requests("a", S.FINISHED_STOPPED)
    out, _ = step(s)
    x = out.scheduled[-1]
    assert (x.request_id, x.is_new, x.is_resumed) == ("c", True, True)
    assert (x.start_pos, x.num_scheduled_tokens) == (0, 9)
    assert list(x.token_ids) == c.all_token_ids[:9] and x.sample


def test_finished_request_frees_room_without_preemption():
    s, (a, b, c) = _fill_cache_scheduler()
    # a finishes: b and c grow into its blocks.
    s.finish_requests("a", S.FINISHED_STOPPED)
    out, _ = step(s)
    assert out.preempted_request_ids == ()
    assert sched_map(out) == {"b": 1, "c": 1}


def test_priority_waiting_order_and_victim():
    s = make(seqs=1, policy="priority")
    s.add_request(mk("late_hi", 3, priority=0, arrival=5.0, max_tokens=1))
    s.add_request(mk("lo", 3, priority=2, arrival=0.0, max_tokens=1))
    s.add_request(mk("early_hi", 3, priority=0, arrival=1.0, max_tokens=1))
    order = []
    for _ in range(3):
        out, _ = step(s)
        order += list(sched_map(out))
    assert order == ["early_hi", "late_hi", "lo"]

    # The victim is the lowest-priority running request, not the newest.
    s, (a, b, c) = _fill_cache_scheduler("priority", priorities=(1, 2, 0))
    out, _ = step(s)
    assert out.preempted_request_ids == ("b",)
    assert [x.request_id for x in out.scheduled] == ["c", "a"]


# ---------------------------------------------------------------------- stop conditions
def test_eos_stop_token_and_min_tokens():
    s = make()
    r = mk("eos", 3, max_tokens=10, eos=2)
    s.add_request(r)
    step(s, 4)
    _, fin = step(s, 2)
    assert fin == [r] and r.status == S.FINISHED_STOPPED and r.stop_reason is None
    assert r.output_token_ids == [4, 2] and r.get_finished_reason() == "stop"

    r = mk("ign", 3, max_tokens=3, eos=2, ignore_eos=True)
    s.add_request(r)
    for _ in range(3):
        step(s, 2)
    assert r.status == S.FINISHED_LENGTH_CAPPED and r.output_token_ids == [2, 2, 2]

    r = mk("min", 3, max_tokens=10, eos=2, min_tokens=2, stop_token_ids=[9])
    s.add_request(r)
    step(s, 2)
    step(s, 9)
    assert r.status == S.FINISHED_STOPPED and r.stop_reason == 9 and r.output_token_ids == [2, 9]


def test_max_model_len_caps_length():
    s = make(max_len=8)
    r = mk("a", 6, max_tokens=None)
    s.add_request(r)
    for _ in range(2):
        step(s)
    assert r.status == S.FINISHED_LENGTH_CAPPED and r.num_tokens == 8
    full = mk("b", 8, max_tokens=None)  # prompt fills the context: one token, never fed
    s.add_request(full)
    step(s)
    assert full.status == S.FINISHED_LENGTH_CAPPED and full.num_output_tokens == 1


def test_finish_requests_for_stop_strings():
    s = make()
    r = mk("a", 3, max_tokens=10)
    s.add_request(r)
    step(s)
    assert s.finish_requests(["a"], S.FINISHED_STOPPED) == [r]
    assert r.status == S.FINISHED_STOPPED and s.kv.get_num_free_blocks() == 63
    assert s.schedule().finished_request_ids == {"a"}
    with pytest.raises(ValueError):
        s.finish_requests(["a"], S.RUNNING)


# ---------------------------------------------------------------------- aborts
def test_abort_in_every_state():
    s, (a, b, c) = _fill_cache_scheduler()
    w = mk("w", 2)
    s.add_request(w)
    step(s)  # c is preempted; w waits (no admission in a preempting step)
    assert (w.status, c.status, a.status) == (S.WAITING, S.PREEMPTED, S.RUNNING)
    got = s.abort_requests(["w", "c", "a", "nope"])
    assert got == [w, c, a]
    for r in got:
        assert r.status == S.FINISHED_ABORTED and r.get_finished_reason() == "abort"
    assert list(s.waiting) == [] and s.running == [b]
    assert s.abort_requests("a") == []  # already finished: ignored
    out = s.schedule()
    assert out.finished_request_ids == {"w", "c", "a"} and sched_map(out) == {"b": 1}
    # Aborted between schedule() and update_from_output(): its row is skipped.
    s.abort_requests("b")
    assert s.update_from_output(out, {"b": [3]}) == []
    assert b.output_token_ids == [5, 5]
    assert not s.has_unfinished_requests()
    assert s.kv.get_num_free_blocks() == 6
    assert all(blk.ref_cnt == 0 for blk in s.kv.pool.blocks)
    assert s.schedule().finished_request_ids == {"b"}


def test_abort_mid_prefill_frees_blocks():
    s = make(budget=4)
    r = mk("a", 10)
    s.add_request(r)
    out, _ = step(s)
    assert not out.scheduled[0].sample and len(s.kv.get_block_ids("a")) == 1
    s.abort_requests("a")
    assert r.status == S.FINISHED_ABORTED and s.kv.get_num_free_blocks() == 63
