"""N-gram (prompt lookup) drafting, and the acceptance rule.

Proposing: for n from prompt_lookup_max down to prompt_lookup_min, look for the n tokens that
end the request's context earlier in it; at the latest such occurrence, the (up to k) tokens
that followed it are the drafts. No match: no drafts (the request decodes one token a step).

Accepting: the step samples a token x_j at each of the k + 1 positions (after the last known
token and after each draft), with the request's own sampling parameters and the random number
of that output position. The output takes x_0, x_1, ... while each x_j equals draft d_j, and
stops after the first that differs (or after x_k). For a greedy request that is exactly
"accept while the draft is the argmax". For a sampled one it is rejection sampling with a
one-hot draft distribution: d_j is accepted with probability p_j(d_j), and on rejection the
token is x_j given x_j != d_j, i.e. drawn from p_j without d_j, renormalised; every emitted
token is distributed as without speculation. Because a row's random number depends only on
the request's seed and the output position, a seeded request even gives the same tokens with
and without drafts (as long as the logits are the same).

Which requests draft: those whose sampling does not depend on the outputs before it within the
step. Penalties (presence, frequency, repetition) and multi-token bad words read the sampling
state, which the step folds from its input tokens (the drafts are not folded); structured
output's bitmask follows a grammar that would have to advance over each draft. Such requests
decode without drafts, next to others that draft. min_tokens, logit_bias, allowed_token_ids and
logprobs work with drafts (they are per row or per slot).
"""

from __future__ import annotations

import numpy as np

from jaxserve.sampling_params import SamplingParams


def can_speculate(params: SamplingParams) -> bool:
    """Whether a request with these parameters may take drafts (see the module docstring)."""
    return not (params.structured_outputs is not None or params.presence_penalty or params.frequency_penalty
                or params.repetition_penalty != 1.0 or params.bad_words)


def accept_drafts(sampled: list[int], drafts: tuple[int, ...] | list[int]) -> list[int]:
    """The tokens a step with `drafts` (k) emits, given its k + 1 row samples: sampled[j] while
    it equals drafts[j], then the first that differs (or the last sample)."""
    out = []
    for j, tok in enumerate(sampled):
        out.append(tok)
        if j == len(drafts) or tok != drafts[j]:
            break
    return out


class NgramProposer:
    on_device = False  # proposes on the host, from the request's tokens

    def __init__(self, num_speculative_tokens: int, prompt_lookup_min: int, prompt_lookup_max: int):
        self.k = num_speculative_tokens
        self.min_n = prompt_lookup_min
        self.max_n = prompt_lookup_max

    def propose(self, context: np.ndarray, max_drafts: int | None = None) -> list[int]:
        """Up to k (and `max_drafts`) draft tokens continuing `context` (1-D int array)."""
        k = self.k if max_drafts is None else min(self.k, max_drafts)
        L = len(context)
        if k <= 0 or L <= self.min_n:
            return []
        for n in range(min(self.max_n, L - 1), self.min_n - 1, -1):
            suffix = context[L - n:]
            # Candidate starts: where the suffix's first token occurs, ending before the suffix.
            starts = np.flatnonzero(context[: L - n] == suffix[0])
            if n > 1 and len(starts):
                hit = np.ones(len(starts), bool)
                for i in range(1, n):
                    hit &= context[starts + i] == suffix[i]
                starts = starts[hit]
            if len(starts):
                after = int(starts[-1]) + n  # the latest occurrence
                return context[after: after + k].tolist()
        return []
