"""Speculative decoding: draft tokens proposed on the host, checked by the model in one step.

A request with k drafts feeds its last token and the k drafts as k + 1 query tokens of the flat
batch, and the step samples at each of those positions (k + 1 sampling rows: the drafts are
just more tokens, and the bucket grid is unchanged). The runner then keeps the longest prefix of
drafts that the samples confirm, plus the sample after it (jaxserve/runner/model_runner.py);
the scheduler rolls `num_computed_tokens` back over the rejected ones, whose KV is overwritten
later. See ngram.py for the n-gram proposer and which requests draft, draft_head.py for drafting
inside the compiled step (an EAGLE-3 head, DeepSeek MTP, a draft model: the drafts come back
with the step's samples).
"""

from jaxserve.spec_decode.ngram import NgramProposer, accept_drafts, can_speculate

__all__ = ["NgramProposer", "accept_drafts", "can_speculate"]  # draft_head.py: not here
