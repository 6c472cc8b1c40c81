"""Pydantic models of the tokenizer routes (vLLM's /tokenize and /detokenize): a prompt or
chat messages in, token ids (and their strings) out, and back."""

from __future__ import annotations

from typing import Any

from pydantic import model_validator

from jaxserve.server.protocol import _Request, _Response
from jaxserve.server.protocol_chat import ChatMessage
from jaxserve.server.protocol_tools import ChatTool


class TokenizeRequest(_Request):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[ChatTool] | None = None
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _one_of(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("send exactly one of 'prompt' or 'messages'.")
        return self


class TokenizeResponse(_Response):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(_Response):
    prompt: str
