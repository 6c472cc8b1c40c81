"""EngineCore: the scheduler and the model runner, one step at a time (token ids in and out).

Requests come in validated and tokenized (`EngineRequest`, from the input processor); each step
returns `EngineCoreOutput`s: new token ids, numeric log-probs, finish reasons. Text (detokenizing,
stop strings) is the output processor's, on the frontend side.

With async scheduling (SchedulerConfig.async_scheduling, the default) the host work of step
t+1 overlaps the device work of step t, as in vLLM v1:

    schedule(t+1) -> prepare(t+1) -> launch(t+1) -> collect(t) -> update(t) -> outputs of t

The scheduler plans step t+1 with the tokens of step t still pending (the step reads them on
the device), so the device always has the next step queued while the host waits for the last
one. Without it a step is schedule -> prepare -> launch -> collect -> update.

Failures inside a step. When the runner cannot prepare a step because of some requests' input
(or a request's grammar can no longer be enforced), `RequestFailedError` names them: those
requests fail (their output carries the error), the step is discarded (its other requests are
preempted and recomputed, and the blocks it was to fill leave the prefix cache) and the engine
goes on; a step in flight is still collected. Any other exception (in launch or collect: the device; in update: a bug) leaves the
core in an unknown state and propagates: the engine is dead.

Structured output: a constrained request's next bitmask needs its last token on the host, so
while one is unfinished, steps do not overlap: a step in flight is collected first (that call
launches nothing), then each step is schedule -> grammar bitmask -> prepare -> launch ->
collect -> update. The tokens are the same either way (a row's random draw depends on its
seed and position only); the grammar state is the StructuredOutputManager's.

Multi-step decode (`num_decode_steps` K > 1): while every running request only decodes, a
step is a decode block (Scheduler.schedule_block: K decode steps in one device call), overlapped
like any step; structured output and requests that may draft keep single steps, since both
need each token on the host (`_schedule_block`).

Speculative decoding (`proposer`): after each step the proposer drafts the next tokens of every
request that may draft (jaxserve/spec_decode/), from its tokens so far; the scheduler feeds
them in the next step. Drafts need the last token on the host, so while a request that may
draft runs and the step has spare sampling rows (drafts take no others), steps do not overlap
(as with structured output); at full occupancy nothing could draft, and steps overlap again.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Iterable
from typing import Any

import numpy as np

from jaxserve.core.protocol import ScheduledStep, StepScheduler
from jaxserve.engine.messages import EngineCoreOutput, EngineSleepingError, EngineStats
from jaxserve.request import EngineRequest, Request, RequestFailedError, RequestStatus
from jaxserve.runner.model_runner import RunnerOutput
from jaxserve.runner.protocol import StepRunner
from jaxserve.spec_decode import NgramProposer, can_speculate
from jaxserve.structured.manager import StructuredOutputManager

logger = logging.getLogger(__name__)


@dataclasses.dataclass(slots=True)
class HostTimes:
    """Cumulative seconds per part of a step (see benchmarks/host_overhead.py): the engine
    thread's CPU time for the host parts, wall time for collect (waiting on the device)."""

    steps: int = 0
    schedule: float = 0.0
    prepare: float = 0.0
    launch: float = 0.0
    collect: float = 0.0  # waiting for the device (and the transfer)
    update: float = 0.0  # update_from_output and the core outputs
    grammar: float = 0.0  # structured output: advancing the matchers, computing the bitmask


