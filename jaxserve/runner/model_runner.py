"""ModelRunner: turns a step's typed batch into one call of a precompiled step executable.

One executable per (T tokens, R requests) bucket does: replace pending input tokens by the
tokens their slots sampled last -> fold the input tokens into the sampling state (penalty
counts) -> model forward over the flat token batch (KV cache updated in place, donated) ->
logits at each request's last scheduled token -> sampling (+ raw logprobs, and prompt
logprobs when some row asks) -> keep each row's sampled token in its slot. Every bucket is
compiled at start-up from abstract inputs that carry the real shardings; a step whose shape
misses the grid raises.

A step runs in three parts, so that the engine can prepare and launch step t+1 while the
device still computes step t:

    plan = runner.prepare(batch)    # host only: slots, packing (numpy)
    step = runner.launch(plan)      # the JAX calls; returns once dispatched
    out = runner.collect(step)      # the one device->host transfer; waits for it

`prepare` reads the step's `StepBatch` (the scheduler's snapshot: typed rows, no `Request`) and
the runner's per-slot host state, and packs it through runner/step_packing.py; `launch` needs
only the plan (a multi-host follower runs it on a plan received from the leader); `collect`
needs only the launched step. A batch the scheduler planned as a decode block (multi-step
decode, `StepBatch.num_steps` > 1) runs the block of its request bucket instead
(runner/decode_block.py), and `collect` reads back each row's tokens of its steps.
Everything the steps are a function of is the runner's
`StepRecipe` (runner/recipe.py), from which the compile workers, the memory probes and
shard-plan build the same programs.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import TYPE_CHECKING

import jax
import numpy as np
from jax.sharding import Mesh
from tqdm import tqdm

from jaxserve.core.sched_output import StepBatch
from jaxserve.outputs import SampleLogprobs
from jaxserve.request import RequestFailedError
from jaxserve.runner.compile import CompileCounter
from jaxserve.runner.compile_pool import compile_in_workers
from jaxserve.runner.executable_cache import ExecutableCache, ExecutableScope, canonical, executable_scope, signature
from jaxserve.runner.kv_cache import allocate_kv_cache
from jaxserve.runner.kv_scales import kv_scales_of
from jaxserve.runner.lora_weights import LoRAWeights
from jaxserve.runner.prebuilt import prebuilt_scope, target_material
from jaxserve.runner.recipe import StepRecipe, step_program
from jaxserve.runner.step_buffers import BufferLayout
from jaxserve.runner.step_fn import PromptLogprobs
from jaxserve.runner.step_packing import (LogprobRow, PackedRank, PromptLogprobRows, SlotTable, pack_rank,
                                          rank_rows)
from jaxserve.sampling.metadata import SamplingMetadataBuilder
from jaxserve.sampling.sampler import SamplerOutput
from jaxserve.sampling.state import SlotRowsWrite
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
    # A drafter in the step: request id -> the drafts the step made for its next tokens (requests that sampled)
    drafts: dict[str, list[int]] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(slots=True)
class StepPlan:
    """One prepared step: the bucket, its inputs packed (`step_buffers`), and what `collect`
    reads back (rows and tokens of the whole step: ranks one after another)."""

    bucket: tuple[int, int]  # (T, R)
    slot_writes: list[SlotRowsWrite]  # sampler rows of admitted requests, written first
    buffers: tuple[np.ndarray, ...]  # (ModelInputs, SamplingMetadata, TokenInfo), packed
    sample_ids: list[str] = dataclasses.field(default_factory=list)  # each sampling row's request
    sample_rows: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0, np.int64))
    logprob_rows: list[LogprobRow] = dataclasses.field(default_factory=list)
    prompt_logprob_rows: list[PromptLogprobRows] = dataclasses.field(default_factory=list)
    # LoRA adapters to write into their slots before the step: (slot, contents)
    lora_writes: list[tuple[int, list[np.ndarray]]] = dataclasses.field(default_factory=list)
    # Speculative decoding: request id -> its drafts (it samples on len + 1 rows)
    drafts: dict[str, tuple[int, ...]] = dataclasses.field(default_factory=dict)
    # Multi-step decode: a decode block of K steps (bucket (R, R)); each sampling row's own
    # steps (the tokens collect reads back for it)
    num_steps: int = 1
    row_steps: list[int] = dataclasses.field(default_factory=list)
    # A drafter in the step: each request row's request id (the rows of the step's drafts) and whether it sampled
    draft_rows: list[tuple[str, bool]] = dataclasses.field(default_factory=list)


@dataclasses.dataclass(slots=True)
class LaunchedStep:
    plan: StepPlan
    out: SamplerOutput  # [R] rows; a decode block's: [K, R]
    plp: PromptLogprobs | None  # None: a decode block
    drafts: jax.Array | None = None  # a drafter's: [R, k] each request row's drafts


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
        executables: str | None = None,
        prebuilt: ExecutableScope | None = None,
        show_progress: bool = True,
        timer: StartupTimer | None = None,
        drafter=None,
    ):
        """The steps of `recipe` (runner/recipe.py: everything they are a function of) over
        `model`'s weights, on `mesh`. The host-side options: `seed` (requests without one),
        `max_cpu_loras` (the adapters' host LRU), `compile_workers` (processes compiling the
        steps at a cold start, from the recipe), the executable cache, `executables` (a
        directory of executables compiled ahead, runner/prebuilt.py: loaded where they match) or
        `prebuilt`, that directory's scope already opened for this recipe (engine/setup.py).
        `drafter`: the loaded EAGLE-3 head or draft model of a recipe with a `draft_model` (MTP's
        is the model's)."""
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
        self.program, self.params, self._params_treedef = step_program(recipe, model, backend, mesh, max_cpu_loras,
                                                                       drafter=drafter)
        # A quantized cache's scales as the steps take them (inputs beside the weights), per
        # layer (k, v); None with a float cache.
        self.kv_scales = kv_scales_of(model)
        with timer.phase("weight arena"):
            backend.place_weights(model, self.params, self._params_treedef)
        self.drafting = self.program.drafter_params is not None  # a drafter in the step
        if self.drafting:
            self.params += self.program.drafter_params
        self.num_weights = len(self.params)
        self.params += self.program.lora_arrays(abstract=False)
        self.replicated, self.state_sharding = self.program.replicated, self.program.state_sharding
        self.counter = CompileCounter()
        self.executable_cache = executable_cache
        self.executables = executables
        self.prebuilt = prebuilt
        self.compile_workers = compile_workers
        with self.counter.active(), timer.phase("kv cache"):
            self._scope = self._executable_scope()
            self._allocate_state()
        self.builder = SamplingMetadataBuilder(recipe.sampler_config, seed=seed)
        self._reset_slots()
        self._host_params: list[np.ndarray] | None = None  # the weights while asleep
        self._compiled: dict[tuple[int, int], jax.stages.Compiled] = {}
        self.layouts: dict[tuple[int, int], BufferLayout] = {}
        self.num_decode_steps = recipe.num_decode_steps  # K of the decode blocks (1: none)
        self._blocks: dict[int, jax.stages.Compiled] = {}  # R -> the decode block of R rows
        self.block_layouts: dict[int, BufferLayout] = {}
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
        zeros = self.program.kv_zeros(self._scope)
        self.kv = allocate_kv_cache(self.cfg, self.num_pages, self.page_size, self.kv_dtype, self.mesh,
                                    self.recipe.rules, zeros=zeros)
        if self.drafting:  # the drafter's own pages, next to the target's
            from jaxserve.runner.draft_head_step import DraftKV, draft_cache_dtype

            own = allocate_kv_cache(self.program.drafter_cfg, self.num_pages, self.page_size,
                                    draft_cache_dtype(self.recipe.dtype, self.kv_dtype), self.mesh, self.recipe.rules,
                                    zeros=self.program.draft_kv_zeros(self._scope))
            self.kv = DraftKV(self.kv, own)
        # The backend's thread placing the host buffers (the CPU's huge pages), if any.
        self.host_placement = self.backend.place_kv_cache([*self.params, *jax.tree.leaves(self.kv)])
        self.sstate = self.program.sampling_state_init(self._scope)()

    def _reset_slots(self) -> None:
        """Per-slot host state: which request holds each sampling slot, its block table, ..."""
        self.slots = SlotTable(self.max_num_seqs, self.dp, self.pages_per_req, self.sampler_config.max_logprobs,
                               self.sampler_config.max_stop_ids)

    @property
    def slot_of(self) -> dict[str, int]:
        return self.slots.slot_of

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
        for i, (T, R) in enumerate(tqdm(shapes, desc="step executables (compiled or loaded)", disable=not show_progress, unit="bucket")):
            self.layouts[(T, R)] = self.step_layout(T, R)
            t0, compiled_before = time.perf_counter(), scope.compiled
            self._compiled[(T, R)] = self.program.step_executable(scope, (T, R), params, kv, sstate)
            if scope.compiled != compiled_before:
                logger.info("compiled step %dx%d in %.1fs: %d of %d steps ready, %d left", T, R,
                            time.perf_counter() - t0, i + 1, len(shapes), len(shapes) - i - 1)
        for R in self.recipe.block_buckets():
            self.block_layouts[R] = self.program.block_layout(R)
            t0, compiled_before = time.perf_counter(), scope.compiled
            self._blocks[R] = self.program.block_executable(scope, R, params, kv, sstate)
            if scope.compiled != compiled_before:
                logger.info("compiled decode block %dx%d in %.1fs", R, self.num_decode_steps,
                            time.perf_counter() - t0)
        self._write_rows = self.program.slot_rows_writer(scope, sstate)
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
            name = self.program.step_name((T, R))
            if not scope.has(name):
                keys[(T, R)] = (name, scope.entry_key(name))
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
        scope = executable_scope(
            self.executable_cache, self.mesh.devices.flat, **self.backend.fingerprint(),
            graphdef=canonical(fn.graphdef),
            params=signature(params), params_treedef=str(self._params_treedef), kv=signature(kv),
            sstate=signature(sstate), layer_impl=str(layer), sampler=canonical(self.sampler_config),
            # the drafter's part (no key of a step without one changes)
            **({"draft": f"{fn.head.key()} {fn.num_speculative_tokens}"} if self.drafting else {}),
            mesh=repr(self.mesh), pages=f"{self.page_size} {self.pages_per_req} {self.num_pages} {self.dp}",
            replicated=repr(self.replicated))
        if self.prebuilt is not None:
            scope.prebuilt = self.prebuilt
        elif self.executables is not None:
            devices = list(self.mesh.devices.flat)
            scope.prebuilt = prebuilt_scope(self.executables, target_material(self.recipe, devices, self.backend),
                                            devices)
        return scope

    def empty_slot_write(self) -> SlotRowsWrite:
        return self.program.empty_slot_write()

    def executable(self, bucket: tuple[int, int]) -> jax.stages.Compiled:
        """The compiled step of `bucket` (its memory analysis, its HLO)."""
        return self._compiled[bucket]

    def decode_block(self, R: int) -> jax.stages.Compiled:
        """The compiled decode block of R rows (multi-step decode)."""
        return self._blocks[R]

    @property
    def num_buckets(self) -> int:
        return len(self._compiled)

    # ------------------------------------------------------------------ per step
    def prepare(self, batch: StepBatch, token_bitmask: np.ndarray | None = None) -> StepPlan | None:
        """The host half of a step (numpy only); None when nothing is scheduled. `batch`: the
        scheduler's snapshot of the step (one tuple of rows per data-parallel rank).
        `token_bitmask`: structured output's [rows, ceil(V/32)] int32 rows, in batch order
        (ranks in order; None: nothing is masked)."""
        for rid in batch.finished_request_ids:
            self.slots.release(rid)
        for rid in batch.preempted_request_ids:
            self.slots.release(rid)
        if batch.is_empty:
            return None
        lora_writes = self._lora_writes(batch) if batch.adapter_loads else []
        if batch.num_steps > 1:
            return self._prepare_block(batch, lora_writes)
        ranks = [rank_rows(rows, r, self.slots, self.builder) for r, rows in enumerate(batch.ranks)]
        T, R = self.grid.pick(max(x.num_tokens for x in ranks), max(x.num_sample_rows for x in ranks))
        masks = [None] * len(ranks)
        if token_bitmask is not None:  # split by rank: the batch lists the ranks' rows in order
            bounds = np.cumsum([0] + [len(x.rows) for x in ranks])
            masks = [token_bitmask[a:b] for a, b in zip(bounds[:-1], bounds[1:])]
        packs = [pack_rank(x, T, R, rank=r, table=self.slots, builder=self.builder, layout=self.layouts[(T, R)],
                           page_size=self.page_size, lora=self.lora is not None, token_bitmask=m,
                           drafting=self.drafting)
                 for r, (x, m) in enumerate(zip(ranks, masks))]
        drafts = {s.request_id: s.draft_token_ids for x in ranks if x.num_drafts for s in x.rows if s.num_draft_tokens}
        plan = self._plan((T, R), packs, lora_writes, drafts)
        if self.drafting:
            plan.draft_rows = [(s.request_id, s.sample) for x in ranks for s in x.rows]
        return plan

    def _prepare_block(self, batch: StepBatch, lora_writes) -> StepPlan:
        """A decode block's plan (Scheduler.schedule_block): one row per request, each feeding
        one token; the block of the smallest request bucket holding them."""
        if batch.num_steps != self.num_decode_steps or len(batch.ranks) != 1:
            raise RuntimeError(f"a decode block of {batch.num_steps} steps over {len(batch.ranks)} ranks; the "
                               f"runner compiled blocks of {self.num_decode_steps} steps, one rank")
        (rows,) = batch.ranks
        r = rank_rows(rows, 0, self.slots, self.builder)
        if r.num_tokens != len(rows) or r.num_drafts:
            raise RuntimeError("a decode block's rows feed one token each")
        R = self.grid.pick_requests(len(rows))
        p = pack_rank(r, R, R, rank=0, table=self.slots, builder=self.builder, layout=self.block_layouts[R],
                      page_size=self.page_size, lora=self.lora is not None, num_steps=batch.num_steps)
        plan = self._plan((R, R), [p], lora_writes, {})
        plan.num_steps = batch.num_steps
        plan.row_steps = [rows[i].num_steps for i in p.sample_rows.tolist()]
        return plan

    def _plan(self, bucket: tuple[int, int], packs: list[PackedRank], lora_writes, drafts) -> StepPlan:
        """The ranks' packed inputs as one step: [D, ...] buffers, rows and tokens offset by rank."""
        T, R = bucket
        if drafts and max(map(len, drafts.values())) > self.recipe.num_speculative_tokens:
            raise RuntimeError(f"a step feeds more drafts than the recipe's {self.recipe.num_speculative_tokens}")
        writes = self.builder.take_slot_writes()
        if len(packs) == 1:
            p = packs[0]
            return StepPlan(bucket, writes, p.buffers, p.sample_ids, p.sample_rows, p.logprob_rows,
                            p.prompt_logprob_rows, lora_writes, drafts)
        buffers = tuple(np.stack([p.buffers[g] for p in packs]) for g in range(len(packs[0].buffers)))
        plan = StepPlan(bucket, writes, buffers, lora_writes=lora_writes, drafts=drafts)
        for r, p in enumerate(packs):
            plan.sample_ids += p.sample_ids
            plan.logprob_rows += [LogprobRow(x.row + r * R, x.request_id, x.k) for x in p.logprob_rows]
            plan.prompt_logprob_rows += [x._replace(first_token=x.first_token + r * T) for x in p.prompt_logprob_rows]
        plan.sample_rows = np.concatenate([p.sample_rows + r * R for r, p in enumerate(packs)])
        return plan

    def _lora_writes(self, batch: StepBatch) -> list[tuple[int, list[np.ndarray]]]:
        """The contents of the adapters given a slot this step; an adapter that cannot be read
        fails the requests that use it (those admitted with its slot this step)."""
        writes = []
        for slot, lora in batch.adapter_loads:
            try:
                writes.append((slot, self.lora.host_copy(lora)))
            except Exception as e:  # noqa: BLE001 - this adapter's requests fail alone
                users = [s.request_id for s in batch.rows if s.new is not None and s.new.adapter_slot == slot]
                raise RequestFailedError(users, e) from e
        return writes

    def launch(self, plan: StepPlan) -> LaunchedStep:
        """Dispatch the step (the sampler rows of admitted requests first); returns at once."""
        with self.counter.active():
            for w in plan.slot_writes:
                self.sstate = self._write_rows(self.sstate, w)
            if plan.lora_writes:
                n = self.num_weights
                for slot, values in plan.lora_writes:
                    self.params[n:] = self.lora.write(self.params[n:], slot, values)
            if plan.num_steps > 1:
                self.kv, self.sstate, out = self._blocks[plan.bucket[1]](self.params, self.kv, self.sstate,
                                                                         *plan.buffers)
                return LaunchedStep(plan, out, None)
            self.kv, self.sstate, out, plp = self._compiled[plan.bucket](self.params, self.kv, self.sstate,
                                                                         *plan.buffers)
        if self.drafting:
            plp, drafts = plp
            return LaunchedStep(plan, out, plp, drafts)
        return LaunchedStep(plan, out, plp)

    def collect(self, step: LaunchedStep) -> RunnerOutput:
        """The step's sampled tokens (and log-probs) on the host; waits for the device."""
        plan, out, plp = step.plan, step.out, step.plp
        if plan.num_steps > 1:
            return self._collect_block(plan, out)
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
        drafted = {}
        if step.drafts is not None and any(s for _, s in plan.draft_rows):
            rows = np.asarray(step.drafts)
            drafted = {rid: rows[i].tolist() for i, (rid, s) in enumerate(plan.draft_rows) if s}
        return RunnerOutput(sampled, logprobs, prompt_lps, drafted)

    def _collect_block(self, plan: StepPlan, out: SamplerOutput) -> RunnerOutput:
        """A decode block's tokens: each row's first `row_steps` of its K (the scheduler trims
        what follows a stop token), with their log-probs when asked."""
        token_ids = np.asarray(out.token_ids).T  # [R, K]: the one transfer, with log-probs when asked
        sampled = {rid: token_ids[row, :k].tolist()
                   for rid, row, k in zip(plan.sample_ids, plan.sample_rows.tolist(), plan.row_steps)}
        logprobs = {}
        if plan.logprob_rows:
            lp, rank, ids, top = jax.device_get((out.logprobs, out.rank, out.topk_ids, out.topk_logprobs))
            for row, rid, k in plan.logprob_rows:
                logprobs[rid] = [SampleLogprobs(float(lp[j, row]), int(rank[j, row]), ids[j, row, :k].tolist(),
                                                top[j, row, :k].tolist()) for j in range(len(sampled[rid]))]
        return RunnerOutput(sampled, logprobs, {})

    def execute(self, batch: StepBatch) -> RunnerOutput:
        """prepare, launch and collect one step."""
        plan = self.prepare(batch)
        if plan is None:
            return RunnerOutput({}, {}, {})
        return self.collect(self.launch(plan))

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
        for x in (*self.params, *jax.tree.leaves(self.kv), *jax.tree.leaves(self.sstate)):
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
