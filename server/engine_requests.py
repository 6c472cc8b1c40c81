"""An HTTP request's engine requests: adding them (one per prompt, in one command), merging
their output queues as outputs arrive within the request's deadline (--request-timeout),
aborting them, and the API error for whatever fails meanwhile."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator, Callable
from typing import Any

from jaxserve.engine.client import (
    EngineClient,
    EngineDeadError,
    EngineOverloadedError,
    EngineShutdownError,
    EngineSleepingError,
    OutputKind,
    RequestStream,
)
from jaxserve.outputs import RequestOutput
from jaxserve.sampling_params import SamplingParams
from jaxserve.server.errors import APIError, internal_error


class RequestTimeoutError(Exception):
    """The request passed its deadline (--request-timeout); it is aborted."""


@dataclasses.dataclass(frozen=True, slots=True)
class Deadline:
    at: float  # on the event loop's clock (loop.time())
    seconds: float  # the server's request timeout

    def remaining(self) -> float:
        return self.at - asyncio.get_running_loop().time()

    def error(self) -> RequestTimeoutError:
        return RequestTimeoutError(
            f"the request did not finish within the server's request timeout of {self.seconds:g} s "
            "and was aborted; ask for fewer tokens, or retry when the server is less busy.")


def engine_error(e: BaseException, request_id: str | None = None) -> APIError:
    """The API error for a failure while serving a request: the engine's ValueErrors are the
    user's (400), a full queue or a shutting-down engine is a 503, a request past its deadline
    a 504; anything else is a 500 that names the request id (the exception goes to the log,
    not to the client)."""
    if isinstance(e, APIError):
        return e
    if isinstance(e, ValueError):
        return APIError(400, str(e), param=getattr(e, "param", None))
    if isinstance(e, EngineOverloadedError):
        return APIError(503, str(e), headers={"Retry-After": str(e.retry_after)})
    if isinstance(e, (EngineShutdownError, EngineSleepingError)):
        return APIError(503, str(e))
    if isinstance(e, RequestTimeoutError):
        return APIError(504, str(e))
    return internal_error(e, request_id)


async def add_all(engine: EngineClient, request_ids: list[str], prompts: Any,
                  params: SamplingParams, priority: int, arrival_time: float,
                  add_special_tokens: bool = True, cache_salt: str | None = None, *,
                  stream: bool, lora_request=None) -> list[RequestStream]:
    """Add one engine request per prompt, all in one command (they can share the next step);
    `prompts` may be a function making them (run in the engine's worker thread, with the
    tokenizing). A stream gets each step's new tokens (DELTA outputs), a plain response its
    final output alone. Bad input raises the 400 before anything is queued, a full queue the 503."""
    try:
        kind = OutputKind.DELTA if stream else OutputKind.FINAL_ONLY
        return await engine.add_requests(request_ids, prompts, params, priority=priority,
                                         arrival_time=arrival_time,
                                         add_special_tokens=add_special_tokens,
                                         cache_salt=cache_salt, lora_request=lora_request,
                                         output_kind=kind)
    except (ValueError, EngineOverloadedError, EngineShutdownError, EngineSleepingError) as e:
        raise engine_error(e) from None
    except EngineDeadError:
        raise APIError(503, "the engine has failed and the server is shutting down; retry once it "
                            "has restarted.") from None
    # anything else: a 500, made (with the request id) by RequestContextMiddleware


async def _get(queue: asyncio.Queue, deadline: Deadline | None) -> Any:
    if deadline is None:
        return await queue.get()
    remaining = deadline.remaining()
    if remaining <= 0:
        raise deadline.error()
    try:
        async with asyncio.timeout(remaining):
            return await queue.get()
    except TimeoutError:
        raise deadline.error() from None


async def merge(queues: list[asyncio.Queue], deadline: Deadline | None = None
                ) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(prompt index, output) as they arrive, until every request has finished; an exception
    put in a queue is raised, and RequestTimeoutError once `deadline` has passed (the caller
    aborts the requests)."""
    if len(queues) == 1:
        while True:
            out = await _get(queues[0], deadline)
            if isinstance(out, BaseException):
                raise out
            yield 0, out
            if out.finished:
                return
    getters = {i: asyncio.ensure_future(q.get()) for i, q in enumerate(queues)}
    try:
        while getters:
            timeout = None
            if deadline is not None and (timeout := deadline.remaining()) <= 0:
                raise deadline.error()
            done, _ = await asyncio.wait(getters.values(), timeout=timeout,
                                         return_when=asyncio.FIRST_COMPLETED)
            if not done:
                raise deadline.error()
            for i in sorted(i for i, t in getters.items() if t in done):
                out = getters.pop(i).result()
                if isinstance(out, BaseException):
                    raise out
                yield i, out
                if not out.finished:
                    getters[i] = asyncio.ensure_future(queues[i].get())
    finally:
        for t in getters.values():
            t.cancel()


def abort_all(engine: EngineClient, request_ids: list[str]) -> Callable[[], None]:
    """A function that aborts the engine requests (a response's `on_close` / `on_done`)."""
    def close() -> None:
        for rid in request_ids:
            engine.abort(rid)
    return close
