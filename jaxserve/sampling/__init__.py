"""Sampling fused into the compiled step (see sampler.py for the order of transforms)."""

from jaxserve.sampling.config import SamplerConfig
from jaxserve.sampling.metadata import (
    SamplingMetadata,
    SamplingMetadataBuilder,
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
    "init_sampling_state",
    "prompt_logprobs",
    "sample",
    "tokenize_bad_words",
    "update_state_from_tokens",
    "write_slot_rows",
]
