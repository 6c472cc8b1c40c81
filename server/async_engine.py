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

If the engine thread raises, the engine is marked dead: every pending request gets the error,
new requests are refused and /health answers 503. Every method here is for the event loop's
thread.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
import time
from collections.abc import Sequence
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
    def __init__(self, parts: EngineParts, stats_listener: StatsListener | None = None):
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
        """Stop the engine thread (it aborts whatever still runs) and join it."""
        self.accepting = False
        with self._cond:
            self._stop = True
            self._cond.notify()
        if self._thread is not None:
            self._thread.join(timeout)

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
        (bad input: nothing is queued), EngineDeadError or EngineShutdownError."""
        self._check_alive()
        arrival = arrival_time or time.time()
        ip = self.input_processor

        def process() -> list[ProcessedRequest]:  # (structured output's grammars compile here too)
            return [ip.process(rid, p, params, arrival_time=arrival, priority=priority,
                               add_special_tokens=add_special_tokens, cache_salt=cache_salt)
                    for rid, p in zip(request_ids, prompts)]

        processed = await asyncio.to_thread(process)
        self._check_alive()
        op = self.output_processor
        for req in processed:
            if op.has(req.request_id):
                raise ValueError(f"request id {req.request_id!r} is already in use")
        streams = []
        for req in processed:
            queue: asyncio.Queue = asyncio.Queue()
            op.add(req, OutputKind.DELTA, arrival, queue)
            streams.append(RequestStream(req.request_id, req.prompt_token_ids, queue))
        self._send(_Add([seq for req in processed for seq in req.sequences]))
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
        while True:
            with self._cond:
                while not (self._commands or self._stop or core.has_work()):
                    self._cond.wait()
                commands, self._commands = self._commands, []
                stop = self._stop
            for cmd in commands:
                if isinstance(cmd, _Add):
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
                self.stats = core.stats()
                return
            if core.has_work():
                outputs = core.step()
                if outputs:
                    self._post(self._on_outputs, outputs)
            self.stats = core.stats()

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
        _, stopped = self.output_processor.process(outputs)  # delivered to the requests' queues
        if stopped and self.error is None:
            self._send(_Abort(stopped))

    def _reject(self, sequence_id: str, error: BaseException) -> None:
        others = self.output_processor.fail_sequence(sequence_id, error)
        if others:
            self._send(_Abort(others))

    def _fail(self, error: BaseException) -> None:
        dead = EngineDeadError(f"the engine has failed: {error!r}")
        self.output_processor.fail(dead)
        with self._cond:
            for cmd in self._commands:
                if isinstance(cmd, _Call):
                    _set_exception(cmd.future, dead)
            self._commands.clear()


def _set_result(fut: asyncio.Future, value: Any) -> None:
    if not fut.done():
        fut.set_result(value)


def _set_exception(fut: asyncio.Future, exc: BaseException) -> None:
    if not fut.done():
        fut.set_exception(exc)
