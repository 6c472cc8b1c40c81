"""The frontend's side of embeddings (--runner pooling): inputs in, vectors out.

`embedding_inputs` validates and tokenizes what a client sends (prompts read by jaxserve.inputs) into the
token id lists the engine core's `embed` takes; `truncate` applies Matryoshka `dimensions` to
the vectors it returns (the first `dimensions` values, re-normalized when the model
normalizes, as vLLM does). Both raise ValueError for bad input (a 400 at the server).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np

from jaxserve.engine.input_processor import ModelInfo
from jaxserve.inputs import Prompt

NOT_POOLING = ("this model is served for generation; start the server with --runner pooling "
               "(or --task embed) to serve embeddings")
NOT_GENERATING = ("this model is served with --runner pooling: it embeds (/v1/embeddings, "
                  "LLM.embed) and does not generate")


@dataclasses.dataclass(slots=True)
class EmbeddingResult:
    """One input's embedding and the tokens it was computed from."""

    prompt_token_ids: list[int]
    embedding: np.ndarray  # [dimensions] float32


def embedding_inputs(tokenizer: Any, info: ModelInfo, inputs: Sequence[Prompt], *,
                     add_special_tokens: bool = True) -> list[list[int]]:
    """Token ids of each input (read by jaxserve.inputs: text is tokenized, ids are taken)."""
    if info.runner != "pooling":
        raise ValueError(NOT_POOLING)
    if not inputs:
        raise ValueError("input must not be empty")
    out = []
    for i, x in enumerate(inputs):
        if x.token_ids is not None:
            ids = list(x.token_ids)
            bad = [t for t in ids if not 0 <= t < info.vocab_size]
            if bad:
                raise ValueError(f"input {i}: token id {bad[0]} is outside the vocabulary "
                                 f"(0 to {info.vocab_size - 1})")
        else:
            ids = tokenizer.encode(x.text, add_special_tokens=add_special_tokens)
        if not ids:
            raise ValueError(f"input {i} is empty")
        if len(ids) > info.max_model_len:
            raise ValueError(f"input {i} has {len(ids)} tokens, but the model's context length is "
                             f"{info.max_model_len}")
        out.append(ids)
    return out


def check_dimensions(info: ModelInfo, dimensions: int | None) -> None:
    if info.runner != "pooling":
        raise ValueError(NOT_POOLING)
    if dimensions is not None and not 1 <= dimensions <= info.hidden_size:
        raise ValueError(f"dimensions must be between 1 and the model's hidden size "
                         f"{info.hidden_size}, got {dimensions}")


def truncate(info: ModelInfo, vectors: np.ndarray, dimensions: int | None) -> np.ndarray:
    """Matryoshka truncation: the first `dimensions` values, re-normalized when the model's
    embeddings are normalized."""
    check_dimensions(info, dimensions)
    if dimensions is None or dimensions == vectors.shape[-1]:
        return vectors
    out = vectors[:, :dimensions]
    if info.normalize_embeddings:
        out = out / np.maximum(np.linalg.norm(out, axis=-1, keepdims=True), 1e-12)
    return out.astype(np.float32)
