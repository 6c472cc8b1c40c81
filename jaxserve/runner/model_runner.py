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
needs only the launched step. Everything the steps are a function of is the runner's
`StepRecipe` (runner/recipe.py), from which the compile workers, the memory probes and
shard-plan build the same programs.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
from typing import TYPE_CHECKING

import jax
import numpy as np
from jax.sharding import Mesh
from tqdm import tqdm

from jaxserve.core.sched_output import ScheduledRequest, SchedulerOutput
from jaxserve.outputs import SampleLogprobs
from jaxserve.request import RequestFailedError
from jaxserve.runner.compile import CompileCounter
from jaxserve.runner.compile_pool import compile_in_workers
from jaxserve.runner.executable_cache import ExecutableCache, ExecutableScope, canonical, executable_scope, signature
from jaxserve.runner.kv_cache import allocate_kv_cache, zeros_compiler
from jaxserve.runner.lora_weights import LoRAWeights
from jaxserve.runner.recipe import StepRecipe, step_program
from jaxserve.runner.step_buffers import BufferLayout
from jaxserve.runner.step_fn import PromptLogprobs
from jaxserve.runner.step_inputs import TokenInfo, pack_rows
from jaxserve.sampling.metadata import SamplingMetadataBuilder
from jaxserve.sampling.sampler import SamplerOutput
from jaxserve.sampling.state import SlotRowsWrite, init_sampling_state, write_slot_rows
from jaxserve.spec_decode.ngram import accept_drafts
from jaxserve.startup_timer import StartupTimer

if TYPE_CHECKING:
    from jaxserve.backends.base import Backend

logger = logging.getLogger(__name__)


@dataclasses.dataclass(slots=True)
class RunnerOutput:
    sampled: dict[str, list[int]]  # one token, or with drafts the accepted ones and the next
    logprobs: dict[str, list[SampleLogprobs]]  # one per sampled token
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
    # LoRA adapters to write into their slots before the step: (slot, contents)
    lora_writes: list[tuple[int, list[np.ndarray]]] = dataclasses.field(default_factory=list)
    # Speculative decoding: request id -> its drafts (it samples on len + 1 rows)
    drafts: dict[str, tuple[int, ...]] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(slots=True)
class LaunchedStep:
    plan: StepPlan
    out: SamplerOutput
    plp: PromptLogprobs


