"""The operator's routes: liveness (/health, and vLLM's /ping), /version, /metrics (Prometheus
text), POST /reset_prefix_cache, and under --enable-sleep-mode POST /sleep, POST /wake_up and
GET /is_sleeping. Each handler takes the ServerState and the request."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

import jaxserve
from jaxserve.server.errors import APIError, error_response
from jaxserve.server.metrics import CONTENT_TYPE
from jaxserve.server.state import ServerState


async def health(state: ServerState, request: Request) -> Response:
    """200 while the engine runs; else 503, naming what failed only where that is public (a
    lost host), never anything internal."""
    engine = state.engine
    if engine.is_alive:
        return Response(status_code=200)
    reason = engine.error
    if getattr(reason, "public", False):
        return error_response(503, f"the engine is not running: {reason}")
    return error_response(503, "the engine is not running; the server log has the details.")


async def version(state: ServerState, request: Request) -> Response:
    return JSONResponse({"version": jaxserve.__version__})


async def metrics(state: ServerState, request: Request) -> Response:
    return Response(state.metrics.render(), media_type=CONTENT_TYPE)


async def reset_prefix_cache(state: ServerState, request: Request) -> Response:
    if not await state.engine.call("reset_prefix_cache"):
        raise APIError(409, "the prefix cache cannot be reset while requests hold blocks; retry "
                            "when idle.")
    return Response(status_code=200)


async def sleep(state: ServerState, request: Request) -> Response:
    """Level 1 only: the weights kept on the host, the KV cache dropped (409 while busy)."""
    level = request.query_params.get("level", "1")
    if level != "1":
        raise APIError(400, f"sleep level {level!r} is not supported; use 1 (weights kept on the "
                            "host, KV cache dropped).", param="level")
    try:
        await state.engine.call("sleep")
    except RuntimeError as e:
        raise APIError(409, str(e)) from None
    return Response(status_code=200)


async def wake_up(state: ServerState, request: Request) -> Response:
    await state.engine.call("wake_up")
    return Response(status_code=200)


async def is_sleeping(state: ServerState, request: Request) -> Response:
    return JSONResponse({"is_sleeping": (await state.engine.call("stats")).is_sleeping})


def routes(state: ServerState) -> list[Route]:
    """The operator's routes over `state` (the sleep routes only under --enable-sleep-mode)."""
    route = state.route
    found = [
        route("/health", health, ["GET"]),
        route("/ping", health, ["GET", "POST"]),  # vLLM's (SageMaker's) liveness route
        route("/version", version, ["GET"]),
        route("/metrics", metrics, ["GET"]),
        route("/reset_prefix_cache", reset_prefix_cache, ["POST"]),
    ]
    if state.config.enable_sleep_mode:
        found += [route("/sleep", sleep, ["POST"]), route("/wake_up", wake_up, ["POST"]),
                  route("/is_sleeping", is_sleeping, ["GET"])]
    return found
