"""POST /v1/chat/completions.

Tool calling (`tools`, `tool_choice`, `parallel_tool_calls`), as vLLM serves it:
- "none": the tools are shown to the template, the output is plain content;
- "auto" (the default with tools): needs --enable-auto-tool-choice and --tool-call-parser;
  the parser finds the calls in the model's free output (content before them stays content);
- "required": structured output constrains the output to a JSON array of {"name",
  "parameters"} (one item without parallel_tool_calls), finish_reason "tool_calls";
- a named function: the output is constrained to its parameters' schema; finish_reason
  "stop" (OpenAI's and vLLM's convention for a forced function).
Calls come back as `message.tool_calls` (content null) or, streaming, as `delta.tool_calls`.

Reasoning (--reasoning-parser, vLLM's): each choice's output is split into `reasoning_content`
(the reasoning, up to the end marker) and `content` (the answer after it), streamed as
`delta.reasoning_content` and `delta.content`; tool calls are parsed from the answer only. Where
the prompt already closed reasoning (e.g. enable_thinking false) the whole output is content and
reasoning_content is null. Without a parser the responses carry no reasoning key. gpt-oss's
Harmony channels (`gpt_oss`): the analysis channel is the reasoning, the final channel the
content, and under "auto" the parser keeps the calls to `functions.NAME` in the answer for the
tool-call parser `openai` (jaxserve/reasoning/gpt_oss.py).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from jaxserve.reasoning import ReasoningParser, ReasoningStream
from jaxserve.server import sse
from jaxserve.server.body import parse_body
from jaxserve.server.chat_template import UNTRUSTED_TEMPLATE, render_chat
from jaxserve.server.errors import APIError
from jaxserve.server.engine_requests import Deadline, abort_all, add_all, merge
from jaxserve.server.logprobs import chat_logprobs, prompt_logprobs_json
from jaxserve.server.protocol import UsageInfo, random_id
from jaxserve.server.protocol_chat import (
    ChatCompletionLogProbs,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionResponseChoice,
    ChatCompletionStreamChoice,
    ChatCompletionStreamResponse,
    ChatResponseMessage,
    DeltaMessage,
)
from jaxserve.server.protocol_tools import (
    FunctionCall,
    NamedToolChoice,
    ToolCall,
    parameters_schema,
    required_schema,
    tool_dicts,
)
from jaxserve.server.serving_beam import add_beam_searches, beam_params
from jaxserve.server.request_checks import check_request, log_request, with_defaults
from jaxserve.server.state import ServerState
from jaxserve.server.streaming import EventStream, respond_json, sse_stream
from jaxserve.chat.tool_parsers import FunctionCallText, ToolCallStream, parse_required, tool_call_id
from jaxserve.sampling_params import SamplingParams, StructuredOutputsParams

__all__ = ["UNTRUSTED_TEMPLATE", "ChatHandler", "ToolMode", "chat_prompt", "chat_sampling", "render_chat",
           "split_tool_calls", "tool_mode"]

AUTO_NEEDS_PARSER = ('"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set; '
                     'send tool_choice "none", "required" or a named function, or start the server with them.')


@dataclasses.dataclass(slots=True)
class ToolMode:
    """A request's tool mode: None (no tool calls), "auto", "required" or "named"."""

    mode: str | None = None
    function: str | None = None  # named
    max_calls: int | None = None  # 1 without parallel_tool_calls

    def stream(self, state: ServerState) -> ToolCallStream | None:
        if self.mode is None:
            return None
        return ToolCallStream(self.mode, state.tool_parser, self.function, self.max_calls)  # type: ignore[arg-type]


@dataclasses.dataclass(slots=True)
class _Choice:
    text: str = ""
    num_tokens: int = 0
    token_ids: list[int] = dataclasses.field(default_factory=list)
    logprobs: list | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    role_sent: bool = False
    calls: ToolCallStream | None = None
    reasoning: ReasoningStream | None = None  # streaming with reasoning: splits each delta


