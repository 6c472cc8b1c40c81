"""Randomised end-to-end runs of Scheduler + KVCacheManager against a fake model.

The fake model behaves like a causal transformer with a paged KV cache: the "KV" it stores at
position p is a hash of the state at p - 1 (read back through the block table) and the token
at p, so a sampled token depends on the request's whole history *as read from the cache*.
A wrong block table, a stale or clobbered cached block, or a wrongly fed token changes the
output. Each run is compared with the outputs the same model gives when run on each request
alone, so preemption, chunking and prefix caching must not change any token. Every workload
runs twice: with plain steps, and overlapped (vLLM v1's async scheduling: step t+1 is
scheduled and run before step t's tokens reach the scheduler; the fake model reads a pending
token from what the request sampled last, as the device does); and twice more with decode
blocks of 4 steps (multi-step decode: `schedule_block` first, the fake model decoding each
block row's steps and stopping it on its stop tokens as the device does).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest

from jaxserve.core.kv_cache_manager import KVCacheManager, cdiv
from jaxserve.core.sched_output import PENDING, SchedulerOutput
from jaxserve.core.scheduler import Scheduler, SchedulerConfig
from jaxserve.request import Request, RequestStatus
from jaxserve.sampling_params import SamplingParams

S = RequestStatus
EOS = 1
VOCAB = 24
MASK = (1 << 61) - 1


def mix(prev: int, token: int, pos: int) -> int:
    return hash((prev, token, pos)) & MASK


def sample(state: int) -> int:
    return EOS if state % 13 == 0 else 2 + (state >> 7) % (VOCAB - 2)


class FakeRunner:
    """Writes every scheduled token's state into its slot, then samples from the cache. It
    keeps each request's block table from the scheduler's deltas, and the token each request
    sampled last (what a PENDING input token is)."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.bs = block_size
        self.requests: dict[str, object] = {}  # NewRequestData of each admitted request
        # Requests a block stopped (a stop token): the host finishes them when the block's
        # tokens arrive; rows scheduled for them meanwhile (overlapped) compute garbage.
        self.stopped: set[str] = set()
        self.num_block_stops = 0  # rows a block stopped before their last step
        self.cache: list[list[tuple[int, int] | None]] = [
            [None] * block_size for _ in range(num_blocks)
        ]
        self.tables: dict[str, list[int]] = {}
        self.last: dict[str, int] = {}

    def _slot(self, block_ids: tuple[int, ...], pos: int) -> tuple[int, int]:
        block = block_ids[pos // self.bs]
        assert block != 0, "wrote into the null block"
        return block, pos % self.bs

    def _read(self, block_ids: tuple[int, ...], pos: int) -> int:
        b, o = self._slot(block_ids, pos)
        entry = self.cache[b][o]
        assert entry is not None and entry[0] == pos, f"slot for position {pos} holds {entry}"
        return entry[1]

    def execute(self, out: SchedulerOutput) -> dict[str, list[int]]:
        for rid in (*out.finished_request_ids, *out.preempted_request_ids):
            self.tables.pop(rid, None)
            self.stopped.discard(rid)
        written: set[tuple[int, int]] = set()
        if out.num_steps > 1:
            return self._block(out)
        for x in out.scheduled:
            if x.request_id in self.stopped:  # finished by a block in flight: output dropped
                self.tables[x.request_id] += x.new_block_ids
                continue
            if x.is_new:
                self.requests[x.request_id] = x.new
                self.tables[x.request_id] = list(x.new_block_ids)
            else:
                self.tables[x.request_id] += x.new_block_ids
            table = tuple(self.tables[x.request_id])
            state = self._read(table, x.start_pos - 1) if x.start_pos else 0
            for j, tok in enumerate(x.token_ids):
                if tok == PENDING:
                    tok = self.last[x.request_id]
                pos = x.start_pos + j
                state = mix(state, tok, pos)
                slot = self._slot(table, pos)
                assert slot not in written, "two requests wrote one slot in a step"
                written.add(slot)
                self.cache[slot[0]][slot[1]] = (pos, state)
        sampled = {}
        for x in out.scheduled:
            if x.request_id in self.stopped:
                sampled[x.request_id] = [VOCAB + 7]
            elif x.sample:
                tok = sample(self._read(tuple(self.tables[x.request_id]), x.end_pos - 1))
                sampled[x.request_id] = [tok]
                self.last[x.request_id] = tok
        return sampled

    def _block(self, out: SchedulerOutput) -> dict[str, list[int]]:
        """A decode block: each row feeds its token, samples, feeds the sample, ... for its
        steps, stopping after a stop token (EOS unless ignore_eos, a stop token id, once
        min_tokens allow); the tokens it returns after a stop are garbage (the host trims)."""
        sampled = {}
        for x in out.scheduled:
            assert not x.is_new and x.num_scheduled_tokens == 1 and x.sample
            self.tables[x.request_id] += x.new_block_ids
            if x.request_id in self.stopped:
                sampled[x.request_id] = [VOCAB + 7] * x.num_steps
                continue
            table, new = tuple(self.tables[x.request_id]), self.requests[x.request_id]
            p = new.sampling_params
            stops = set(p.stop_token_ids or ()) | (set() if p.ignore_eos else {EOS})
            tok = x.token_ids[0] if x.token_ids[0] != PENDING else self.last[x.request_id]
            state = self._read(table, x.start_pos - 1) if x.start_pos else 0
            toks: list[int] = []
            for j in range(x.num_steps):
                pos = x.start_pos + j
                state = mix(state, tok, pos)
                self.cache[table[pos // self.bs]][pos % self.bs] = (pos, state)
                tok = sample(state)
                toks.append(tok)
                if tok in stops and pos + 2 - new.num_prompt_tokens >= p.min_tokens:
                    self.stopped.add(x.request_id)
                    self.num_block_stops += j + 1 < x.num_steps
                    break
            self.last[x.request_id] = tok
            sampled[x.request_id] = toks + [VOCAB + 7] * (x.num_steps - len(toks))
        return sampled


def reference(req: Request, max_model_len: int) -> tuple[list[int], RequestStatus, int | None]:
    """The request's output when run alone: (tokens, final status, stop_reason)."""
    params = req.sampling_params
    tokens = list(req.prompt_token_ids)
    state = 0
    for pos, tok in enumerate(tokens):
        state = mix(state, tok, pos)
    out: list[int] = []
    while True:
        tok = sample(state)
        out.append(tok)
        if len(out) >= params.min_tokens:
            if tok == EOS and not params.ignore_eos:
                return out, S.FINISHED_STOPPED, None
            if tok in params.stop_token_ids:
                return out, S.FINISHED_STOPPED, tok
        if len(tokens) + len(out) >= max_model_len or (
            params.max_tokens is not None and len(out) >= params.max_tokens
        ):
            return out, S.FINISHED_LENGTH_CAPPED, None
        state = mix(state, tok, len(tokens) + len(out) - 1)


# ---------------------------------------------------------------------- invariants
def check_state(s: Scheduler, num_steps: int = 1) -> None:
    kv, pool, cfg = s.kv, s.kv.pool, s.config
    running_ids = {r.request_id for r in s.running}
    assert set(kv._req_to_blocks) == running_ids, "only running requests hold blocks"
    assert len(s.running) <= cfg.max_num_seqs
    assert set(s.requests) == running_ids | {r.request_id for r in s.waiting}
    holders = [0] * pool.num_blocks
    for r in s.running:
        ids = kv.get_block_ids(r.request_id)
        assert r.status == S.RUNNING
        assert 0 not in ids and len(set(ids)) == len(ids)
        assert r.num_computed_tokens <= r.num_tokens + r.num_output_placeholders
        assert r.num_tokens <= cfg.max_model_len and 0 <= r.num_output_placeholders <= 2 * num_steps
        assert len(ids) * kv.block_size >= r.num_computed_tokens
        for i in ids:
            holders[i] += 1
    for r in s.waiting:
        assert r.status in (S.WAITING, S.PREEMPTED) and r.num_computed_tokens == 0
    free = set(pool.free_block_ids())
    assert 0 not in free and len(free) == pool.get_num_free_blocks()
    for b in pool.blocks[1:]:
        assert b.ref_cnt == holders[b.block_id], "ref count != number of holders"
        assert (b.ref_cnt == 0) == (b.block_id in free)
        if b.ref_cnt > 1:
            assert b.block_hash is not None, "shared block outside the prefix cache"
        if b.block_hash is not None:
            assert pool.get_cached_block(b.block_hash) is b


def check_output(s: Scheduler, out: SchedulerOutput, runner: FakeRunner) -> None:
    """After the runner took `out`: the rows, and the runner's block tables (from deltas)."""
    cfg, bs = s.config, s.kv.block_size
    assert out.total_num_scheduled_tokens == sum(x.num_scheduled_tokens for x in out.scheduled)
    assert out.total_num_scheduled_tokens <= cfg.max_num_batched_tokens
    assert len(out.scheduled) <= cfg.max_num_seqs
    assert len({x.request_id for x in out.scheduled}) == len(out.scheduled)
    assert len(out.requests) == len(out.scheduled)
    for x, r in zip(out.scheduled, out.requests):
        assert s.requests[x.request_id] is r and x.num_scheduled_tokens == len(x.token_ids) > 0
        # the runner's side of a row is a snapshot: no Request in it
        assert x.new is None if not x.is_new else x.new.prompt_token_ids == tuple(r.prompt_token_ids)
        # tokens in flight before this step (a block row adds its steps)
        pending = r.num_output_placeholders - (x.num_steps if x.sample else 0)
        fed_end = x.start_pos + x.num_scheduled_tokens
        assert r.num_computed_tokens == x.end_pos == fed_end + x.num_steps - 1
        assert fed_end <= r.num_tokens + pending and x.end_pos <= cfg.max_model_len
        assert x.num_steps == 1 or x.num_steps <= out.num_steps and x.num_scheduled_tokens == 1
        known = r.get_token_ids(x.start_pos, fed_end)
        assert list(x.token_ids) == known + [PENDING] * (x.num_scheduled_tokens - len(known))
        assert runner.tables[x.request_id] == s.kv.get_block_ids(x.request_id)
        assert len(runner.tables[x.request_id]) * bs >= x.end_pos
        assert x.sample == (fed_end == r.num_tokens + pending)
        if x.is_new:
            assert not pending and x.start_pos == r.num_computed_tokens - x.num_scheduled_tokens
            if not cfg.enable_chunked_prefill:
                assert x.sample, "without chunked prefill, a new request runs to its end"
        assert x.is_resumed == (x.is_new and r.num_preemptions > 0)


# ---------------------------------------------------------------------- random workloads
@dataclass
class Coverage:
    steps: int = 0
    preemptions: int = 0
    prefix_hits: int = 0
    chunks: int = 0
    pending: int = 0  # tokens fed before they reached the scheduler (overlapped steps)
    blocks: int = 0  # decode blocks (multi-step decode)
    block_stops: int = 0  # block rows stopped by a stop token before their last step
    aborted: dict[str, int] = field(default_factory=dict)


def make_workload(rng: random.Random):
    bs = rng.choice([1, 2, 4, 8, 16])
    max_len = rng.randint(8, 80)
    chunked = rng.random() < 0.8
    budget = rng.choice([1, 2, 3, 5, 8, 16, 64]) if chunked else max_len + rng.randint(0, 16)
    blocks = cdiv(max_len, bs) + 1 + rng.choice([0, 0, 1, 3, 10, 100])
    cfg = SchedulerConfig(
        max_num_seqs=rng.randint(1, 8),
        max_num_batched_tokens=budget,
        max_model_len=max_len,
        enable_chunked_prefill=chunked,
        policy=rng.choice(["fcfs", "priority"]),
    )
    kv = KVCacheManager(bs, blocks, enable_caching=rng.random() < 0.8, max_model_len=max_len)
    prefixes = [[rng.randrange(2, VOCAB) for _ in range(rng.randint(1, max_len))] for _ in range(3)]
    arrivals: dict[int, list[Request]] = {}
    for k in range(rng.randint(1, 24)):
        n = rng.randint(1, max_len)
        prompt = (rng.choice(prefixes) + [rng.randrange(2, VOCAB) for _ in range(n)])[:n]
        max_tokens = rng.choice([None, 1, 2, 5, 12, 30])
        params = SamplingParams(
            max_tokens=max_tokens,
            min_tokens=rng.choice([0, 0, 1, 3]) if max_tokens is None or max_tokens >= 3 else 0,
            ignore_eos=rng.random() < 0.2,
            stop_token_ids=[rng.randrange(2, VOCAB)] if rng.random() < 0.2 else None,
            prompt_logprobs=1 if rng.random() < 0.1 else None,
        )
        t = rng.randint(0, 20)
        copies = rng.choice([1, 1, 1, 3])  # n > 1: identical prompts arriving together
        for c in range(copies):
            arrivals.setdefault(t, []).append(
                Request(f"r{k}.{c}", prompt, params, arrival_time=float(t),
                        priority=rng.randint(0, 3), eos_token_id=EOS)
            )
    return Scheduler(cfg, kv), arrivals


def run_workload(seed: int, overlap: bool = False, num_steps: int = 1) -> Coverage:
    rng = random.Random(seed)
    s, arrivals = make_workload(rng)
    runner = FakeRunner(s.kv.num_blocks, s.kv.block_size)
    all_reqs = {r.request_id: r for rs in arrivals.values() for r in rs}
    cut_short: set[str] = set()  # aborted or stopped by a "stop string"
    cov = Coverage()
    p_abort = rng.choice([0.0, 0.05, 0.2])

    def maybe_abort(p: float) -> None:
        if s.requests and rng.random() < p:
            r = s.requests[rng.choice(sorted(s.requests))]
            state = r.status.name
            if r.status == S.RUNNING and r.num_computed_tokens < r.num_prompt_tokens:
                state = "prefill"
            cov.aborted[state] = cov.aborted.get(state, 0) + 1
            assert s.abort_requests([r.request_id]) == [r]
            cut_short.add(r.request_id)

    step = 0
    in_flight = None  # (output, sampled) of the step whose tokens the scheduler has not seen
    while step <= max(arrivals) or s.has_unfinished_requests() or in_flight:
        for r in arrivals.get(step, []):
            s.add_request(r)
        maybe_abort(p_abort)
        out = s.schedule_block(num_steps) if num_steps > 1 else None
        if out is None:
            out = s.schedule()
        else:
            cov.blocks += 1
        check_state(s, num_steps)
        sampled = runner.execute(out)
        check_output(s, out, runner)
        assert out.scheduled or in_flight or not s.has_unfinished_requests(), "no progress"
        cov.preemptions += len(out.preempted_request_ids)
        cov.chunks += sum(1 for x in out.scheduled if not x.sample)
        cov.pending += sum(x.token_ids.count(PENDING) for x in out.scheduled)
        maybe_abort(p_abort / 4)  # between schedule() and update_from_output()
        if overlap:  # this step stays in flight; the previous one's tokens arrive
            in_flight, (out, sampled) = (out, sampled) if out.scheduled else None, in_flight or (None, None)
        if out is not None:
            updated = s.update_from_output(out, sampled)
            finished = [r for r, _ in updated if r.is_finished]
            assert all(r.request_id not in s.requests for r in finished)
        check_state(s, num_steps)
        if s.running and rng.random() < p_abort / 4:  # the output processor saw a stop string
            victim = rng.choice(s.running)
            s.finish_requests([victim.request_id], S.FINISHED_STOPPED)
            cut_short.add(victim.request_id)
        step += 1
        assert step < 5000

    assert s.kv.get_num_free_blocks() == s.kv.num_blocks - 1
    assert all(b.ref_cnt == 0 for b in s.kv.pool.blocks)
    assert not s.running and not len(s.waiting)
    for rid, r in all_reqs.items():
        expected, status, stop_reason = reference(r, s.config.max_model_len)
        assert r.is_finished
        if rid in cut_short:
            assert r.output_token_ids == expected[: r.num_output_tokens], rid
        else:
            got = (r.output_token_ids, r.status, r.stop_reason)
            assert got == (expected, status, stop_reason), rid
    cov.steps = step
    cov.block_stops = runner.num_block_stops
    cov.prefix_hits = s.make_stats().prefix_cache_hits
    assert s.make_stats().num_preemptions == cov.preemptions
    return cov


@pytest.mark.parametrize("overlap", [False, True], ids=["plain", "overlapped"])
@pytest.mark.parametrize("seed", range(300))
def test_random_workload(seed: int, overlap: bool) -> None:
    run_workload(seed, overlap)


@pytest.mark.parametrize("overlap", [False, True], ids=["plain", "overlapped"])
@pytest.mark.parametrize("seed", range(100))
def test_random_workload_with_decode_blocks(seed: int, overlap: bool) -> None:
    run_workload(seed, overlap, num_steps=4)


def test_decode_blocks_run_in_the_random_workloads() -> None:
    blocks = preemptions = stops = 0
    for seed in range(40):
        cov = run_workload(seed, overlap=seed % 2 == 1, num_steps=4)
        blocks += cov.blocks
        preemptions += cov.preemptions
        stops += cov.block_stops
    assert blocks > 100 and preemptions > 20 and stops > 5, (blocks, preemptions, stops)


def test_random_workloads_cover_the_interesting_cases() -> None:
    total = Coverage()
    for seed in range(60):
        cov = run_workload(seed, overlap=seed % 2 == 1)
        total.preemptions += cov.preemptions
        total.prefix_hits += cov.prefix_hits
        total.chunks += cov.chunks
        total.pending += cov.pending
        for k, v in cov.aborted.items():
            total.aborted[k] = total.aborted.get(k, 0) + v
    assert total.preemptions > 20 and total.prefix_hits > 100 and total.chunks > 100
    assert total.pending > 100
    assert {"WAITING", "RUNNING", "PREEMPTED", "prefill"} <= set(total.aborted), total.aborted
