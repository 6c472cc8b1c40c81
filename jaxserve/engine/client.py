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
from jaxserve.engine.input_processor import ModelInfo, check_lora
from jaxserve.engine.messages import EngineSleepingError, EngineStats
from jaxserve.engine.output_processor import StatsListener
from jaxserve.engine.plan import PLAN_HELP  # noqa: F401 - serve's --help shows what the plan resolves
from jaxserve.inputs import Prompt
from jaxserve.outputs import OutputKind
from jaxserve.platform import Platform, serving_platform
from jaxserve.parallel.multihost import FingerprintMismatch, LeaderLostError, exit_now
from jaxserve.sampling_params import SamplingParams

__all__ = [
    "check_lora",
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
    "exit_now",
]

logger = logging.getLogger(__name__)

CoreMode = Literal["auto", "thread", "process"]
# --engine-core auto, per platform, as measured (benchmarks/engine_core_modes.py;
# docs/performance.md, "The engine core on a thread or in a process of its own"): on the CPU
# the device work of a step takes the cores the second process would want (the two modes within
# 1-8 %, the thread ahead);
# with a fast step (the null model standing in for a TPU/GPU) the host work decides, and the
# process serves 1.3-1.5x the tokens at 32 and 128 streams.
ENGINE_CORE_BY_PLATFORM: dict[str, Literal["thread", "process"]] = {
    "cpu": "thread", "tpu": "process", "gpu": "process"}


def default_engine_core(platform: Platform) -> Literal["thread", "process"]:
    """Where the engine core runs when the user does not say (`--engine-core auto`): the faster
    of the two on that platform as measured (benchmarks/engine_core_modes.py;
    docs/performance.md, "The engine core on a thread or in a process of its own")."""
    return ENGINE_CORE_BY_PLATFORM[platform]


def engine_core_placement(requested: CoreMode) -> tuple[str, str]:
    """(where the engine core runs, why) for `--engine-core requested`: the engine plan's entry
    (engine/plan.py), resolved here, before the engine (and JAX) loads."""
    if requested != "auto":
        return requested, "given (--engine-core)"
    platform = serving_platform()
    core = default_engine_core(platform)
    logger.info("engine core: %s (the default on %s; --engine-core thread|process to choose)", core, platform)
    return core, f"auto: the faster on {platform} (--engine-core thread|process to choose)"


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
                           cache_salt: str | None = None,
                           output_kind: OutputKind = OutputKind.DELTA,
                           lora_request: Any = None) -> list[RequestStream]: ...

    async def embed(self, inputs: Sequence[Prompt], *, dimensions: int | None = None,
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
    placement = engine_core_placement(core)
    core = placement[0]
    if core == "thread":
        from jaxserve.engine.setup import build_engine

        parts = build_engine(config, timer, engine_core=placement)
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
            BuildEngine(config, placement), timer=timer,
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
