"""The scheduler with speculative drafts: a decoding request feeds its last token and its drafts
in one step, within the budget, the spare rows, max_tokens and max_model_len; the step's
accepted tokens are appended and num_computed_tokens rolls back over the rejected drafts;
drafts never enter the prefix cache."""

from __future__ import annotations

from jaxserve.core.sched_output import ScheduledRequest
from jaxserve.request import RequestStatus
from tests.core.test_scheduler import make, mk, step


def decoding(s, rid="a", prompt=6, **kw):
    """Add a request and run its prefill (one token sampled: 5)."""
    req = mk(rid, prompt, **kw)
    s.add_request(req)
    while not req.num_output_tokens:
        step(s)
    assert req.num_output_tokens == 1 and req.num_computed_tokens == req.num_tokens - 1
    return req


def only(out) -> ScheduledRequest:
    (x,) = out.scheduled
    return x


def test_drafts_are_fed_after_the_last_token_and_rejected_ones_roll_back():
    s = make(bs=4)
    req = decoding(s, max_tokens=20)
    req.spec_token_ids = [7, 8, 9]
    out = s.schedule()
    x = only(out)
    assert x.num_draft_tokens == 3 and x.num_scheduled_tokens == 4 and x.sample
    assert x.token_ids == (5, 7, 8, 9) and x.start_pos == 6
    assert out.total_num_scheduled_tokens == 4
    assert req.num_computed_tokens == 10 and req.spec_token_ids == []
    # Drafts 7 and 8 accepted, then 11 instead of 9.
    (updated, taken), = s.update_from_output(out, {"a": [7, 8, 11]})
    assert updated is req and taken == 3
    assert req.output_token_ids == [5, 7, 8, 11]
    assert req.num_computed_tokens == req.num_tokens - 1 == 9  # the draft 9's KV is void
    # Every draft rejected: one token, everything past the last known token rolled back.
    req.spec_token_ids = [1, 2]
    out = s.schedule()
    assert only(out).num_scheduled_tokens == 3
    s.update_from_output(out, {"a": [3]})
    assert req.output_token_ids[-1] == 3 and req.num_computed_tokens == req.num_tokens - 1
    stats = s.make_stats()
    assert (stats.spec_num_drafts, stats.spec_num_draft_tokens, stats.spec_num_accepted_tokens) == (2, 5, 2)
    # No drafts: a plain decode step.
    out = s.schedule()
    assert only(out).num_scheduled_tokens == 1 and only(out).num_draft_tokens == 0


def test_draft_count_limits():
    # max_tokens: a step emits at most drafts + 1 tokens.
    s = make()
    req = decoding(s, max_tokens=3)
    req.spec_token_ids = [7, 8, 9, 10]
    assert only(s.schedule()).num_draft_tokens == 1  # 1 output so far, 2 more allowed
    # max_model_len: the drafts' positions must fit.
    s = make(max_len=10, blocks=16)
    req = decoding(s, prompt=6, max_tokens=None)
    req.spec_token_ids = [7, 8, 9, 10, 11]
    assert only(s.schedule()).num_draft_tokens == 10 - 7
    # The token budget.
    s = make(budget=3)
    req = decoding(s, max_tokens=20)
    req.spec_token_ids = [7, 8, 9, 10]
    assert only(s.schedule()).num_draft_tokens == 2


def test_drafts_take_only_the_spare_rows():
    s = make(seqs=4)
    a = decoding(s, "a", max_tokens=20)
    b = decoding(s, "b", max_tokens=20)
    a.spec_token_ids = [1, 2, 3]
    b.spec_token_ids = [1, 2, 3]
    s.add_request(mk("c", 5))  # one row kept for the waiting request
    out = s.schedule()
    drafts = {x.request_id: x.num_draft_tokens for x in out.scheduled}
    assert drafts == {"a": 1, "b": 0, "c": 0}
    assert sum(1 + x.num_draft_tokens for x in out.scheduled) <= 4


def test_no_drafts_while_a_prompt_is_still_being_computed():
    s = make(budget=4)
    req = mk("a", 10, max_tokens=20)
    s.add_request(req)
    req.spec_token_ids = [1, 2]  # (nothing proposes during a prefill; the scheduler ignores them)
    out = s.schedule()
    assert only(out).num_draft_tokens == 0 and only(out).num_scheduled_tokens == 4
    s.update_from_output(out, {})
    req.spec_token_ids = [1, 2]
    assert only(s.schedule()).num_draft_tokens == 0


def test_drafts_never_enter_the_prefix_cache():
    s = make(bs=4)
    req = decoding(s, prompt=6, max_tokens=20)  # positions 0-5 prompt, 6 holds the first output
    req.spec_token_ids = [7, 8, 9, 10, 11]  # positions 7-11: blocks 1 and 2 would fill with drafts
    out = s.schedule()
    assert only(out).num_draft_tokens == 5
    assert s.kv._num_cached_blocks["a"] == 1  # only the block of known tokens 0-3
    s.update_from_output(out, {"a": [7, 1]})  # one accepted: tokens 0-8 known
    assert s.kv._num_cached_blocks["a"] == 1
    step(s)  # the next allocation registers block 1 (tokens 4-7, all known and computed)
    assert s.kv._num_cached_blocks["a"] == 2
    assert req.block_hashes[1] == s.kv.pool.blocks[s.kv.get_block_ids("a")[1]].block_hash


def test_a_stop_token_among_accepted_drafts_finishes_the_request():
    s = make()
    req = decoding(s, max_tokens=20, eos=2)
    req.spec_token_ids = [7, 2, 9]
    out = s.schedule()
    (updated, taken), = s.update_from_output(out, {"a": [7, 2, 9, 4]})
    assert taken == 2 and req.output_token_ids == [5, 7, 2]
    assert req.status == RequestStatus.FINISHED_STOPPED
    assert s.kv.get_num_free_blocks() == s.kv.num_blocks - 1


def test_drafts_that_do_not_fit_are_dropped_and_preemption_drops_drafts():
    s = make(bs=4, blocks=5, max_len=16)  # 4 usable blocks, 2 per request after its prefill
    a = decoding(s, "a", prompt=6, max_tokens=20)
    b = decoding(s, "b", prompt=6, max_tokens=20)
    a.spec_token_ids = [1, 2, 3]  # positions 7-9 would need a third block: none is free
    out = s.schedule()
    assert not out.preempted_request_ids  # drafts never preempt anyone
    assert {x.request_id: x.num_draft_tokens for x in out.scheduled} == {"a": 0, "b": 0}
    s.update_from_output(out, {"a": [5], "b": [5]})
    b.spec_token_ids = [1, 2]
    out = s.schedule()  # a's next token needs a block: b, the newest, is preempted
    assert out.preempted_request_ids == ("b",)
    assert b.status == RequestStatus.PREEMPTED and b.spec_token_ids == []
