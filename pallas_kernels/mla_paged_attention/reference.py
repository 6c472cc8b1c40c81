"""Pure-JAX reference of paged multi-head latent attention in its absorbed form: the semantic
spec, and the CPU serving path.

The cache of one layer is `[N, page_size, W]`, one row per token: the normed compressed KV
(`value_dim` = kv_lora_rank wide, 512 in DeepSeek V3) followed by the roped shared key part
(qk_rope_head_dim, 64): W = 576. A query `q` [T, H, W] is, per head, the latent-space query
(q_nope times the head's key up-projection, `value_dim` wide) beside the head's roped part.
Every head scores against the same rows, so this is multi-query attention with one W-wide
"head" whose value is the first `value_dim` columns of the same rows:

    out[t, h] = sum_j softmax_j(sm_scale * <q[t, h], row_j>) * row_j[:value_dim]

over the positions j the token sees (causal, as `ragged_paged_attention`'s conventions in
`ragged_paged_attention/metadata.py`). The caller maps `out` through each head's value
up-projection and the output projection.

It is the paged GQA reference with the values read from the keys' rows
(`ragged_paged_attention/reference.py`'s `value_dim`: chunked online softmax over the block
table, traced trip counts, each page gathered once and only `value_dim` value columns summed).
"""

from __future__ import annotations

import jax
from jaxserve.pallas_kernels.ragged_paged_attention.metadata import AttentionMetadata
from jaxserve.pallas_kernels.ragged_paged_attention.reference import (
    ragged_paged_attention_reference,
)


def mla_paged_attention_reference(
    q: jax.Array,  # [T, H, W]
    latent_cache: jax.Array,  # [N, page_size, W]
    md: AttentionMetadata,
    *,
    sm_scale: float,
    value_dim: int,
    chunk_pages: int | None = None,
    context_only: bool = False,
    return_lse: bool = False,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """[T, H, value_dim] in q.dtype; padding tokens get zeros. `context_only`: each query
    reads its request's cached context only; `return_lse`: also each row's log-sum-exp,
    [T, H] float32 (-inf where it read nothing): the op's (`ops.mla_paged_attention`)."""
    return ragged_paged_attention_reference(q, latent_cache, latent_cache, md, sm_scale=sm_scale,
                                            chunk_pages=chunk_pages, value_dim=value_dim,
                                            context_only=context_only, return_lse=return_lse)
