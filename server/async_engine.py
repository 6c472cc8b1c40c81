"""AsyncEngine: an `LLMEngine` driven by its own thread, served to asyncio handlers.

The engine thread owns every call into the engine (and so all JAX work). It sleeps on a
condition variable while there is nothing to do; adds and aborts are handed to it under the
condition's lock. Each request has an asyncio.Queue on the server's loop; the engine thread
delivers outputs with `loop.call_soon_threadsafe` (one call per step for all requests).
If the engine loop raises, the engine is marked dead: every pending request gets the error,
new requests are refused and /health answers 503.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

from jaxserve.core.scheduler import SchedulerStats
from jaxserve.engine.llm_engine import LLMEngine
from jaxserve.outputs import OutputKind, RequestOutput
from jaxserve.request import RequestStatus
from jaxserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine loop has failed; the server cannot serve requests."""


class EngineShutdownError(RuntimeError):
    """The engine is shutting down and accepts no new requests."""


@dataclasses.dataclass(slots=True)
class _Add:
    request_id: str
    prompt: str | list[int]
    params: SamplingParams
    priority: int
    add_special_tokens: bool
    arrival_time: float
    queue: asyncio.Queue
    ack: asyncio.Future


@dataclasses.dataclass(slots=True)
class _Track:
    """Per-request bookkeeping the engine thread keeps for metrics."""

    arrival_time: float
    child_id: str
    scheduled: bool = False
    last_token_time: float | None = None


class StatsListener:
    """What the engine thread reports to (metrics); all methods are called on the engine thread."""

    def on_scheduled(self, queue_seconds: float) -> None: ...
    def on_first_token(self, ttft_seconds: float) -> None: ...
    def on_tokens(self, itl_seconds: float) -> None: ...
    def on_output(self, out: RequestOutput) -> None: ...
    def on_finished(self, out: RequestOutput, e2e_seconds: float) -> None: ...


