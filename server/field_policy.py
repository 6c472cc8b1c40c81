"""What happens to request fields the server does not act on; nothing is dropped silently.

- Unknown fields are accepted (benchmarks and SDKs send extras), as vLLM does: each unknown name
  is logged once per process, and the response lists the ones its request carried in the
  `X-Ignored-Fields` header (nested ones by path, e.g. `messages[].refusal`).
- Fields of vLLM's or OpenAI's requests that this server knows but does not implement
  (`UNIMPLEMENTED`, `CHAT_UNIMPLEMENTED`) are a 400 naming them when set to anything but their
  neutral value; the protocol models call `refuse_unimplemented` while validating.
"""

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


# Fields of vLLM's or OpenAI's requests that this server knows but does not implement: a 400
# when set to anything but their neutral value (field -> (is it neutral?, why)).
UNIMPLEMENTED: dict[str, tuple[Any, str]] = {
    "logits_processors": (lambda v: not v, "custom logits processors are not supported"),
    "return_tokens_as_token_ids": (lambda v: not v, "return_tokens_as_token_ids is not supported"),
    "prompt_embeds": (lambda v: v is None, "prompt embeddings are not supported"),
    "kv_transfer_params": (lambda v: v is None, "KV transfer (disaggregated serving) is not supported"),
    "vllm_xargs": (lambda v: not v, "vllm_xargs (custom extension arguments) are not supported"),
    "store": (lambda v: not v, "store is not supported: responses are not stored"),
}
CHAT_UNIMPLEMENTED: dict[str, tuple[Any, str]] = {
    "functions": (lambda v: v is None, "'functions' is deprecated by OpenAI and not supported; send 'tools'"),
    "function_call": (lambda v: v is None, "'function_call' is deprecated by OpenAI and not supported; send "
                                           "'tool_choice'"),
    "audio": (lambda v: v is None, "audio output is not supported"),
    "modalities": (lambda v: v is None or list(v) == ["text"], "only the 'text' modality is supported"),
    "prediction": (lambda v: v is None, "predicted outputs are not supported"),
    "web_search_options": (lambda v: v is None, "web search is not supported"),
    "documents": (lambda v: v is None, "documents (RAG templates) are not supported"),
    "mm_processor_kwargs": (lambda v: v is None, "multimodal inputs are not supported"),
}


def refuse_unimplemented(model: BaseModel, table: dict[str, tuple[Any, str]]) -> None:
    extra = model.model_extra or {}
    for name, (neutral, why) in table.items():
        if name in extra and not neutral(extra[name]):
            raise ValueError(f"{name}: {why}; remove the field.")
