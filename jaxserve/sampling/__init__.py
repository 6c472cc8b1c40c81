"""Sampling fused into the compiled step.

Inside the step (all shapes fixed by the bucket (T, R) and the SamplerConfig; no parameter,
feature mix or batch composition changes a shape or a static argument):

    state = update_state_from_tokens(state, slots[T], input_ids[T], is_prompt[T], valid[T],
                                     meta.reset_slots, penalty_slots(meta))
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
  search on the value for wider nuclei: ops.boundary, 31 probes a pass, at most 8 passes).
- Random numbers are drawn on the host (one uniform per row, a hash of seed and output
  position), which keeps threefry out of the executable (it cost 2 s of compile time).
"""

# The names below, imported lazily (PEP 562): `jaxserve.sampling.config` is plain Python, needed by
# request validation in processes that never run a step (a frontend beside an engine process).
_EXPORTS = {
    "SamplerConfig": "config",
    "SamplingMetadata": "metadata", "SamplingMetadataBuilder": "metadata", "abstract_metadata": "metadata",
    "penalty_slots": "metadata", "row_uniforms": "metadata", "uses_penalties": "metadata",
    "SamplerOutput": "sampler", "prompt_logprobs": "sampler", "sample": "sampler",
    "SamplingState": "state", "SlotRowsWrite": "state", "init_sampling_state": "state",
    "update_state_from_tokens": "state", "write_slot_rows": "state",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'jaxserve.sampling' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(f"jaxserve.sampling.{module}"), name)