class ModelRunner:
    def __init__(
        self,
        model,
        recipe: StepRecipe,
        *,
        backend: Backend,
        mesh: Mesh,
        seed: int = 0,
        max_cpu_loras: int | None = None,
        compile_workers: int = 1,
        executable_cache: ExecutableCache | None = None,
        show_progress: bool = True,
        timer: StartupTimer | None = None,
    ):
        """The steps of `recipe` (runner/recipe.py: everything they are a function of) over
        `model`'s weights, on `mesh`. The host-side options: `seed` (requests without one),
        `max_cpu_loras` (the adapters' host LRU), `compile_workers` (processes compiling the
        steps at a cold start, from the recipe), the executable cache."""
        self.mesh, self.recipe, self.backend = mesh, recipe, backend
        # Data parallelism: D ranks, each with its own pages and its own range of S / D sampling
        # slots (see core/dp_scheduler.py); the step runs per rank inside a shard_map over "data".
        self.dp = mesh.shape.get("data", 1)
        self.max_num_seqs = S = recipe.sampler_config.max_num_seqs
        if S % self.dp:
            raise ValueError(f"max_num_seqs ({S}) must be a multiple of the data-parallel size {self.dp}")
        self.cfg = model.config
        self.num_pages, self.page_size, self.kv_dtype = recipe.num_pages, recipe.page_size, recipe.kv_dtype
        self.pages_per_req = recipe.pages_per_req()
        self.grid = recipe.grid()
        self.sampler_config = recipe.sampler_config
        timer = timer or StartupTimer()  # the phases of this runner's start (build_engine logs them)
        # The weights travel to the step as a flat list of arrays (flattening the nnx State on
        # every call costs milliseconds of host time per step), the LoRA slots' after them.
        self.program, self.params, self._params_treedef = step_program(recipe, model, backend, mesh, max_cpu_loras)
        with timer.phase("weight arena"):
            backend.place_weights(model, self.params, self._params_treedef)
        self.num_weights = len(self.params)
        self.params += self.program.lora_arrays(abstract=False)
        self.replicated, self.state_sharding = self.program.replicated, self.program.state_sharding
        self.counter = CompileCounter()
        self.executable_cache = executable_cache
        self.compile_workers = compile_workers
        with self.counter.active(), timer.phase("kv cache"):
            self._scope = self._executable_scope()
            self._allocate_state()
        self.builder = SamplingMetadataBuilder(recipe.sampler_config, seed=seed)
        self._reset_slots()
        self._host_params: list[np.ndarray] | None = None  # the weights while asleep
        self._compiled: dict[tuple[int, int], jax.stages.Compiled] = {}
        self.layouts: dict[tuple[int, int], BufferLayout] = {}
        t0 = time.perf_counter()
        with self.counter.active(), timer.phase("executables"):
            self._compile_all(show_progress)
        self.compile_seconds = time.perf_counter() - t0
        self.counter.mark_warm()

    @property
    def lora(self) -> LoRAWeights | None:
        return self.program.lora

    def _allocate_state(self) -> None:
        """The KV cache and the sampling state (device), zeroed, by two small executables of the
        executable cache (as eager ops, some ten compilations: ~0.3 s of a start)."""
        one = self.program.abstract_kv().k[0]
        zeros = self._scope.get("kv-zeros", (), zeros_compiler(one))
        self.kv = allocate_kv_cache(self.cfg, self.num_pages, self.page_size, self.kv_dtype, self.mesh,
                                    self.recipe.rules, zeros=zeros)
        # The backend's thread placing the host buffers (the CPU's huge pages), if any.
        self.host_placement = self.backend.place_kv_cache([*self.params, *self.kv.k, *self.kv.v])
        init = self._scope.get("sampling-state", (), lambda: jax.jit(
            functools.partial(init_sampling_state, self.sampler_config), out_shardings=self.state_sharding
        ).lower().compile())
        self.sstate = init()

    def _reset_slots(self) -> None:
        """Per-slot host state: which request holds each sampling slot, and its block table."""
        S = self.max_num_seqs
        per = S // self.dp  # each data-parallel rank's slots: [r * per, (r + 1) * per)
        self.free_slots = [list(range((r + 1) * per - 1, r * per - 1, -1)) for r in range(self.dp)]
        self.slot_of: dict[str, int] = {}
        self.block_table = np.zeros((S, self.pages_per_req), np.int32)
        self.num_blocks = np.zeros(S, np.int64)
        self.prompt_len = np.zeros(S, np.int64)
        self._logprobs_k: list[int | None] = [None] * S
        self._prompt_logprobs_k: list[int | None] = [None] * S
        self._prompt_ids: list[list[int] | None] = [None] * S
        self.lora_slot = np.zeros(S, np.int32)  # the LoRA slot of each sampling slot's request

    # ------------------------------------------------------------------ compilation
    def step_layout(self, T: int, R: int) -> BufferLayout:
        """How a (T, R) step's inputs (ModelInputs, SamplingMetadata, TokenInfo) are packed."""
        return self.program.layout(T, R)

    def _abstract_arguments(self):
        shaped = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)  # noqa: E731
        return [shaped(x) for x in self.params], jax.tree.map(shaped, self.kv), jax.tree.map(shaped, self.sstate)

    def lower(self, bucket: tuple[int, int]) -> jax.stages.Lowered:
        """The Lowered step of `bucket` over this runner's arguments (its program: the one the
        recipe's other users build, runner/recipe.py)."""
        return self.program.lower(bucket, *self._abstract_arguments())[0]()

    def _compile_all(self, show_progress: bool) -> None:
        params, kv, sstate = self._abstract_arguments()
        shapes = self.grid.shapes()
        scope = self._scope
        self._compile_in_workers(shapes)
        for i, (T, R) in enumerate(tqdm(shapes, desc="compiling buckets", disable=not show_progress, unit="bucket")):
            self.layouts[(T, R)] = self.step_layout(T, R)
            lower, buffers = self.program.lower((T, R), params, kv, sstate)
            t0, compiled_before = time.perf_counter(), scope.compiled
            self._compiled[(T, R)] = scope.get(f"step-{T}x{R}", (params, kv, sstate, *buffers),
                                               lambda: lower().compile())
            if scope.compiled != compiled_before:
                logger.info("compiled step %dx%d in %.1fs: %d of %d steps ready, %d left", T, R,
                            time.perf_counter() - t0, i + 1, len(shapes), len(shapes) - i - 1)
        rep = self.replicated
        rows = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=rep), self.empty_slot_write())
        keep = jax.tree.map(lambda x: x.sharding, self.sstate)
        self._write_rows = scope.get("write-slot-rows", (sstate, rows), lambda: jax.jit(
            write_slot_rows, donate_argnums=(0,), out_shardings=keep).lower(sstate, rows).compile())
        self.program.compile_lora_writer(scope)
        self.executables_loaded, self.executables_compiled = scope.loaded, scope.compiled

    def _compile_in_workers(self, shapes: list[tuple[int, int]]) -> None:
        """Compile the steps the executable cache lacks in `compile_workers` processes, from the
        recipe, which store them there (the loop of `_compile_all` then loads them); nothing
        without a cache, a compile target or a second worker."""
        scope = self._scope
        if self.compile_workers <= 1 or not self.recipe.target or scope.cache is None:
            return
        keys = {}
        for T, R in shapes:
            name = f"step-{T}x{R}"
            key = scope.entry_key(name)
            if not scope.cache.has(key, name):
                keys[(T, R)] = (name, key)
        if len(keys) < 2:
            return
        workers = min(self.compile_workers, len(keys))
        logger.info("compiling %d steps in %d processes", len(keys), workers)

        def done(result: dict, n: int, total: int) -> None:
            T, R = result["bucket"]
            if "error" in result:
                logger.warning("a compile worker failed on step %dx%d (%s); it compiles in this process",
                               T, R, result["error"][:500])
            else:
                logger.info("compiled step %dx%d in %.1fs: %d of %d, %d left", T, R, result["seconds"], n,
                            total, total - n)

        pool = compile_in_workers(self.recipe, list(keys), workers, cache_dir=str(scope.cache.directory),
                                  keys=keys, on_done=done)
        logger.info("%d steps compiled in %d processes in %.1fs", len(keys), workers, pool.seconds)

    def _executable_scope(self) -> ExecutableScope:
        """The keys of this runner's executables in the executable cache: everything the steps
        are a function of besides the environment (see runner/executable_cache.py)."""
        params = [jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding) for x in self.params]
        kv, sstate = self.program.abstract_kv(), self.program.abstract_state()
        fn = self.program.function
        layer = fn.layer_impl and f"{fn.layer_impl.__module__}.{fn.layer_impl.__qualname__}"
        return executable_scope(
            self.executable_cache, self.mesh.devices.flat, **self.backend.fingerprint(),
            graphdef=canonical(fn.graphdef),
            params=signature(params), params_treedef=str(self._params_treedef), kv=signature(kv),
            sstate=signature(sstate), layer_impl=str(layer), sampler=canonical(self.sampler_config),
            mesh=repr(self.mesh), pages=f"{self.page_size} {self.pages_per_req} {self.num_pages} {self.dp}",
            replicated=repr(self.replicated))

    def empty_slot_write(self) -> SlotRowsWrite:
        c = self.sampler_config
        return SlotRowsWrite(
            slots=np.full(c.slot_write_batch, c.max_num_seqs, np.int32),
            logit_bias=np.zeros((c.slot_write_batch, c.vocab_size), np.float32),
            bad_words=np.zeros((c.slot_write_batch, c.max_bad_words, c.max_bad_word_len), np.int32),
        )

    def executable(self, bucket: tuple[int, int]) -> jax.stages.Compiled:
        """The compiled step of `bucket` (its memory analysis, its HLO)."""
        return self._compiled[bucket]

    @property
    def num_buckets(self) -> int:
        return len(self._compiled)

    # ------------------------------------------------------------------ per step
    def _admit(self, s: ScheduledRequest, rank: int) -> int:
        """Give a (re)admitted request a sampling slot of its rank and its rows; returns the slot."""
        req = s.request
        self._release(req.request_id)
        free = self.free_slots[rank]
        slot = free.pop()
        p = req.sampling_params
        eos = () if req.eos_token_id is None else (req.eos_token_id,)
        try:
            self.builder.admit(slot, p, eos, req.bad_words_token_ids)
        except Exception as e:  # noqa: BLE001 - this request's parameters: it fails alone
            free.append(slot)
            raise RequestFailedError((req.request_id,), e) from e
        self.slot_of[req.request_id] = slot
        ids = s.new_block_ids
        self.block_table[slot, : len(ids)] = ids
        self.num_blocks[slot] = len(ids)
        self.prompt_len[slot] = req.num_prompt_tokens
        self._logprobs_k[slot] = p.logprobs
        self._prompt_logprobs_k[slot] = p.prompt_logprobs
        self._prompt_ids[slot] = req.prompt_token_ids if p.prompt_logprobs is not None else None
        self.lora_slot[slot] = req.lora_slot
        return slot

    def _release(self, request_id: str) -> None:
        slot = self.slot_of.pop(request_id, None)
        if slot is not None:
            self.free_slots[slot // (self.max_num_seqs // self.dp)].append(slot)

    def prepare(self, so, token_bitmask: np.ndarray | None = None) -> StepPlan | None:
        """The host half of a step (numpy only); None when nothing is scheduled. `so` is a
        SchedulerOutput, or a DataParallelOutput (one per rank) with data parallelism.
        `token_bitmask`: structured output's [len(so.scheduled), ceil(V/32)] int32 rows, in
        batch order (ranks in order; None: nothing is masked)."""
        for rid in so.finished_request_ids:
            self._release(rid)
        for rid in so.preempted_request_ids:
            self._release(rid)
        if so.is_empty:
            return None
        lora_writes = self._lora_writes(so) if so.lora_loads else []
        rows = [self._rows(r, rank_so) for r, rank_so in enumerate(so.ranks)]
        T, R = self.grid.pick(max(len(x[4]) for x in rows), max(len(x[0]) + sum(x[6]) for x in rows))
        masks = [None] * len(rows)
        if token_bitmask is not None:  # split by rank: so.scheduled lists the ranks' rows in order
            bounds = np.cumsum([0] + [len(x[0]) for x in rows])
            masks = [token_bitmask[a:b] for a, b in zip(bounds[:-1], bounds[1:])]
        packs = [self._pack(r, x, T, R, m) for r, (x, m) in enumerate(zip(rows, masks))]
        if self.dp == 1:
            buffers = packs[0][0]
        else:
            buffers = tuple(np.stack([p[0][g] for p in packs]) for g in range(len(packs[0][0])))
        sample_ids, sample_rows, logprob_rows, prompt_rows = [], [], [], []
        for r, (_, ids, srows, lrows, prows) in enumerate(packs):
            sample_ids += ids
            sample_rows.append(srows + r * R)
            logprob_rows += [(row + r * R, rid, k) for row, rid, k in lrows]
            prompt_rows += [(rid, lo + r * T, count, first, k) for rid, lo, count, first, k in prows]
        drafts = {s.request_id: s.token_ids[s.num_scheduled_tokens - s.num_draft_tokens:]
                  for s in so.scheduled if s.num_draft_tokens}
        return StepPlan((T, R), self.builder.take_slot_writes(), buffers, sample_ids, np.concatenate(sample_rows),
                        logprob_rows, prompt_rows, drafts=drafts, lora_writes=lora_writes)

    def _lora_writes(self, so) -> list[tuple[int, list[np.ndarray]]]:
        """The contents of the adapters given a slot this step; an adapter that cannot be read
        fails the requests that use it."""
        writes = []
        for slot, lora in so.lora_loads:
            try:
                writes.append((slot, self.lora.host_copy(lora)))
            except Exception as e:  # noqa: BLE001 - this adapter's requests fail alone
                users = [s.request_id for s in so.scheduled if s.request.lora_slot == slot]
                raise RequestFailedError(users, e) from e
        return writes

    def _rows(self, rank: int, so: SchedulerOutput):
        """One rank's rows: (slots, starts, lens, samples, tokens, scheduled, drafts per
        request), admitting new requests."""
        n = len(so.scheduled)
        slots, starts, lens, samples, tokens = [0] * n, [0] * n, [0] * n, [False] * n, []
        drafts = [s.num_draft_tokens for s in so.scheduled]
        slot_of, table, num_blocks = self.slot_of, self.block_table, self.num_blocks
        for i, s in enumerate(so.scheduled):
            if s.is_new:
                slot = self._admit(s, rank)
            else:
                slot = slot_of[s.request.request_id]
                if s.new_block_ids:
                    nb = num_blocks[slot]
                    table[slot, nb : nb + len(s.new_block_ids)] = s.new_block_ids
                    num_blocks[slot] = nb + len(s.new_block_ids)
            slots[i], starts[i], lens[i], samples[i] = slot, s.start_pos, s.num_scheduled_tokens, s.sample
            tokens.extend(s.token_ids)
        return slots, starts, lens, samples, tokens, so.scheduled, drafts

    def _pack(self, rank: int, rows, T: int, R: int, token_bitmask: np.ndarray | None):
        """One rank's rows packed into a (T, R) bucket: (buffers, sample ids, sample rows,
        logprob rows, prompt-logprob rows), rows and tokens indexed within the rank. Slots are
        the rank's own (the step sees its range of the sampling state; the sentinel for "none"
        is the range's size).

        A request samples on one row, or with k drafts on k + 1 rows (its last k + 1 tokens'
        logits, each with its own output position); rows are requests when no request drafts."""
        slots, starts, lens, samples, tokens, scheduled, drafts = rows
        per = self.max_num_seqs // self.dp
        offset = rank * per
        total = len(tokens)
        slots_np = np.asarray(slots, np.int32)
        starts_np, lens_np = np.asarray(starts, np.int64), np.asarray(lens, np.int64)
        inputs = pack_rows(np.asarray(tokens, np.int32), starts_np, lens_np, self.block_table[slots_np],
                           num_tokens=T, num_reqs=R, page_size=self.page_size)
        tok_slots = np.full(T, offset, np.int32)
        tok_slots[:total] = np.repeat(slots_np, lens_np)
        valid = np.zeros(T, np.bool_)
        valid[:total] = True
        out_lens = starts_np + lens_np - self.prompt_len[slots_np]
        samples_np = np.asarray(samples, np.bool_)
        if any(drafts):
            ks = np.asarray(drafts, np.int64)
            per_req = 1 + ks
            first_row = np.cumsum(per_req) - per_req
            row_req = np.repeat(np.arange(len(slots)), per_req)  # [m] the request of each row
            back = (first_row + ks)[row_req] - np.arange(len(row_req))  # [m] drafts after the row
            logits_indices = np.zeros(R, np.int32)
            logits_indices[: len(row_req)] = inputs.logits_indices[row_req] - back
            inputs = dataclasses.replace(inputs, logits_indices=logits_indices)
            # Drafts are not folded into the sampling state (a drafting request never reads it).
            from_end = np.repeat(starts_np + lens_np, lens_np) - inputs.positions[:total]  # 1 = a row's last
            valid[:total] = from_end > np.repeat(ks, lens_np)
            out_lens = out_lens[row_req] - back
            if token_bitmask is not None:
                token_bitmask = np.repeat(token_bitmask, per_req, axis=0)
        else:
            row_req = first_row = np.arange(len(slots))
        row_slots = slots_np[row_req]
        is_prompt = valid & (inputs.positions < self.prompt_len[tok_slots])
        sample_rows = np.flatnonzero(samples_np[row_req])
        sample_slots = np.full(R, per, np.int32)
        sample_slots[sample_rows] = row_slots[sample_rows] - offset
        nxt = np.full(T, -1, np.int32)
        logprob_rows, prompt_rows = [], []
        lo = 0
        for i, slot in enumerate(slots):
            if samples[i] and self._logprobs_k[slot] is not None:
                rid, k = scheduled[i].request.request_id, self._k(self._logprobs_k[slot])
                first = int(first_row[i])
                logprob_rows += [(row, rid, k) for row in range(first, first + 1 + drafts[i])]
            if self._prompt_logprobs_k[slot] is not None:
                pos = starts[i] + np.arange(lens[i])
                has_next = pos + 1 < self.prompt_len[slot]
                count = int(has_next.sum())  # the leading positions of the row
                if count:
                    nxt[lo : lo + count] = np.asarray(self._prompt_ids[slot], np.int32)[pos[:count] + 1]
                    prompt_rows.append((scheduled[i].request.request_id, lo, count, starts[i] + 1,
                                        self._k(self._prompt_logprobs_k[slot])))
            lo += lens[i]
        lora_slots = None
        if self.lora is not None:
            lora_slots = np.zeros(T, np.int32)
            lora_slots[:total] = np.repeat(self.lora_slot[slots_np], lens_np)
        tok = TokenInfo(slots=tok_slots - offset, is_prompt=is_prompt, valid=valid, next_prompt_token=nxt,
                        sample_slots=sample_slots, lora_slots=lora_slots)
        meta = self.builder.build(row_slots, out_lens, R, token_bitmask)
        if self.dp > 1:  # the rank's own slot range
            live = np.arange(R) < len(row_slots)
            meta = dataclasses.replace(
                meta, slots=np.where(live, meta.slots - offset, 0).astype(np.int32),
                reset_slots=np.where(meta.reset_slots == self.max_num_seqs, per, meta.reset_slots - offset)
                .astype(np.int32))
        sample_ids = [scheduled[i].request.request_id for i in row_req[sample_rows].tolist()]
        buffers = self.layouts[(T, R)].pack((inputs, meta, tok))
        return buffers, sample_ids, sample_rows, logprob_rows, prompt_rows

    def launch(self, plan: StepPlan) -> LaunchedStep:
        """Dispatch the step (the sampler rows of admitted requests first); returns at once."""
        with self.counter.active():
            for w in plan.slot_writes:
                self.sstate = self._write_rows(self.sstate, w)
            if plan.lora_writes:
                n = self.num_weights
                for slot, values in plan.lora_writes:
                    self.params[n:] = self.lora.write(self.params[n:], slot, values)
            self.kv, self.sstate, out, plp = self._compiled[plan.bucket](self.params, self.kv, self.sstate,
                                                                         *plan.buffers)
        return LaunchedStep(plan, out, plp)

    def collect(self, step: LaunchedStep) -> RunnerOutput:
        """The step's sampled tokens (and log-probs) on the host; waits for the device."""
        plan, out, plp = step.plan, step.out, step.plp
        token_ids = np.asarray(out.token_ids)  # the one device->host transfer of a plain step
        if not plan.drafts:
            sampled = {rid: [t] for rid, t in zip(plan.sample_ids, token_ids[plan.sample_rows].tolist())}
        else:
            sampled = {}
            for rid, t in zip(plan.sample_ids, token_ids[plan.sample_rows].tolist()):
                sampled.setdefault(rid, []).append(t)
            for rid, drafts in plan.drafts.items():
                sampled[rid] = accept_drafts(sampled[rid], drafts)
        logprobs, prompt_lps = {}, {}
        if plan.logprob_rows:
            lp, rank, ids, top = jax.device_get((out.logprobs, out.rank, out.topk_ids, out.topk_logprobs))
            for row, rid, k in plan.logprob_rows:
                row_lps = logprobs.setdefault(rid, [])
                if len(row_lps) < len(sampled[rid]):  # (with drafts: the accepted rows only)
                    row_lps.append(SampleLogprobs(float(lp[row]), int(rank[row]), ids[row, :k].tolist(),
                                                  top[row, :k].tolist()))
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
