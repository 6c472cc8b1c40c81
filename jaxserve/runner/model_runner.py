"""ModelRunner: turns a SchedulerOutput into one call of a precompiled step executable.

One executable per (T tokens, R requests) bucket does: fold the input tokens into the sampling
state (penalty counts) -> model forward over the flat token batch (KV cache updated in place,
donated) -> logits at each request's last scheduled token -> sampling (+ raw logprobs, and
prompt logprobs when some row asks). Every bucket is compiled at start-up from abstract inputs
that carry the real shardings; a step whose shape misses the grid raises.
"""

from __future__ import annotations

import dataclasses
import logging
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from tqdm import tqdm

from jaxserve.core.sched_output import ScheduledRequest, SchedulerOutput
from jaxserve.runner.buckets import BucketGrid
from jaxserve.runner.compile import CompileCounter
from jaxserve.runner.kv_cache import allocate_kv_cache
from jaxserve.runner.step_inputs import ModelInputs, StepRequest, pack_step
from jaxserve.sampling.config import SamplerConfig
from jaxserve.sampling.metadata import SamplingMetadata, SamplingMetadataBuilder
from jaxserve.sampling.sampler import SamplerOutput, prompt_logprobs, sample
from jaxserve.sampling.state import SamplingState, init_sampling_state, update_state_from_tokens, write_slot_rows

logger = logging.getLogger(__name__)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TokenInfo:
    """Per input token: which slot it belongs to and what it is (for the sampling state), and
    the next prompt token when its prompt log-probs are wanted (-1 otherwise)."""

    slots: np.ndarray  # [T] int32
    is_prompt: np.ndarray  # [T] bool
    valid: np.ndarray  # [T] bool
    next_prompt_token: np.ndarray  # [T] int32


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PromptLogprobs:
    logprob: jax.Array  # [T] f32
    topk_ids: jax.Array  # [T, K] int32
    topk_logprobs: jax.Array  # [T, K] f32
    rank: jax.Array  # [T] int32


@dataclasses.dataclass(slots=True)
class SampleLogprobs:
    """Log-probs of one sampled token: its own, its rank and the top-k alternatives."""

    logprob: float
    rank: int
    top_ids: list[int]
    top_logprobs: list[float]


@dataclasses.dataclass(slots=True)
class RunnerOutput:
    sampled: dict[str, list[int]]
    logprobs: dict[str, SampleLogprobs]
    # request id -> (first position, per-position SampleLogprobs of the NEXT prompt token)
    prompt_logprobs: dict[str, tuple[int, list[SampleLogprobs]]]