class EngineCore:
    def __init__(self, scheduler: StepScheduler, runner: StepRunner, *,
                 async_scheduling: bool = True, proposer: NgramProposer | None = None,
                 num_decode_steps: int = 1):
        """num_decode_steps: multi-step decode's K (the runner compiled decode blocks of K
        steps; 1: none)."""
        self.scheduler = scheduler
        self.runner = runner
        self.proposer = proposer
        self.async_scheduling = async_scheduling
        self.num_decode_steps = num_decode_steps
        self.num_blocks = 0  # decode blocks run
        self._may_draft: set[str] = set()  # requests the proposer drafts for
        self._in_flight: tuple[ScheduledStep, Any] | None = None
        self.times = HostTimes()
        self.num_steps = 0
        # Ids whose runner state a discarded step may have left behind: released next step.
        self._release_finished: set[str] = set()
        self._release_preempted: list[str] = []
        self.num_failed_requests = 0
        self.structured = StructuredOutputManager(runner.sampler_config.vocab_size)

    # ------------------------------------------------------------------ requests
    def add_request(self, request: EngineRequest) -> None:
        if self.is_sleeping:
            raise EngineSleepingError("the engine is sleeping; wake it up first (POST /wake_up)")
        self.scheduler.add_request(Request.from_engine_request(request))
        self.structured.add(request)
        if self.proposer is not None and can_speculate(request.sampling_params):
            self._may_draft.add(request.request_id)

    def abort_requests(self, request_ids: Iterable[str]) -> None:
        """Finish these requests now (unknown or finished ids are ignored); no output follows."""
        request_ids = list(request_ids)
        self.scheduler.abort_requests(request_ids)
        self.structured.remove(request_ids)
        self._may_draft.difference_update(request_ids)

    def abort_all(self) -> None:
        self.abort_requests(list(self.scheduler.requests))

    def has_work(self) -> bool:
        return self.scheduler.has_unfinished_requests() or self._in_flight is not None

    # ------------------------------------------------------------------ the step
    def step(self) -> list[EngineCoreOutput]:
        t = self.times
        cpu = time.thread_time  # host work: the engine thread's CPU time, not the machine's load
        constrained = self.structured.active
        plain = not (constrained or self._may_draft_now())  # the next step needs no token on the host
        if not plain and self._in_flight is not None:
            # The next bitmask or drafts need the tokens of the step in flight: collect it first.
            done, self._in_flight = self._in_flight, None
            return self._collect(done, [])
        c0 = cpu()
        so = self._schedule_block(constrained)
        if so is None:
            so = self.scheduler.schedule()
        else:
            self.num_blocks += 1
        if self._release_finished or self._release_preempted:
            so = self._with_releases(so)
        c1 = cg = cpu()
        failed: list[EngineCoreOutput] = []
        try:
            bitmask = self.structured.bitmask(so) if constrained else None
            cg = cpu()
            batch = so.batch()  # the step as the runner takes it: typed rows, no scheduler state
            plan = self.runner.prepare(batch) if bitmask is None else self.runner.prepare(batch, bitmask)
        except RequestFailedError as e:
            failed, plan = self._discard(so, e), None
        c2 = cpu()
        launched = self.runner.launch(plan) if plan is not None else None
        c3 = cpu()
        t.schedule += c1 - c0
        t.grammar += cg - c1
        t.prepare += c2 - cg
        t.launch += c3 - c2
        if self.async_scheduling and plain:
            done, self._in_flight = self._in_flight, (so, launched) if launched is not None else None
        else:
            done = (so, launched) if launched is not None else None
        return self._collect(done, failed)

    def _schedule_block(self, constrained: bool):
        """A decode block of `num_decode_steps` steps (Scheduler.schedule_block), or None for an
        ordinary step: without blocks (K = 1), while a request follows a grammar (`constrained`:
        its next bitmask needs each token on the host) or a request that may draft runs (drafts
        need the last token on the host), and whenever the scheduler refuses (admissions,
        prefill chunks, drafts already proposed, too few free blocks, nothing that would decode
        more than one token)."""
        if self.num_decode_steps == 1 or constrained or self._may_draft:
            return None
        return self.scheduler.schedule_block(self.num_decode_steps)

    def _may_draft_now(self) -> bool:
        """Whether a step now could feed drafts: a request that may draft runs and the step has
        spare sampling rows (fewer requests than max_num_seqs). Otherwise steps may overlap."""
        return bool(self._may_draft) and len(self.scheduler.requests) < self.scheduler.config.max_num_seqs

    def _collect(self, done: tuple[ScheduledStep, Any] | None,
                 failed: list[EngineCoreOutput]) -> list[EngineCoreOutput]:
        """Waits for the step `done` (if any) and turns it into outputs, after `failed`'s."""
        t = self.times
        outputs = failed
        if done is not None:
            w = time.perf_counter()
            result = self.runner.collect(done[1])
            t.collect += time.perf_counter() - w
            c4 = time.thread_time()
            outputs = failed + self._outputs(done[0], result)
            t.update += time.thread_time() - c4
        t.steps += 1
        self.num_steps += 1
        return outputs

    def _discard(self, so: ScheduledStep, e: RequestFailedError) -> list[EngineCoreOutput]:
        """The runner could not prepare `so` because of the requests `e` names: they fail, and
        the step's other requests are preempted (nothing of the step ran; they are recomputed).
        Returns the failed requests' outputs."""
        sched = self.scheduler
        failed = [rid for rid in dict.fromkeys(e.request_ids) if sched.get_request(rid) is not None]
        preempted = sched.discard_step(so)  # first: it uncaches the blocks the step was to fill
        sched.finish_requests(failed, RequestStatus.FINISHED_ABORTED)
        self.structured.remove(failed)
        self._may_draft.difference_update(failed)
        preempted = [rid for rid in preempted if rid not in failed]
        # The runner may have taken state for any of these before it raised.
        self._release_finished.update(so.finished_request_ids)
        self._release_preempted += [*so.preempted_request_ids, *preempted]
        self.num_failed_requests += len(failed)
        logger.warning("a step could not be prepared: %s; %d request(s) failed, %d to recompute",
                       e, len(failed), len(preempted))
        return [EngineCoreOutput(rid, [], finish_reason="abort", error=e.cause) for rid in failed]

    def _with_releases(self, so: ScheduledStep) -> ScheduledStep:
        so = dataclasses.replace(so, finished_request_ids=so.finished_request_ids | self._release_finished,
                                 preempted_request_ids=(*self._release_preempted, *so.preempted_request_ids))
        self._release_finished, self._release_preempted = set(), []
        return so

    def _outputs(self, so: ScheduledStep, result: RunnerOutput) -> list[EngineCoreOutput]:
        outputs: dict[str, EngineCoreOutput] = {}
        for req, n in self.scheduler.update_from_output(so, result.sampled):
            rid = req.request_id
            out = EngineCoreOutput(rid, req.output_token_ids[-n:], num_cached_tokens=req.num_cached_tokens,
                                   first_scheduled_time=req.first_scheduled_time)
            lp = result.logprobs.get(rid)
            if lp is not None:
                out.logprobs = lp[:n]
            if req.is_finished:
                out.finish_reason, out.stop_reason = req.get_finished_reason(), req.stop_reason
                self._may_draft.discard(rid)
            elif rid in self._may_draft:
                req.spec_token_ids = (self.proposer.drafts(rid, result.drafts) if self.proposer.on_device
                                      else self.proposer.propose(np.asarray(req.all_token_ids, np.int64)))
            outputs[rid] = out
        # Prompt log-probs belong to the step that computed them: the request comes from the
        # step's own rows, finished or not (a request may end in the step that ends its prompt).
        scheduled = dict(zip((s.request_id for s in so.scheduled), so.requests)) if result.prompt_logprobs else {}
        for rid, plp in result.prompt_logprobs.items():
            req = scheduled[rid]
            out = outputs.get(rid)
            if out is None:
                out = outputs[rid] = EngineCoreOutput(rid, [], num_cached_tokens=req.num_cached_tokens,
                                                      first_scheduled_time=req.first_scheduled_time)
            out.prompt_logprobs = plp
        return list(outputs.values())

    # ------------------------------------------------------------------ commands
    def stats(self) -> EngineStats:
        c = self.runner.counter
        return EngineStats(self.scheduler.make_stats(), c.num_compiles, c.recompiles, c.compile_seconds,
                           self.num_steps, self.is_sleeping)

    def embed(self, prompts: list[list[int]]) -> np.ndarray:
        """Embeddings are the pooling core's (engine/pooling_core.py); the frontend refuses
        them first, with a 400 naming --runner pooling."""
        raise ValueError("this model is served for generation; start it with --runner "
                         "pooling to embed")

    def reset_prefix_cache(self) -> bool:
        return self.scheduler.reset_prefix_cache()

    @property
    def is_sleeping(self) -> bool:
        return self.runner.is_sleeping

    def sleep(self) -> None:
        """Free the device memory of the weights and the KV cache; only when idle."""
        if self.has_work():
            raise RuntimeError("the engine cannot sleep while requests are running")
        # Requests that finished in the last step hold their runner slots until a step tells the
        # runner: an empty one does (nothing is scheduled, nothing launches).
        so = self.scheduler.schedule()
        if self._release_finished or self._release_preempted:
            so = self._with_releases(so)
        self.runner.prepare(so)
        self.scheduler.reset_prefix_cache()
        self.runner.sleep()

    def wake_up(self) -> None:
        self.runner.wake_up()
