"""The scheduler's adapter slots (core/adapter_slots.py): an adapter runs only while it holds a
slot, slots go least recently used first among adapters no running request uses, each
assignment is a load, and with no slots (LoRA off) base requests pass and adapters are refused."""

from __future__ import annotations

from jaxserve.config import SchedulerConfig
from jaxserve.core.kv_cache_manager import KVCacheManager, hash_block_tokens
from jaxserve.core.adapter_slots import AdapterSlots
from jaxserve.core.scheduler import Scheduler
from jaxserve.lora_request import LoRARequest
from jaxserve.request import Request, RequestStatus
from jaxserve.sampling_params import SamplingParams

A, B, C = (LoRARequest(n, i, f"/adapters/{n}") for i, n in enumerate("abc", start=1))


def test_lru_over_unused_slots():
    t = AdapterSlots(2)
    assert t.acquire("r1", A) == 1 and t.acquire("r2", B) == 2
    assert t.take_loads() == ((1, A), (2, B))
    assert not t.can_acquire(C)  # both adapters in use
    t.release("r1")
    assert t.acquire("r3", A) == 1 and t.take_loads() == ()  # held: no load
    t.release("r3")
    t.release("r2")
    assert t.acquire("r4", C) == 2  # B used least recently (A since)
    assert t.take_loads() == ((2, C),)
    assert t.running_names() == ["c"]
    t.release("r4")
    assert t.forget(A.lora_int_id) and t.acquire("r5", B) == 1  # the slot A left
    assert not t.forget(B.lora_int_id)  # in use


def _req(rid, lora, tokens=(5, 6, 7, 8, 9)):
    return Request(rid, list(tokens), SamplingParams(max_tokens=4), lora_request=lora)


def test_scheduler_admits_only_adapters_with_a_slot():
    kv = KVCacheManager(4, 64, enable_caching=True, max_model_len=64)
    s = Scheduler(
        SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=256, max_model_len=64),
        kv,
        AdapterSlots(1),
    )
    for r in (_req("x", A), _req("base", None), _req("y", A), _req("z", B)):
        s.add_request(r)
    out = s.schedule()
    assert [x.request_id for x in out.scheduled] == ["x", "base", "y"]  # z waits: one slot, A runs
    assert out.lora_loads == ((1, A),)
    assert [x.new.adapter_slot for x in out.scheduled] == [1, 0, 1]  # what the runner packs per token
    stats = s.make_stats()
    assert stats.running_lora_adapters == ("a",) and stats.waiting_lora_adapters == ("b",)
    s.finish_requests(["x", "y"], RequestStatus.FINISHED_ABORTED)
    out = s.schedule()
    assert [x.request_id for x in out.scheduled if x.is_new] == ["z"] and out.lora_loads == (
        (1, B),
    )


def test_a_request_whose_adapter_has_no_slot_lets_later_ones_pass_and_keeps_its_place():
    """vLLM's order: a waiting request whose adapter can get no slot (each slot's adapter is
    running) steps aside; later base-model requests and requests of a slotted adapter run;
    it goes first once a slot frees, before requests that arrived after it."""
    kv = KVCacheManager(4, 64, enable_caching=True, max_model_len=64)
    s = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=256, max_model_len=64), kv, AdapterSlots(1))
    s.add_request(_req("a1", A))
    assert [x.request_id for x in s.schedule().scheduled] == ["a1"]
    for r in (_req("b1", B), _req("base", None), _req("a2", A), _req("b2", B)):
        s.add_request(r)
    out = s.schedule()
    assert [x.request_id for x in out.scheduled if x.is_new] == ["base", "a2"]
    assert [r.request_id for r in s.waiting] == ["b1", "b2"]  # both kept, in their order
    s.add_request(_req("late", None))
    s.finish_requests(["a1", "a2"], RequestStatus.FINISHED_ABORTED)
    out = s.schedule()
    assert [x.request_id for x in out.scheduled if x.is_new] == ["b1", "b2", "late"]
    assert out.lora_loads == ((1, B),)


def test_without_slots_base_requests_pass_and_adapters_are_refused():
    import pytest

    kv = KVCacheManager(4, 64, enable_caching=True, max_model_len=64)
    s = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=256, max_model_len=64), kv)
    assert not s.adapters.enabled
    with pytest.raises(ValueError, match="LoRA is not enabled"):
        s.add_request(_req("x", A))
    s.add_request(_req("base", None))
    out = s.schedule()
    assert [x.new.adapter_slot for x in out.scheduled] == [0] and out.lora_loads == ()
    stats = s.make_stats()
    assert stats.running_lora_adapters == () == stats.waiting_lora_adapters


def test_prefix_cache_keys_blocks_by_adapter():
    tokens = [1, 2, 3, 4]
    base = hash_block_tokens(None, tokens, None)
    assert hash_block_tokens(None, tokens, None, 1) != base
    assert hash_block_tokens(None, tokens, None, 1) != hash_block_tokens(None, tokens, None, 2)
    kv = KVCacheManager(4, 64, enable_caching=True, max_model_len=64)
    s = Scheduler(
        SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=256, max_model_len=64),
        kv,
        AdapterSlots(2),
    )
    s.add_request(_req("first", A, tokens * 3))
    s.schedule()
    s.finish_requests(["first"], RequestStatus.FINISHED_ABORTED)
    for rid, lora, hit in (("other", B, 0), ("same", A, 8)):
        r = _req(rid, lora, tokens * 3)
        assert kv.get_computed_blocks(r)[1] == hit, rid