# ---------------------------------------------------------------------------- shared with /v1/responses
def tool_mode(state: ServerState, body: ChatCompletionRequest) -> tuple[ToolMode, StructuredOutputsParams | None]:
    """The request's tool mode, and the structured output that enforces it ("required", named)."""
    choice = body.effective_tool_choice
    tools = body.tools or []
    max_calls = None if body.parallel_tool_calls else 1
    if choice == "none":
        return ToolMode(), None
    if choice == "auto":
        if not (state.config.enable_auto_tool_choice and state.tool_parser is not None):
            raise APIError(400, AUTO_NEEDS_PARSER, param="tool_choice")
        return ToolMode("auto", max_calls=max_calls), None
    if choice == "required":
        try:
            schema = required_schema(tools, parallel=body.parallel_tool_calls)
        except ValueError as e:
            raise APIError(400, str(e), param="tools") from None
        return ToolMode("required", max_calls=max_calls), StructuredOutputsParams(json=schema)
    assert isinstance(choice, NamedToolChoice)
    tool = next(t for t in tools if t.function.name == choice.function.name)
    return ToolMode("named", function=tool.function.name), StructuredOutputsParams(json=parameters_schema(tool))


def chat_sampling(state: ServerState, body: ChatCompletionRequest) -> tuple[ToolMode, SamplingParams]:
    """The request's tool mode and sampling settings (the model's defaults for what it did not
    send, the tool mode's constraint); APIError 400 for bad values."""
    tools, constraint = tool_mode(state, body)
    try:
        params = with_defaults(body.to_sampling_params(), body, state.engine.info.sampling_defaults)
        if constraint is not None:
            params = params.clone(structured_outputs=constraint)
        reasoning = state.reasoning_parser
        if ((tools.mode == "auto" and state.tool_parser.needs_special_tokens)
                or (reasoning is not None and reasoning.needs_special_tokens)):
            params = params.clone(skip_special_tokens=False)  # their markers are special tokens
    except ValueError as e:
        raise APIError(400, str(e)) from None
    return tools, params


def chat_prompt(state: ServerState, body: ChatCompletionRequest) -> str:
    """The request's conversation through the chat template (ValueError for what it cannot take)."""
    config = state.config
    return render_chat(
        state.engine.tokenizer, body.messages, add_generation_prompt=body.add_generation_prompt,
        continue_final_message=body.continue_final_message, chat_template=body.chat_template,
        chat_template_kwargs=template_kwargs(body), trust_chat_template=config.trust_request_chat_template,
        tools=tool_dicts(body.tools) if body.tools else None, tool_format=config.tool_call_parser,
        default_template=config.chat_template_text)


def template_kwargs(body: ChatCompletionRequest) -> dict[str, Any] | None:
    """The request's chat_template_kwargs with its reasoning_effort, as vLLM passes it to the
    template: as `reasoning_effort`, and as `enable_thinking` (false for "none") unless the
    kwargs set that themselves."""
    kwargs = body.chat_template_kwargs
    if body.reasoning_effort is None:
        return kwargs
    kwargs = {**(kwargs or {}), "reasoning_effort": body.reasoning_effort}
    kwargs.setdefault("enable_thinking", body.reasoning_effort != "none")
    return kwargs


