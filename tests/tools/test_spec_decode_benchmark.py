"""benchmarks/spec_decode_benchmark.py's pure helpers: the mean acceptance length from the
scheduler's counters, the predicted accelerator speed-up, the drafter passes per step, and the
chat prompts being apart from the ones the EAGLE-3 head trained or was measured on."""

from __future__ import annotations

import pathlib
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
import spec_decode_benchmark as sdb  # noqa: E402
import train_eagle3 as te  # noqa: E402


def test_mean_acceptance_length_is_accepted_per_verifying_step_plus_one():
    assert sdb.mean_acceptance_length(10, 15) == pytest.approx(2.5)
    assert sdb.mean_acceptance_length(4, 0) == 1.0
    assert sdb.mean_acceptance_length(0, 0) == 1.0  # nothing verified: one token a step


def test_predicted_speedup_counts_request_steps_and_draft_passes():
    # 100 tokens, 50 of them accepted drafts: 50 request steps, 2 tokens a step.
    assert sdb.predicted_speedup(100, 50, 0, 0.0) == pytest.approx(2.0)
    # three draft passes at a tenth of the target each: a step costs 1.3 plain steps
    assert sdb.predicted_speedup(100, 50, 3, 0.1) == pytest.approx(2.0 / 1.3)
    # no accepted drafts and a drafter that costs something: a slowdown
    assert sdb.predicted_speedup(64, 0, 3, 0.05) < 1.0
    with pytest.raises(ValueError):
        sdb.predicted_speedup(10, 10, 3, 0.1)


def test_chat_prompts_are_not_the_heads_training_or_held_out_prompts():
    assert len(set(sdb.CHAT_PROMPTS)) == len(sdb.CHAT_PROMPTS) >= 16
    assert not set(sdb.CHAT_PROMPTS) & (set(te.INSTRUCTIONS) | set(te.HELD_OUT))


def test_draft_passes_per_step_of_each_method():
    # A draft model runs over the step's tokens and then k chained passes; EAGLE-3's head's
    # first draft comes from its pass over the step's tokens.
    assert [sdb.draft_passes(m, 3) for m in ("none", "ngram", "eagle3", "draft_model")] == [0, 0, 3, 4]
