"""Rendering a conversation with the model's chat template (Jinja, as transformers does), tools
and tool-call history included; one renderer for the offline `LLM.chat` and the server.

A template that knows tools (its source names `tools`) gets them as transformers passes them
(`tools=[{"type": "function", "function": {...}}]`), and assistant turns' `tool_calls` with
their arguments as objects. A template without a tools section (the default model's) cannot
show them, so they are written into the conversation the way such models are prompted for
tool use: a system-prompt block that lists the functions and the call format (the tool
parser's, e.g. Hermes `<tool_call>` tags), earlier calls as the model writes them, and tool
results as user turns in the format's wrapper.

The messages are read by their attributes (`role`, `content` as a string or text parts, `name`,
`tool_calls`, `tool_call_id`, `reasoning_content` / `reasoning`, `text()`): the server's
`ChatMessage` models as they are, and conversations given as dicts as `ChatTurn`s (turns.py).
Whether a template sent by a client may render at all is the server's policy, not this module's.
"""

from __future__ import annotations

import json
import re
from typing import Any

from jaxserve.chat.tool_parsers import DEFAULT_FORMAT, FunctionCallText, ToolParser, get_tool_parser

_TOOLS = re.compile(r"\btools\b")
# A template that loops over a message's content takes OpenAI's list of parts (vLLM's "openai"
# content format); any other takes the content as one string.
_LOOPS_OVER_CONTENT = re.compile(r"\bfor\s+\w+\s+in\s+\w+(?:\[\s*['\"]content['\"]\s*\]|\.content\b)")
CONTENT_FORMATS = ("auto", "string", "openai")


def resolve_content_format(source: str, requested: str) -> str:
    """"string" or "openai": the requested format, or for "auto" the one the template takes."""
    if requested not in CONTENT_FORMATS:
        raise ValueError(f"chat_template_content_format must be one of {', '.join(CONTENT_FORMATS)}; "
                         f"got {requested!r}.")
    if requested != "auto":
        return requested
    return "openai" if _LOOPS_OVER_CONTENT.search(source) else "string"


def _content(m: Any, content_format: str) -> Any:
    if content_format == "string":
        return m.text()
    m.text()  # refuses content parts other than text
    if m.content is None:
        return []
    if isinstance(m.content, str):
        return [{"type": "text", "text": m.content}]
    return [{"type": "text", "text": part.text} for part in m.content]


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


def _reasoning(m: Any) -> dict[str, str]:
    """A turn's reasoning (history) as templates read it: vLLM passes it under both its names;
    gpt-oss's template reads it as `thinking` (its analysis message), so that name too."""
    text = m.reasoning if m.reasoning is not None else m.reasoning_content
    return {} if text is None else {"reasoning_content": text, "reasoning": text, "thinking": text}


def conversation(messages: list[Any], tools: list[dict[str, Any]] | None, *,
                 template_knows_tools: bool, fmt: ToolParser,
                 content_format: str = "string") -> list[dict[str, Any]]:
    """The messages as the template takes them (`content_format`: each message's content as
    one string, or as OpenAI's list of text parts, where the template shows them itself)."""
    if template_knows_tools:
        out = []
        for m in messages:
            d: dict[str, Any] = {"role": m.role, "content": _content(m, content_format)}
            if m.name:
                d["name"] = m.name
            if m.tool_calls:
                d["tool_calls"] = [{"id": c.id, "type": "function",
                                    "function": {"name": c.function.name, "arguments": _arguments(c)}}
                                   for c in m.tool_calls]
            if m.tool_call_id is not None:
                d["tool_call_id"] = m.tool_call_id
            out.append({**d, **_reasoning(m)})
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
        out.append({**d, **_reasoning(m)})
    for d in out:
        d.pop("_tool_results", None)
    if tools:
        block = fmt.system_prompt(tools)
        if out and out[0]["role"] == "system":
            out[0]["content"] = f"{out[0]['content']}\n\n{block}" if out[0]["content"] else block
        else:
            out.insert(0, {"role": "system", "content": block})
    return out


def render_chat(tokenizer: Any, messages: list[Any], *, add_generation_prompt: bool = True,
                continue_final_message: bool = False, chat_template: str | None = None,
                chat_template_kwargs: dict[str, Any] | None = None,
                tools: list[dict[str, Any]] | None = None, tool_format: str | None = None,
                default_template: str | None = None, content_format: str = "auto") -> str:
    """The prompt text of a conversation; ValueError for anything the template cannot take.

    `chat_template` (or the same key in `chat_template_kwargs`) replaces the model's template;
    it renders in transformers' sandboxed Jinja environment. `tool_format` names the tool
    parser whose format shows tools to a template without a tools section (default: Hermes).
    `default_template` (an operator's --chat-template) replaces the model's when no template
    is given. `content_format` ("auto", "string", "openai"): how message content reaches the
    template (vLLM's chat_template_content_format)."""
    kwargs = dict(chat_template_kwargs or {})
    if chat_template is not None:
        kwargs["chat_template"] = chat_template
    if kwargs.get("chat_template") is None and default_template is not None:
        kwargs["chat_template"] = default_template
    kwargs.pop("tools", None)  # tools come from the request's own field
    source = template_source(tokenizer, kwargs.get("chat_template"), bool(tools))
    knows = knows_tools(source)
    has_history = any(m.tool_calls or m.role == "tool" for m in messages)
    conv = conversation(messages, tools, template_knows_tools=knows or not (tools or has_history),
                        fmt=get_tool_parser(tool_format or DEFAULT_FORMAT),
                        content_format=resolve_content_format(source, content_format))
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