class AsyncEngine:
    def __init__(self, engine: LLMEngine, stats_listener: StatsListener | None = None):
        self.engine = engine
        self.listener = stats_listener or StatsListener()
        self._cond = threading.Condition()
        self._adds: list[_Add] = []
        self._aborts: list[str] = []
        self._queues: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._track: dict[str, _Track] = {}
        self._stop = False
        self._drain_abort = False
        self.error: BaseException | None = None
        self.stats: SchedulerStats = engine.scheduler.make_stats()
        self._thread: threading.Thread | None = None
        self.accepting = True

    # ------------------------------------------------------------------ facts
    @property
    def model_name(self) -> str:
        return self.engine.model_name

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def is_alive(self) -> bool:
        return self.error is None and self._thread is not None and self._thread.is_alive()

    @property
    def num_in_flight(self) -> int:
        return len(self._queues)

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self._run, name="jaxserve-engine", daemon=True)
        self._thread.start()

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stop the loop: abort whatever is still running and join the thread."""
        self.accepting = False
        with self._cond:
            self._stop = True
            self._cond.notify()
        if self._thread is not None:
            self._thread.join(timeout)

    async def drain(self, grace_seconds: float) -> None:
        """Refuse new requests, wait up to grace_seconds for in-flight ones, abort the rest."""
        self.accepting = False
        deadline = time.monotonic() + grace_seconds
        while self._queues and time.monotonic() < deadline and self.is_alive:
            await asyncio.sleep(0.05)
        for rid in list(self._queues):
            self.abort(rid)

    # ------------------------------------------------------------------ requests
    async def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        *,
        priority: int = 0,
        add_special_tokens: bool = True,
        arrival_time: float | None = None,
    ) -> asyncio.Queue:
        """Hand a request to the engine thread; raises ValueError (bad input) or EngineDeadError.
        Returns the queue its RequestOutputs (DELTA) arrive on; an exception instance in the
        queue means the request failed."""
        self._check_alive()
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        ack = loop.create_future()
        item = _Add(request_id, prompt, params, priority, add_special_tokens,
                    arrival_time or time.time(), queue, ack)
        with self._cond:
            self._adds.append(item)
            self._cond.notify()
        try:
            await ack  # raises the engine's ValueError
        except asyncio.CancelledError:
            self.abort(request_id)  # the client left while the request was being added
            raise
        return queue

    def abort(self, request_id: str) -> None:
        """Thread-safe, idempotent: the request's KV blocks are freed at the engine's next turn."""
        with self._cond:
            if self.error is None and not self._stop:
                self._aborts.append(request_id)
                self._cond.notify()

    async def generate(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        *,
        priority: int = 0,
        add_special_tokens: bool = True,
        arrival_time: float | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Stream DELTA outputs. Leaving early (cancel, close, exception) aborts the request."""
        queue = await self.add_request(request_id, prompt, params, priority=priority,
                                       add_special_tokens=add_special_tokens, arrival_time=arrival_time)
        finished = False
        try:
            while True:
                out = await queue.get()
                if isinstance(out, BaseException):
                    finished = True
                    raise out
                if out.finished:
                    finished = True
                yield out
                if finished:
                    return
        finally:
            if not finished:
                self.abort(request_id)

    def _check_alive(self) -> None:
        if self.error is not None:
            raise EngineDeadError(f"the engine has failed: {self.error!r}")
        if not self.accepting or self._stop:
            raise EngineShutdownError("the server is shutting down")

    # ------------------------------------------------------------------ engine thread
    def _run(self) -> None:
        try:
            self._loop()
        except BaseException as e:  # noqa: BLE001 - any failure kills the engine
            logger.exception("engine loop failed")
            self._fail(e)

    def _loop(self) -> None:
        engine = self.engine
        while True:
            with self._cond:
                while not (self._adds or self._aborts or self._stop or engine.has_unfinished_requests()):
                    self._cond.wait()
                adds, self._adds = self._adds, []
                aborts, self._aborts = self._aborts, []
                stop = self._stop
            deliveries: list[tuple[asyncio.AbstractEventLoop, Callable[..., Any], tuple]] = []
            for item in adds:
                self._do_add(item, stop)
            if stop:
                aborts = list(self._queues)
            for rid in aborts:
                if rid in self._queues:
                    for out in engine.abort_request(rid):
                        self._collect(out, deliveries, time.time())
                    self._finish(rid)
            if stop:
                self._deliver(deliveries)
                self.stats = engine.scheduler.make_stats()
                return
            if engine.has_unfinished_requests():
                t0 = time.time()
                outputs = engine.step()
                now = time.time()
                self._note_scheduled(t0)
                for out in outputs:
                    self._collect(out, deliveries, now)
            self.stats = engine.scheduler.make_stats()
            self._deliver(deliveries)

    def _do_add(self, item: _Add, stop: bool) -> None:
        loop = item.ack.get_loop()
        if stop:
            loop.call_soon_threadsafe(_set_exception, item.ack, EngineShutdownError("the server is shutting down"))
            return
        try:
            self.engine.add_request(item.request_id, item.prompt, item.params, arrival_time=item.arrival_time,
                                    priority=item.priority, output_kind=OutputKind.DELTA,
                                    add_special_tokens=item.add_special_tokens)
        except Exception as e:  # noqa: BLE001 - ValueError = bad input; reported to the caller
            loop.call_soon_threadsafe(_set_exception, item.ack, e)
            return
        self._queues[item.request_id] = (loop, item.queue)
        children = self.engine.output_processor.child_ids(item.request_id)
        self._track[item.request_id] = _Track(item.arrival_time, children[0] if children else item.request_id)
        loop.call_soon_threadsafe(_set_result, item.ack, None)

    def _note_scheduled(self, step_start: float) -> None:
        sched = self.engine.scheduler
        for t in self._track.values():
            if t.scheduled:
                continue
            req = sched.get_request(t.child_id)
            if req is None or req.status == RequestStatus.RUNNING or req.num_computed_tokens > 0:
                t.scheduled = True
                self.listener.on_scheduled(max(0.0, step_start - t.arrival_time))

    def _collect(self, out: RequestOutput, deliveries: list, now: float) -> None:
        entry = self._queues.get(out.request_id)
        if entry is None:
            return
        track = self._track.get(out.request_id)
        if track is not None and any(o.token_ids for o in out.outputs):
            if track.last_token_time is None:
                self.listener.on_first_token(max(0.0, now - track.arrival_time))
            else:
                self.listener.on_tokens(now - track.last_token_time)
            track.last_token_time = now
        self.listener.on_output(out)
        loop, queue = entry
        deliveries.append((loop, queue.put_nowait, (out,)))
        if out.finished:
            if track is not None:
                self.listener.on_finished(out, max(0.0, now - track.arrival_time))
            self._finish(out.request_id)

    def _finish(self, rid: str) -> None:
        self._queues.pop(rid, None)
        self._track.pop(rid, None)

    @staticmethod
    def _deliver(deliveries: Sequence[tuple[asyncio.AbstractEventLoop, Callable[..., Any], tuple]]) -> None:
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for loop, fn, args in deliveries:
            by_loop.setdefault(loop, []).append((fn, args))
        for loop, calls in by_loop.items():
            try:
                loop.call_soon_threadsafe(_run_all, calls)
            except RuntimeError:  # the loop is closed: nobody is listening any more
                pass

    def _fail(self, error: BaseException) -> None:
        with self._cond:
            self.error = error
            adds, self._adds = self._adds, []
        dead = EngineDeadError(f"the engine has failed: {error!r}")
        for item in adds:
            try:
                item.ack.get_loop().call_soon_threadsafe(_set_exception, item.ack, dead)
            except RuntimeError:
                pass
        for loop, queue in list(self._queues.values()):
            try:
                loop.call_soon_threadsafe(queue.put_nowait, dead)
            except RuntimeError:
                pass
        self._queues.clear()
        self._track.clear()


def _run_all(calls: list) -> None:
    for fn, args in calls:
        fn(*args)


def _set_result(fut: asyncio.Future, value: Any) -> None:
    if not fut.done():
        fut.set_result(value)


def _set_exception(fut: asyncio.Future, exc: BaseException) -> None:
    if not fut.done():
        fut.set_exception(exc)
