"""Rendering a conversation with the model's chat template (Jinja, as transformers does), tools
and tool-call history included.

A template that knows tools (its source names `tools`) gets them as transformers passes them
(`tools=[{"type": "function", "function": {...}}]`), and assistant turns' `tool_calls` with
their arguments as objects. A template without a tools section (the default model's) cannot
show them, so they are written into the conversation the way such models are prompted for
tool use: a system-prompt block that lists the functions and the call format (the tool
parser's, e.g. Hermes `<tool_call>` tags), earlier calls as the model writes them, and tool
results as user turns in the format's wrapper.
"""

from __future__ import annotations

import json
import re
from typing import Any

from jaxserve.server.errors import APIError
from jaxserve.server.protocol import ChatMessage
from jaxserve.server.tool_parsers import DEFAULT_FORMAT, FunctionCallText, ToolParser, get_tool_parser

UNTRUSTED_TEMPLATE = ("a chat template was sent with the request, but this server does not render "
                      "client-supplied chat templates; start it with --trust-request-chat-template to allow them.")
_TOOLS = re.compile(r"\btools\b")


def template_source(tokenizer: Any, chat_template: str | None, with_tools: bool) -> str:
    """The template that will render (a request's, else the tokenizer's; its tool_use variant
    when there are tools and the tokenizer has named templates)."""
    if chat_template is not None:
        return chat_template
    hf = getattr(tokenizer, "hf_tokenizer", None)
    source = getattr(hf, "chat_template", None)
    if isinstance(source, dict):
        return source.get("tool_use" if with_tools and "tool_use" in source else "default") or ""
    return source or ""


def knows_tools(source: str) -> bool:
    return bool(_TOOLS.search(source))


def _arguments(call: Any) -> Any:
    try:
        return json.loads(call.function.arguments)
    except (json.JSONDecodeError, TypeError):
        return call.function.arguments


def conversation(messages: list[ChatMessage], tools: list[dict[str, Any]] | None, *,
                 template_knows_tools: bool, fmt: ToolParser) -> list[dict[str, Any]]:
    """The messages as the template takes them."""
    if template_knows_tools:
        out = []
        for m in messages:
            d: dict[str, Any] = {"role": m.role, "content": m.text()}
            if m.name:
                d["name"] = m.name
            if m.tool_calls:
                d["tool_calls"] = [{"id": c.id, "type": "function",
                                    "function": {"name": c.function.name, "arguments": _arguments(c)}}
                                   for c in m.tool_calls]
            if m.tool_call_id is not None:
                d["tool_call_id"] = m.tool_call_id
            out.append(d)
        return out
    out = []
    for m in messages:
        if m.role == "tool":
            role, text = fmt.render_tool_result(m.text())
            if out and out[-1].get("_tool_results"):
                out[-1]["content"] += "\n" + text  # answers to one turn's calls share a turn
            else:
                out.append({"role": role, "content": text, "_tool_results": True})
            continue
        text = m.text()
        if m.tool_calls:
            calls = fmt.render_calls([FunctionCallText(c.function.name, c.function.arguments) for c in m.tool_calls])
            text = f"{text}\n{calls}" if text else calls
        d = {"role": m.role, "content": text}
        if m.name:
            d["name"] = m.name
        out.append(d)
    for d in out:
        d.pop("_tool_results", None)
    if tools:
        block = fmt.system_prompt(tools)
        if out and out[0]["role"] == "system":
            out[0]["content"] = f"{out[0]['content']}\n\n{block}" if out[0]["content"] else block
        else:
            out.insert(0, {"role": "system", "content": block})
    return out


def render_chat(tokenizer: Any, messages: list[ChatMessage], *, add_generation_prompt: bool = True,
                continue_final_message: bool = False, chat_template: str | None = None,
                chat_template_kwargs: dict[str, Any] | None = None, trust_chat_template: bool = False,
                tools: list[dict[str, Any]] | None = None, tool_format: str | None = None,
                default_template: str | None = None) -> str:
    """The prompt text of a conversation; ValueError for anything the template cannot take.

    A template from the request (`chat_template`, or the same key in `chat_template_kwargs`)
    is Jinja code: it is refused (APIError 400) unless `trust_chat_template`, and rendered in
    transformers' sandboxed environment either way. `tool_format` names the tool parser whose
    format shows tools to a template without a tools section (default: Hermes).
    `default_template` (the operator's --chat-template) replaces the model's."""
    kwargs = dict(chat_template_kwargs or {})
    if chat_template is not None:
        kwargs["chat_template"] = chat_template
    if kwargs.get("chat_template") is not None and not trust_chat_template:
        raise APIError(400, UNTRUSTED_TEMPLATE, param="chat_template")
    if kwargs.get("chat_template") is None and default_template is not None:
        kwargs["chat_template"] = default_template
    kwargs.pop("tools", None)  # tools come from the request's own field
    source = template_source(tokenizer, kwargs.get("chat_template"), bool(tools))
    knows = knows_tools(source)
    has_history = any(m.tool_calls or m.role == "tool" for m in messages)
    conv = conversation(messages, tools, template_knows_tools=knows or not (tools or has_history),
                        fmt=get_tool_parser(tool_format or DEFAULT_FORMAT))
    if tools and knows:
        kwargs["tools"] = tools
    if continue_final_message:
        kwargs["continue_final_message"] = True
    try:
        return tokenizer.apply_chat_template(conv, add_generation_prompt=add_generation_prompt, **kwargs)
    except ValueError:
        raise
    except Exception as e:  # noqa: BLE001 - template errors are the user's (jinja, bad roles)
        raise ValueError(f"the chat template could not be applied to these messages: {e}") from None
