"""build_app: the Starlette application of the OpenAI-compatible server."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import pathlib
import time
from collections.abc import AsyncIterator, Sequence

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

import jaxserve
from jaxserve.engine.client import EngineClient
from jaxserve.server.auth import PUBLIC_PATHS, APIKeyMiddleware
from jaxserve.server.body import Disconnected, default_max_body_bytes, parse_body
from jaxserve.server.errors import APIError, error_response, from_api_error
from jaxserve.server.metrics import CONTENT_TYPE, ServerMetrics
from jaxserve.server.playground import PUBLIC_PATHS as PLAYGROUND_PATHS
from jaxserve.server.playground import playground_routes
from jaxserve.server.protocol import (
    DetokenizeRequest,
    DetokenizeResponse,
    LoadLoRAAdapterRequest,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
    UnloadLoRAAdapterRequest,
)
from jaxserve.server.request_context import RequestContextMiddleware
from jaxserve.server.chat_template import render_chat
from jaxserve.server.protocol_tools import tool_dicts
from jaxserve.server.serving_base import ServerState
from jaxserve.server.serving_chat import ChatHandler
from jaxserve.server.serving_completions import CompletionsHandler
from jaxserve.server.serving_embeddings import EmbeddingsHandler
from jaxserve.server.serving_responses import ResponsesHandler

logger = logging.getLogger(__name__)


def display_name(model: str) -> str:
    """The model's name for clients: for a local path (models are local), its last component;
    the server's file layout is not the clients' business."""
    path = pathlib.Path(model)
    return path.resolve().name if path.exists() else model


def build_app(
    engine: EngineClient,
    *,
    served_model_names: Sequence[str] | None = None,
    api_keys: Sequence[str] | None = None,
    allowed_origins: Sequence[str] | None = None,
    max_body_bytes: int | None = None,
    request_id_header: bool = True,
    shutdown_grace_seconds: float = 30.0,
    trust_request_chat_template: bool = False,
    enable_sleep_mode: bool = False,
    request_timeout: float | None = None,
    chat_template: str | None = None,
    tool_call_parser: str | None = None,
    enable_auto_tool_choice: bool = False,
    log_requests: bool = False,
    lora_modules: Sequence[str] | None = None,
    allow_runtime_lora_updating: bool = False,
) -> Starlette:
    """The app over `engine` (an EngineClient, started by the app's lifespan).

    `api_keys` protect every route but /health, /ping, /version and /metrics. `max_body_bytes`
    None fits the limit to the context length (`default_max_body_bytes`). A chat template sent
    with a request is refused unless `trust_request_chat_template`; it is always rendered in
    transformers' sandboxed Jinja environment. `request_timeout` (seconds from arrival) aborts
    a request that has not finished by then: 504 for a plain response, an error event in a
    stream (None: no deadline). `chat_template` (the operator's, e.g. from --chat-template)
    replaces the model's. `tool_call_parser` names the model's tool-call format
    (server/tool_parsers); tool_choice "auto" also needs `enable_auto_tool_choice`.
    `log_requests`: one log line per generation request. `lora_modules`: NAME=PATH adapters
    offered as models (the engine started with LoRA on); `allow_runtime_lora_updating` adds
    POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's routes under its
    VLLM_ALLOW_RUNTIME_LORA_UPDATING)."""
    names = list(served_model_names or []) or [engine.model_name]
    if max_body_bytes is None:
        max_body_bytes = default_max_body_bytes(engine.max_model_len)
    if enable_auto_tool_choice and not tool_call_parser:
        raise ValueError("enable_auto_tool_choice needs a tool_call_parser (--tool-call-parser).")
    state = ServerState(engine, names, max_body_bytes=max_body_bytes, request_id_header=request_id_header,
                        trust_request_chat_template=trust_request_chat_template, request_timeout=request_timeout,
                        tool_call_parser=tool_call_parser, enable_auto_tool_choice=enable_auto_tool_choice,
                        log_requests=log_requests, chat_template=chat_template)
    for entry in lora_modules or ():
        name, sep, path = entry.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--lora-modules takes NAME=PATH entries, got {entry!r}")
        state.loras.add(name, path)  # ValueError: the server does not start
    metrics = ServerMetrics(names[0], engine.max_model_len)
    engine.listener = metrics
    metrics.attach(engine)
    created = int(time.time())
    root = display_name(engine.model_name)
    tokenizer = engine.tokenizer
    completions, chat = CompletionsHandler(state), ChatHandler(state)
    embeddings = EmbeddingsHandler(state)
    responses = ResponsesHandler(state)

    async def health(request: Request) -> Response:
        if engine.is_alive:
            return Response(status_code=200)
        reason = engine.error
        if getattr(reason, "public", False):  # names what failed (a lost host), nothing internal
            return error_response(503, f"the engine is not running: {reason}")
        return error_response(503, "the engine is not running; the server log has the details.")

    async def version(request: Request) -> Response:
        return JSONResponse({"version": jaxserve.__version__})

    async def models(request: Request) -> Response:
        data = [ModelCard(id=n, created=created, root=root, max_model_len=engine.max_model_len) for n in names]
        data += [ModelCard(id=n, created=created, root=lora.lora_path, parent=names[0],
                           max_model_len=engine.max_model_len)
                 for n, lora in state.loras.adapters.items()]
        return JSONResponse(ModelList(data=data).model_dump())

    async def metrics_endpoint(request: Request) -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    async def tokenize(request: Request) -> Response:
        body = await parse_body(request, TokenizeRequest, max_body_bytes)
        state.resolve_model(body.model)
        try:
            if body.messages is not None:
                text = render_chat(tokenizer, body.messages, add_generation_prompt=body.add_generation_prompt,
                                   continue_final_message=body.continue_final_message,
                                   chat_template=body.chat_template, chat_template_kwargs=body.chat_template_kwargs,
                                   trust_chat_template=trust_request_chat_template,
                                   tools=tool_dicts(body.tools) if body.tools else None,
                                   tool_format=state.tool_call_parser, default_template=state.chat_template)
                ids = tokenizer.encode(text, add_special_tokens=bool(body.add_special_tokens))
            else:
                add = True if body.add_special_tokens is None else body.add_special_tokens
                ids = tokenizer.encode(body.prompt or "", add_special_tokens=add)
        except ValueError as e:
            raise APIError(400, str(e)) from None
        strs = tokenizer.convert_ids_to_tokens(ids) if body.return_token_strs else None
        return JSONResponse(TokenizeResponse(count=len(ids), max_model_len=engine.max_model_len, tokens=ids,
                                             token_strs=strs).model_dump(exclude_none=True))

    async def detokenize(request: Request) -> Response:
        body = await parse_body(request, DetokenizeRequest, max_body_bytes)
        state.resolve_model(body.model)
        vocab = engine.info.vocab_size
        bad = [t for t in body.tokens if not 0 <= t < max(vocab, tokenizer.vocab_size)]
        if bad:
            raise APIError(400, f"token ids must be in [0, {vocab}); got {bad[:5]}.", param="tokens")
        return JSONResponse(DetokenizeResponse(prompt=tokenizer.decode(body.tokens)).model_dump())

    async def tokenizer_info(request: Request) -> Response:
        hf = tokenizer.hf_tokenizer
        info = {
            "tokenizer_class": type(hf).__name__,
            "eos_token": hf.eos_token, "bos_token": hf.bos_token, "pad_token": hf.pad_token,
            "unk_token": hf.unk_token, "eos_token_id": hf.eos_token_id, "bos_token_id": hf.bos_token_id,
            "chat_template": state.chat_template or hf.chat_template, "model_max_length": engine.max_model_len,
            "vocab_size": tokenizer.vocab_size, "add_bos_token": getattr(hf, "add_bos_token", None),
            "add_eos_token": getattr(hf, "add_eos_token", None),
        }
        return JSONResponse(info)

    async def load_lora_adapter(request: Request) -> Response:
        body = await parse_body(request, LoadLoRAAdapterRequest, max_body_bytes)
        if not body.lora_name or not body.lora_path:
            raise APIError(400, "Both 'lora_name' and 'lora_path' must be provided.")
        try:
            await asyncio.to_thread(state.loras.add, body.lora_name, body.lora_path)
        except ValueError as e:
            raise APIError(400, str(e)) from None
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")

    async def unload_lora_adapter(request: Request) -> Response:
        body = await parse_body(request, UnloadLoRAAdapterRequest, max_body_bytes)
        if not body.lora_name:
            raise APIError(400, "'lora_name' needs to be provided to unload a LoRA adapter.")
        if not state.loras.remove(body.lora_name):
            raise APIError(404, f"The lora adapter '{body.lora_name}' cannot be found.")
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")

    async def reset_prefix_cache(request: Request) -> Response:
        if not await engine.call("reset_prefix_cache"):
            raise APIError(409, "the prefix cache cannot be reset while requests hold blocks; retry when idle.")
        return Response(status_code=200)

    async def sleep(request: Request) -> Response:
        level = request.query_params.get("level", "1")
        if level != "1":
            raise APIError(400, f"sleep level {level!r} is not supported; use 1 (weights kept on the host, "
                                "KV cache dropped).", param="level")
        try:
            await engine.call("sleep")
        except RuntimeError as e:
            raise APIError(409, str(e)) from None
        return Response(status_code=200)

    async def wake_up(request: Request) -> Response:
        await engine.call("wake_up")
        return Response(status_code=200)

    async def is_sleeping(request: Request) -> Response:
        return JSONResponse({"is_sleeping": (await engine.call("stats")).is_sleeping})

    async def on_api_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, APIError)
        return from_api_error(exc)

    async def on_http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        return error_response(exc.status_code, str(exc.detail), headers=getattr(exc, "headers", None))

    async def on_disconnect(request: Request, exc: Exception) -> Response:
        return Response(status_code=499)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        engine.start()
        try:
            yield
        finally:
            await engine.drain(shutdown_grace_seconds)
            engine.shutdown()

    # outermost first: every response (a 401 too) carries the request id
    middleware = [Middleware(RequestContextMiddleware, send_header=request_id_header)]
    if allowed_origins:
        middleware.append(Middleware(CORSMiddleware, allow_origins=list(allowed_origins), allow_methods=["*"],
                                     allow_headers=["*"], allow_credentials=True))
    if api_keys:
        middleware.append(Middleware(APIKeyMiddleware, api_keys=list(api_keys),
                                     public_paths=PUBLIC_PATHS | PLAYGROUND_PATHS))
    routes = [
        Route("/health", health, methods=["GET"]),
        Route("/ping", health, methods=["GET", "POST"]),  # vLLM's (SageMaker's) liveness route
        Route("/version", version, methods=["GET"]),
        Route("/metrics", metrics_endpoint, methods=["GET"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/v1/completions", completions.handle, methods=["POST"]),
        Route("/v1/chat/completions", chat.handle, methods=["POST"]),
        Route("/v1/embeddings", embeddings.handle, methods=["POST"]),
        Route("/v1/responses", responses.create, methods=["POST"]),
        Route("/v1/responses/{response_id}", responses.retrieve, methods=["GET"]),
        Route("/v1/responses/{response_id}/cancel", responses.cancel, methods=["POST"]),
        Route("/tokenize", tokenize, methods=["POST"]),
        Route("/detokenize", detokenize, methods=["POST"]),
        Route("/tokenizer_info", tokenizer_info, methods=["GET"]),
        Route("/reset_prefix_cache", reset_prefix_cache, methods=["POST"]),
        *playground_routes(),  # the chat page at /: public, its API calls carry the key
    ]
    if allow_runtime_lora_updating:
        routes += [Route("/v1/load_lora_adapter", load_lora_adapter, methods=["POST"]),
                   Route("/v1/unload_lora_adapter", unload_lora_adapter, methods=["POST"])]
    if enable_sleep_mode:
        routes += [Route("/sleep", sleep, methods=["POST"]), Route("/wake_up", wake_up, methods=["POST"]),
                   Route("/is_sleeping", is_sleeping, methods=["GET"])]
    app = Starlette(
        routes=routes, middleware=middleware, lifespan=lifespan,
        exception_handlers={APIError: on_api_error, HTTPException: on_http_error, Disconnected: on_disconnect},
    )
    app.state.server = state
    app.state.metrics = metrics
    app.state.engine = engine
    return app
