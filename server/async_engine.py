"""AsyncEngine: the engine as the server drives it, split over two threads.

- The frontend runs on the server's asyncio event loop: requests are validated and tokenized
  by the input processor in a worker thread (never on the loop itself), registered with the
  output processor, and handed to the engine core as one command per client request (all of
  a multi-prompt request's sequences at once). The core's outputs come back to the loop, where
  the output processor detokenizes them, matches stop strings and puts RequestOutputs (DELTA)
  on each request's queue.
- The engine core runs on its own thread ("jaxserve-engine"), which owns every JAX call. It
  sleeps on a condition variable while there is nothing to do, and takes commands in order:
  add, abort, and calls of the core's methods (stats, reset_prefix_cache, sleep, wake_up).

Back-pressure: the frontend refuses a request (EngineOverloadedError, HTTP 503 with
Retry-After) while the sequences waiting to be scheduled number `max_waiting_requests` or more.
The scheduler owns the waiting queue and publishes its length (and the running count) after
every step; the frontend adds the sequences it has sent since the engine last took commands,
less those that free running slots will take (a burst between two steps, which on a CPU can be
seconds apart, is counted at once). The default limit comes from the KV cache
(`default_max_waiting`).

Failures: a request the engine core could not take (its input failed inside a step) fails alone
with its error. Any other exception on the engine thread (a device error), or in the output
processor, is unrecoverable: the engine is marked dead, every pending request gets the error,
new requests are refused (503), /health answers 503, and the callbacks registered with
`add_dead_callback` run (the CLI's server then exits non-zero, for its supervisor to restart
it). Every method here is for the event loop's thread.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from jaxserve.engine.core import EngineStats
from jaxserve.engine.input_processor import InputProcessor, ProcessedRequest
from jaxserve.engine.output_processor import OutputProcessor, StatsListener
from jaxserve.engine.setup import EngineParts
from jaxserve.outputs import OutputKind
from jaxserve.request import EngineRequest
from jaxserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

# The core's methods a command may call on the engine thread.
CORE_CALLS = frozenset({"stats", "reset_prefix_cache", "sleep", "wake_up"})


class EngineDeadError(RuntimeError):
    """The engine loop has failed; the server cannot serve requests."""


class EngineShutdownError(RuntimeError):
    """The engine is shutting down and accepts no new requests."""


class EngineOverloadedError(RuntimeError):
    """Too many sequences wait to be scheduled; the client should retry after `retry_after`
    seconds."""

    def __init__(self, message: str, retry_after: int):
        super().__init__(message)
        self.retry_after = retry_after


# What a refused client is told to wait (Retry-After, seconds). A constant: the engine cannot
# predict when a slot frees, and a short wait lets a retry take the first one that does.
RETRY_AFTER_SECONDS = 1
# The default waiting limit: this many times the KV cache's token capacity, counted in
# sequences of the full context length (and never fewer than one full batch).
WAITING_CACHE_FILLS = 4


def default_max_waiting(cache_tokens: int, max_model_len: int, max_num_seqs: int) -> int:
    """The default limit on waiting sequences: enough to fill the KV cache
    WAITING_CACHE_FILLS times over if every one grew to the full context, and at least one
    full batch (`max_num_seqs`): max(max_num_seqs, 4 * cache_tokens // max_model_len)."""
    return max(max_num_seqs, WAITING_CACHE_FILLS * cache_tokens // max_model_len)


@dataclasses.dataclass(slots=True)
class _Add:
    sequences: list[EngineRequest]


@dataclasses.dataclass(slots=True)
class _Abort:
    sequence_ids: list[str]


@dataclasses.dataclass(slots=True)
class _Call:
    method: str
    args: tuple
    future: asyncio.Future


@dataclasses.dataclass(slots=True)
class RequestStream:
    """One added request: its id, prompt tokens and the queue its outputs arrive on (an
    exception instance in the queue means the request failed)."""

    request_id: str
    prompt_token_ids: list[int]
    queue: asyncio.Queue


class AsyncEngine:
    def __init__(self, parts: EngineParts, stats_listener: StatsListener | None = None, *,
                 max_waiting_requests: int | None = None):
        self.parts = parts
        self.info = parts.info
        self.tokenizer = parts.tokenizer
        self.core = parts.core
        self.input_processor = InputProcessor(parts.tokenizer, parts.info)
        self.output_processor = OutputProcessor(parts.tokenizer, stats_listener)
        self._cond = threading.Condition()
        self._commands: list[_Add | _Abort | _Call] = []
        self._stop = False
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.error: BaseException | None = None
        self.stats: EngineStats = self.core.stats()  # refreshed by the engine thread each step
        self.accepting = True
        if max_waiting_requests is None:
            sched = self.core.scheduler
            max_waiting_requests = default_max_waiting(sched.cache_tokens, self.info.max_model_len,
                                                       sched.config.max_num_seqs)
        if max_waiting_requests < 1:
            raise ValueError(f"max_waiting_requests must be >= 1, got {max_waiting_requests}")
        self.max_waiting_requests = max_waiting_requests
        self.num_refused = 0  # requests refused because the queue was full
        self._sent = 0  # sequences sent to the engine (event loop)
        self._max_num_seqs = self.core.scheduler.config.max_num_seqs
        # (sequences the engine had taken, its waiting and running counts then), after each step
        self._load = (0, self.stats.scheduler.num_waiting, self.stats.scheduler.num_running)
        self._dead_callbacks: list[Callable[[BaseException], None]] = []
        self._failed = False
        link = getattr(parts, "link", None)
        if link is not None and hasattr(link, "add_failure_callback"):  # a multi-host leader
            link.add_failure_callback(self._fail_from_outside)

    # ------------------------------------------------------------------ facts
    @property
    def model_name(self) -> str:
        return self.info.name

    @property
    def max_model_len(self) -> int:
        return self.info.max_model_len

    @property
    def listener(self) -> StatsListener:
        return self.output_processor.listener

    @listener.setter
    def listener(self, listener: StatsListener) -> None:
        self.output_processor.listener = listener

    @property
    def is_alive(self) -> bool:
        return self.error is None and self._thread is not None and self._thread.is_alive()

    @property
    def num_in_flight(self) -> int:
        return len(self.output_processor.unfinished())

    @property
    def num_waiting(self) -> int:
        """Sequences waiting to be scheduled: the scheduler's count after the last step, plus
        the sequences sent since the engine last took commands but those that free running
        slots will take (when nothing waited, nothing else held the slots back)."""
        taken, waiting, running = self._load
        in_transit = self._sent - taken
        if waiting == 0:
            in_transit = max(0, in_transit - (self._max_num_seqs - running))
        return waiting + in_transit

    def add_dead_callback(self, fn: Callable[[BaseException], None]) -> None:
        """Call fn(error), on the event loop, when the engine fails for good."""
        self._dead_callbacks.append(fn)

    def default_sampling_params(self) -> SamplingParams:
        return self.input_processor.default_sampling_params()

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        if self._thread is not None:
            return
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="jaxserve-engine", daemon=True)
        self._thread.start()

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stop the engine thread (it aborts whatever still runs) and join it. After a failure
        the thread may be stuck in a device call that never returns: it is not waited for."""
        self.accepting = False
        with self._cond:
            self._stop = True
            self._cond.notify()
        if self._thread is not None:
            self._thread.join(timeout if self.error is None else 0.5)

    async def drain(self, grace_seconds: float) -> None:
        """Refuse new requests, wait up to grace_seconds for in-flight ones, abort the rest
        (their clients get a final output with finish_reason "abort")."""
        self.accepting = False
        deadline = time.monotonic() + grace_seconds
        while self.output_processor.unfinished() and time.monotonic() < deadline and self.is_alive:
            await asyncio.sleep(0.05)
        for rid in self.output_processor.unfinished():
            self.abort(rid)

    # ------------------------------------------------------------------ requests
    async def add_requests(
        self,
        request_ids: Sequence[str],
        prompts: Sequence[str | Sequence[int]],
        params: SamplingParams,
        *,
        priority: int = 0,
        add_special_tokens: bool = True,
        arrival_time: float | None = None,
        cache_salt: str | None = None,
    ) -> list[RequestStream]:
        """Validate and tokenize every prompt (in a worker thread), then hand all of them to
        the engine in one command, so that they can share the next step. Raises ValueError
        (bad input: nothing is queued), EngineOverloadedError (the waiting queue is full),
        EngineDeadError or EngineShutdownError."""
        self._check_alive()
        self._check_capacity()  # before tokenizing: a refusal should cost little
        arrival = arrival_time or time.time()
        ip = self.input_processor

        def process() -> list[ProcessedRequest]:  # (structured output's grammars compile here too)
            return [ip.process(rid, p, params, arrival_time=arrival, priority=priority,
                               add_special_tokens=add_special_tokens, cache_salt=cache_salt)
                    for rid, p in zip(request_ids, prompts)]

        processed = await asyncio.to_thread(process)
        self._check_alive()
        self._check_capacity()
        op = self.output_processor
        for req in processed:
            if op.has(req.request_id):
                raise ValueError(f"request id {req.request_id!r} is already in use")
        streams = []
        for req in processed:
            queue: asyncio.Queue = asyncio.Queue()
            op.add(req, OutputKind.DELTA, arrival, queue)
            streams.append(RequestStream(req.request_id, req.prompt_token_ids, queue))
        seqs = [seq for req in processed for seq in req.sequences]
        self._sent += len(seqs)
        self._send(_Add(seqs))
        return streams

    async def add_request(self, request_id: str, prompt: str | Sequence[int], params: SamplingParams,
                          **kwargs: Any) -> RequestStream:
        (stream,) = await self.add_requests([request_id], [prompt], params, **kwargs)
        return stream

    def abort(self, request_id: str) -> None:
        """Idempotent: the request's client gets a final "abort" output (if still listening)
        and its KV blocks are freed at the engine's next turn."""
        op = self.output_processor
        if not op.has(request_id):
            return
        ids = op.sequence_ids(request_id)
        op.abort(request_id)
        if self.error is None:
            self._send(_Abort(ids))

    async def call(self, method: str, *args: Any) -> Any:
        """Run one of the engine core's commands (CORE_CALLS) on the engine thread, in order
        with adds and aborts; returns its result or raises its exception."""
        if method not in CORE_CALLS:
            raise ValueError(f"unknown engine command {method!r}")
        self._check_alive()
        future = asyncio.get_running_loop().create_future()
        self._send(_Call(method, args, future))
        return await future

    def _send(self, command: _Add | _Abort | _Call) -> None:
        with self._cond:
            self._commands.append(command)
            self._cond.notify()

    def _check_alive(self) -> None:
        if self.error is not None:
            raise EngineDeadError(f"the engine has failed: {self.error!r}")
        if not self.accepting or self._stop:
            raise EngineShutdownError("the server is shutting down")

    def _check_capacity(self) -> None:
        waiting = self.num_waiting
        if waiting >= self.max_waiting_requests:
            self.num_refused += 1
            raise EngineOverloadedError(
                f"the server is at capacity: {waiting} sequences are waiting to be scheduled (the "
                f"limit is {self.max_waiting_requests}); retry in {RETRY_AFTER_SECONDS} s.",
                RETRY_AFTER_SECONDS)

    # ------------------------------------------------------------------ engine thread
    def _run(self) -> None:
        try:
            self._engine_loop()
        except BaseException as e:  # noqa: BLE001 - any failure kills the engine
            logger.exception("engine loop failed")
            self.error = e
            self._post(self._fail, e)

    def _engine_loop(self) -> None:
        core = self.core
        taken = 0  # sequences taken from add commands
        while True:
            with self._cond:
                while not (self._commands or self._stop or core.has_work()):
                    self._cond.wait()
                commands, self._commands = self._commands, []
                stop = self._stop
            for cmd in commands:
                if isinstance(cmd, _Add):
                    taken += len(cmd.sequences)
                    for seq in cmd.sequences:
                        try:
                            core.add_request(seq)
                        except (ValueError, RuntimeError) as e:  # e.g. sleeping: this request fails
                            self._post(self._reject, seq.request_id, e)
                elif isinstance(cmd, _Abort):
                    core.abort_requests(cmd.sequence_ids)
                else:
                    self._run_call(cmd)
            if stop:
                core.abort_requests(list(core.scheduler.requests))
                self._publish(taken)
                return
            if core.has_work():
                outputs = core.step()
                if outputs:
                    self._post(self._on_outputs, outputs)
            self._publish(taken)

    def _publish(self, taken: int) -> None:
        self.stats = stats = self.core.stats()
        self._load = (taken, stats.scheduler.num_waiting, stats.scheduler.num_running)

    def _run_call(self, cmd: _Call) -> None:
        try:
            result = getattr(self.core, cmd.method)(*cmd.args)
        except Exception as e:  # noqa: BLE001 - reported to the caller
            self._post(_set_exception, cmd.future, e)
        else:
            self._post(_set_result, cmd.future, result)

    def _post(self, fn, *args) -> None:
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            pass

    # ------------------------------------------------------------------ event loop side
    def _on_outputs(self, outputs) -> None:
        if self._failed:
            return
        failed = [o for o in outputs if o.error is not None]
        if failed:
            outputs = [o for o in outputs if o.error is None]
        try:
            _, stopped = self.output_processor.process(outputs)  # delivered to the requests' queues
        except Exception as e:  # noqa: BLE001 - the frontend's state is unknown now: fatal
            logger.exception("the output processor failed")
            self._die(e)
            return
        for o in failed:  # the core has finished these; the request's other samples go too
            stopped += self.output_processor.fail_sequence(o.request_id, o.error)
        if stopped and self.error is None:
            self._send(_Abort(stopped))

    def _reject(self, sequence_id: str, error: BaseException) -> None:
        others = self.output_processor.fail_sequence(sequence_id, error)
        if others:
            self._send(_Abort(others))

    def _fail_from_outside(self, error: BaseException) -> None:
        """An unrecoverable failure seen by another thread (a lost follower): any thread."""
        if self.error is None:
            self.error = error
        with self._cond:
            self._stop = True
            self._cond.notify()
        if self._loop is not None:
            self._post(self._fail, error)

    def _die(self, error: BaseException) -> None:
        """An unrecoverable failure on the event loop's side: stop the engine thread too."""
        if self.error is None:
            self.error = error
        with self._cond:
            self._stop = True
            self._cond.notify()
        self._fail(error)

    def _fail(self, error: BaseException) -> None:
        if self._failed:
            return
        self._failed = True
        dead = EngineDeadError(f"the engine has failed: {error!r}")
        self.output_processor.fail(dead)
        with self._cond:
            for cmd in self._commands:
                if isinstance(cmd, _Call):
                    _set_exception(cmd.future, dead)
            self._commands.clear()
        for fn in self._dead_callbacks:
            try:
                fn(error)
            except Exception:  # noqa: BLE001 - one callback does not stop the others
                logger.exception("a dead-engine callback failed")


def _set_result(fut: asyncio.Future, value: Any) -> None:
    if not fut.done():
        fut.set_result(value)


def _set_exception(fut: asyncio.Future, exc: BaseException) -> None:
    if not fut.done():
        fut.set_exception(exc)
