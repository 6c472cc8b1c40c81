"""Pydantic models of /v1/embeddings (OpenAI's shape; vLLM's add_special_tokens)."""

from __future__ import annotations

import base64
from typing import Literal

import numpy as np
from pydantic import Field, StrictInt, StrictStr

from jaxserve.inputs import Prompt, parse_prompts
from jaxserve.server.field_policy import collect
from jaxserve.server.protocol import UsageInfo, _Request, _Response, random_id


class EmbeddingRequest(_Request):
    model: str | None = None
    # A string, a list of strings, token ids, or a list of token id lists (OpenAI's four forms).
    input: StrictStr | list[StrictStr] | list[StrictInt] | list[list[StrictInt]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: StrictInt | None = None  # Matryoshka: the first values, re-normalized
    user: str | None = None
    add_special_tokens: bool = True

    @property
    def ignored_fields(self) -> list[str]:
        return collect(self)

    def inputs(self) -> list[Prompt]:
        """The inputs as a list, one embedding each (read as every prompt is: jaxserve.inputs)."""
        return parse_prompts(self.input)


class EmbeddingData(_Response):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str


class EmbeddingResponse(_Response):
    id: str = Field(default_factory=lambda: random_id("embd"))
    object: Literal["list"] = "list"
    created: int
    model: str
    data: list[EmbeddingData]
    usage: UsageInfo


def encode(vector: np.ndarray, encoding_format: str) -> list[float] | str:
    """A vector as a JSON list of floats, or as OpenAI's base64 of little-endian float32 bytes."""
    if encoding_format == "base64":
        return base64.b64encode(np.asarray(vector, "<f4").tobytes()).decode("ascii")
    return np.asarray(vector, np.float32).tolist()