def split_tool_calls(state: ServerState, tools: ToolMode, text: str, finish: str | None
                     ) -> tuple[str | None, list[FunctionCallText], str | None]:
    """A finished output's content (None when it is all calls), its tool calls, and its finish
    reason ("tool_calls" where calls were made under "auto", or completed under "required")."""
    mode = tools.mode
    calls: list[FunctionCallText] = []
    content: str | None = text
    if mode == "auto":
        content, calls = state.tool_parser.extract(text)
    elif mode == "required":
        calls = parse_required(text) or []
        content = None if calls else text
    elif mode == "named":
        calls, content = [FunctionCallText(tools.function, text)], None  # type: ignore[arg-type]
    if tools.max_calls is not None:
        calls = calls[: tools.max_calls]
    if calls and (mode == "auto" or (mode == "required" and finish == "stop")):
        finish = "tool_calls"
    return content, calls, finish


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
        headers = check_request(self.state, body, "/v1/chat/completions")
        tools, params = chat_sampling(self.state, body)

        def prompts() -> list[str]:
            """The conversation through its template (slow, and the client's input: rendered
            off the event loop, in the same worker-thread hop as the tokenizing)."""
            return [chat_prompt(self.state, body)]

        rid = f"chatcmpl-{body.request_id}" if body.request_id else random_id("chatcmpl")
        log_request(self.state, rid, 1, params)
        lora = self.state.loras.get(model)
        if body.use_beam_search:
            beam = beam_params(body, params, self.engine.max_model_len)
            (stream,), close = await add_beam_searches(
                self.engine, [rid], prompts, params, beam, priority=body.priority, arrival_time=arrival,
                add_special_tokens=body.add_special_tokens, cache_salt=body.cache_salt, lora_request=lora,
                deadline=deadline)
        else:
            (stream,) = await add_all(self.engine, [rid], prompts, params, body.priority, arrival,
                                      body.add_special_tokens, body.cache_salt, stream=body.stream, lora_request=lora)
            close = abort_all(self.engine, [rid])
        queues = [stream.queue]
        ctx = _Ctx(rid, int(arrival), model, body, list(stream.prompt_token_ids), tools, self._echo(body), deadline)
        parser = ctx.reasoning = self.state.reasoning_parser
        ctx.thinking = parser is not None and not parser.reasoning_ended(ctx.prompt_token_ids)
        if body.stream:
            return EventStream(sse_stream(self._stream(ctx, queues)), close, headers)
        return await respond_json(request, self._collect(ctx, queues), close, headers)

    @staticmethod
    def _echo(body: ChatCompletionRequest) -> str:
        """With echo, the last message's content when the answer continues its role (vLLM's rule)."""
        if not body.echo:
            return ""
        last = body.messages[-1]
        role = "assistant" if body.add_generation_prompt else last.role
        return last.text() if last.role == role else ""

    def _usage(self, ctx: _Ctx) -> UsageInfo:
        c = sum(ch.num_tokens for ch in ctx.choices.values())
        p = len(ctx.prompt_token_ids)
        return UsageInfo(prompt_tokens=p, completion_tokens=c, total_tokens=p + c)

    def _delta_logprobs(self, ctx: _Ctx, o: Any) -> ChatCompletionLogProbs | None:
        if not ctx.body.logprobs or o.logprobs is None:
            return None
        return ChatCompletionLogProbs(content=chat_logprobs(o.token_ids, o.logprobs, self.tokenizer,
                                                            ctx.body.top_logprobs or 0))

    # ------------------------------------------------------------------ whole responses
    def _final_message(self, ctx: _Ctx, ch: _Choice) -> tuple[ChatResponseMessage, str | None]:
        """The message and finish reason of a finished choice (reasoning, tool calls extracted)."""
        reasoning, text = (ctx.reasoning.extract(ch.text, with_calls=ctx.tools.mode == "auto")
                           if ctx.thinking else (None, ch.text))
        if text is None:  # all reasoning: no answer (cut short), no calls
            content, calls, finish = None, [], ch.finish_reason
        else:
            content, calls, finish = split_tool_calls(self.state, ctx.tools, text, ch.finish_reason)
        if ctx.echo and content is not None:
            content = ctx.echo + content
        tool_calls = [ToolCall(id=tool_call_id(), function=FunctionCall(name=c.name, arguments=c.arguments))
                      for c in calls]
        parsed = {"reasoning_content": reasoning} if ctx.reasoning is not None else {}
        return ChatResponseMessage(content=content, tool_calls=tool_calls, **parsed), finish

    async def _collect(self, ctx: _Ctx, queues: list) -> ChatCompletionResponse:
        plp = None
        async for _, out in merge(queues, ctx.deadline):
            if out.finished:
                plp = prompt_logprobs_json(out.prompt_logprobs)
            for o in out.outputs:
                ch = ctx.choices.setdefault(o.index, _Choice(logprobs=[] if ctx.body.logprobs else None))
                ch.text += o.text
                ch.num_tokens += len(o.token_ids)
                ch.token_ids += o.token_ids
                lp = self._delta_logprobs(ctx, o)
                if lp is not None and ch.logprobs is not None:
                    ch.logprobs.extend(lp.content or [])
                if o.finish_reason is not None:
                    ch.finish_reason, ch.stop_reason = o.finish_reason, o.stop_reason
        choices = []
        for i, ch in sorted(ctx.choices.items()):
            message, finish = self._final_message(ctx, ch)
            choices.append(ChatCompletionResponseChoice(
                index=i, message=message,
                logprobs=ChatCompletionLogProbs(content=ch.logprobs) if ch.logprobs is not None else None,
                finish_reason=finish, stop_reason=ch.stop_reason,
                token_ids=ch.token_ids if ctx.body.return_token_ids else None))
        return ChatCompletionResponse(id=ctx.id, created=ctx.created, model=ctx.model, choices=choices,
                                      usage=self._usage(ctx), prompt_logprobs=plp,
                                      prompt_token_ids=ctx.prompt_token_ids if ctx.body.return_token_ids else None)

    # ------------------------------------------------------------------ streaming
    async def _stream(self, ctx: _Ctx, queues: list) -> AsyncIterator[str]:
        body = ctx.body

        def chunk(choice: ChatCompletionStreamChoice, **extra: Any) -> str:
            return sse.event(ChatCompletionStreamResponse(
                id=ctx.id, created=ctx.created, model=ctx.model, choices=[choice],
                usage=self._usage(ctx) if body.continuous_usage else None, **extra))

        async for _, out in merge(queues, ctx.deadline):
            for o in out.outputs:
                ch = ctx.choices.get(o.index)
                if ch is None:
                    ch = ctx.choices[o.index] = _Choice(
                        calls=ctx.tools.stream(self.state),
                        reasoning=(ctx.reasoning.streamer(with_calls=ctx.tools.mode == "auto")
                                   if ctx.thinking else None))
                ch.num_tokens += len(o.token_ids)
                if not ch.role_sent:
                    # the first chunk goes out once the first token exists (TTFT is measured from it)
                    ch.role_sent = True
                    first = {"prompt_token_ids": ctx.prompt_token_ids} if body.return_token_ids else {}
                    yield chunk(ChatCompletionStreamChoice(index=o.index,
                                                           delta=DeltaMessage(role="assistant", content="")), **first)
                    if ctx.echo:
                        yield chunk(ChatCompletionStreamChoice(index=o.index, delta=DeltaMessage(content=ctx.echo)))
                finish = o.finish_reason
                delta = DeltaMessage(content=o.text)
                answer, held = o.text, False
                if ch.reasoning is not None:
                    thought, answer = ch.reasoning.update(o.text, final=finish is not None)
                    delta = DeltaMessage(content=answer or None, reasoning_content=thought or None)
                    held = not (thought or answer)
                if ch.calls is not None:
                    ch.text += answer
                    content, calls = ch.calls.update(ch.text, final=finish is not None)
                    delta = DeltaMessage(content=content or None, tool_calls=calls or None,
                                         reasoning_content=delta.reasoning_content)
                    if ch.calls.called and (ctx.tools.mode == "auto" or (ctx.tools.mode == "required"
                                                                         and finish == "stop")):
                        finish = "tool_calls" if finish is not None else None
                    held = not (delta.content or delta.tool_calls or delta.reasoning_content)
                if held and finish is None and not o.logprobs and not body.return_token_ids:
                    continue  # held back (a marker may be starting)
                yield chunk(ChatCompletionStreamChoice(
                    index=o.index, delta=delta, logprobs=self._delta_logprobs(ctx, o),
                    finish_reason=finish, stop_reason=o.stop_reason,
                    token_ids=o.token_ids if body.return_token_ids else None))
        if body.include_usage:
            yield sse.event(ChatCompletionStreamResponse(id=ctx.id, created=ctx.created, model=ctx.model,
                                                         choices=[], usage=self._usage(ctx)))


@dataclasses.dataclass(slots=True)
class _Ctx:
    id: str
    created: int
    model: str
    body: ChatCompletionRequest
    prompt_token_ids: list[int]
    tools: ToolMode
    echo: str = ""
    deadline: Deadline | None = None
    choices: dict[int, _Choice] = dataclasses.field(default_factory=dict)
    reasoning: ReasoningParser | None = None  # the server's parser: the response has reasoning keys
    thinking: bool = False  # the output starts with reasoning (the prompt did not close it)
