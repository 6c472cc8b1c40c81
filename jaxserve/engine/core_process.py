"""The engine core in a process of its own, as vLLM V1 runs its EngineCore: the serving process
keeps the HTTP event loop, tokenization, detokenization and everything per request; the engine
process builds the engine (model, KV cache, compiled steps) and runs the core's loop
(core_loop.py), so a step never waits for the server's interpreter lock and the server never
waits for a step's.

The two talk over a pipe (multiprocessing.Pipe, pickled messages): core_loop's commands one
way, its events the other; a request travels as its token ids and sampling parameters (a
structured-output constraint is compiled again, and cached, on the engine's side: an llguidance
matcher does not cross processes), an output as token ids and numeric log-probs. The engine
process sends the model's directory as soon as it has it (the serving process loads the
tokenizer meanwhile), then its ModelInfo when ready. It ignores SIGINT and SIGTERM (the serving
process drains, then stops it) and exits when the pipe closes (the serving process is gone).
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing
import pickle
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

from jaxserve.engine import core_loop
from jaxserve.engine.core_loop import Command, Event
from jaxserve.engine.input_processor import grammar_compiler

logger = logging.getLogger(__name__)


class EngineProcessError(RuntimeError):
    """The engine process failed to start, or exited while serving."""


# ---------------------------------------------------------------------------- start-up messages
@dataclasses.dataclass(slots=True)
class ModelDirectory:
    path: str


@dataclasses.dataclass(slots=True)
class Ready:
    info: Any  # ModelInfo
    stats: Any  # EngineStats
    startup_phases: dict[str, float] = dataclasses.field(default_factory=dict)  # the build's, in seconds
    startup_notes: dict[str, str] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(slots=True)
class Following:
    """This process is a multi-host follower: it runs the leader's steps; nothing to serve."""


@dataclasses.dataclass(slots=True)
class Failed:
    error: BaseException


@dataclasses.dataclass(frozen=True)
class BuildEngine:
    """`build_engine(config, ...)` as a picklable callable that does not import the engine (and
    JAX) until it is called, in the engine process."""

    config: Any  # EngineConfig
    engine_core: tuple[str, str] | None = None  # (where the core runs, why): the plan's entry

    def __call__(self, **kwargs: Any):
        from jaxserve.engine.setup import build_engine

        return build_engine(self.config, engine_core=self.engine_core, **kwargs)


def _picklable(error: BaseException) -> BaseException:
    """`error`, or a RuntimeError carrying its repr when it does not pickle (device errors)."""
    try:
        pickle.loads(pickle.dumps(error))
        return error
    except Exception:  # noqa: BLE001
        return RuntimeError(repr(error))


def _grammars_here(parts) -> None:
    """Constraints arrive uncompiled (an llguidance matcher does not pickle): compiled in this
    process, with the tokenizer's tables built meanwhile on a thread rather than at the first
    request."""
    compiler = parts.core.structured.compiler = grammar_compiler(parts.tokenizer, parts.info)

    def build_tables() -> None:
        try:
            compiler.tokenizer()
        except Exception:  # noqa: BLE001 - a constrained request reports it (the frontend refuses it first)
            logger.debug("structured output's tokenizer tables could not be built", exc_info=True)

    threading.Thread(target=build_tables, name="jaxserve-grammar-tables", daemon=True).start()


