"""POST /v1/chat/completions."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from jaxserve.server import sse
from jaxserve.server.body import parse_body
from jaxserve.server.errors import APIError
from jaxserve.server.protocol import (
    ChatCompletionLogProbs,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionResponseChoice,
    ChatCompletionStreamChoice,
    ChatCompletionStreamResponse,
    ChatMessage,
    ChatResponseMessage,
    DeltaMessage,
    UsageInfo,
    random_id,
)
from jaxserve.server.serving_base import (
    Deadline,
    EventStream,
    ServerState,
    abort_all,
    add_all,
    chat_logprobs,
    merge,
    prompt_logprobs_json,
    respond_json,
    sse_stream,
    with_defaults,
)


UNTRUSTED_TEMPLATE = ("a chat template was sent with the request, but this server does not render "
                      "client-supplied chat templates; start it with --trust-request-chat-template to allow them.")


def render_chat(tokenizer: Any, messages: list[ChatMessage], *, add_generation_prompt: bool = True,
                continue_final_message: bool = False, chat_template: str | None = None,
                chat_template_kwargs: dict[str, Any] | None = None, trust_chat_template: bool = False) -> str:
    """The prompt text of a conversation; ValueError for anything the template cannot take.

    A template from the request (`chat_template`, or the same key in `chat_template_kwargs`)
    is Jinja code: it is refused (APIError 400) unless `trust_chat_template`, and rendered in
    transformers' sandboxed environment either way."""
    conv = [{"role": m.role, "content": m.text(), **({"name": m.name} if m.name else {})} for m in messages]
    kwargs = dict(chat_template_kwargs or {})
    if chat_template is not None:
        kwargs["chat_template"] = chat_template
    if kwargs.get("chat_template") is not None and not trust_chat_template:
        raise APIError(400, UNTRUSTED_TEMPLATE, param="chat_template")
    if continue_final_message:
        kwargs["continue_final_message"] = True
    try:
        return tokenizer.apply_chat_template(conv, add_generation_prompt=add_generation_prompt, **kwargs)
    except ValueError:
        raise
    except Exception as e:  # noqa: BLE001 - template errors are the user's (jinja, bad roles)
        raise ValueError(f"the chat template could not be applied to these messages: {e}") from None


@dataclasses.dataclass(slots=True)
class _Choice:
    text: str = ""
    num_tokens: int = 0
    logprobs: list | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    role_sent: bool = False


class ChatHandler:
    def __init__(self, state: ServerState):
        self.state = state
        self.engine = state.engine
        self.tokenizer = state.engine.tokenizer

    async def handle(self, request: Request) -> Response:
        arrival = time.time()
        deadline = self.state.deadline()
        body = await parse_body(request, ChatCompletionRequest, self.state.max_body_bytes)
        model = self.state.resolve_model(body.model)
        try:
            params = with_defaults(body.to_sampling_params(), body, self.engine.info.sampling_defaults)
            # Templates can be slow (and are the client's input): off the event loop.
            text = await asyncio.to_thread(
                render_chat, self.tokenizer, body.messages, add_generation_prompt=body.add_generation_prompt,
                continue_final_message=body.continue_final_message, chat_template=body.chat_template,
                chat_template_kwargs=body.chat_template_kwargs,
                trust_chat_template=self.state.trust_request_chat_template)
        except ValueError as e:
            raise APIError(400, str(e)) from None
        rid = f"chatcmpl-{body.request_id}" if body.request_id else random_id("chatcmpl")
        (stream,) = await add_all(self.engine, [rid], [text], params, body.priority, arrival,
                                  body.add_special_tokens)
        queues = [stream.queue]
        ctx = _Ctx(rid, int(arrival), model, body, len(stream.prompt_token_ids), deadline)
        if body.stream:
            return EventStream(sse_stream(self._stream(ctx, queues)), abort_all(self.engine, [rid]))
        return await respond_json(request, self._collect(ctx, queues), abort_all(self.engine, [rid]))

    def _usage(self, ctx: _Ctx) -> UsageInfo:
        c = sum(ch.num_tokens for ch in ctx.choices.values())
        return UsageInfo(prompt_tokens=ctx.num_prompt_tokens, completion_tokens=c, total_tokens=ctx.num_prompt_tokens + c)

    def _delta_logprobs(self, ctx: _Ctx, o: Any) -> ChatCompletionLogProbs | None:
        if not ctx.body.logprobs or o.logprobs is None:
            return None
        return ChatCompletionLogProbs(content=chat_logprobs(o.token_ids, o.logprobs, self.tokenizer,
                                                            ctx.body.top_logprobs or 0))

    async def _collect(self, ctx: _Ctx, queues: list) -> ChatCompletionResponse:
        plp = None
        async for _, out in merge(queues, ctx.deadline):
            if out.finished:
                plp = prompt_logprobs_json(out.prompt_logprobs)
            for o in out.outputs:
                ch = ctx.choices.setdefault(o.index, _Choice(logprobs=[] if ctx.body.logprobs else None))
                ch.text += o.text
                ch.num_tokens += len(o.token_ids)
                lp = self._delta_logprobs(ctx, o)
                if lp is not None and ch.logprobs is not None:
                    ch.logprobs.extend(lp.content or [])
                if o.finish_reason is not None:
                    ch.finish_reason, ch.stop_reason = o.finish_reason, o.stop_reason
        choices = [
            ChatCompletionResponseChoice(
                index=i, message=ChatResponseMessage(content=ch.text),
                logprobs=ChatCompletionLogProbs(content=ch.logprobs) if ch.logprobs is not None else None,
                finish_reason=ch.finish_reason, stop_reason=ch.stop_reason)
            for i, ch in sorted(ctx.choices.items())
        ]
        return ChatCompletionResponse(id=ctx.id, created=ctx.created, model=ctx.model, choices=choices,
                                      usage=self._usage(ctx), prompt_logprobs=plp)

    async def _stream(self, ctx: _Ctx, queues: list) -> AsyncIterator[str]:
        body = ctx.body

        def chunk(choice: ChatCompletionStreamChoice) -> str:
            return sse.event(ChatCompletionStreamResponse(
                id=ctx.id, created=ctx.created, model=ctx.model, choices=[choice],
                usage=self._usage(ctx) if body.continuous_usage else None))

        async for _, out in merge(queues, ctx.deadline):
            for o in out.outputs:
                ch = ctx.choices.setdefault(o.index, _Choice())
                ch.num_tokens += len(o.token_ids)
                if not ch.role_sent:
                    # the first chunk goes out once the first token exists (TTFT is measured from it)
                    ch.role_sent = True
                    yield chunk(ChatCompletionStreamChoice(index=o.index,
                                                           delta=DeltaMessage(role="assistant", content="")))
                yield chunk(ChatCompletionStreamChoice(
                    index=o.index, delta=DeltaMessage(content=o.text), logprobs=self._delta_logprobs(ctx, o),
                    finish_reason=o.finish_reason, stop_reason=o.stop_reason))
        if body.include_usage:
            yield sse.event(ChatCompletionStreamResponse(id=ctx.id, created=ctx.created, model=ctx.model,
                                                         choices=[], usage=self._usage(ctx)))


@dataclasses.dataclass(slots=True)
class _Ctx:
    id: str
    created: int
    model: str
    body: ChatCompletionRequest
    num_prompt_tokens: int
    deadline: Deadline | None = None
    choices: dict[int, _Choice] = dataclasses.field(default_factory=dict)
