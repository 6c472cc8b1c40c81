"""The server's policy on chat templates: one sent with a request (`chat_template`, or that key
in `chat_template_kwargs`) is Jinja code from a client, rendered only under
--trust-request-chat-template, else a 400. The rendering itself is jaxserve/chat/template.py's,
shared with the offline `LLM.chat`."""

from __future__ import annotations

from typing import Any

from jaxserve.chat.template import render_chat as _render
from jaxserve.server.errors import APIError

UNTRUSTED_TEMPLATE = ("a chat template was sent with the request, but this server does not render "
                      "client-supplied chat templates; start it with --trust-request-chat-template to allow them.")


def render_chat(tokenizer: Any, messages: list[Any], *, chat_template: str | None = None,
                chat_template_kwargs: dict[str, Any] | None = None, trust_chat_template: bool = False,
                **options: Any) -> str:
    """The prompt text of a request's conversation (jaxserve.chat.template.render_chat's
    options); APIError 400 for a client's template unless `trust_chat_template`, ValueError for
    what the template cannot take."""
    sent = chat_template is not None or (chat_template_kwargs or {}).get("chat_template") is not None
    if sent and not trust_chat_template:
        raise APIError(400, UNTRUSTED_TEMPLATE, param="chat_template")
    return _render(tokenizer, messages, chat_template=chat_template, chat_template_kwargs=chat_template_kwargs,
                   **options)
