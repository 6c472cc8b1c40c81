"""Host-side packing of one step's ragged batch into padded numpy arrays (and the pytree the
compiled step takes).

Each scheduled request contributes a contiguous run of tokens: the token ids to compute this
step, the position of the first one (= tokens already in its KV cache), and its block table.
Everything is padded to the bucket (T tokens, R requests, P pages per request).
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

    input_ids: np.ndarray  # [T] int32
    positions: np.ndarray  # [T] int32
    md: AttentionMetadata
    logits_indices: np.ndarray  # [R] int32: flat index of each request's last token


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
    input_ids = np.zeros(num_tokens, np.int32)
    positions = np.zeros(num_tokens, np.int32)
    slot_mapping = np.arange(num_tokens, dtype=np.int32) % page_size  # padding -> null page 0
    block_tables = np.zeros((num_reqs, pages_per_req), np.int32)
    kv_lens = np.zeros(num_reqs, np.int32)
    qsl = np.full(num_reqs + 1, total, np.int32)
    qsl[0] = 0
    qsl[1 : len(reqs) + 1] = np.cumsum(lens)
    logits_indices = np.zeros(num_reqs, np.int32)
    for i, r in enumerate(reqs):
        n = int(lens[i])
        lo = int(qsl[i])
        end_pos = r.start_pos + n
        need_pages = -(-end_pos // page_size)
        if need_pages > len(r.block_ids) or need_pages > pages_per_req:
            raise ValueError(f"request {i} needs {need_pages} pages, has {len(r.block_ids)} (max {pages_per_req})")
        blocks = np.asarray(r.block_ids[:pages_per_req], np.int32)
        block_tables[i, : len(blocks)] = blocks
        pos = np.arange(r.start_pos, end_pos, dtype=np.int32)
        input_ids[lo : lo + n] = r.token_ids
        positions[lo : lo + n] = pos
        slot_mapping[lo : lo + n] = blocks[pos // page_size] * page_size + pos % page_size
        kv_lens[i] = end_pos
        logits_indices[i] = lo + n - 1
    md = AttentionMetadata(
        block_tables=block_tables,
        kv_lens=kv_lens,
        query_start_loc=qsl,
        num_seqs=np.asarray(len(reqs), np.int32),
        slot_mapping=slot_mapping,
    )
    return ModelInputs(input_ids=input_ids, positions=positions, md=md, logits_indices=logits_indices)
