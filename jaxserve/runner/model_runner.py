"""ModelRunner: turns a SchedulerOutput into one call of a precompiled step executable.

One executable per (T tokens, R requests) bucket does: replace pending input tokens by the
tokens their slots sampled last -> fold the input tokens into the sampling state (penalty
counts) -> model forward over the flat token batch (KV cache updated in place, donated) ->
logits at each request's last scheduled token -> sampling (+ raw logprobs, and prompt
logprobs when some row asks) -> keep each row's sampled token in its slot. Every bucket is
compiled at start-up from abstract inputs that carry the real shardings; a step whose shape
misses the grid raises.

A step runs in three parts, so that the engine can prepare and launch step t+1 while the
device still computes step t:

    plan = runner.prepare(scheduler_output)   # host only: slots, packing (numpy)
    step = runner.launch(plan)                # the JAX calls; returns once dispatched
    out = runner.collect(step)                # the one device->host transfer; waits for it

`prepare` reads the scheduler output and the runner's per-slot host state; `launch` needs only
the plan (a multi-host follower would run it on a plan received from the leader); `collect`
needs only the launched step.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from tqdm import tqdm

from jaxserve.core.sched_output import ScheduledRequest, SchedulerOutput
from jaxserve.outputs import SampleLogprobs
from jaxserve.runner.buckets import BucketGrid
from jaxserve.runner.compile import CompileCounter
from jaxserve.runner.kv_cache import allocate_kv_cache
from jaxserve.runner.step_buffers import BufferLayout
from jaxserve.runner.step_inputs import ModelInputs, TokenInfo, pack_rows
from jaxserve.sampling.config import SamplerConfig
from jaxserve.sampling.metadata import SamplingMetadata, SamplingMetadataBuilder
from jaxserve.sampling.sampler import SamplerOutput, prompt_logprobs, sample
from jaxserve.sampling.state import (
    SlotRowsWrite,
    init_sampling_state,
    record_sampled_tokens,
    resolve_pending_tokens,
    update_state_from_tokens,
    write_slot_rows,
)

logger = logging.getLogger(__name__)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PromptLogprobs:
    logprob: jax.Array  # [T] f32
    topk_ids: jax.Array  # [T, K] int32
    topk_logprobs: jax.Array  # [T, K] f32
    rank: jax.Array  # [T] int32


@dataclasses.dataclass(slots=True)
class RunnerOutput:
    sampled: dict[str, list[int]]
    logprobs: dict[str, SampleLogprobs]
    # request id -> (first position, per-position SampleLogprobs of the NEXT prompt token)
    prompt_logprobs: dict[str, tuple[int, list[SampleLogprobs]]]


@dataclasses.dataclass(slots=True)
class StepPlan:
    """One prepared step: the bucket, its inputs packed (`step_buffers`), and what `collect`
    reads back."""

    bucket: tuple[int, int]  # (T, R)
    slot_writes: list[SlotRowsWrite]  # sampler rows of admitted requests, written first
    buffers: tuple[np.ndarray, ...]  # (ModelInputs, SamplingMetadata, TokenInfo), packed
    sample_ids: list[str]  # the request of each row that samples, in row order
    sample_rows: np.ndarray  # [n] int: those rows
    logprob_rows: list[tuple[int, str, int]]  # (row, request id, top k)
    # (request id, first flat token, count, first position, top k)
    prompt_logprob_rows: list[tuple[str, int, int, int, int]]


@dataclasses.dataclass(slots=True)
class LaunchedStep:
    plan: StepPlan
    out: SamplerOutput
    plp: PromptLogprobs


class ModelRunner:
    def __init__(
        self,
        model,
        *,
        backend,
        mesh: Mesh,
        num_pages: int,
        page_size: int,
        max_model_len: int,
        max_num_seqs: int,
        grid: BucketGrid,
        sampler_config: SamplerConfig,
        kv_dtype,
        seed: int = 0,
        show_progress: bool = True,
    ):
        self.mesh = mesh
        self.cfg = model.config
        self.num_pages = num_pages
        self.page_size = page_size
        self.kv_dtype = kv_dtype
        self.pages_per_req = -(-max_model_len // page_size)
        self.grid = grid
        self.sampler_config = sampler_config
        self.max_num_seqs = max_num_seqs
        self.backend = backend
        self.graphdef, state = nnx.split(model)
        # The weights travel to the step as a flat list of arrays: flattening the nnx State (one
        # Variable per weight) on every call costs milliseconds of host time per step.
        self.params, self._params_treedef = jax.tree.flatten(state)
        del state
        self.layer_impl = backend.layer_impl(model)
        backend.place_weights(model, self.params, self._params_treedef)
        self.replicated = NamedSharding(mesh, P())
        self._allocate_state()
        self.builder = SamplingMetadataBuilder(sampler_config, seed=seed)
        self._reset_slots()
        self._host_params: list[np.ndarray] | None = None  # the weights while asleep
        self.counter = CompileCounter()
        self._compiled: dict[tuple[int, int], jax.stages.Compiled] = {}
        self._layouts: dict[tuple[int, int], BufferLayout] = {}
        t0 = time.perf_counter()
        with self.counter.active():
            self._compile_all(show_progress)
        self.compile_seconds = time.perf_counter() - t0
        self.counter.mark_warm()

    def _allocate_state(self) -> None:
        """The KV cache and the sampling state (device), zeroed."""
        self.kv = allocate_kv_cache(self.cfg, self.num_pages, self.page_size, self.kv_dtype, self.mesh)
        # The thread advising huge pages under the host buffers (CPU), if any.
        self.huge_pages = self.backend.place_kv_cache([*self.params, *self.kv.k, *self.kv.v])
        self.sstate = jax.device_put(init_sampling_state(self.sampler_config), self.replicated)

    def _reset_slots(self) -> None:
        """Per-slot host state: which request holds each sampling slot, and its block table."""
        S = self.max_num_seqs
        self.free_slots = list(range(S - 1, -1, -1))
        self.slot_of: dict[str, int] = {}
        self.block_table = np.zeros((S, self.pages_per_req), np.int32)
        self.num_blocks = np.zeros(S, np.int64)
        self.prompt_len = np.zeros(S, np.int64)
        self._logprobs_k: list[int | None] = [None] * S
        self._prompt_logprobs_k: list[int | None] = [None] * S
        self._prompt_ids: list[list[int] | None] = [None] * S

    # ------------------------------------------------------------------ compilation
    def _step_fn(self, params, kv, sstate, inputs: ModelInputs, meta: SamplingMetadata, tok: TokenInfo):
        input_ids = resolve_pending_tokens(sstate, inputs.input_ids, tok.slots)
        sstate = update_state_from_tokens(sstate, tok.slots, input_ids, tok.is_prompt, tok.valid, meta.reset_slots)
        model = nnx.merge(self.graphdef, jax.tree.unflatten(self._params_treedef, params))
        hidden, kv = model(input_ids, inputs.positions, kv, inputs.md, self.layer_impl)  # [T, E]
        logits = model.compute_logits(hidden[inputs.logits_indices])  # [R, V]
        out = sample(logits, meta, sstate, self.sampler_config)
        sstate = record_sampled_tokens(sstate, out.token_ids, tok.sample_slots)
        k = self.sampler_config.max_logprobs
        T = hidden.shape[0]
        wants = tok.next_prompt_token >= 0

        def with_prompt_lp():
            lp, ids, top, rank = prompt_logprobs(model.compute_logits(hidden), jnp.maximum(tok.next_prompt_token, 0), k,
                                                 self.sampler_config.native)
            return PromptLogprobs(lp, ids, top, rank)

        def without():
            return PromptLogprobs(jnp.zeros((T,), jnp.float32), jnp.zeros((T, k), jnp.int32),
                                  jnp.zeros((T, k), jnp.float32), jnp.zeros((T,), jnp.int32))

        plp = jax.lax.cond(jnp.any(wants), with_prompt_lp, without)
        return kv, sstate, out, plp

    def step_layout(self, T: int, R: int) -> BufferLayout:
        """How a (T, R) step's inputs (ModelInputs, SamplingMetadata, TokenInfo) are packed."""
        empty = np.zeros(0, np.int32)
        dummy = pack_rows(empty, empty, empty, np.zeros((0, self.pages_per_req), np.int32),
                          num_tokens=T, num_reqs=R, page_size=self.page_size)
        tok = TokenInfo(slots=np.zeros(T, np.int32), is_prompt=np.zeros(T, np.bool_), valid=np.zeros(T, np.bool_),
                        next_prompt_token=np.zeros(T, np.int32), sample_slots=np.zeros(R, np.int32))
        meta = SamplingMetadataBuilder(self.sampler_config).build([], [], R)
        return BufferLayout.of((dummy, meta, tok))

    def _packed_step_fn(self, layout: BufferLayout, params, kv, sstate, *buffers):
        return self._step_fn(params, kv, sstate, *layout.unpack(buffers))

    def _compile_all(self, show_progress: bool) -> None:
        shaped = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)  # noqa: E731
        params = [shaped(x) for x in self.params]
        kv = jax.tree.map(shaped, self.kv)
        sstate = jax.tree.map(shaped, self.sstate)
        shapes = self.grid.shapes()
        for T, R in tqdm(shapes, desc="compiling buckets", disable=not show_progress, unit="bucket"):
            layout = self._layouts[(T, R)] = self.step_layout(T, R)
            jitted = jax.jit(functools.partial(self._packed_step_fn, layout), donate_argnums=(1, 2))
            self._compiled[(T, R)] = jitted.lower(params, kv, sstate, *layout.abstract(self.replicated)).compile()
        rows = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=self.replicated),
                            self._empty_slot_write())
        self._write_rows = jax.jit(write_slot_rows, donate_argnums=(0,)).lower(sstate, rows).compile()

    def _empty_slot_write(self) -> SlotRowsWrite:
        c = self.sampler_config
        return SlotRowsWrite(
            slots=np.full(c.slot_write_batch, c.max_num_seqs, np.int32),
            logit_bias=np.zeros((c.slot_write_batch, c.vocab_size), np.float32),
            bad_words=np.zeros((c.slot_write_batch, c.max_bad_words, c.max_bad_word_len), np.int32),
        )

    @property
    def num_buckets(self) -> int:
        return len(self._compiled)

    # ------------------------------------------------------------------ per step
    def _admit(self, s: ScheduledRequest) -> int:
        """Give a (re)admitted request a sampling slot and its rows; returns the slot."""
        req = s.request
        self._release(req.request_id)
        slot = self.free_slots.pop()
        p = req.sampling_params
        eos = () if req.eos_token_id is None else (req.eos_token_id,)
        self.builder.admit(slot, p, eos, req.bad_words_token_ids)
        self.slot_of[req.request_id] = slot
        ids = s.new_block_ids
        self.block_table[slot, : len(ids)] = ids
        self.num_blocks[slot] = len(ids)
        self.prompt_len[slot] = req.num_prompt_tokens
        self._logprobs_k[slot] = p.logprobs
        self._prompt_logprobs_k[slot] = p.prompt_logprobs
        self._prompt_ids[slot] = req.prompt_token_ids if p.prompt_logprobs is not None else None
        return slot

    def _release(self, request_id: str) -> None:
        slot = self.slot_of.pop(request_id, None)
        if slot is not None:
            self.free_slots.append(slot)

    def prepare(self, so: SchedulerOutput, token_bitmask: np.ndarray | None = None) -> StepPlan | None:
        """The host half of a step (numpy only); None when nothing is scheduled.
        `token_bitmask`: structured output's [len(so.scheduled), ceil(V/32)] int32 rows, in
        batch order (None: nothing is masked)."""
        for rid in so.finished_request_ids:
            self._release(rid)
        for rid in so.preempted_request_ids:
            self._release(rid)
        if so.is_empty:
            return None
        n = len(so.scheduled)
        slots, starts, lens, samples, tokens = [0] * n, [0] * n, [0] * n, [False] * n, []
        slot_of, table, num_blocks = self.slot_of, self.block_table, self.num_blocks
        for i, s in enumerate(so.scheduled):
            if s.is_new:
                slot = self._admit(s)
            else:
                slot = slot_of[s.request.request_id]
                if s.new_block_ids:
                    nb = num_blocks[slot]
                    table[slot, nb : nb + len(s.new_block_ids)] = s.new_block_ids
                    num_blocks[slot] = nb + len(s.new_block_ids)
            slots[i], starts[i], lens[i], samples[i] = slot, s.start_pos, s.num_scheduled_tokens, s.sample
            tokens.extend(s.token_ids)
        total = len(tokens)
        T, R = self.grid.pick(total, n)
        slots_np = np.asarray(slots, np.int32)
        starts_np, lens_np = np.asarray(starts, np.int64), np.asarray(lens, np.int64)
        inputs = pack_rows(np.asarray(tokens, np.int32), starts_np, lens_np, table[slots_np],
                           num_tokens=T, num_reqs=R, page_size=self.page_size)
        tok_slots = np.zeros(T, np.int32)
        tok_slots[:total] = np.repeat(slots_np, lens_np)
        valid = np.zeros(T, np.bool_)
        valid[:total] = True
        is_prompt = valid & (inputs.positions < self.prompt_len[tok_slots])
        samples_np = np.asarray(samples, np.bool_)
        sample_rows = np.flatnonzero(samples_np)
        sample_slots = np.full(R, self.max_num_seqs, np.int32)
        sample_slots[sample_rows] = slots_np[sample_rows]
        nxt = np.full(T, -1, np.int32)
        logprob_rows, prompt_rows = [], []
        lo = 0
        for i, slot in enumerate(slots):
            if samples[i] and self._logprobs_k[slot] is not None:
                logprob_rows.append((i, so.scheduled[i].request.request_id, self._k(self._logprobs_k[slot])))
            if self._prompt_logprobs_k[slot] is not None:
                pos = starts[i] + np.arange(lens[i])
                has_next = pos + 1 < self.prompt_len[slot]
                count = int(has_next.sum())  # the leading positions of the row
                if count:
                    nxt[lo : lo + count] = np.asarray(self._prompt_ids[slot], np.int32)[pos[:count] + 1]
                    prompt_rows.append((so.scheduled[i].request.request_id, lo, count, starts[i] + 1,
                                        self._k(self._prompt_logprobs_k[slot])))
            lo += lens[i]
        tok = TokenInfo(slots=tok_slots, is_prompt=is_prompt, valid=valid, next_prompt_token=nxt,
                        sample_slots=sample_slots)
        meta = self.builder.build(slots_np, starts_np + lens_np - self.prompt_len[slots_np], R, token_bitmask)
        sample_ids = [so.scheduled[i].request.request_id for i in sample_rows.tolist()]
        buffers = self._layouts[(T, R)].pack((inputs, meta, tok))
        return StepPlan((T, R), self.builder.take_slot_writes(), buffers, sample_ids, sample_rows, logprob_rows,
                        prompt_rows)

    def launch(self, plan: StepPlan) -> LaunchedStep:
        """Dispatch the step (the sampler rows of admitted requests first); returns at once."""
        with self.counter.active():
            for w in plan.slot_writes:
                self.sstate = self._write_rows(self.sstate, w)
            self.kv, self.sstate, out, plp = self._compiled[plan.bucket](self.params, self.kv, self.sstate,
                                                                         *plan.buffers)
        return LaunchedStep(plan, out, plp)

    def collect(self, step: LaunchedStep) -> RunnerOutput:
        """The step's sampled tokens (and log-probs) on the host; waits for the device."""
        plan, out, plp = step.plan, step.out, step.plp
        token_ids = np.asarray(out.token_ids)  # the one device->host transfer of a plain step
        sampled = {rid: [t] for rid, t in zip(plan.sample_ids, token_ids[plan.sample_rows].tolist())}
        logprobs, prompt_lps = {}, {}
        if plan.logprob_rows:
            lp, rank, ids, top = jax.device_get((out.logprobs, out.rank, out.topk_ids, out.topk_logprobs))
            for row, rid, k in plan.logprob_rows:
                logprobs[rid] = SampleLogprobs(float(lp[row]), int(rank[row]), ids[row, :k].tolist(),
                                               top[row, :k].tolist())
        if plan.prompt_logprob_rows:
            p_lp, p_rank, p_ids, p_top = jax.device_get((plp.logprob, plp.rank, plp.topk_ids, plp.topk_logprobs))
            for rid, lo, count, first, k in plan.prompt_logprob_rows:
                prompt_lps[rid] = (first, [SampleLogprobs(float(p_lp[t]), int(p_rank[t]), p_ids[t, :k].tolist(),
                                                          p_top[t, :k].tolist()) for t in range(lo, lo + count)])
        return RunnerOutput(sampled, logprobs, prompt_lps)

    def execute(self, so: SchedulerOutput) -> RunnerOutput:
        """prepare, launch and collect one step."""
        plan = self.prepare(so)
        if plan is None:
            return RunnerOutput({}, {}, {})
        return self.collect(self.launch(plan))

    def _k(self, requested: int) -> int:
        return self.sampler_config.max_logprobs if requested < 0 else min(requested, self.sampler_config.max_logprobs)

    # ------------------------------------------------------------------ sleep mode
    @property
    def is_sleeping(self) -> bool:
        return self._host_params is not None

    def sleep(self) -> None:
        """Free the device memory of the weights (kept on the host) and the KV cache (dropped).
        Only while no request holds a slot."""
        if self.is_sleeping:
            return
        if self.slot_of:
            raise RuntimeError("the runner cannot sleep while requests hold slots")
        self._shardings = [x.sharding for x in self.params]
        self._host_params = [np.array(x) for x in self.params]
        for x in (*self.params, *self.kv.k, *self.kv.v, *jax.tree.leaves(self.sstate)):
            x.delete()
        self.params = []

    def wake_up(self) -> None:
        """Put the weights back on the devices and allocate a fresh KV cache."""
        if not self.is_sleeping:
            return
        self.params = [jax.device_put(h, s) for h, s in zip(self._host_params, self._shardings)]
        self._host_params = None
        self._allocate_state()
        self._reset_slots()
