"""EngineClient: everything a server may use of an engine, and `open_engine`, which starts one.

The server (jaxserve/server/) imports this module and nothing else of the engine layer: the
protocol below, the errors it raises, the stream a request's outputs arrive on, the listener
its metrics implement, and the types of the facts it reads. Its one implementation is
`AsyncEngineClient` (async_client.py), whose core runs on a thread of the serving process
("thread") or in a process of its own ("process", core_process.py): the same frontend, the same
policies, two transports.
"""

from __future__ import annotations

import concurrent.futures
import logging
from collections.abc import Callable, Sequence
from typing import Any, Literal, Protocol

from jaxserve.engine.async_client import (
    AsyncEngineClient,
    EngineDeadError,
    EngineOverloadedError,
    EngineShutdownError,
    RequestStream,
)
from jaxserve.engine.embedding import EmbeddingResult
from jaxserve.engine.input_processor import ModelInfo
from jaxserve.engine.messages import EngineSleepingError, EngineStats
from jaxserve.engine.output_processor import StatsListener
from jaxserve.outputs import OutputKind
from jaxserve.parallel.multihost import FingerprintMismatch, LeaderLostError
from jaxserve.sampling_params import SamplingParams

__all__ = [
    "EmbeddingResult",
    "EngineClient",
    "EngineDeadError",
    "EngineOverloadedError",
    "EngineShutdownError",
    "EngineSleepingError",
    "EngineStats",
    "FingerprintMismatch",
    "FollowerRole",
    "LeaderLostError",
    "ModelInfo",
    "OutputKind",
    "RequestStream",
    "StatsListener",
    "open_engine",
]

logger = logging.getLogger(__name__)

CoreMode = Literal["auto", "thread", "process"]


def default_engine_core() -> Literal["thread", "process"]:
    """Where the engine core runs when the user does not say (`--engine-core auto`)."""
    return "thread"


class EngineClient(Protocol):
    """An engine as an asyncio server drives it. Every method is for the event loop's thread."""

    info: ModelInfo  # the model's facts (name, context, vocabulary, sampling defaults, ...)
    tokenizer: Any  # the model's tokenizer (chat templates, /tokenize)
    stats: EngineStats  # the core's latest snapshot
    error: BaseException | None  # why the engine failed, once it has
    max_waiting_requests: int
    num_refused: int  # requests refused because the waiting queue was full
    listener: StatsListener  # per-request metrics

    @property
    def model_name(self) -> str: ...
    @property
    def max_model_len(self) -> int: ...
    @property
    def is_alive(self) -> bool: ...
    @property
    def num_in_flight(self) -> int: ...
    @property
    def num_waiting(self) -> int: ...

    def default_sampling_params(self) -> SamplingParams: ...
    def add_dead_callback(self, fn: Callable[[BaseException], None]) -> None: ...
    def start(self) -> None: ...
    def shutdown(self, timeout: float = 30.0) -> None: ...
    def close(self) -> None: ...
    async def drain(self, grace_seconds: float) -> None: ...

    async def add_requests(self, request_ids: Sequence[str], prompts: Any, params: SamplingParams, *,
                           priority: int = 0, add_special_tokens: bool = True, arrival_time: float | None = None,
                           cache_salt: str | None = None, output_kind: OutputKind = OutputKind.DELTA
                           ) -> list[RequestStream]: ...

    async def embed(self, inputs: Sequence[str | Sequence[int]], *, dimensions: int | None = None,
                    add_special_tokens: bool = True) -> list[EmbeddingResult]: ...

    def abort(self, request_id: str) -> None: ...
    async def call(self, method: str, *args: Any) -> Any: ...


class FollowerRole(Exception):
    """`open_engine` found this process to be a multi-host follower: there is nothing to serve;
    `run()` runs the leader's steps until the leader shuts down (returns 0) or is lost (raises
    LeaderLostError)."""

    def __init__(self, run: Callable[[], int]):
        super().__init__("this process is a multi-host follower")
        self.run = run


def open_engine(config, *, core: CoreMode = "auto", timer=None, max_waiting_requests: int | None = None,
                stats_listener: StatsListener | None = None) -> AsyncEngineClient:
    """Build the engine of `config` with its core on a thread of this process or in a process of
    its own, and the client that serves it (not started: `start()` on the event loop). Raises
    what building the engine raises, and FollowerRole on a multi-host follower."""
    if core == "auto":
        core = default_engine_core()
    if core == "thread":
        from jaxserve.engine.setup import build_engine

        parts = build_engine(config, timer)
        if parts.is_follower:
            def follow() -> int:
                parts.run_follower()
                return 0
            raise FollowerRole(follow)
        return AsyncEngineClient.in_thread(parts, max_waiting_requests=max_waiting_requests,
                                           stats_listener=stats_listener)
    if core != "process":
        raise ValueError(f"engine core {core!r}: 'thread' or 'process'")
    from jaxserve.engine.core_process import BuildEngine, FollowerProcess, ProcessCore
    from jaxserve.engine.tokenizer import Tokenizer

    pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="jaxserve-tokenizer")
    tokenizer: list[concurrent.futures.Future] = []
    try:
        transport, info, stats = ProcessCore.spawn(
            BuildEngine(config),
            on_model_directory=lambda path: tokenizer.append(pool.submit(Tokenizer.from_pretrained, path)))
    except FollowerProcess as f:
        process = f.process  # (the name `f` is unbound after the except clause)

        def wait() -> int:
            process.join()
            return process.exitcode or 0
        raise FollowerRole(wait) from None
    finally:
        pool.shutdown(wait=False)
    return AsyncEngineClient(transport, tokenizer[0].result(), info, stats, max_waiting_requests=max_waiting_requests,
                             stats_listener=stats_listener, mode="process")
