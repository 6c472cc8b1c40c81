"""Sampling fused into the compiled step.

Inside the step (all shapes fixed by the bucket (T, R) and the SamplerConfig; no parameter,
feature mix or batch composition changes a shape or a static argument):

    state = update_state_from_tokens(state, slots[T], input_ids[T], is_prompt[T], valid[T],
                                     meta.reset_slots)
    out = sample(logits[R, V], meta, state, config)   # -> SamplerOutput

On the host, every step: `builder.admit(slot, params, eos_ids, bad_words_ids)` for requests
that got a slot, `write_slot_rows(state, w)` for each `w in builder.take_slot_writes()`, and
`meta = builder.build(slots, output_lens, R)`.

Design notes (measured at R=32, V=49152 on the 2-core development CPU):
- Per-request dense rows (logit_bias, the -inf mask of allowed_token_ids and single-token bad
  words) live in SamplingState.logit_bias [S, V], written once at admission by the small
  jitted `write_slot_rows`, not per step: a per-step row gather + add costs ~0.3 ms more than
  a sparse [K]-wide scatter, and only in batches where some row uses them (lax.cond), while
  the dense row has no limit on allowed_token_ids / logit_bias sizes.
- XLA's CPU backend is slow at variadic reductions and comparator sorts (jnp.argmax ~3 ms,
  lax.top_k(64) ~5 ms, a full sort ~400 ms at this size); ops.py works on [R, V/b, b] blocks
  instead, and top-k / top-p never sort the vocabulary (exact K-candidate list, then an exact
  bisection on the value for wider nuclei).
- Random numbers are drawn on the host (one uniform per row, a hash of seed and output
  position), which keeps threefry out of the executable (it cost 2 s of compile time).
"""

from jaxserve.sampling.config import SamplerConfig
from jaxserve.sampling.metadata import (
    SamplingMetadata,
    SamplingMetadataBuilder,
    abstract_metadata,
    row_uniforms,
    tokenize_bad_words,
)
from jaxserve.sampling.sampler import SamplerOutput, prompt_logprobs, sample
from jaxserve.sampling.state import (
    SamplingState,
    SlotRowsWrite,
    init_sampling_state,
    update_state_from_tokens,
    write_slot_rows,
)

__all__ = [
    "SamplerConfig",
    "SamplerOutput",
    "SamplingMetadata",
    "SamplingMetadataBuilder",
    "SamplingState",
    "SlotRowsWrite",
    "abstract_metadata",
    "init_sampling_state",
    "prompt_logprobs",
    "row_uniforms",
    "sample",
    "tokenize_bad_words",
    "update_state_from_tokens",
    "write_slot_rows",
]
