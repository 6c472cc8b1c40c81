"""The drafting step's former module name: runner/draft_head_step.py (a draft head, EAGLE-3's or
DeepSeek MTP's, run inside the target's step) is the module; these names stay importable here."""

from jaxserve.runner.draft_head_step import (  # noqa: F401
    DraftInputs,
    DraftKV,
    accepted_rows,
    chain_metadata,
    draft_inputs,
    draft_layer_config,
)