@dataclasses.dataclass(slots=True)
class _ReqState:
    slot: int
    prompt_ids: tuple[int, ...]
    wants_prompt_logprobs: int | None
    wants_logprobs: int | None


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
        self.page_size = page_size
        self.pages_per_req = -(-max_model_len // page_size)
        self.grid = grid
        self.sampler_config = sampler_config
        self.max_num_seqs = max_num_seqs
        self.graphdef, state = nnx.split(model)
        # The weights travel to the step as a flat list of arrays: flattening the nnx State (one
        # Variable per weight) on every call costs milliseconds of host time per step.
        self.params, self._params_treedef = jax.tree.flatten(state)
        del state
        self.layer_impl = backend.layer_impl(model)
        backend.place_weights(model, self.params, self._params_treedef)
        self.kv = allocate_kv_cache(self.cfg, num_pages, page_size, kv_dtype, mesh)
        # The thread advising huge pages under the host buffers (CPU), if any.
        self.huge_pages = backend.place_kv_cache([*self.params, *self.kv.k, *self.kv.v])
        self.replicated = NamedSharding(mesh, P())
        self.sstate = jax.device_put(init_sampling_state(sampler_config), self.replicated)
        self.builder = SamplingMetadataBuilder(sampler_config, seed=seed)
        self.free_slots = list(range(max_num_seqs - 1, -1, -1))
        self.requests: dict[str, _ReqState] = {}
        self.counter = CompileCounter()
        self._compiled: dict[tuple[int, int], jax.stages.Compiled] = {}
        t0 = time.perf_counter()
        with self.counter.active():
            self._compile_all(show_progress)
        self.compile_seconds = time.perf_counter() - t0
        self.counter.mark_warm()

    # ------------------------------------------------------------------ compilation
    def _step_fn(self, params, kv, sstate, inputs: ModelInputs, meta: SamplingMetadata, tok: TokenInfo):
        sstate = update_state_from_tokens(sstate, tok.slots, inputs.input_ids, tok.is_prompt, tok.valid, meta.reset_slots)
        model = nnx.merge(self.graphdef, jax.tree.unflatten(self._params_treedef, params))
        hidden, kv = model(inputs.input_ids, inputs.positions, kv, inputs.md, self.layer_impl)  # [T, E]
        logits = model.compute_logits(hidden[inputs.logits_indices])  # [R, V]
        out = sample(logits, meta, sstate, self.sampler_config)
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

    def _abstract_inputs(self, T: int, R: int):
        rep = self.replicated
        i32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.int32, sharding=rep)  # noqa: E731
        dummy = pack_step([], num_tokens=T, num_reqs=R, pages_per_req=self.pages_per_req, page_size=self.page_size)
        inputs = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=rep), dummy)
        meta_np = self.builder.build([], [], R)
        meta = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=rep), meta_np)
        tok = TokenInfo(slots=i32(T), is_prompt=jax.ShapeDtypeStruct((T,), jnp.bool_, sharding=rep),
                        valid=jax.ShapeDtypeStruct((T,), jnp.bool_, sharding=rep), next_prompt_token=i32(T))
        return inputs, meta, tok

    def _compile_all(self, show_progress: bool) -> None:
        shaped = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)  # noqa: E731
        params = [shaped(x) for x in self.params]
        kv = jax.tree.map(shaped, self.kv)
        sstate = jax.tree.map(shaped, self.sstate)
        jitted = jax.jit(self._step_fn, donate_argnums=(1, 2))
        shapes = self.grid.shapes()
        for T, R in tqdm(shapes, desc="compiling buckets", disable=not show_progress, unit="bucket"):
            self._compiled[(T, R)] = jitted.lower(params, kv, sstate, *self._abstract_inputs(T, R)).compile()
        rows = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=self.replicated),
                            self._empty_slot_write())
        self._write_rows = jax.jit(write_slot_rows, donate_argnums=(0,)).lower(sstate, rows).compile()

    def _empty_slot_write(self):
        from jaxserve.sampling.state import SlotRowsWrite

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
    def _admit(self, s: ScheduledRequest, eos_ids: tuple[int, ...], bad_words) -> None:
        old = self.requests.pop(s.request_id, None)
        if old is not None:
            self.free_slots.append(old.slot)
        slot = self.free_slots.pop()
        p = s.sampling_params
        self.builder.admit(slot, p, eos_ids, bad_words)
        self.requests[s.request_id] = _ReqState(
            slot=slot,
            prompt_ids=tuple(s.all_token_ids[: s.num_prompt_tokens]),
            wants_prompt_logprobs=p.prompt_logprobs,
            wants_logprobs=p.logprobs,
        )

    def release(self, request_ids) -> None:
        for rid in request_ids:
            st = self.requests.pop(rid, None)
            if st is not None:
                self.free_slots.append(st.slot)

    def execute(self, so: SchedulerOutput, eos_ids: tuple[int, ...] = (), bad_words=None) -> RunnerOutput:
        """Run one step. `bad_words`: request id -> token-id sequences (optional)."""
        with self.counter.active():
            return self._execute(so, eos_ids, bad_words)

    def _execute(self, so: SchedulerOutput, eos_ids: tuple[int, ...], bad_words) -> RunnerOutput:
        self.release(so.finished_request_ids)
        self.release(so.preempted_request_ids)
        if so.is_empty:
            return RunnerOutput({}, {}, {})
        for s in so.scheduled:
            if s.is_new:
                self._admit(s, eos_ids, (bad_words or {}).get(s.request_id))
        for w in self.builder.take_slot_writes():
            self.sstate = self._write_rows(self.sstate, w)
        n_tok = so.total_num_scheduled_tokens
        T, R = self.grid.pick(n_tok, len(so.scheduled))
        inputs = pack_step(
            [StepRequest(s.token_ids, s.start_pos, s.block_ids) for s in so.scheduled],
            num_tokens=T, num_reqs=R, pages_per_req=self.pages_per_req, page_size=self.page_size,
        )
        tok = self._token_info(so, T)
        states = [self.requests[s.request_id] for s in so.scheduled]
        meta = self.builder.build([st.slot for st in states], [s.end_pos - s.num_prompt_tokens for s in so.scheduled], R)
        self.kv, self.sstate, out, plp = self._compiled[(T, R)](self.params, self.kv, self.sstate, inputs, meta, tok)
        return self._collect(so, states, out, plp, tok)

    def _token_info(self, so: SchedulerOutput, T: int) -> TokenInfo:
        slots = np.zeros(T, np.int32)
        is_prompt = np.zeros(T, np.bool_)
        valid = np.zeros(T, np.bool_)
        nxt = np.full(T, -1, np.int32)
        lo = 0
        for s in so.scheduled:
            st = self.requests[s.request_id]
            n = s.num_scheduled_tokens
            pos = np.arange(s.start_pos, s.end_pos)
            slots[lo : lo + n] = st.slot
            is_prompt[lo : lo + n] = pos < s.num_prompt_tokens
            valid[lo : lo + n] = True
            if st.wants_prompt_logprobs is not None:
                m = pos + 1 < s.num_prompt_tokens
                nxt[lo : lo + n][m] = np.asarray(st.prompt_ids, np.int32)[pos[m] + 1]
            lo += n
        return TokenInfo(slots=slots, is_prompt=is_prompt, valid=valid, next_prompt_token=nxt)

    def _collect(self, so, states, out: SamplerOutput, plp: PromptLogprobs, tok: TokenInfo) -> RunnerOutput:
        token_ids = np.asarray(out.token_ids)  # the one device->host transfer of a plain step
        want_lp = any(st.wants_logprobs is not None for st in states)
        want_plp = bool((tok.next_prompt_token >= 0).any())
        if want_lp:
            lp, rank, ids, top = jax.device_get((out.logprobs, out.rank, out.topk_ids, out.topk_logprobs))
        if want_plp:
            p_lp, p_rank, p_ids, p_top = jax.device_get((plp.logprob, plp.rank, plp.topk_ids, plp.topk_logprobs))
        sampled, logprobs, prompt_lps = {}, {}, {}
        lo = 0
        for i, (s, st) in enumerate(zip(so.scheduled, states)):
            if s.sample:
                sampled[s.request_id] = [int(token_ids[i])]
                if st.wants_logprobs is not None:
                    k = _k(st.wants_logprobs, self.sampler_config.max_logprobs)
                    logprobs[s.request_id] = SampleLogprobs(float(lp[i]), int(rank[i]), ids[i, :k].tolist(), top[i, :k].tolist())
            if st.wants_prompt_logprobs is not None:
                k = _k(st.wants_prompt_logprobs, self.sampler_config.max_logprobs)
                rows = [
                    SampleLogprobs(float(p_lp[t]), int(p_rank[t]), p_ids[t, :k].tolist(), p_top[t, :k].tolist())
                    for t in range(lo, lo + s.num_scheduled_tokens)
                    if tok.next_prompt_token[t] >= 0
                ]
                if rows:
                    prompt_lps[s.request_id] = (s.start_pos + 1, rows)
            lo += s.num_scheduled_tokens
        return RunnerOutput(sampled, logprobs, prompt_lps)


def _k(requested: int, max_logprobs: int) -> int:
    return max_logprobs if requested < 0 else min(requested, max_logprobs)

