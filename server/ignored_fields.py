"""Request fields this server does not know: accepted (benchmarks and SDKs send extras), as vLLM
does, but never silently. Each unknown name is logged once per process, and the response
lists the ones its request carried in the `X-Ignored-Fields` header (nested ones by path, e.g.
`messages[].refusal`). Fields the server knows but does not implement are refused with a 400
by the protocol models instead."""

from __future__ import annotations

import logging
import threading
from typing import Any

from pydantic import BaseModel

logger = logging.getLogger(__name__)

HEADER = "X-Ignored-Fields"
MAX_NAMES = 32  # listed in the header; more are counted
MAX_NAME_CHARS = 64
MAX_LOGGED = 1024  # distinct names logged per process (a client could send endless new ones)
_logged: set[str] = set()
_lock = threading.Lock()


def _safe(name: str) -> str:
    """A client's field name as header text: printable ASCII (no commas), escapes otherwise."""
    out = "".join(c if " " <= c <= "~" and c != "," else f"\\x{ord(c):02x}" if ord(c) < 256
                  else f"\\u{ord(c):04x}" if ord(c) < 0x10000 else f"\\U{ord(c):08x}" for c in name)
    return out if len(out) <= MAX_NAME_CHARS else out[: MAX_NAME_CHARS - 3] + "..."


def collect(model: BaseModel, prefix: str = "") -> list[str]:
    """The unknown fields of a validated request model and of the models nested in it."""
    names = [prefix + k for k in (model.model_extra or {})]
    for field in type(model).model_fields:
        value = getattr(model, field, None)
        names += _nested(value, f"{prefix}{field}")
    return list(dict.fromkeys(names))


def _nested(value: Any, path: str) -> list[str]:
    if isinstance(value, BaseModel):
        return collect(value, path + ".")
    if isinstance(value, list):
        out: list[str] = []
        for item in value:
            if isinstance(item, BaseModel):
                out += collect(item, path + "[].")
        return out
    return []


def report(names: list[str], route: str) -> dict[str, str]:
    """Log the names not logged before; the response headers that list them."""
    if not names:
        return {}
    names = [_safe(n) for n in names]
    with _lock:
        new = [n for n in names if n not in _logged][: max(0, MAX_LOGGED - len(_logged))]
        _logged.update(new)
        if new and len(_logged) >= MAX_LOGGED:
            logger.warning("%d unknown field names logged; further ones are not", MAX_LOGGED)
    if new:
        logger.warning("%s: ignoring unknown request field(s) %s (logged once per name)", route, ", ".join(new))
    listed = names[:MAX_NAMES]
    if len(names) > MAX_NAMES:
        listed.append(f"(+{len(names) - MAX_NAMES} more)")
    return {HEADER: ", ".join(listed)}
