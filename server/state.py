"""ServerState: what every handler reads, built once by build_app from the engine and the
ServerConfig: the served model names (and the LoRA adapters offered beside them), the body
limit, the tool-call and reasoning parsers, the metrics, and each request's deadline; and the
routes of handlers that take it (`route`)."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Awaitable, Callable

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from jaxserve.chat.tool_parsers import get_tool_parser
from jaxserve.engine.client import EngineClient
from jaxserve.reasoning import get_reasoning_parser
from jaxserve.server.body import default_max_body_bytes
from jaxserve.server.config import ServerConfig
from jaxserve.server.engine_requests import Deadline
from jaxserve.server.errors import APIError, quote
from jaxserve.server.lora import LoRARegistry
from jaxserve.server.metrics import ServerMetrics


class ServerState:
    """The engine, the front end's options (`config`, read where they are used) and what is
    resolved from them once."""

    def __init__(self, engine: EngineClient, config: ServerConfig):
        self.engine = engine
        self.config = config
        # The names clients use for the model (the first is reported); default: the engine's.
        self.served_model_names = list(config.served_model_name or ()) or [engine.model_name]
        self.max_body_bytes = (config.max_request_body if config.max_request_body is not None
                               else default_max_body_bytes(engine.max_model_len))
        # The parser of the model's tool-call format (also how tools are shown to a template
        # without a tools section); auto tool choice needs it and enable_auto_tool_choice.
        parser = config.tool_call_parser
        self.tool_parser = get_tool_parser(parser) if parser else None
        # The model's reasoning format (--reasoning-parser, an engine option the engine's ModelInfo
        # carries): chat completions and responses split each output into reasoning and content
        # with it. None: the reasoning (if any) stays in the content.
        name = engine.info.reasoning_parser
        self.reasoning_parser = get_reasoning_parser(name)(engine.tokenizer) if name else None
        needs = self.tool_parser.reasoning_parser if self.tool_parser is not None else None
        if needs is not None and not isinstance(self.reasoning_parser, get_reasoning_parser(needs)):
            raise ValueError(f"--tool-call-parser {parser} reads the calls the reasoning parser "
                             f"{needs!r} finds: start the server with --reasoning-parser {needs} "
                             "too.")
        self.loras = LoRARegistry(engine)  # the LoRA adapters offered as models
        for entry in config.lora_modules or ():
            lora_name, sep, path = entry.partition("=")
            if not sep or not lora_name or not path:
                raise ValueError(f"--lora-modules takes NAME=PATH entries, got {entry!r}")
            self.loras.add(lora_name, path)  # ValueError: the server does not start
        self.metrics = ServerMetrics(self.model_name, engine.max_model_len)

    def route(self, path: str, handler: Callable[[ServerState, Request], Awaitable[Response]],
              methods: list[str]) -> Route:
        """The route of `handler(state, request)` over this state (the route modules' handlers)."""
        return Route(path, functools.partial(handler, self), methods=methods, name=handler.__name__)

    def deadline(self) -> Deadline | None:
        """The deadline of a request arriving now (--request-timeout; None: no deadline)."""
        timeout = self.config.request_timeout
        if timeout is None:
            return None
        return Deadline(asyncio.get_running_loop().time() + timeout, timeout)

    @property
    def model_name(self) -> str:
        return self.served_model_names[0]

    def resolve_model(self, name: str | None) -> str:
        if name is None or name == "":
            return self.model_name
        if name not in self.served_model_names and name not in self.loras.adapters:
            raise APIError(404, f"The model {quote(name)} does not exist; available: "
                                f"{', '.join([*self.served_model_names, *self.loras.adapters])}.",
                           param="model")
        return name
