"""What the speculative-decoding tests share: an engine's greedy tokens, its draft counters, and
a run in which the engine is fed the target's own next tokens as drafts (so that its steps keep
0 to k of them) while the drafts each step returned are recorded."""

from __future__ import annotations

import numpy as np

from jaxserve.sampling_params import SamplingParams


def tokens(llm, prompts, params):
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def spec_stats(llm) -> np.ndarray:
    """(drafts, draft tokens, accepted tokens) so far: the scheduler's counters."""
    s = llm.engine.scheduler.make_stats()
    return np.array([s.spec_num_drafts, s.spec_num_draft_tokens, s.spec_num_accepted_tokens])


def run_feeding_the_targets_tokens(spec_llm, plain_llm, prompt, k: int, vocab: int, max_tokens: int):
    """Generate `prompt` greedily on `spec_llm`, each step's drafts replaced by the target's own
    next tokens (from `plain_llm`), the j-th step's wrong from its (j mod k+1)-th on: the outputs
    stay the plain ones (asserted), drafts are kept (asserted) and the steps keep 0 to k of them.
    Returns (the plain tokens, [(tokens the step emitted, the drafts it returned)] per sampling
    step, the request's block table after each)."""
    greedy = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    (want,) = tokens(plain_llm, [prompt], greedy)
    runner, steps, pages = spec_llm.engine.runner, [], []
    collect = runner.collect

    def feed_the_target(step):
        out = collect(step)
        if not out.sampled:  # a prefill chunk that samples nothing
            return out
        (rid,) = out.sampled
        steps.append((len(out.sampled[rid]), out.drafts[rid]))
        pages.append(runner.slots.block_table[runner.slots.slot_of[rid]].copy())
        done = sum(n for n, _ in steps)
        right = len(steps) % (k + 1)
        out.drafts[rid] = want[done: done + right] + [(t + 1) % vocab for t in want[done + right: done + k]]
        return out

    runner.collect = feed_the_target
    before = spec_stats(spec_llm)
    try:
        assert tokens(spec_llm, [prompt], greedy) == [want]
    finally:
        del runner.collect
    assert (spec_stats(spec_llm) - before)[2] >= 2  # drafts were kept
    assert max(n for n, _ in steps[1:]) > 1  # a step emitted more than one token
    return want, steps, pages
