"""Drafting inside the step (an EAGLE-3 head, DeepSeek MTP, a draft model), the engine's side:
the drafts come with each step's output.

The drafter runs inside the target's compiled step (jaxserve/runner/draft_head_step.py), which
returns the next k drafts of every request that sampled; the engine core makes them the
request's `spec_token_ids`, fed and verified in the next step as n-gram drafts are.
"""

from __future__ import annotations


class DraftHeadProposer:
    """The engine's side of drafting in the step, for every drafter: the drafts come with each
    step's output (`RunnerOutput.drafts`), made on the device; nothing is proposed on the host."""

    on_device = True

    def __init__(self, num_speculative_tokens: int):
        self.k = num_speculative_tokens

    def drafts(self, request_id: str, step_drafts: dict[str, list[int]]) -> list[int]:
        return list(step_drafts.get(request_id, ()))[: self.k]

