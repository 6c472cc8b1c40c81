"""POST /v1/embeddings: the embeddings of a model served with --runner pooling.

The engine client validates and tokenizes the inputs and the engine core computes them
(jaxserve/engine/embedding.py, runner/pooling_runner.py); a model served for generation
answers 400 naming the flag. Bad input is a 400 in OpenAI's error envelope, never a 500.
"""

from __future__ import annotations

import asyncio
import time

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from jaxserve.engine.client import EngineDeadError
from jaxserve.server import field_policy
from jaxserve.server.body import parse_body
from jaxserve.server.engine_requests import engine_error
from jaxserve.server.errors import APIError
from jaxserve.server.protocol import UsageInfo
from jaxserve.server.protocol_embeddings import (
    EmbeddingData,
    EmbeddingRequest,
    EmbeddingResponse,
    encode,
)
from jaxserve.server.request_context import request_id_of
from jaxserve.server.state import ServerState


class EmbeddingsHandler:
    def __init__(self, state: ServerState):
        self.state = state

    async def handle(self, request: Request) -> Response:
        state = self.state
        body = await parse_body(request, EmbeddingRequest, state.max_body_bytes)
        model = state.resolve_model(body.model)
        headers = field_policy.report(body.ignored_fields, "/v1/embeddings")
        deadline = state.deadline()
        try:
            call = state.engine.embed(body.inputs(), dimensions=body.dimensions,
                                      add_special_tokens=body.add_special_tokens)
            if deadline is not None:
                call = asyncio.wait_for(call, max(deadline.remaining(), 0))
            results = await call
        except TimeoutError:
            raise engine_error(deadline.error()) from None
        except EngineDeadError:
            raise APIError(503, "the engine has failed and the server is shutting down; retry once "
                                "it has restarted.") from None
        except Exception as e:  # noqa: BLE001 - mapped to its status (engine_error)
            raise engine_error(e, request_id_of(request.scope)) from None
        tokens = sum(len(r.prompt_token_ids) for r in results)
        data = [EmbeddingData(index=i, embedding=encode(r.embedding, body.encoding_format))
                for i, r in enumerate(results)]
        response = EmbeddingResponse(created=int(time.time()), model=model, data=data,
                                     usage=UsageInfo(prompt_tokens=tokens, total_tokens=tokens))
        return JSONResponse(response.model_dump(), headers=headers)
