"""Host-side packing of one step's ragged batch into padded numpy arrays (and the pytrees the
compiled step takes).

Each scheduled request contributes a contiguous run of tokens: the token ids to compute this
step, the position of the first one (= tokens already in its KV cache), and its block table.
Everything is padded to the bucket (T tokens, R requests, P pages per request). Packing is
vectorized over the batch (a few numpy calls per step, not per request).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import numpy as np

from jaxserve.pallas_kernels.ragged_paged_attention.metadata import AttentionMetadata


@dataclasses.dataclass(frozen=True, slots=True)
class StepRequest:
    token_ids: Sequence[int]  # the tokens computed this step
    start_pos: int  # position of token_ids[0] (tokens of this request already cached)
    block_ids: Sequence[int]  # the request's block table (physical page ids)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ModelInputs:
    """The arrays of one step (numpy on the host, jax.Array inside the step)."""

    input_ids: np.ndarray  # [T] int32 (-1: the token sampled last for the token's slot)
    positions: np.ndarray  # [T] int32
    md: AttentionMetadata
    logits_indices: np.ndarray  # [R] int32: flat index of each request's last token


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TokenInfo:
    """Per input token: its request's sampling slot and what it is (for the sampling state),
    and the next prompt token when its prompt log-probs are wanted (-1 otherwise); per
    request row: the slot that keeps the row's sampled token (S = none: the row samples
    nothing, or is padding)."""

    slots: np.ndarray  # [T] int32
    is_prompt: np.ndarray  # [T] bool
    valid: np.ndarray  # [T] bool
    next_prompt_token: np.ndarray  # [T] int32
    sample_slots: np.ndarray  # [R] int32
    # [T] int32: each token's LoRA adapter slot (0: none); None when LoRA is off (the step
    # then takes no such input)
    lora_slots: np.ndarray | None = None


def pack_rows(
    token_ids: np.ndarray,  # [total] int32, the rows' tokens one after another
    starts: np.ndarray,  # [n] int: position of each row's first token
    lens: np.ndarray,  # [n] int: tokens of each row (> 0)
    block_tables: np.ndarray,  # [n, P] int32: each row's block table (padded with anything)
    *,
    num_tokens: int,
    num_reqs: int,
    page_size: int,
) -> ModelInputs:
    """Pack n rows into a (num_tokens, num_reqs) bucket (the caller checks that they fit)."""
    n, total = len(lens), len(token_ids)
    pages_per_req = block_tables.shape[1]
    qsl = np.full(num_reqs + 1, total, np.int32)
    qsl[0] = 0
    np.cumsum(lens, out=qsl[1 : n + 1])
    row = np.repeat(np.arange(n), lens)  # [total] row of each token
    pos = (np.arange(total) - qsl[row]) + starts[row]
    input_ids = np.zeros(num_tokens, np.int32)
    input_ids[:total] = token_ids
    positions = np.zeros(num_tokens, np.int32)
    positions[:total] = pos
    slot_mapping = np.arange(num_tokens, dtype=np.int32) % page_size  # padding -> null page 0
    slot_mapping[:total] = block_tables[row, pos // page_size] * page_size + pos % page_size
    tables = np.zeros((num_reqs, pages_per_req), np.int32)
    tables[:n] = block_tables
    kv_lens = np.zeros(num_reqs, np.int32)
    kv_lens[:n] = starts + lens
    logits_indices = np.zeros(num_reqs, np.int32)
    logits_indices[:n] = qsl[1 : n + 1] - 1
    md = AttentionMetadata(block_tables=tables, kv_lens=kv_lens, query_start_loc=qsl,
                           num_seqs=np.asarray(n, np.int32), slot_mapping=slot_mapping)
    return ModelInputs(input_ids=input_ids, positions=positions, md=md, logits_indices=logits_indices)


def pack_step(
    reqs: Sequence[StepRequest],
    *,
    num_tokens: int,
    num_reqs: int,
    pages_per_req: int,
    page_size: int,
) -> ModelInputs:
    """Pack `reqs` into a (num_tokens, num_reqs) bucket. Raises ValueError if they do not fit."""
    lens = np.fromiter((len(r.token_ids) for r in reqs), dtype=np.int32, count=len(reqs))
    total = int(lens.sum())
    if len(reqs) > num_reqs or total > num_tokens:
        raise ValueError(f"{len(reqs)} requests / {total} tokens do not fit bucket ({num_reqs}, {num_tokens})")
    tables = np.zeros((len(reqs), pages_per_req), np.int32)
    starts = np.zeros(len(reqs), np.int32)
    for i, r in enumerate(reqs):
        need_pages = -(-(r.start_pos + int(lens[i])) // page_size)
        if need_pages > len(r.block_ids) or need_pages > pages_per_req:
            raise ValueError(f"request {i} needs {need_pages} pages, has {len(r.block_ids)} (max {pages_per_req})")
        blocks = np.asarray(r.block_ids[:pages_per_req], np.int32)
        tables[i, : len(blocks)] = blocks
        starts[i] = r.start_pos
    tokens = np.fromiter((t for r in reqs for t in r.token_ids), dtype=np.int32, count=total)
    return pack_rows(tokens, starts, lens, tables, num_tokens=num_tokens, num_reqs=num_reqs, page_size=page_size)
