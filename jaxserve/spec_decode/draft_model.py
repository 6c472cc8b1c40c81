"""Drafting with a draft model, the engine's side: the drafts come with each step's output.

The draft model runs inside the target's compiled step (jaxserve/runner/draft_model_step.py),
which returns the next k greedy drafts of every request that sampled; the engine core makes them
the request's `spec_token_ids`, fed and verified in the next step as every draft is.
"""

from __future__ import annotations


class DraftModelProposer:
    """The engine's side of draft-model drafting: the drafts come with each step's output
    (`RunnerOutput.drafts`), made on the device; nothing is proposed on the host."""

    on_device = True

    def __init__(self, num_speculative_tokens: int):
        self.k = num_speculative_tokens

    def drafts(self, request_id: str, step_drafts: dict[str, list[int]]) -> list[int]:
        return list(step_drafts.get(request_id, ()))[: self.k]