def _engine_main(build: Callable[..., Any], conn, log_level: int) -> None:
    """The engine process: build the engine, report, serve the pipe until Stop or EOF."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=log_level, format="%(asctime)s %(levelname)s %(name)s [engine]: %(message)s")
    lock = threading.Lock()

    def send(message: Any) -> None:
        with lock:
            conn.send(message)

    from jaxserve.startup_timer import StartupTimer

    timer = StartupTimer()  # the build's phases, reported to the serving process's start-up line
    try:
        parts = build(on_model_path=lambda p: send(ModelDirectory(str(p))), timer=timer)
    except BaseException as e:  # noqa: BLE001 - reported to the serving process
        send(Failed(_picklable(e)))
        return
    if parts.is_follower:
        send(Following())
        parts.run_follower()
        return
    if parts.info.runner == "generate":  # (a pooling core takes no requests, so no grammars)
        _grammars_here(parts)
    link = parts.link
    if link is not None and hasattr(link, "add_failure_callback"):  # a multi-host leader
        link.add_failure_callback(lambda e: send(core_loop.Died(_picklable(e))))
    send(Ready(parts.info, parts.core.stats(), timer.phases, timer.notes))

    def next_commands(block: bool) -> list[Command]:
        commands = [conn.recv()] if block else []
        while conn.poll(0):
            commands.append(conn.recv())
        return commands

    def emit(event: Event) -> None:
        if isinstance(event, (core_loop.Died, core_loop.Rejected)):
            event.error = _picklable(event.error)
        elif isinstance(event, core_loop.Returned) and event.error is not None:
            event.error = _picklable(event.error)
        send(event)

    try:
        core_loop.run_core_loop(parts.core, next_commands, emit)
    except (EOFError, OSError):  # the serving process is gone
        pass
    finally:
        parts.close()


class ProcessCore:
    """A core transport (see async_client.CoreTransport) over an engine process."""

    def __init__(self, process: multiprocessing.process.BaseProcess, conn):
        self.process = process
        self._conn = conn
        self._lock = threading.Lock()
        self._receiver: threading.Thread | None = None

    @classmethod
    def spawn(cls, build: Callable[..., Any], *, on_model_directory: Callable[[str], None] | None = None,
              timeout: float | None = None, timer=None) -> tuple[ProcessCore, Any, Any]:
        """Start an engine process, which calls `build(on_model_path=..., timer=...)` (picklable,
        e.g. BuildEngine(config)) for its EngineParts, and wait until it is built; returns
        (transport, ModelInfo, EngineStats). `on_model_directory(path)` is called (on this
        thread) as soon as the engine process has resolved the model. `timer` (a StartupTimer)
        gets the build's phases, and the rest of the wait as "engine process" (starting the
        interpreter, imports). Raises the
        engine's own error when it cannot be built; FollowerProcess when this process is a
        multi-host follower (then the engine process runs the leader's steps until it exits)."""
        ctx = multiprocessing.get_context("spawn")
        started = time.perf_counter()
        ours, theirs = ctx.Pipe(duplex=True)
        process = ctx.Process(target=_engine_main, name="jaxserve-engine",
                              args=(build, theirs, logging.getLogger().getEffectiveLevel()), daemon=False)
        process.start()
        theirs.close()
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            wait = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not ours.poll(wait):
                process.kill()
                raise EngineProcessError(f"the engine process did not start within {timeout:g} s")
            try:
                message = ours.recv()
            except (EOFError, OSError):
                process.join(5)
                raise EngineProcessError(f"the engine process exited while starting (exit code "
                                         f"{process.exitcode})") from None
            if isinstance(message, ModelDirectory):
                if on_model_directory is not None:
                    on_model_directory(message.path)
            elif isinstance(message, Ready):
                if timer is not None:
                    waited = time.perf_counter() - started
                    for name, seconds in message.startup_phases.items():
                        timer.add(name, seconds)
                    timer.notes.update(message.startup_notes)
                    timer.add("engine process", max(0.0, waited - sum(message.startup_phases.values())))
                return cls(process, ours), message.info, message.stats
            elif isinstance(message, Failed):
                process.join(30)
                raise message.error
            elif isinstance(message, Following):
                raise FollowerProcess(process)

    def start(self, deliver: Callable[[Event], None]) -> None:
        def receive() -> None:
            while True:
                try:
                    event = self._conn.recv()
                except (EOFError, OSError):
                    self.process.join(5)
                    code = self.process.exitcode
                    if code not in (0, None):
                        deliver(core_loop.Died(EngineProcessError(f"the engine process exited (code {code})")))
                    return
                deliver(event)
                if isinstance(event, core_loop.Stopped):
                    return

        self._receiver = threading.Thread(target=receive, name="jaxserve-engine-events", daemon=True)
        self._receiver.start()

    def send(self, command: Command) -> None:
        if isinstance(command, core_loop.Add):  # compiled constraints stay here (see the module)
            command = core_loop.Add([dataclasses.replace(s, grammar=None) for s in command.sequences])
        with self._lock:
            try:
                self._conn.send(command)
            except (OSError, ValueError):  # the engine process is gone: its Died event says so
                pass

    def join(self, timeout: float) -> None:
        self.process.join(timeout)

    def close(self) -> None:
        """Stop the engine process: it ends after its loop (Stop), else it is killed."""
        if self.process.is_alive():
            self.process.join(5)
        if self.process.is_alive():
            logger.warning("the engine process did not stop; killing it")
            self.process.kill()
            self.process.join(5)
        self._conn.close()


class FollowerProcess(Exception):
    """`ProcessCore.spawn` found this process to be a multi-host follower: its engine process
    runs the leader's steps; wait for it (`process.join()`), serve nothing."""

    def __init__(self, process: multiprocessing.process.BaseProcess):
        super().__init__("a multi-host follower")
        self.process = process

