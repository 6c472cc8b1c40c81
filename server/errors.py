"""OpenAI's error envelope: {"error": {"message", "type", "param", "code"}}, and the app's
answers to the exceptions a handler raises (`EXCEPTION_HANDLERS`)."""

from __future__ import annotations

import logging
from http import HTTPStatus

from pydantic import ValidationError
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

logger = logging.getLogger(__name__)

_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError",
          405: "MethodNotAllowed", 413: "BadRequestError", 500: "InternalServerError",
          503: "ServiceUnavailableError", 504: "TimeoutError"}
# how much of a client-supplied value an error message quotes
QUOTE_CHARS = 100


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, type_: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.type = type_ or _TYPES.get(status) or HTTPStatus(status).phrase.replace(" ", "")
        self.headers = headers  # sent with the error response (e.g. Retry-After)


class Disconnected(Exception):
    """The client went away before the response was ready."""


def quote(value: object) -> str:
    """`value` for an error message: repr'd, cut to QUOTE_CHARS characters."""
    text = repr(value)
    return text if len(text) <= QUOTE_CHARS else text[: QUOTE_CHARS - 3] + "..."


def _printable(text: str | None) -> str | None:
    """Text that encodes as UTF-8: lone surrogates (which a JSON body may carry, as in
    "\\ud800") are written out as backslash escapes rather than failing the response."""
    return None if text is None else text.encode("utf-8", "backslashreplace").decode("utf-8")


def error_body(status: int, message: str, type_: str | None = None, param: str | None = None) -> dict:
    return {"error": {"message": _printable(message), "type": type_ or _TYPES.get(status, "Error"),
                      "param": _printable(param), "code": status}}


def error_response(status: int, message: str, type_: str | None = None, param: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, type_, param), status_code=status, headers=headers)


def from_api_error(e: APIError) -> JSONResponse:
    return error_response(e.status, e.message, e.type, e.param, headers=e.headers)


def internal_error(e: BaseException, request_id: str | None) -> APIError:
    """A 500 for an unexpected failure: the details go to the log under the request id, and the
    client gets the id, never the exception text."""
    logger.error("request %s failed", request_id or "(no id)", exc_info=e)
    where = f" (request id {request_id})" if request_id else ""
    return APIError(500, f"internal server error{where}; the server log has the details.",
                    type_="InternalServerError")


def validation_message(e: ValidationError) -> tuple[str, str | None]:
    """A readable one-line summary of a pydantic error, and the first offending field."""
    parts, param = [], None
    for err in e.errors()[:5]:
        loc = ".".join(str(x)[:QUOTE_CHARS] for x in err.get("loc", ()))
        if param is None and err.get("loc"):
            param = str(err["loc"][0])
        msg = err.get("msg", "invalid value")
        msg = msg.removeprefix("Value error, ")  # pydantic's prefix for our validators' messages
        parts.append(f"{loc}: {msg}" if loc else msg)
    return "; ".join(parts) or "invalid request", param


async def _on_api_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, APIError)
    return from_api_error(exc)


async def _on_http_error(request: Request, exc: Exception) -> Response:
    """Starlette's own errors (an unknown route, a method not allowed) in the envelope."""
    assert isinstance(exc, HTTPException)
    return error_response(exc.status_code, str(exc.detail), headers=getattr(exc, "headers", None))


async def _on_disconnect(request: Request, exc: Exception) -> Response:
    return Response(status_code=499)  # nobody reads it: the client has gone


# The app's exception handlers (Starlette's `exception_handlers`).
EXCEPTION_HANDLERS = {APIError: _on_api_error, HTTPException: _on_http_error,
                      Disconnected: _on_disconnect}
