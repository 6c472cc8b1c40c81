"""uvicorn's server with a graceful shutdown that drains the engine first."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Callable

import uvicorn

from jaxserve.engine.client import EngineClient

FAILED_HEALTH_SECONDS = 2.0


class DrainingServer(uvicorn.Server):
    """Drains the engine as soon as the server is asked to exit (SIGTERM, Ctrl-C): new requests
    get 503, in-flight ones get `grace_seconds` to finish and are then aborted (their clients
    receive a final "abort" output), so that the connections uvicorn waits for close by
    themselves and the process exits 0.

    When the engine fails for good, the server stops by itself: in-flight requests have their
    error, /health answers 503 until the listener closes, and `run()` returns (the CLI then
    exits 1)."""

    def __init__(self, config: uvicorn.Config, engine: EngineClient, grace_seconds: float,
                 on_started: Callable[[], None] | None = None):
        super().__init__(config)
        self.engine = engine
        self.grace_seconds = grace_seconds
        self.on_started = on_started  # called once the server listens
        engine.add_dead_callback(self._engine_failed)

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets)
        if self.on_started is not None and self.started:
            self.on_started()

    def _engine_failed(self, error: BaseException) -> None:
        # /health answers 503 (with the reason) for a moment before the listener closes.
        asyncio.get_running_loop().call_later(FAILED_HEALTH_SECONDS, setattr, self, "should_exit", True)

    def handle_exit(self, sig: int, frame) -> None:
        super().handle_exit(sig, frame)
        # uvicorn re-raises the signals it handled once it has shut down, so that the process
        # dies of them; after a completed drain SIGTERM is a clean exit (status 0) instead.
        if sig == signal.SIGTERM:
            self._captured_signals.remove(sig)

    async def shutdown(self, sockets=None) -> None:
        drain = asyncio.create_task(self.engine.drain(self.grace_seconds))
        await super().shutdown(sockets)
        await drain
