"""Request bodies: the size limit, JSON parsing and pydantic validation, with every failure a 4xx.

Python's JSON parser accepts more than a server should pass on: nesting deep enough to exhaust
the interpreter's recursion limit (RecursionError), integers beyond Python's 4300-digit
conversion limit (ValueError) and lone UTF-16 surrogates ("\\ud800", which no UTF-8 text can hold
and the fast tokenizer refuses with a TypeError). `read_json` turns all of these into 400s here,
where they arise, so nothing further in can meet them. Non-finite numbers (NaN, Infinity) are
the protocol models' to refuse (`allow_inf_nan=False`), field by field.
"""

from __future__ import annotations

import json
import re
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError
from starlette.requests import ClientDisconnect, Request

from jaxserve.server.errors import APIError, Disconnected, validation_message

M = TypeVar("M", bound=BaseModel)

# Deepest nesting a body may have; OpenAI-style requests need about five levels (messages →
# message → content parts → part), chat_template_kwargs and ignored extras (tool schemas) more.
MAX_JSON_DEPTH = 64
# The default body limit: room for the fields, plus this much per token of context. A token is
# about 4 characters of text (up to ~6x that once JSON-escaped) or one id of at most 6 digits in
# a token-id prompt, so this holds several full-context prompts of either kind.
BODY_BASE_BYTES = 1 << 20
BODY_BYTES_PER_CONTEXT_TOKEN = 256

_SURROGATE = re.compile("[\ud800-\udfff]")


def default_max_body_bytes(max_model_len: int) -> int:
    """The largest request body a server with this context length accepts by default."""
    return BODY_BASE_BYTES + BODY_BYTES_PER_CONTEXT_TOKEN * max_model_len


def _too_large(max_bytes: int) -> APIError:
    return APIError(413, f"request body is larger than the {max_bytes}-byte limit.")


async def read_body(request: Request, max_bytes: int) -> bytes:
    length = request.headers.get("content-length", "")
    if length.isdigit() and (len(length) > 18 or int(length) > max_bytes):
        raise _too_large(max_bytes)
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > max_bytes:
                raise _too_large(max_bytes)
            chunks.append(chunk)
    except ClientDisconnect:
        raise Disconnected() from None
    return b"".join(chunks)


def parse_json(body: bytes) -> Any:
    """The JSON value of a request body; APIError(400) for anything a handler should not see."""
    if not body.strip():
        raise APIError(400, "the request body is empty; send a JSON object.")
    try:
        data = json.loads(body)
    except UnicodeDecodeError:
        raise APIError(400, "the request body is not valid UTF-8 text; send JSON encoded as UTF-8.") from None
    except json.JSONDecodeError as e:
        raise APIError(400, f"the request body is not valid JSON: {e}.") from None
    except RecursionError:
        raise _too_deep(None) from None
    except ValueError:  # the only other ValueError is an integer over Python's digit limit
        raise APIError(400, "the request body holds a number too long to parse (more than 4300 digits).") from None
    check_json_tree(data)
    return data


def _too_deep(field: str | None) -> APIError:
    return APIError(400, f"the request body is nested more than {MAX_JSON_DEPTH} levels deep.", param=field)


def _surrogate(field: str | None) -> APIError:
    return APIError(400, "a string in the request body holds a lone UTF-16 surrogate (such as \"\\ud800\"), "
                         "which is not valid Unicode text; send well-formed UTF-8.", param=field)


def check_json_tree(data: Any) -> None:
    """Raise APIError(400) if parsed JSON nests deeper than MAX_JSON_DEPTH or holds a string with
    a lone surrogate (in a value or a key). Iterative, so any depth is safe to walk; the
    offending top-level field is reported as `param`."""
    stack: list[tuple[Any, int, str | None]] = [(data, 1, None)]
    while stack:
        node, depth, field = stack.pop()
        if isinstance(node, str):
            if _SURROGATE.search(node):
                raise _surrogate(field)
            continue
        if depth > MAX_JSON_DEPTH:
            raise _too_deep(field)
        if isinstance(node, dict):
            for key, value in node.items():
                name = key if depth == 1 else field
                if _SURROGATE.search(key):
                    raise _surrogate(field)
                if isinstance(value, (str, dict, list)):
                    stack.append((value, depth + 1, name))
        elif isinstance(node, list):
            stack.extend((value, depth + 1, field) for value in node if isinstance(value, (str, dict, list)))


async def read_json(request: Request, max_bytes: int) -> Any:
    return parse_json(await read_body(request, max_bytes))


def validate(model: type[M], data: Any) -> M:
    """`data` (parsed JSON) as a request model; APIError(400) naming the first bad field."""
    if not isinstance(data, dict):
        raise APIError(400, "the request body must be a JSON object.")
    try:
        return model.model_validate(data)
    except ValidationError as e:
        msg, param = validation_message(e)
        raise APIError(400, msg, param=param) from None


async def parse_body(request: Request, model: type[M], max_bytes: int) -> M:
    return validate(model, await read_json(request, max_bytes))
