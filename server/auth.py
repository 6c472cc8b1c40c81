"""The API-key check (pure ASGI middleware, so streaming responses pass through untouched).

Like vLLM, every route needs the key except a short list of public ones (liveness, version,
metrics): the tokenizer routes render chat templates and cost CPU like any other. The public
paths are matched exactly, so no spelling of a path (`//`, `%2f`, `..`, case) slips past."""

from __future__ import annotations

import hmac
from collections.abc import Iterable, Sequence

from starlette.types import ASGIApp, Receive, Scope, Send

from jaxserve.server.errors import error_response

PUBLIC_PATHS = frozenset({"/health", "/ping", "/version", "/metrics"})


class APIKeyMiddleware:
    def __init__(self, app: ASGIApp, api_keys: Sequence[str], public_paths: Iterable[str] = PUBLIC_PATHS):
        self.app = app
        self.keys = [k.encode() for k in api_keys]
        self.public_paths = frozenset(public_paths)

    def _authorized(self, scope: Scope) -> bool:
        headers = dict(scope.get("headers") or [])
        auth = headers.get(b"authorization", b"")
        token = auth[7:].strip() if auth[:7].lower() == b"bearer " else headers.get(b"x-api-key", b"")
        return any(hmac.compare_digest(token, k) for k in self.keys)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (scope["type"] == "http" and self.keys and scope.get("method") != "OPTIONS"
                and scope["path"] not in self.public_paths and not self._authorized(scope)):
            resp = error_response(401, "Invalid or missing API key; send 'Authorization: Bearer <key>'.",
                                  "AuthenticationError")
            await resp(scope, receive, send)
            return
        await self.app(scope, receive, send)
