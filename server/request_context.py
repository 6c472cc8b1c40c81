"""Every HTTP request gets an id (the client's X-Request-Id, or a fresh one), echoed in the
response header; an exception that nothing handled becomes a 500 in the error envelope naming
that id, and goes to the log. Pure ASGI, so streaming responses pass through untouched."""

from __future__ import annotations

import uuid

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from jaxserve.server.errors import from_api_error, internal_error

REQUEST_ID_KEY = "request_id"  # in the scope's state (request.state.request_id)


def request_id_of(scope: Scope) -> str | None:
    """The id RequestContextMiddleware gave this request."""
    return (scope.get("state") or {}).get(REQUEST_ID_KEY)


class RequestContextMiddleware:
    def __init__(self, app: ASGIApp, send_header: bool = True):
        self.app = app
        self.send_header = send_header

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        raw = dict(scope.get("headers") or []).get(b"x-request-id") or uuid.uuid4().hex.encode()
        rid = raw.decode("latin-1")
        scope = {**scope, "state": {**(scope.get("state") or {}), REQUEST_ID_KEY: rid}}
        started = False

        async def send_with_id(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                if self.send_header:
                    message = {**message, "headers": [*message.get("headers", []), (b"x-request-id", raw)]}
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        except Exception as e:  # noqa: BLE001 - the last resort: logged, answered, never re-raised
            err = internal_error(e, rid)
            if not started:  # once a response has begun, ending it is all that is left to do
                await from_api_error(err)(scope, receive, send_with_id)
