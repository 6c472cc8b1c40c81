"""The playground: a chat page at `/` over the public API (static files, package data).

The page and its two files are public (they hold nothing of the server's; with `--api-key` the
page asks for the key and sends it on /v1 calls, which stay protected). Files are read from the
package once, at app construction, and served from memory with their content type.
"""

from __future__ import annotations

from importlib import resources

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

# path -> (file in server/static, content type)
_FILES = {
    "/": ("index.html", "text/html; charset=utf-8"),
    "/playground/playground.js": ("playground.js", "text/javascript; charset=utf-8"),
    "/playground/playground.css": ("playground.css", "text/css; charset=utf-8"),
}
PUBLIC_PATHS = frozenset(_FILES)


def playground_routes() -> list[Route]:
    static = resources.files("jaxserve.server") / "static"
    routes = []
    for path, (name, media_type) in _FILES.items():
        body = (static / name).read_bytes()

        async def serve(request: Request, body: bytes = body, media_type: str = media_type) -> Response:
            return Response(body, media_type=media_type, headers={"Cache-Control": "no-cache"})

        routes.append(Route(path, serve, methods=["GET"]))
    return routes
