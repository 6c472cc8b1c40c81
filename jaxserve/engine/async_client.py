"""AsyncEngineClient: the engine as an asyncio server drives it (jaxserve/engine/client.py has
the protocol the server sees).

The frontend runs on the server's event loop: a request is validated and tokenized by the input
processor in a worker thread (never on the loop itself; the chat template is rendered in the same
hop), registered with the output processor, and handed to the engine core as one command per
client request (all of a multi-prompt request's sequences at once). The core runs elsewhere, behind
a transport: on a thread of this process (core_thread.ThreadCore) or in a process of its own
(core_process.ProcessCore); it sends back each step's token ids, which the output processor turns
into RequestOutputs on the loop (DELTA for streams, FINAL_ONLY otherwise) and puts on each
request's queue.

Back-pressure: a request is refused (EngineOverloadedError, HTTP 503 with Retry-After) while the
sequences waiting to be scheduled number `max_waiting_requests` or more. The scheduler owns the
waiting queue and publishes its length (and the running count) after every step; the client adds
the sequences it has sent since the core last took commands, less those that free running slots
will take (a burst between two steps, which on a CPU can be seconds apart, is counted at once).

Failures: a request the core could not take (its input failed inside a step) fails alone with
its error. Any other failure of the core (a device error, a lost follower, the engine process
gone), or of the output processor, is unrecoverable: the client is marked dead, every pending
request gets the error, new requests are refused (503), and the callbacks registered with
`add_dead_callback` run (the CLI's server then exits non-zero, for its supervisor to restart it).
Every method here is for the event loop's thread.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from jaxserve.engine import core_loop
from jaxserve.engine.core_loop import Command, Event
from jaxserve.engine.embedding import EmbeddingResult, check_dimensions, embedding_inputs, truncate
from jaxserve.engine.frontend import Frontend
from jaxserve.engine.input_processor import ModelInfo, ProcessedRequest
from jaxserve.engine.messages import EngineStats
from jaxserve.engine.output_processor import StatsListener
from jaxserve.inputs import Prompt, PromptType
from jaxserve.outputs import OutputKind
from jaxserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)



class EngineDeadError(RuntimeError):
    """The engine has failed; the server cannot serve requests."""


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


class CoreTransport(Protocol):
    """Where the engine core runs, as the client sees it."""

    def start(self, deliver: Callable[[Event], None]) -> None:
        """Start the core's loop; `deliver(event)` may be called on any thread."""

    def send(self, command: Command) -> None: ...

    def join(self, timeout: float) -> None:
        """Wait for the loop to end (after a Stop)."""

    def close(self) -> None:
        """Release what the engine holds beyond its loop (multi-host: the followers)."""


@dataclasses.dataclass(slots=True)
class RequestStream:
    """One added request: its id, prompt tokens and the queue its outputs arrive on (an
    exception instance in the queue means the request failed)."""

    request_id: str
    prompt_token_ids: list[int]
    queue: asyncio.Queue


