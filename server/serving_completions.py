"""POST /v1/completions."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import AsyncIterator

from starlette.requests import Request
from starlette.responses import Response

from jaxserve.outputs import CompletionOutput, RequestOutput
from jaxserve.server import sse
from jaxserve.server.body import parse_body
from jaxserve.server.engine_requests import Deadline, abort_all, add_all, merge
from jaxserve.server.errors import APIError
from jaxserve.server.logprobs import append_completion_logprobs, prompt_logprobs_json
from jaxserve.server.protocol import (
    CompletionLogProbs,
    CompletionRequest,
    CompletionResponse,
    CompletionResponseChoice,
    CompletionStreamChoice,
    CompletionStreamResponse,
    UsageInfo,
    random_id,
)
from jaxserve.server.serving_beam import add_beam_searches, beam_params
from jaxserve.server.request_checks import check_request, log_request, with_defaults
from jaxserve.server.state import ServerState
from jaxserve.server.streaming import EventStream, respond_json, sse_stream


@dataclasses.dataclass(slots=True)
class _Choice:
    text: str = ""
    num_tokens: int = 0
    logprobs: CompletionLogProbs | None = None
    offset: int = 0
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    started: bool = False
    prompt_logprobs: list | None = None
    token_ids: list[int] = dataclasses.field(default_factory=list)


class CompletionsHandler:
    def __init__(self, state: ServerState):
        self.state = state
        self.engine = state.engine
        self.tokenizer = state.engine.tokenizer

    async def handle(self, request: Request) -> Response:
        arrival = time.time()
        deadline = self.state.deadline()
        body = await parse_body(request, CompletionRequest, self.state.max_body_bytes)
        model = self.state.resolve_model(body.model)
        headers = check_request(self.state, body, "/v1/completions")
        try:
            params = with_defaults(body.to_sampling_params(), body, self.engine.info.sampling_defaults)
        except ValueError as e:
            raise APIError(400, str(e)) from None
        base_id = random_id("cmpl")
        if body.request_id:
            base_id = f"cmpl-{body.request_id}"
        prompts = body.prompts()
        rids = [f"{base_id}-{i}" for i in range(len(prompts))]
        log_request(self.state, base_id, len(prompts), params)
        lora = self.state.loras.get(model)
        if body.use_beam_search:
            beam = beam_params(body, params, self.engine.max_model_len)
            streams, close = await add_beam_searches(
                self.engine, rids, prompts, params, beam, priority=body.priority, arrival_time=arrival,
                add_special_tokens=body.add_special_tokens, cache_salt=body.cache_salt, lora_request=lora,
                deadline=deadline)
        else:
            streams = await add_all(self.engine, rids, prompts, params, body.priority, arrival,
                                    body.add_special_tokens, body.cache_salt, stream=body.stream, lora_request=lora)
            close = abort_all(self.engine, rids)
        queues = [st.queue for st in streams]
        ctx = _Ctx(base_id, int(arrival), model, body, [list(st.prompt_token_ids) for st in streams], body.n,
                   deadline)
        if body.stream:
            return EventStream(sse_stream(self._stream(ctx, queues)), close, headers)
        return await respond_json(request, self._collect(ctx, queues), close, headers)

    def _prompt_text(self, ctx: _Ctx, i: int) -> str:
        p = ctx.body.prompts()[i]
        if p.token_ids is None and ctx.body.truncate_prompt_tokens is None:
            return p.text
        return self.tokenizer.decode(ctx.prompts[i])  # the tokens the model saw

    def _fold(self, ctx: _Ctx, i: int, out: RequestOutput) -> list[tuple[int, CompletionOutput, str, CompletionLogProbs | None]]:
        """Fold one delta output in; returns (choice index, choice, delta text, delta logprobs)."""
        body, deltas = ctx.body, []
        for o in out.outputs:
            idx = i * ctx.n + o.index
            ch = ctx.choices.setdefault(idx, _Choice(logprobs=CompletionLogProbs() if body.logprobs is not None else None))
            text = o.text
            delta_lp = CompletionLogProbs() if body.logprobs is not None else None
            if not ch.started:
                ch.started = True
                if body.echo:
                    text = self._prompt_text(ctx, i) + text
                    if delta_lp is not None:
                        plp = out.prompt_logprobs or [None] * len(ctx.prompts[i])
                        ch.offset = append_completion_logprobs(delta_lp, ctx.prompts[i], plp, self.tokenizer, ch.offset)
            if delta_lp is not None and o.logprobs is not None:
                ch.offset = append_completion_logprobs(delta_lp, o.token_ids, o.logprobs, self.tokenizer, ch.offset)
            if delta_lp is not None and ch.logprobs is not None:
                for f in ("text_offset", "token_logprobs", "tokens", "top_logprobs"):
                    getattr(ch.logprobs, f).extend(getattr(delta_lp, f))
            ch.text += text
            ch.num_tokens += len(o.token_ids)
            ch.token_ids += o.token_ids
            if out.finished and out.prompt_logprobs is not None:
                ch.prompt_logprobs = prompt_logprobs_json(out.prompt_logprobs)
            if o.finish_reason is not None:
                ch.finish_reason, ch.stop_reason = o.finish_reason, o.stop_reason
            deltas.append((idx, o, text, delta_lp))
        return deltas

    def _usage(self, ctx: _Ctx) -> UsageInfo:
        p = sum(len(x) for x in ctx.prompts)
        c = sum(ch.num_tokens for ch in ctx.choices.values())
        return UsageInfo(prompt_tokens=p, completion_tokens=c, total_tokens=p + c)

    async def _collect(self, ctx: _Ctx, queues: list) -> CompletionResponse:
        async for i, out in merge(queues, ctx.deadline):
            self._fold(ctx, i, out)
        ids = ctx.body.return_token_ids
        choices = [
            CompletionResponseChoice(index=idx, text=ch.text, logprobs=ch.logprobs, finish_reason=ch.finish_reason,
                                     stop_reason=ch.stop_reason, prompt_logprobs=ch.prompt_logprobs,
                                     prompt_token_ids=ctx.prompts[idx // ctx.n] if ids else None,
                                     token_ids=ch.token_ids if ids else None)
            for idx, ch in sorted(ctx.choices.items())
        ]
        return CompletionResponse(id=ctx.id, created=ctx.created, model=ctx.model, choices=choices,
                                  usage=self._usage(ctx))

    async def _stream(self, ctx: _Ctx, queues: list) -> AsyncIterator[str]:
        body = ctx.body
        ids = body.return_token_ids
        sent_prompt: set[int] = set()
        async for i, out in merge(queues, ctx.deadline):
            for idx, o, text, lp in self._fold(ctx, i, out):
                first = ids and idx not in sent_prompt
                sent_prompt.add(idx)
                chunk = CompletionStreamResponse(
                    id=ctx.id, created=ctx.created, model=ctx.model,
                    choices=[CompletionStreamChoice(index=idx, text=text, logprobs=lp,
                                                    finish_reason=o.finish_reason, stop_reason=o.stop_reason,
                                                    prompt_token_ids=ctx.prompts[i] if first else None,
                                                    token_ids=o.token_ids if ids else None)],
                    usage=self._usage(ctx) if body.continuous_usage else None,
                )
                yield sse.event(chunk)
        if body.include_usage:
            yield sse.event(CompletionStreamResponse(id=ctx.id, created=ctx.created, model=ctx.model,
                                                     choices=[], usage=self._usage(ctx)))


@dataclasses.dataclass(slots=True)
class _Ctx:
    id: str
    created: int
    model: str
    body: CompletionRequest
    prompts: list[list[int]]
    n: int
    deadline: Deadline | None = None
    choices: dict[int, _Choice] = dataclasses.field(default_factory=dict)
