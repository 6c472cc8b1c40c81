"""OpenAI's error envelope: {"error": {"message", "type", "param", "code"}}."""

from __future__ import annotations

from http import HTTPStatus

from pydantic import ValidationError
from starlette.responses import JSONResponse

_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError",
          405: "MethodNotAllowed", 413: "BadRequestError", 500: "InternalServerError",
          503: "ServiceUnavailableError"}


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, type_: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.type = type_ or _TYPES.get(status) or HTTPStatus(status).phrase.replace(" ", "")


def error_body(status: int, message: str, type_: str | None = None, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_ or _TYPES.get(status, "Error"),
                      "param": param, "code": status}}


def error_response(status: int, message: str, type_: str | None = None, param: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, type_, param), status_code=status, headers=headers)


def from_api_error(e: APIError) -> JSONResponse:
    return error_response(e.status, e.message, e.type, e.param)


def validation_message(e: ValidationError) -> tuple[str, str | None]:
    """A readable one-line summary of a pydantic error, and the first offending field."""
    parts, param = [], None
    for err in e.errors()[:5]:
        loc = ".".join(str(x) for x in err.get("loc", ()))
        if param is None and err.get("loc"):
            param = str(err["loc"][0])
        msg = err.get("msg", "invalid value")
        parts.append(f"{loc}: {msg}" if loc else msg)
    return "; ".join(parts) or "invalid request", param
