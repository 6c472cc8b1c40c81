"""The tokenizer's routes (vLLM's): POST /tokenize (a prompt, or chat messages rendered as the
chat route renders them), POST /detokenize and GET /tokenizer_info. Each handler takes the
ServerState and the request."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from jaxserve.server.body import parse_body
from jaxserve.server.chat_template import render_chat
from jaxserve.server.errors import APIError
from jaxserve.server.protocol_tokenize import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeRequest,
    TokenizeResponse,
)
from jaxserve.server.protocol_tools import tool_dicts
from jaxserve.server.state import ServerState


async def tokenize(state: ServerState, request: Request) -> Response:
    body = await parse_body(request, TokenizeRequest, state.max_body_bytes)
    state.resolve_model(body.model)
    tokenizer, config = state.engine.tokenizer, state.config
    try:
        if body.messages is not None:
            text = render_chat(tokenizer, body.messages,
                               add_generation_prompt=body.add_generation_prompt,
                               continue_final_message=body.continue_final_message,
                               chat_template=body.chat_template,
                               chat_template_kwargs=body.chat_template_kwargs,
                               trust_chat_template=config.trust_request_chat_template,
                               tools=tool_dicts(body.tools) if body.tools else None,
                               tool_format=config.tool_call_parser,
                               default_template=config.chat_template_text)
            ids = tokenizer.encode(text, add_special_tokens=bool(body.add_special_tokens))
        else:
            add = True if body.add_special_tokens is None else body.add_special_tokens
            ids = tokenizer.encode(body.prompt or "", add_special_tokens=add)
    except ValueError as e:
        raise APIError(400, str(e)) from None
    strs = tokenizer.convert_ids_to_tokens(ids) if body.return_token_strs else None
    out = TokenizeResponse(count=len(ids), max_model_len=state.engine.max_model_len, tokens=ids,
                           token_strs=strs)
    return JSONResponse(out.model_dump(exclude_none=True))


async def detokenize(state: ServerState, request: Request) -> Response:
    body = await parse_body(request, DetokenizeRequest, state.max_body_bytes)
    state.resolve_model(body.model)
    tokenizer = state.engine.tokenizer
    vocab = state.engine.info.vocab_size
    bad = [t for t in body.tokens if not 0 <= t < max(vocab, tokenizer.vocab_size)]
    if bad:
        raise APIError(400, f"token ids must be in [0, {vocab}); got {bad[:5]}.", param="tokens")
    return JSONResponse(DetokenizeResponse(prompt=tokenizer.decode(body.tokens)).model_dump())


async def tokenizer_info(state: ServerState, request: Request) -> Response:
    """The tokenizer's special tokens, chat template (the operator's, else the model's) and
    sizes."""
    tokenizer = state.engine.tokenizer
    hf = tokenizer.hf_tokenizer
    info = {
        "tokenizer_class": type(hf).__name__,
        "eos_token": hf.eos_token, "bos_token": hf.bos_token, "pad_token": hf.pad_token,
        "unk_token": hf.unk_token, "eos_token_id": hf.eos_token_id, "bos_token_id": hf.bos_token_id,
        "chat_template": state.config.chat_template_text or hf.chat_template,
        "model_max_length": state.engine.max_model_len,
        "vocab_size": tokenizer.vocab_size, "add_bos_token": getattr(hf, "add_bos_token", None),
        "add_eos_token": getattr(hf, "add_eos_token", None),
    }
    return JSONResponse(info)


def routes(state: ServerState) -> list[Route]:
    return [state.route("/tokenize", tokenize, ["POST"]),
            state.route("/detokenize", detokenize, ["POST"]),
            state.route("/tokenizer_info", tokenizer_info, ["GET"])]
