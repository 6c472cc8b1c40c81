"""What every generation request goes through once its body is validated: its unknown fields
reported (server/field_policy.py), the model's default sampling settings for the fields it left
unset, and one log line (unless --disable-log-requests)."""

from __future__ import annotations

import logging
from typing import Any

from pydantic import BaseModel

from jaxserve.sampling_params import SamplingParams
from jaxserve.server import field_policy
from jaxserve.server.state import ServerState

logger = logging.getLogger(__name__)


def check_request(state: ServerState, body: Any, route: str) -> dict[str, str]:
    """What every generation request goes through after validation (the engine validates the
    rest, its priority among it): its unknown fields are logged; returns the response headers
    that list them."""
    return field_policy.report(body.ignored_fields, route)


def log_request(state: ServerState, request_id: str, num_prompts: int,
                params: SamplingParams) -> None:
    """One INFO line per request unless --disable-log-requests (no prompt text: it is the
    client's data)."""
    if not state.config.disable_log_requests:
        logger.info("Received request %s: %d prompt(s), %s", request_id, num_prompts,
                    describe_params(params))


def describe_params(params: SamplingParams) -> str:
    """The sampling settings that differ from SamplingParams' defaults."""
    default = SamplingParams()
    parts = []
    for name in SamplingParams.__dataclass_fields__:
        value = getattr(params, name)
        if value != getattr(default, name):
            if name == "structured_outputs":
                value = value.kind
            elif isinstance(value, (list, dict)) and len(value) > 8:
                value = f"<{len(value)} items>"
            parts.append(f"{name}={value!r}")
    return "SamplingParams(" + ", ".join(parts) + ")"


def with_defaults(params: SamplingParams, body: BaseModel,
                  defaults: dict[str, Any]) -> SamplingParams:
    """`params` with the model's default sampling settings (generation_config.json) for the
    fields the client did not send."""
    unset = {k: v for k, v in defaults.items() if k not in body.model_fields_set}
    return params.clone(**unset) if unset else params
