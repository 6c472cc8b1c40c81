"""build_app: the Starlette application of the OpenAI-compatible server, assembled from the
ServerConfig: middleware, the routes (the generation handlers and the route modules) and the
lifespan that starts and drains the engine."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.routing import Route

from jaxserve.engine.client import EngineClient
from jaxserve.server import routes_admin, routes_models, routes_tokens
from jaxserve.server.auth import PUBLIC_PATHS, APIKeyMiddleware
from jaxserve.server.config import ServerConfig
from jaxserve.server.errors import EXCEPTION_HANDLERS
from jaxserve.server.playground import PUBLIC_PATHS as PLAYGROUND_PATHS
from jaxserve.server.playground import playground_routes
from jaxserve.server.request_context import RequestContextMiddleware
from jaxserve.server.serving_chat import ChatHandler
from jaxserve.server.serving_completions import CompletionsHandler
from jaxserve.server.serving_embeddings import EmbeddingsHandler
from jaxserve.server.serving_responses import ResponsesHandler
from jaxserve.server.state import ServerState


def build_app(engine: EngineClient, config: ServerConfig) -> Starlette:
    """The app over `engine` (an EngineClient, started by the app's lifespan and drained for
    `config.shutdown_grace` seconds at its end), with the front end's options of `config`
    (server/config.py: the `jaxserve serve` server flags, each documented there). ValueError
    where the engine cannot take them (a LoRA adapter it cannot serve)."""
    state = ServerState(engine, config)
    engine.listener = state.metrics
    state.metrics.attach(engine)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        engine.start()
        try:
            yield
        finally:
            await engine.drain(config.shutdown_grace)
            engine.shutdown()

    app = Starlette(routes=_routes(state), middleware=_middleware(config), lifespan=lifespan,
                    exception_handlers=EXCEPTION_HANDLERS)
    app.state.server = state  # for what runs the app (tests, benchmarks): the state, the engine
    app.state.engine = engine
    return app


def _middleware(config: ServerConfig) -> list[Middleware]:
    """Outermost first: every response (a 401 too) carries the request id."""
    send_id = not config.disable_request_id_header
    middleware = [Middleware(RequestContextMiddleware, send_header=send_id)]
    if config.allowed_origins:
        middleware.append(Middleware(CORSMiddleware, allow_origins=list(config.allowed_origins),
                                     allow_methods=["*"], allow_headers=["*"],
                                     allow_credentials=True))
    if config.api_key:
        middleware.append(Middleware(APIKeyMiddleware, api_keys=list(config.api_key),
                                     public_paths=PUBLIC_PATHS | PLAYGROUND_PATHS))
    return middleware


def _routes(state: ServerState) -> list[Route]:
    completions, chat = CompletionsHandler(state), ChatHandler(state)
    embeddings, responses = EmbeddingsHandler(state), ResponsesHandler(state)
    return [
        *routes_admin.routes(state),
        *routes_models.routes(state),
        Route("/v1/completions", completions.handle, methods=["POST"]),
        Route("/v1/chat/completions", chat.handle, methods=["POST"]),
        Route("/v1/embeddings", embeddings.handle, methods=["POST"]),
        Route("/v1/responses", responses.create, methods=["POST"]),
        Route("/v1/responses/{response_id}", responses.retrieve, methods=["GET"]),
        Route("/v1/responses/{response_id}/cancel", responses.cancel, methods=["POST"]),
        *routes_tokens.routes(state),
        *playground_routes(),  # the chat page at /: public, its API calls carry the key
    ]
