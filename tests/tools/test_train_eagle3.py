"""benchmarks/train_eagle3.py's steps on the tiny `llama` fixture as the target: its greedy
text, its taps, a draft vocabulary, a short training run, the speculators-layout checkpoint
that `load_eagle3` reads back, and the offline acceptance measurement."""

from __future__ import annotations

import json
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxserve.models.eagle3_checkpoint import load_eagle3

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
import train_eagle3 as te  # noqa: E402

TARGET = ROOT / "tests" / "data" / "arch" / "llama"
TAPS = (0, 1, 2)  # the fixture has 2 layers: the default ids (2, 1, -1) do not exist
DRAFT_VOCAB = 48
RECIPE = te.Recipe(steps=60, batch=4, lr=3e-3, warmup=5, seed=0)


def greedy_text(target: te.TargetTaps, prompt: list[int], total: int) -> list[int]:
    """`prompt` continued with the target's greedy tokens to `total` tokens."""
    seq = list(prompt)
    while len(seq) < total:
        seq.append(int(target(seq)[1][-1]))
    return seq


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    target = te.TargetTaps(TARGET, TAPS)
    rng = np.random.default_rng(0)
    seqs = [(greedy_text(target, rng.integers(3, 128, 6).tolist(), 40), 6) for _ in range(6)]
    examples = te.build_examples(seqs, target, 63)
    d2t, t2d = te.draft_vocabulary(examples, 128, DRAFT_VOCAB)
    hf = json.loads((TARGET / "config.json").read_text())
    config = te.drafter_hf_config(hf, DRAFT_VOCAB, TAPS, 3)
    drafter = te.new_drafter(config, target.embedding_table(), d2t, t2d, seed=0)
    fresh = te.acceptance(drafter, examples, 3)
    curve = te.train(drafter, examples, RECIPE, log=lambda *_: None)
    out = te.save_drafter(drafter, config, tmp_path_factory.mktemp("drafter"))
    return dict(target=target, seqs=seqs, examples=examples, d2t=d2t, t2d=t2d, drafter=drafter, fresh=fresh,
                curve=curve, out=out, loaded=load_eagle3(out, target=TARGET))


def test_examples_are_the_targets_own_next_tokens(run):
    """At position i the drafter's input is s[i+1] and its label the target's greedy token
    after it: on greedy text (after the 6-token prompt) that is s[i+2]; the taps are the target's at i, zero past the
    end."""
    ex, (seq, _) = run["examples"], run["seqs"][0]
    n = len(seq) - 1
    assert ex.valid[0].sum() == n and not ex.valid[0, n:].any()
    np.testing.assert_array_equal(ex.input_ids[0, :n], seq[1:])
    np.testing.assert_array_equal(ex.labels[0, 4 : n - 1], seq[6:])  # the greedy part
    assert ex.taps.shape == (6, 63, 3 * 64) and ex.answer_start[0] == 5
    np.testing.assert_allclose(ex.taps[0, :n], run["target"](seq)[0][:n], atol=1e-6, rtol=0)
    assert not ex.taps[0, n:].any()


def test_draft_vocabulary_is_the_most_frequent_target_tokens(run):
    """d2t maps draft ids onto the ids t2d marks, ascending; no unmarked id is more frequent
    than a marked one; the loaded drafter maps the same way."""
    d2t, t2d, ex = run["d2t"], run["t2d"], run["examples"]
    ids = np.arange(DRAFT_VOCAB) + d2t
    np.testing.assert_array_equal(ids, np.flatnonzero(t2d))
    assert t2d.sum() == DRAFT_VOCAB and d2t.dtype == np.int64
    counts = np.bincount(ex.labels[ex.valid], minlength=128)
    assert counts[t2d].min() >= counts[~t2d].max()
    loaded = run["loaded"]
    np.testing.assert_array_equal(np.asarray(loaded.draft_to_target(jnp.arange(DRAFT_VOCAB))), ids)
    np.testing.assert_array_equal(np.asarray(loaded.t2d[...]), t2d)


def test_training_lowers_the_loss(run):
    curve = run["curve"]
    assert len(curve) == RECIPE.steps and len(curve[0]["step_losses"]) == RECIPE.ttt_steps
    first = np.mean([c["loss"] for c in curve[:3]])
    last = np.mean([c["loss"] for c in curve[-5:]])
    assert last < 0.5 * first, (first, last)


def test_saved_directory_loads_to_the_trained_weights(run):
    """The speculators-layout directory: load_eagle3 (with the target's table) gives back the
    trained parameters leaf by leaf, the layers it reads and its draft vocabulary."""
    cfg = json.loads((run["out"] / "config.json").read_text())
    assert cfg["speculators_model_type"] == "eagle3" and cfg["draft_vocab_size"] == DRAFT_VOCAB
    assert cfg["transformer_layer_config"]["num_hidden_layers"] == 1
    loaded, trained = run["loaded"], run["drafter"]
    assert loaded.config.aux_layer_ids == TAPS and loaded.config.layout == "speculators"
    ours = dict(jax.tree_util.tree_leaves_with_path(nnx.state(trained)))
    theirs = dict(jax.tree_util.tree_leaves_with_path(nnx.state(loaded)))
    assert ours.keys() == theirs.keys()
    for path, value in ours.items():
        np.testing.assert_array_equal(np.asarray(theirs[path]), np.asarray(value),
                                      err_msg=str(path))


def test_trained_drafter_is_accepted_more_than_a_fresh_one(run):
    """On the training text, the loaded drafter's 3-draft chains are accepted more often than
    the untrained drafter's, and at least one draft in two on average."""
    fresh, trained = run["fresh"], te.acceptance(run["loaded"], run["examples"], 3)
    assert trained["positions"] == fresh["positions"] == 6 * (39 - 5 - 3 + 1)
    assert trained["mean_acceptance_length"] > fresh["mean_acceptance_length"] + 0.5
    rates = trained["per_position_acceptance"]
    assert rates == sorted(rates, reverse=True) and rates[0] > 0.5


def test_acceptance_counts_leading_matches(monkeypatch):
    """A drafter whose chains are known: accepted = the drafts matching before the first
    miss, +1 for the bonus token."""
    ex = te.Examples(taps=np.zeros((1, 8, 3), np.float32), input_ids=np.zeros((1, 8), np.int32),
                     labels=np.array([[5, 6, 7, 8, 9, 10, 11, 12]], np.int32),
                     valid=np.array([[True] * 6 + [False] * 2]), answer_start=np.array([0]))

    drafts = np.array([[5, 6, 0, 8], [6, 0, 8, 9], [7, 8, 9, 10]])  # [k, positions]
    monkeypatch.setattr(te, "make_chain",
                        lambda drafter, k: lambda taps, ids: np.pad(drafts, ((0, 0), (0, 4))))
    got = te.acceptance(None, ex, 3)
    # positions 0..3: all three match; first matches then a miss; a miss; all three
    assert got["positions"] == 4
    assert got["mean_accepted_drafts"] == (3 + 1 + 0 + 3) / 4
    assert got["per_position_acceptance"] == [0.75, 0.5, 0.5]
