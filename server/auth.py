"""API-key check for /v1/* (pure ASGI middleware, so streaming responses pass through untouched)."""

from __future__ import annotations

import hmac
from collections.abc import Sequence

from starlette.types import ASGIApp, Receive, Scope, Send

from jaxserve.server.errors import error_response


class APIKeyMiddleware:
    def __init__(self, app: ASGIApp, api_keys: Sequence[str], prefix: str = "/v1"):
        self.app = app
        self.keys = [k.encode() for k in api_keys]
        self.prefix = prefix

    def _authorized(self, scope: Scope) -> bool:
        headers = dict(scope.get("headers") or [])
        auth = headers.get(b"authorization", b"")
        token = auth[7:].strip() if auth[:7].lower() == b"bearer " else headers.get(b"x-api-key", b"")
        return any(hmac.compare_digest(token, k) for k in self.keys)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (scope["type"] == "http" and self.keys and scope.get("method") != "OPTIONS"
                and (scope["path"] == self.prefix or scope["path"].startswith(self.prefix + "/"))
                and not self._authorized(scope)):
            resp = error_response(401, "Invalid or missing API key; send 'Authorization: Bearer <key>'.",
                                  "AuthenticationError")
            await resp(scope, receive, send)
            return
        await self.app(scope, receive, send)
