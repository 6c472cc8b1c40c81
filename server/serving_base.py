"""What the completions and chat handlers share: model names, body parsing (see body.py), the
checks every generation request goes through (unknown fields, priority), request logging,
adding requests, merging per-prompt output queues (within the request's deadline), disconnect
handling and logprob formatting."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

from pydantic import BaseModel
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from jaxserve.engine.client import (
    EngineClient,
    EngineDeadError,
    EngineOverloadedError,
    EngineShutdownError,
    EngineSleepingError,
    OutputKind,
    RequestStream,
)
from jaxserve.outputs import LogprobsDict, RequestOutput
from jaxserve.reasoning import get_reasoning_parser
from jaxserve.sampling_params import SamplingParams
from jaxserve.server import field_policy, sse
from jaxserve.server.body import Disconnected
from jaxserve.server.errors import APIError, error_body, internal_error, quote
from jaxserve.server.protocol import (
    ChatLogProb,
    ChatLogProbsContent,
    CompletionLogProbs,
)
from jaxserve.server.request_context import request_id_of

logger = logging.getLogger(__name__)

NEG_INF_LOGPROB = -9999.0


class RequestTimeoutError(Exception):
    """The request passed its deadline (--request-timeout); it is aborted."""


@dataclasses.dataclass(frozen=True, slots=True)
class Deadline:
    at: float  # on the event loop's clock (loop.time())
    seconds: float  # the server's request timeout

    def remaining(self) -> float:
        return self.at - asyncio.get_running_loop().time()

    def error(self) -> RequestTimeoutError:
        return RequestTimeoutError(
            f"the request did not finish within the server's request timeout of {self.seconds:g} s and was "
            "aborted; ask for fewer tokens, or retry when the server is less busy.")


class ServerState:
    """Everything a handler needs, built once by build_app."""

    def __init__(self, engine: EngineClient, served_model_names: list[str], *, max_body_bytes: int,
                 request_id_header: bool = True, trust_request_chat_template: bool = False,
                 request_timeout: float | None = None, tool_call_parser: str | None = None,
                 enable_auto_tool_choice: bool = False, log_requests: bool = False,
                 chat_template: str | None = None):
        from jaxserve.chat.tool_parsers import get_tool_parser

        self.engine = engine
        self.served_model_names = served_model_names or [engine.model_name]
        self.max_body_bytes = max_body_bytes
        self.request_id_header = request_id_header
        self.trust_request_chat_template = trust_request_chat_template
        self.chat_template = chat_template  # the operator's (--chat-template), replacing the model's
        # The parser of the model's tool-call format (also how tools are shown to a template
        # without a tools section); auto tool choice needs it and enable_auto_tool_choice.
        self.tool_call_parser = tool_call_parser
        self.tool_parser = get_tool_parser(tool_call_parser) if tool_call_parser else None
        self.enable_auto_tool_choice = enable_auto_tool_choice
        # The model's reasoning format (--reasoning-parser, an engine option the engine's ModelInfo
        # carries): chat completions and responses split each output into reasoning and content
        # with it. None: the reasoning (if any) stays in the content.
        name = engine.info.reasoning_parser
        self.reasoning_parser = get_reasoning_parser(name)(engine.tokenizer) if name else None
        self.log_requests = log_requests
        self.request_timeout = request_timeout  # seconds from arrival to the last output; None: none
        from jaxserve.server.lora import LoRARegistry

        self.loras = LoRARegistry(engine)  # the LoRA adapters offered as models

    def deadline(self) -> Deadline | None:
        """The deadline of a request arriving now."""
        if self.request_timeout is None:
            return None
        return Deadline(asyncio.get_running_loop().time() + self.request_timeout, self.request_timeout)

    @property
    def model_name(self) -> str:
        return self.served_model_names[0]

    def resolve_model(self, name: str | None) -> str:
        if name is None or name == "":
            return self.model_name
        if name not in self.served_model_names and name not in self.loras.adapters:
            raise APIError(404, f"The model {quote(name)} does not exist; available: "
                                f"{', '.join([*self.served_model_names, *self.loras.adapters])}.",
                           param="model")
        return name


def check_request(state: ServerState, body: Any, route: str) -> dict[str, str]:
    """What every generation request goes through after validation (the engine validates the
    rest, its priority among it): its unknown fields are logged; returns the response headers
    that list them."""
    return field_policy.report(body.ignored_fields, route)


def log_request(state: ServerState, request_id: str, num_prompts: int, params: SamplingParams) -> None:
    """One INFO line per request unless --disable-log-requests (no prompt text: it is the
    client's data)."""
    if state.log_requests:
        logger.info("Received request %s: %d prompt(s), %s", request_id, num_prompts, describe_params(params))


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


def engine_error(e: BaseException, request_id: str | None = None) -> APIError:
    """The API error for a failure while serving a request: the engine's ValueErrors are the
    user's (400), a full queue or a shutting-down engine is a 503, a request past its deadline
    a 504; anything else is a 500 that names the request id (the exception goes to the log,
    not to the client)."""
    if isinstance(e, APIError):
        return e
    if isinstance(e, ValueError):
        return APIError(400, str(e), param=getattr(e, "param", None))
    if isinstance(e, EngineOverloadedError):
        return APIError(503, str(e), headers={"Retry-After": str(e.retry_after)})
    if isinstance(e, (EngineShutdownError, EngineSleepingError)):
        return APIError(503, str(e))
    if isinstance(e, RequestTimeoutError):
        return APIError(504, str(e))
    return internal_error(e, request_id)


async def add_all(engine: EngineClient, request_ids: list[str], prompts: Any,
                  params: SamplingParams, priority: int, arrival_time: float,
                  add_special_tokens: bool = True, cache_salt: str | None = None, *,
                  stream: bool, lora_request=None) -> list[RequestStream]:
    """Add one engine request per prompt, all in one command (they can share the next step);
    `prompts` may be a function making them (run in the engine's worker thread, with the
    tokenizing). A stream gets each step's new tokens (DELTA outputs), a plain response its
    final output alone. Bad input raises the 400 before anything is queued, a full queue the 503."""
    try:
        return await engine.add_requests(request_ids, prompts, params, priority=priority,
                                         arrival_time=arrival_time, add_special_tokens=add_special_tokens,
                                         cache_salt=cache_salt, lora_request=lora_request,
                                         output_kind=OutputKind.DELTA if stream else OutputKind.FINAL_ONLY)
    except (ValueError, EngineOverloadedError, EngineShutdownError, EngineSleepingError) as e:
        raise engine_error(e) from None
    except EngineDeadError:
        raise APIError(503, "the engine has failed and the server is shutting down; retry once it has "
                            "restarted.") from None
    # anything else: a 500, made (with the request id) by RequestContextMiddleware


def with_defaults(params: SamplingParams, body: BaseModel, defaults: dict[str, Any]) -> SamplingParams:
    """`params` with the model's default sampling settings (generation_config.json) for the
    fields the client did not send."""
    unset = {k: v for k, v in defaults.items() if k not in body.model_fields_set}
    return params.clone(**unset) if unset else params


async def _get(queue: asyncio.Queue, deadline: Deadline | None) -> Any:
    if deadline is None:
        return await queue.get()
    remaining = deadline.remaining()
    if remaining <= 0:
        raise deadline.error()
    try:
        async with asyncio.timeout(remaining):
            return await queue.get()
    except TimeoutError:
        raise deadline.error() from None


async def merge(queues: list[asyncio.Queue], deadline: Deadline | None = None
                ) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(prompt index, output) as they arrive, until every request has finished; an exception
    put in a queue is raised, and RequestTimeoutError once `deadline` has passed (the caller
    aborts the requests)."""
    if len(queues) == 1:
        while True:
            out = await _get(queues[0], deadline)
            if isinstance(out, BaseException):
                raise out
            yield 0, out
            if out.finished:
                return
    getters = {i: asyncio.ensure_future(q.get()) for i, q in enumerate(queues)}
    try:
        while getters:
            timeout = None
            if deadline is not None and (timeout := deadline.remaining()) <= 0:
                raise deadline.error()
            done, _ = await asyncio.wait(getters.values(), timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
            if not done:
                raise deadline.error()
            for i in sorted(i for i, t in getters.items() if t in done):
                out = getters.pop(i).result()
                if isinstance(out, BaseException):
                    raise out
                yield i, out
                if not out.finished:
                    getters[i] = asyncio.ensure_future(queues[i].get())
    finally:
        for t in getters.values():
            t.cancel()


async def until_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def run_unless_disconnected(request: Request, coro: Any) -> Any:
    """Await `coro`; if the client disconnects first, cancel it and raise Disconnected."""
    task = asyncio.ensure_future(coro)
    watcher = asyncio.ensure_future(until_disconnect(request))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        watcher.cancel()
        raise
    if task in done:
        watcher.cancel()
        return task.result()
    task.cancel()
    try:
        await task
    except (asyncio.CancelledError, Exception):  # noqa: BLE001
        pass
    raise Disconnected()


class SSEStream:
    """A handler's SSE events passed through; an error after the stream started is sent as an
    in-stream error event (a 500 names the request id, set by EventStream), after `on_error`
    has run (EventStream's abort: a request past its deadline frees its KV before its client
    hears of it); `[DONE]` always ends the stream."""

    def __init__(self, events: AsyncIterator[str]):
        self.events = events
        self.request_id: str | None = None
        self.on_error: Callable[[], None] | None = None

    async def __aiter__(self) -> AsyncIterator[str]:
        try:
            async for event in self.events:
                yield event
        except Exception as e:  # noqa: BLE001 - reported in-stream
            if self.on_error is not None:
                self.on_error()
            err = engine_error(e, self.request_id)
            yield sse.event(error_body(err.status, err.message, err.type))
        yield sse.DONE


def sse_stream(events: AsyncIterator[str]) -> SSEStream:
    return SSEStream(events)


class EventStream(StreamingResponse):
    """SSE response that always runs `on_close` (aborting the engine requests), even when the
    client disconnects before the body iterator has started."""

    def __init__(self, content: SSEStream, on_close: Callable[[], None],
                 headers: dict[str, str] | None = None):
        super().__init__(content, media_type=sse.MEDIA_TYPE, headers={**sse.HEADERS, **(headers or {})})
        self._on_close = on_close
        if isinstance(content, SSEStream):
            content.on_error = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if isinstance(self.body_iterator, SSEStream):
            self.body_iterator.request_id = request_id_of(scope)
        try:
            await super().__call__(scope, receive, send)
        except (ClientDisconnect, OSError):
            pass  # the client went away mid-stream: abort (below) and stay quiet
        finally:
            self._on_close()


def abort_all(engine: EngineClient, request_ids: list[str]) -> Callable[[], None]:
    def close() -> None:
        for rid in request_ids:
            engine.abort(rid)
    return close


# ---------------------------------------------------------------------------- logprobs
def _lp(x: float) -> float:
    return max(x, NEG_INF_LOGPROB)


def _token_str(tokenizer: Any, tid: int, d: LogprobsDict | None) -> str:
    if d is not None and tid in d and d[tid].decoded_token is not None:
        return d[tid].decoded_token  # type: ignore[return-value]
    return tokenizer.decode([tid])


def append_completion_logprobs(
    acc: CompletionLogProbs,
    token_ids: list[int],
    dicts: list[LogprobsDict | None],
    tokenizer: Any,
    offset: int,
) -> int:
    """Append tokens in the completions format; returns the next text offset."""
    for tid, d in zip(token_ids, dicts):
        tok = _token_str(tokenizer, tid, d)
        acc.tokens.append(tok)
        acc.text_offset.append(offset)
        offset += len(tok)
        if d is None or tid not in d:
            acc.token_logprobs.append(None)
            acc.top_logprobs.append(None)
            continue
        acc.token_logprobs.append(_lp(d[tid].logprob))
        top: dict[str, float] = {}
        for k, v in d.items():
            s = v.decoded_token if v.decoded_token is not None else tokenizer.decode([k])
            top.setdefault(s, _lp(v.logprob))
        acc.top_logprobs.append(top)
    return offset


def chat_logprobs(token_ids: list[int], dicts: list[LogprobsDict], tokenizer: Any, top_k: int) -> list[ChatLogProbsContent]:
    out = []
    for tid, d in zip(token_ids, dicts):
        tok = _token_str(tokenizer, tid, d)
        lp = d[tid].logprob if tid in d else NEG_INF_LOGPROB
        ranked = sorted(d.items(), key=lambda kv: (kv[1].rank if kv[1].rank is not None else 1 << 30, -kv[1].logprob))
        top = []
        for k, v in ranked[:top_k]:
            s = v.decoded_token if v.decoded_token is not None else tokenizer.decode([k])
            top.append(ChatLogProb(token=s, logprob=_lp(v.logprob), bytes=list(s.encode("utf-8"))))
        out.append(ChatLogProbsContent(token=tok, logprob=_lp(lp), bytes=list(tok.encode("utf-8")), top_logprobs=top))
    return out


def prompt_logprobs_json(plp: list[LogprobsDict | None] | None) -> list[dict[str, Any] | None] | None:
    """vLLM's prompt_logprobs: per prompt position {token_id: {logprob, rank, decoded_token}}, first None."""
    if plp is None:
        return None
    return [None if d is None else {str(k): {"logprob": _lp(v.logprob), "rank": v.rank,
                                             "decoded_token": v.decoded_token} for k, v in d.items()}
            for d in plp]


async def respond_json(request: Request, collect: Any, on_done: Callable[[], None],
                       headers: dict[str, str] | None = None) -> Response:
    """Await a non-streaming handler's result as JSON; a client that goes away gets its
    requests aborted (499), an engine failure becomes its API error. `on_done` always runs."""
    try:
        resp = await run_unless_disconnected(request, collect)
    except Disconnected:
        return Response(status_code=499)
    except APIError:
        raise
    except Exception as e:  # noqa: BLE001
        raise engine_error(e, request_id_of(request.scope)) from None
    finally:
        on_done()
    return JSONResponse(resp.model_dump(), headers=headers)
