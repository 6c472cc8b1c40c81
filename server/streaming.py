"""How a generation handler answers: an SSE stream (`EventStream` over an `SSEStream`) or a
JSON body (`respond_json`); either way the engine requests are aborted when the client goes
away, and a failure becomes its API error (in-stream once the stream has started)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from jaxserve.server import sse
from jaxserve.server.engine_requests import engine_error
from jaxserve.server.errors import APIError, Disconnected, error_body
from jaxserve.server.request_context import request_id_of


async def until_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def run_unless_disconnected(request: Request, coro: Any) -> Any:
    """Await `coro`; if the client disconnects first, cancel it and raise Disconnected."""
    task = asyncio.ensure_future(coro)
    watcher = asyncio.ensure_future(until_disconnect(request))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        watcher.cancel()
        raise
    if task in done:
        watcher.cancel()
        return task.result()
    task.cancel()
    try:
        await task
    except (asyncio.CancelledError, Exception):  # noqa: BLE001
        pass
    raise Disconnected()


class SSEStream:
    """A handler's SSE events passed through; an error after the stream started is sent as an
    in-stream error event (a 500 names the request id, set by EventStream), after `on_error`
    has run (EventStream's abort: a request past its deadline frees its KV before its client
    hears of it); `[DONE]` always ends the stream."""

    def __init__(self, events: AsyncIterator[str]):
        self.events = events
        self.request_id: str | None = None
        self.on_error: Callable[[], None] | None = None

    async def __aiter__(self) -> AsyncIterator[str]:
        try:
            async for event in self.events:
                yield event
        except Exception as e:  # noqa: BLE001 - reported in-stream
            if self.on_error is not None:
                self.on_error()
            err = engine_error(e, self.request_id)
            yield sse.event(error_body(err.status, err.message, err.type))
        yield sse.DONE


def sse_stream(events: AsyncIterator[str]) -> SSEStream:
    return SSEStream(events)


class EventStream(StreamingResponse):
    """SSE response that always runs `on_close` (aborting the engine requests), even when the
    client disconnects before the body iterator has started."""

    def __init__(self, content: SSEStream, on_close: Callable[[], None],
                 headers: dict[str, str] | None = None):
        super().__init__(content, media_type=sse.MEDIA_TYPE,
                         headers={**sse.HEADERS, **(headers or {})})
        self._on_close = on_close
        if isinstance(content, SSEStream):
            content.on_error = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if isinstance(self.body_iterator, SSEStream):
            self.body_iterator.request_id = request_id_of(scope)
        try:
            await super().__call__(scope, receive, send)
        except (ClientDisconnect, OSError):
            pass  # the client went away mid-stream: abort (below) and stay quiet
        finally:
            self._on_close()


async def respond_json(request: Request, collect: Any, on_done: Callable[[], None],
                       headers: dict[str, str] | None = None) -> Response:
    """Await a non-streaming handler's result as JSON; a client that goes away gets its
    requests aborted (499), an engine failure becomes its API error. `on_done` always runs."""
    try:
        resp = await run_unless_disconnected(request, collect)
    except Disconnected:
        return Response(status_code=499)
    except APIError:
        raise
    except Exception as e:  # noqa: BLE001
        raise engine_error(e, request_id_of(request.scope)) from None
    finally:
        on_done()
    return JSONResponse(resp.model_dump(), headers=headers)
