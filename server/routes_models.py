"""The models the server offers: GET /v1/models (the served names, then the LoRA adapters
with the base model as their parent) and, under --allow-runtime-lora-updating, vLLM's POST
/v1/load_lora_adapter and /v1/unload_lora_adapter. Each handler takes the ServerState (and
the listing's creation time and root) and the request."""

from __future__ import annotations

import asyncio
import functools
import pathlib
import time

from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from jaxserve.server.body import parse_body
from jaxserve.server.errors import APIError
from jaxserve.server.protocol import (
    LoadLoRAAdapterRequest,
    ModelCard,
    ModelList,
    UnloadLoRAAdapterRequest,
)
from jaxserve.server.state import ServerState


def display_name(model: str) -> str:
    """The model's name for clients: for a local path (models are local), its last component;
    the server's file layout is not the clients' business."""
    path = pathlib.Path(model)
    return path.resolve().name if path.exists() else model


async def list_models(state: ServerState, created: int, root: str, request: Request) -> Response:
    names, max_model_len = state.served_model_names, state.engine.max_model_len
    data = [ModelCard(id=n, created=created, root=root, max_model_len=max_model_len) for n in names]
    data += [ModelCard(id=n, created=created, root=lora.lora_path, parent=names[0],
                       max_model_len=max_model_len)
             for n, lora in state.loras.adapters.items()]
    return JSONResponse(ModelList(data=data).model_dump())


async def load_lora_adapter(state: ServerState, request: Request) -> Response:
    body = await parse_body(request, LoadLoRAAdapterRequest, state.max_body_bytes)
    if not body.lora_name or not body.lora_path:
        raise APIError(400, "Both 'lora_name' and 'lora_path' must be provided.")
    try:
        await asyncio.to_thread(state.loras.add, body.lora_name, body.lora_path)
    except ValueError as e:
        raise APIError(400, str(e)) from None
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")


async def unload_lora_adapter(state: ServerState, request: Request) -> Response:
    body = await parse_body(request, UnloadLoRAAdapterRequest, state.max_body_bytes)
    if not body.lora_name:
        raise APIError(400, "'lora_name' needs to be provided to unload a LoRA adapter.")
    if not state.loras.remove(body.lora_name):
        raise APIError(404, f"The lora adapter '{body.lora_name}' cannot be found.")
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")


def routes(state: ServerState) -> list[Route]:
    """The model routes over `state`; the listing's creation time is the app's."""
    created, root = int(time.time()), display_name(state.engine.model_name)
    listing = functools.partial(list_models, state, created, root)
    found = [Route("/v1/models", listing, methods=["GET"], name="list_models")]
    if state.config.allow_runtime_lora_updating:
        found += [state.route("/v1/load_lora_adapter", load_lora_adapter, ["POST"]),
                  state.route("/v1/unload_lora_adapter", unload_lora_adapter, ["POST"])]
    return found