class AsyncEngineClient:
    def __init__(self, transport: CoreTransport, tokenizer: Any, info: ModelInfo, stats: EngineStats, *,
                 max_waiting_requests: int | None = None, stats_listener: StatsListener | None = None,
                 mode: str = "thread"):
        self.transport = transport
        self.mode = mode  # "thread" or "process": where the engine core runs
        self.tokenizer = tokenizer
        self.info = info
        self.frontend = Frontend(tokenizer, info, stats_listener)
        self.stats = stats  # the core's last snapshot
        self.error: BaseException | None = None
        self.accepting = True
        if max_waiting_requests is None:
            max_waiting_requests = default_max_waiting(info.kv_cache_tokens, info.max_model_len, info.max_num_seqs)
        if max_waiting_requests < 1:
            raise ValueError(f"max_waiting_requests must be >= 1, got {max_waiting_requests}")
        self.max_waiting_requests = max_waiting_requests
        self.num_refused = 0  # requests refused because the queue was full
        self._sent = 0  # sequences sent to the core
        # (sequences the core had taken, its waiting and running counts then), after each step
        self._load = (0, stats.scheduler.num_waiting, stats.scheduler.num_running)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._started = self._stopped = self._failed = False
        self._dead_callbacks: list[Callable[[BaseException], None]] = []
        self._calls: dict[int, asyncio.Future] = {}
        self._call_ids = itertools.count()

    @classmethod
    def in_thread(cls, parts, **kwargs: Any) -> AsyncEngineClient:
        """A client of the engine `parts` (built in this process), its core on a thread."""
        from jaxserve.engine.core_thread import ThreadCore

        return cls(ThreadCore(parts), parts.tokenizer, parts.info, parts.core.stats(), mode="thread", **kwargs)

    # ------------------------------------------------------------------ facts
    @property
    def model_name(self) -> str:
        return self.info.name

    @property
    def max_model_len(self) -> int:
        return self.info.max_model_len

    @property
    def listener(self) -> StatsListener:
        return self.frontend.output_processor.listener

    @listener.setter
    def listener(self, listener: StatsListener) -> None:
        self.frontend.output_processor.listener = listener

    @property
    def is_alive(self) -> bool:
        return self.error is None and self._started and not self._stopped

    @property
    def num_in_flight(self) -> int:
        return len(self.frontend.unfinished())

    @property
    def num_waiting(self) -> int:
        """Sequences waiting to be scheduled: the scheduler's count after the last step, plus
        the sequences sent since the core last took commands but those that free running
        slots will take (when nothing waited, nothing else held the slots back)."""
        taken, waiting, running = self._load
        in_transit = self._sent - taken
        if waiting == 0:
            in_transit = max(0, in_transit - (self.info.max_num_seqs - running))
        return waiting + in_transit

    def add_dead_callback(self, fn: Callable[[BaseException], None]) -> None:
        """Call fn(error), on the event loop, when the engine fails for good."""
        self._dead_callbacks.append(fn)

    def default_sampling_params(self) -> SamplingParams:
        return self.frontend.default_sampling_params()

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        if self._started:
            return
        self._loop = asyncio.get_running_loop()
        self._started = True
        self.transport.start(self._deliver)

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stop the core's loop (it aborts whatever still runs) and wait for it. After a
        failure the core may be stuck in a device call that never returns: it is not waited for."""
        self.accepting = False
        if self._started and not self._stopped:
            self._stopped = True
            self.transport.send(core_loop.Stop())
            self.transport.join(timeout if self.error is None else 0.5)

    def close(self) -> None:
        """After shutdown: release what the engine holds beyond its loop (a multi-host leader:
        its followers shut down with it; a process engine: its process)."""
        self.transport.close()

    async def drain(self, grace_seconds: float) -> None:
        """Refuse new requests, wait up to grace_seconds for in-flight ones, abort the rest
        (their clients get a final output with finish_reason "abort")."""
        self.accepting = False
        deadline = time.monotonic() + grace_seconds
        while self.frontend.unfinished() and time.monotonic() < deadline and self.is_alive:
            await asyncio.sleep(0.05)
        for rid in self.frontend.unfinished():
            self.abort(rid)

    # ------------------------------------------------------------------ requests
    async def add_requests(
        self,
        request_ids: Sequence[str],
        prompts: Sequence[Prompt | PromptType] | Callable[[], Sequence[Prompt | PromptType]],
        params: SamplingParams,
        *,
        priority: int = 0,
        add_special_tokens: bool = True,
        arrival_time: float | None = None,
        cache_salt: str | None = None,
        output_kind: OutputKind = OutputKind.DELTA,
        lora_request: Any = None,
    ) -> list[RequestStream]:
        """Validate and tokenize every prompt (in one worker-thread hop; `prompts` may be a
        function that makes them there, e.g. rendering a chat template), then hand all of them
        to the core in one command, so that they can share the next step. Raises ValueError
        (bad input: nothing is queued), EngineOverloadedError (the waiting queue is full),
        EngineDeadError or EngineShutdownError."""
        self._check_alive()
        self._check_capacity()  # before tokenizing: a refusal should cost little
        arrival = arrival_time or time.time()
        fe = self.frontend

        def process() -> list[ProcessedRequest]:  # (structured output's grammars compile here too)
            texts = prompts() if callable(prompts) else prompts
            if len(texts) != len(request_ids):
                raise ValueError(f"{len(texts)} prompts for {len(request_ids)} request ids")
            return [fe.process(rid, p, params, arrival_time=arrival, priority=priority,
                               add_special_tokens=add_special_tokens, cache_salt=cache_salt,
                               lora_request=lora_request)
                    for rid, p in zip(request_ids, texts)]

        processed = await asyncio.to_thread(process)
        self._check_alive()
        self._check_capacity()
        queues = [asyncio.Queue() for _ in processed]
        fe.register(processed, output_kind, arrival, queues)
        seqs = [seq for req in processed for seq in req.sequences]
        self._sent += len(seqs)
        self.transport.send(core_loop.Add(seqs))
        return [RequestStream(req.request_id, req.prompt_token_ids, q) for req, q in zip(processed, queues)]

    async def add_request(self, request_id: str, prompt: Prompt | PromptType, params: SamplingParams,
                          **kwargs: Any) -> RequestStream:
        (stream,) = await self.add_requests([request_id], [prompt], params, **kwargs)
        return stream

    async def embed(self, inputs: Sequence[Prompt], *, dimensions: int | None = None,
                    add_special_tokens: bool = True) -> list[EmbeddingResult]:
        """Embeddings of `inputs` (--runner pooling): validated and tokenized in a worker thread,
        computed by the engine core in order with its other commands. Raises ValueError (bad
        input, or a model served for generation), EngineDeadError or EngineShutdownError."""
        self._check_alive()
        check_dimensions(self.info, dimensions)
        ids = await asyncio.to_thread(embedding_inputs, self.frontend.tokenizer, self.info, inputs,
                                      add_special_tokens=add_special_tokens)
        vectors = truncate(self.info, await self.call("embed", ids), dimensions)
        return [EmbeddingResult(i, v) for i, v in zip(ids, vectors)]

    def abort(self, request_id: str) -> None:
        """Idempotent: the request's client gets a final "abort" output (if still listening)
        and its KV blocks are freed at the core's next turn."""
        out, ids = self.frontend.abort(request_id)
        if out is not None and ids and self.error is None:
            self.transport.send(core_loop.Abort(ids))

    async def call(self, method: str, *args: Any) -> Any:
        """Run one of the engine core's commands (core_loop.CORE_CALLS) in order with adds and
        aborts; returns its result or raises its exception."""
        if method not in core_loop.CORE_CALLS:
            raise ValueError(f"unknown engine command {method!r}")
        self._check_alive()
        call_id = next(self._call_ids)
        future = self._calls[call_id] = asyncio.get_running_loop().create_future()
        self.transport.send(core_loop.Call(call_id, method, args))
        return await future

    def _check_alive(self) -> None:
        if self.error is not None:
            raise EngineDeadError(f"the engine has failed: {self.error!r}")
        if not self.accepting or self._stopped:
            raise EngineShutdownError("the server is shutting down")

    def _check_capacity(self) -> None:
        waiting = self.num_waiting
        if waiting >= self.max_waiting_requests:
            self.num_refused += 1
            raise EngineOverloadedError(
                f"the server is at capacity: {waiting} sequences are waiting to be scheduled (the "
                f"limit is {self.max_waiting_requests}); retry in {RETRY_AFTER_SECONDS} s.",
                RETRY_AFTER_SECONDS)

    # ------------------------------------------------------------------ events from the core
    def _deliver(self, event: Event) -> None:
        """Any thread: hand the event to the event loop."""
        try:
            self._loop.call_soon_threadsafe(self._on_event, event)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            pass

    def _on_event(self, event: Event) -> None:
        if self._failed:
            return
        if isinstance(event, core_loop.Stepped):
            self.stats = event.stats
            self._load = (event.taken, event.stats.scheduler.num_waiting, event.stats.scheduler.num_running)
            if event.outputs:
                self._on_outputs(event.outputs)
        elif isinstance(event, core_loop.Rejected):
            others = self.frontend.reject(event.sequence_id, event.error)
            if others:
                self.transport.send(core_loop.Abort(others))
        elif isinstance(event, core_loop.Returned):
            future = self._calls.pop(event.call_id, None)
            if future is not None and not future.done():
                if event.error is not None:
                    future.set_exception(event.error)
                else:
                    future.set_result(event.value)
        elif isinstance(event, core_loop.Died):
            logger.error("the engine failed: %r", event.error)
            self._fail(event.error)

    def _on_outputs(self, outputs) -> None:
        try:
            _, to_abort, _ = self.frontend.take_outputs(outputs)  # delivered to the requests' queues
        except Exception as e:  # noqa: BLE001 - the frontend's state is unknown now: fatal
            logger.exception("the output processor failed")
            self.transport.send(core_loop.Stop(e))
            self._fail(e)
            return
        if to_abort and self.error is None:
            self.transport.send(core_loop.Abort(to_abort))

    def _fail(self, error: BaseException) -> None:
        if self._failed:
            return
        self._failed = True
        if self.error is None:
            self.error = error
        dead = EngineDeadError(f"the engine has failed: {error!r}")
        self.frontend.fail_all(dead)
        for future in self._calls.values():
            if not future.done():
                future.set_exception(dead)
        self._calls.clear()
        for fn in self._dead_callbacks:
            try:
                fn(error)
            except Exception:  # noqa: BLE001 - one callback does not stop the others
                logger.exception("a dead-engine callback failed")
