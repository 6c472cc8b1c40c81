"""The engine core on a thread of the serving process ("jaxserve-engine"), which owns every JAX
call: commands reach it through a condition variable, events go back to the event loop with
`call_soon_threadsafe`. The HTTP event loop, detokenization and the steps then share one
interpreter (and its GIL); engine/core_process.py runs the core in a process of its own."""

from __future__ import annotations

import threading
from collections.abc import Callable

from jaxserve.engine import core_loop
from jaxserve.engine.core_loop import Command, Event
from jaxserve.engine.setup import EngineParts


class ThreadCore:
    """A core transport (see async_client.CoreTransport) over an engine built in this process."""

    def __init__(self, parts: EngineParts):
        self.parts = parts
        self._cond = threading.Condition()
        self._commands: list[Command] = []
        self._thread: threading.Thread | None = None
        self._deliver: Callable[[Event], None] | None = None
        link = parts.link
        if link is not None and hasattr(link, "add_failure_callback"):  # a multi-host leader
            link.add_failure_callback(self._failed_outside)

    @property
    def core(self):
        """The engine core (tests look inside it; the client never does)."""
        return self.parts.core

    def start(self, deliver: Callable[[Event], None]) -> None:
        """Start the loop; `deliver(event)` is called on the engine thread (it must hand the
        event over to the frontend's thread itself)."""
        self._deliver = deliver
        self._thread = threading.Thread(target=core_loop.run_core_loop, name="jaxserve-engine", daemon=True,
                                        args=(self.parts.core, self._next, deliver))
        self._thread.start()

    def _failed_outside(self, error: BaseException) -> None:
        """A failure seen by another thread (a lost follower): the frontend hears of it at once,
        since the engine thread may be stuck in a collective that never returns."""
        if self._deliver is not None:
            self._deliver(core_loop.Died(error))
        self.send(core_loop.Stop(error))

    def _next(self, block: bool) -> list[Command]:
        with self._cond:
            while block and not self._commands:
                self._cond.wait()
            commands, self._commands = self._commands, []
        return commands

    def send(self, command: Command) -> None:
        with self._cond:
            self._commands.append(command)
            self._cond.notify()

    def join(self, timeout: float) -> None:
        if self._thread is not None:
            self._thread.join(timeout)

    def close(self) -> None:
        """The leader's clean exit (several processes: the followers shut down with it)."""
        self.parts.close()
