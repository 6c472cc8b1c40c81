"""The engine core's loop, wherever it runs: take the frontend's commands in order (add, abort,
call, stop), step while there is work, and send back each step's outputs with a stats snapshot.

It runs on a thread of the serving process (engine/core_thread.py) or in a process of its own
(engine/core_process.py); the frontend that sends the commands and takes the events is
engine/async_client.py. Commands and events are small picklable messages: token ids in and out,
never text (the frontend tokenizes and detokenizes).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from jaxserve.engine.messages import EngineCoreOutput, EngineStats
from jaxserve.request import EngineRequest

if TYPE_CHECKING:
    import numpy as np

logger = logging.getLogger(__name__)

# The core's methods a command may call.
CORE_CALLS = frozenset({"stats", "reset_prefix_cache", "sleep", "wake_up", "embed"})


@runtime_checkable
class Core(Protocol):
    """What the loop (and LLMEngine) needs of an engine core: `EngineCore` (generation: the
    scheduler and a step runner) or `PoolingCore` (--runner pooling: embeddings, no steps)."""

    @property
    def is_sleeping(self) -> bool: ...

    def add_request(self, request: EngineRequest, /) -> None: ...  # ValueError: refused

    def abort_requests(self, request_ids: Iterable[str], /) -> None: ...

    def abort_all(self) -> None: ...

    def has_work(self) -> bool: ...

    def step(self) -> list[EngineCoreOutput]: ...

    # the calls (CORE_CALLS)
    def stats(self) -> EngineStats: ...

    def reset_prefix_cache(self) -> bool: ...

    def sleep(self) -> None: ...

    def wake_up(self) -> None: ...

    def embed(self, prompts: list[list[int]], /) -> np.ndarray: ...


# ---------------------------------------------------------------------------- commands (frontend -> core)
@dataclasses.dataclass(slots=True)
class Add:
    sequences: list[EngineRequest]


@dataclasses.dataclass(slots=True)
class Abort:
    sequence_ids: list[str]


@dataclasses.dataclass(slots=True)
class Call:
    call_id: int
    method: str
    args: tuple


@dataclasses.dataclass(slots=True)
class Stop:
    """Abort what runs and end the loop; with `error`, the engine failed (seen from outside)."""

    error: BaseException | None = None


Command = Add | Abort | Call | Stop


# ---------------------------------------------------------------------------- events (core -> frontend)
@dataclasses.dataclass(slots=True)
class Stepped:
    """After each turn of the loop: the outputs of the step (possibly none) and the load."""

    outputs: list[EngineCoreOutput]
    stats: EngineStats
    taken: int  # sequences taken from Add commands so far


@dataclasses.dataclass(slots=True)
class Rejected:
    """The core could not take a sequence (e.g. the engine sleeps): its request fails."""

    sequence_id: str
    error: BaseException


@dataclasses.dataclass(slots=True)
class Returned:
    call_id: int
    value: Any = None
    error: BaseException | None = None


@dataclasses.dataclass(slots=True)
class Died:
    """The loop failed (a device error, a lost follower, a bug): nothing more will come."""

    error: BaseException


@dataclasses.dataclass(slots=True)
class Stopped:
    """The loop ended after a Stop command."""


Event = Stepped | Rejected | Returned | Died | Stopped


def run_core_loop(core: Core, next_commands: Callable[[bool], list[Command]],
                  emit: Callable[[Event], None]) -> None:
    """Serve `core` until a Stop: `next_commands(block)` returns the commands that arrived (waiting
    for one when `block`, i.e. when the core has nothing to do), `emit` sends an event to the
    frontend. An exception ends the loop with Died."""
    try:
        _loop(core, next_commands, emit)
    except BaseException as e:  # noqa: BLE001 - any failure kills the engine
        logger.exception("the engine loop failed")
        emit(Died(e))


def _loop(core: Core, next_commands, emit) -> None:
    taken = 0
    while True:
        for cmd in next_commands(not core.has_work()):
            if isinstance(cmd, Add):
                taken += len(cmd.sequences)
                for seq in cmd.sequences:
                    try:
                        core.add_request(seq)
                    except (ValueError, RuntimeError) as e:  # e.g. sleeping: this request fails
                        emit(Rejected(seq.request_id, e))
            elif isinstance(cmd, Abort):
                core.abort_requests(cmd.sequence_ids)
            elif isinstance(cmd, Call):
                try:
                    if cmd.method not in CORE_CALLS:
                        raise ValueError(f"unknown engine command {cmd.method!r}")
                    emit(Returned(cmd.call_id, getattr(core, cmd.method)(*cmd.args)))
                except Exception as e:  # noqa: BLE001 - reported to the caller
                    emit(Returned(cmd.call_id, error=e))
            else:
                core.abort_all()
                if cmd.error is not None:
                    emit(Died(cmd.error))
                else:
                    emit(Stepped([], core.stats(), taken))
                    emit(Stopped())
                return
        outputs = core.step() if core.has_work() else []
        emit(Stepped(outputs, core.stats(), taken))
