"""The EAGLE-3 drafter (models/eagle3.py) against speculators' own implementation.

The fixture tests/data/arch/eagle3_llama (a draft head for the `llama` fixture, written by
speculators' `save_pretrained`; see scripts/make_arch_fixtures.py) holds the outputs of
speculators' torch forward: three draft steps over every position of a 13-token sequence at
once, step k's query at position i seeing the context up to i and its own chain's earlier
drafts at i, the inputs of step k the sequence shifted by k. The same checkpoint converted into
the original EAGLE-3 layout (`midlayer.*`, no embedding table) loads to the same weights.
"""

from __future__ import annotations

import json
import pathlib
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file, save_file

from jaxserve.models.arch_config import ArchConfig
from jaxserve.models.eagle3 import DenseKV, Eagle3Config, default_aux_layer_ids
from jaxserve.models.eagle3_checkpoint import load_eagle3
from jaxserve.models.layers.norm import rms_norm
from jaxserve.models.sharding import single_device_mesh
from jaxserve.models.weights import create_model
from jaxserve.runner.kv_cache import allocate_kv_cache
from jaxserve.runner.step_inputs import StepRequest, pack_step

DATA = pathlib.Path(__file__).resolve().parent.parent / "data" / "arch"
DRAFTER, TARGET = DATA / "eagle3_llama", DATA / "llama"


@pytest.fixture(scope="module")
def expected():
    return load_file(str(DRAFTER / "expected.safetensors"))


@pytest.fixture(scope="module")
def drafter():
    return load_eagle3(DRAFTER, target=TARGET)


@pytest.fixture(scope="module")
def chain(drafter, expected):
    """Our drafter's three steps on the fixture's inputs."""
    return run_chain(drafter, expected, 3)


def chain_mask(n: int, step: int) -> np.ndarray:
    """[n, (step + 1) * n]: the keys each position's draft of `step` sees, as speculators'
    training forward lays them out (step 0's keys causally, then each later step's diagonal)."""
    causal = np.tril(np.ones((n, n), bool))
    blocks = [causal] + [np.eye(n, dtype=bool)] * step
    return np.concatenate(blocks, axis=1)


def jitted(drafter):
    """The drafter's dense step, compiled (one compilation per shape beats op-by-op's)."""
    graphdef, state = nnx.split(drafter)
    fwd = jax.jit(lambda state, *args: nnx.merge(graphdef, state)(*args))
    return lambda *args: fwd(state, *args)


def run_chain(drafter, expected, steps: int):
    """Our drafter on the fixture's inputs, step by step: [DraftStep per step]."""
    ids, pos = expected["input_ids"], expected["positions"]
    n = len(ids)
    hidden = drafter.combine_hidden(jnp.asarray(expected["aux_hidden"]))
    kv = DenseKV.empty(drafter.config)
    out = []
    forward = jitted(drafter)
    for k in range(steps):
        step_ids = np.concatenate([ids[k:], np.zeros(k, np.int32)])
        step, kv = forward(jnp.asarray(step_ids), jnp.asarray(pos + k), hidden, kv,
                           jnp.asarray(chain_mask(n, k)))
        out.append(step)
        hidden = step.hidden
    return out


def write_checkpoint(dir_: pathlib.Path, config: dict, tensors: dict) -> pathlib.Path:
    dir_.mkdir(parents=True, exist_ok=True)
    (dir_ / "config.json").write_text(json.dumps(config))
    save_file(tensors, str(dir_ / "model.safetensors"))
    return dir_


def original_layout(dir_: pathlib.Path, *, aux_ids=(0, 1, 2)) -> pathlib.Path:
    """The fixture as the original EAGLE-3 repositories ship a head: the layer's Llama config
    (transformers 4's keys) with architectures LlamaForCausalLMEagle3 and draft_vocab_size,
    `midlayer.*`, no table."""
    spec_cfg = json.loads((DRAFTER / "config.json").read_text())
    cfg = {**spec_cfg["transformer_layer_config"], "architectures": ["LlamaForCausalLMEagle3"],
           "draft_vocab_size": spec_cfg["draft_vocab_size"]}
    rope = dict(cfg.pop("rope_parameters"))  # written by transformers 4: rope_theta, rope_scaling
    cfg["rope_theta"], cfg["rope_scaling"] = rope.pop("rope_theta"), rope
    if aux_ids is not None:
        cfg["eagle_aux_hidden_state_layer_ids"] = list(aux_ids)
    tensors = {k.replace("layers.0.", "midlayer."): v
               for k, v in load_file(str(DRAFTER / "model.safetensors")).items()
               if k != "embed_tokens.weight"}
    return write_checkpoint(dir_, cfg, tensors)


def test_logits_match_speculators(chain, expected):
    """Three chained draft steps: logits over the draft vocabulary (float32, 1e-4), the layer's
    output fed to the next step, and the greedy draft ids equal speculators'."""
    for k, step in enumerate(chain):
        np.testing.assert_allclose(np.asarray(step.logits), expected["logits"][k],
                                   atol=1e-4, rtol=0)
        np.testing.assert_allclose(np.asarray(step.hidden), expected["layer_out"][k],
                                   atol=1e-4, rtol=0)
        np.testing.assert_array_equal(np.asarray(step.draft_ids), expected["draft_ids"][k])


def test_norm_options_match_speculators(expected, tmp_path):
    """The same weights with norm_before_residual (the residual is the normed hidden state) and
    norm_output (EAGLE 3.1: the next step takes the normed output) on, as config.json says."""
    path = _speculators(tmp_path, edit_config=lambda c: c.update(norm_before_residual=True,
                                                                 norm_output=True))
    steps = run_chain(load_eagle3(path), expected, 3)
    for k, step in enumerate(steps):
        np.testing.assert_allclose(np.asarray(step.logits), expected["logits_norm_options"][k],
                                   atol=1e-4, rtol=0)
    assert np.abs(expected["logits_norm_options"] - expected["logits"]).max() > 0.1


def test_one_chain_with_the_default_mask(drafter, expected):
    """Inference's shape: a context pass over the sequence, then one chain from its last
    position, each step a single token seeing all earlier keys (the default mask) — the same
    logits as that position's entries in the all-positions fixture."""
    ids, n = expected["input_ids"], len(expected["input_ids"])
    hidden = drafter.combine_hidden(jnp.asarray(expected["aux_hidden"]))
    forward = jitted(drafter)
    step, kv = forward(jnp.asarray(ids), jnp.asarray(expected["positions"]), hidden,
                       DenseKV.empty(drafter.config))
    last = step
    for k in (1, 2):  # the fixture pads position n-1's later inputs with token 0
        last, kv = forward(jnp.asarray([0], jnp.int32), jnp.asarray([n - 1 + k], jnp.int32),
                           last.hidden[-1:], kv)
        np.testing.assert_allclose(np.asarray(last.logits[0]), expected["logits"][k][n - 1],
                                   atol=1e-4, rtol=0)
    assert kv.k.shape[0] == n + 2


def test_paged_step_matches_speculators(drafter, expected):
    """The drafter over its own paged cache, as the engine would run it: a context pass for
    two requests in one ragged batch (the sequence and its first 7 tokens), then two chain
    steps of the first request's last position, one token each — speculators' logits."""
    ids, n = expected["input_ids"].tolist(), len(expected["input_ids"])
    first = np.asarray(drafter.combine_hidden(jnp.asarray(expected["aux_hidden"])))
    kv = allocate_kv_cache(drafter.config.layer, 8, 4, jnp.float32, single_device_mesh())
    k_cache, v_cache = kv.k[0], kv.v[0]
    graphdef, state = nnx.split(drafter)

    @jax.jit
    def step(state, k_cache, v_cache, inputs, hidden):
        out, k_cache, v_cache = nnx.merge(graphdef, state).paged_step(
            inputs.input_ids, inputs.positions, hidden, k_cache, v_cache, inputs.md)
        return out, k_cache, v_cache

    def run(reqs, hidden, num_tokens):
        inputs = pack_step(reqs, num_tokens=num_tokens, num_reqs=2, pages_per_req=4, page_size=4)
        padded = np.zeros((num_tokens, hidden.shape[1]), np.float32)
        padded[: len(hidden)] = hidden
        return step(state, k_cache, v_cache, jax.tree.map(jnp.asarray, inputs), jnp.asarray(padded))

    reqs = [StepRequest(ids, 0, [4, 1, 6, 3]), StepRequest(ids[:7], 0, [2, 7])]
    out, k_cache, v_cache = run(reqs, np.concatenate([first, first[:7]]), 32)
    logits = np.asarray(out.logits)
    np.testing.assert_allclose(logits[:n], expected["logits"][0], atol=1e-4, rtol=0)
    np.testing.assert_allclose(logits[n:n + 7], expected["logits"][0][:7], atol=1e-4, rtol=0)
    hidden = np.asarray(out.hidden)[n - 1:n]
    for k in (1, 2):  # the fixture pads position n-1's later inputs with token 0
        out, k_cache, v_cache = run([StepRequest([0], n - 1 + k, [4, 1, 6, 3])], hidden, 8)
        np.testing.assert_allclose(np.asarray(out.logits)[0], expected["logits"][k][n - 1],
                                   atol=1e-4, rtol=0)
        hidden = np.asarray(out.hidden)[:1]


def test_d2t_maps_draft_ids_to_target_ids(drafter, chain, expected):
    """Draft id d is target id d + d2t[d]: onto exactly the ids t2d marks, in order; a step's
    target ids are its draft ids mapped."""
    t2d = np.asarray(load_file(str(DRAFTER / "model.safetensors"))["t2d"])
    vd = drafter.config.draft_vocab_size
    mapped = np.asarray(drafter.draft_to_target(jnp.arange(vd)))
    np.testing.assert_array_equal(mapped, np.flatnonzero(t2d))
    assert vd == 42 and mapped[-1] > vd  # a reduced vocabulary: the offsets matter
    for k, step in enumerate(chain):
        np.testing.assert_array_equal(np.asarray(step.target_ids),
                                      np.flatnonzero(t2d)[expected["draft_ids"][k]])


def test_draft_embeddings_are_the_drafted_tokens_rows(drafter):
    """A chained pass reads its tokens' rows from the draft vocabulary's rows (not the whole
    table): the same rows `embed_tokens` gives, for every draft id, in any order."""
    vd = drafter.config.draft_vocab_size
    ids = drafter.draft_to_target(jnp.asarray(np.random.default_rng(0).permutation(vd)))
    rows = drafter.draft_vocab_embeddings()
    assert rows.shape == (vd, drafter.config.layer.hidden_size) and rows.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(drafter.draft_embeddings(rows, ids)),
                                  np.asarray(drafter.embed_tokens(ids)))


def test_both_layouts_load_the_same_weights(drafter, tmp_path):
    """The original layout (midlayer.*, the table from the target) gives the same parameters,
    leaf by leaf, as the speculators layout (which ships the target's table)."""
    other = load_eagle3(original_layout(tmp_path / "orig"), target=TARGET)
    assert other.config.layout == "eagle3" and drafter.config.layout == "speculators"
    assert other.config.layer == drafter.config.layer  # RoPE (llama3 scaling) included
    ours = {p: np.asarray(v) for p, v in jax.tree_util.tree_leaves_with_path(nnx.state(drafter))}
    theirs = {p: np.asarray(v) for p, v in jax.tree_util.tree_leaves_with_path(nnx.state(other))}
    assert ours.keys() == theirs.keys() and len(ours) == 16
    for path, value in ours.items():
        np.testing.assert_array_equal(theirs[path], value, err_msg=str(path))


def test_config_fields(drafter):
    cfg = drafter.config
    assert (cfg.hidden_size, cfg.draft_vocab_size, cfg.target_vocab_size) == (64, 42, 128)
    assert cfg.aux_layer_ids == (0, 1, 2) and cfg.num_aux == 3
    assert not cfg.norm_before_residual and not cfg.norm_output
    assert default_aux_layer_ids(32) == (2, 16, 29)


def _speculators(tmp_path, edit_config=None, edit_tensors=None, name="bad"):
    cfg = json.loads((DRAFTER / "config.json").read_text())
    tensors = load_file(str(DRAFTER / "model.safetensors"))
    if edit_config:
        edit_config(cfg)
    if edit_tensors:
        edit_tensors(tensors)
    return write_checkpoint(tmp_path / name, cfg, tensors)


def _target_with(tmp_path, **changes):
    d = tmp_path / "target"
    d.mkdir()
    cfg = json.loads((TARGET / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, **changes}))
    shutil.copy(TARGET / "model.safetensors", d / "model.safetensors")
    return d


def test_refuses_a_missing_tensor(tmp_path):
    path = _speculators(tmp_path, edit_tensors=lambda t: t.pop("lm_head.weight"))
    with pytest.raises(ValueError, match=r"\(speculators layout\) lacks lm_head.weight"):
        load_eagle3(path)


def test_refuses_a_hidden_size_other_than_the_targets(tmp_path):
    with pytest.raises(ValueError, match=r"hidden size \(64\) differs from the target's \(96\)"):
        load_eagle3(DRAFTER, target=_target_with(tmp_path, hidden_size=96))


def test_refuses_a_target_vocabulary_of_another_size(tmp_path):
    with pytest.raises(ValueError, match=r"target vocabulary \(128\) differs from the target's "
                                         r"vocab_size \(256\)"):
        load_eagle3(DRAFTER, target=_target_with(tmp_path, vocab_size=256))


def test_refuses_default_layer_ids_a_small_target_lacks(tmp_path):
    """A head naming no target layers reads (2, L // 2, L - 3): impossible for 2 layers."""
    with pytest.raises(ValueError, match=r"reads target layers \[2, 1, -1\].*within \[0, 2\]"):
        load_eagle3(original_layout(tmp_path / "orig", aux_ids=None), target=TARGET)


def test_refuses_tensors_its_config_does_not_describe(tmp_path):
    """Two target layers named, three layers' worth of fc inputs stored."""
    path = _speculators(tmp_path,
                        edit_config=lambda c: c.update(eagle_aux_hidden_state_layer_ids=[0, 1]))
    with pytest.raises(ValueError, match=r"does not match its config.json: fc.weight \(64, 192\) "
                                         r"\(expected \(64, 128\)\)"):
        load_eagle3(path)


def test_refuses_inconsistent_vocabulary_maps(tmp_path):
    def shift(t):
        t["d2t"] = t["d2t"] + 1  # now maps onto ids t2d does not mark

    with pytest.raises(ValueError, match="d2t and t2d disagree"):
        load_eagle3(_speculators(tmp_path, edit_tensors=shift))
    with pytest.raises(ValueError, match="lacks the d2t and t2d mapping"):
        load_eagle3(_speculators(tmp_path, edit_tensors=lambda t: [t.pop("d2t"), t.pop("t2d")],
                                 name="nomap"))


def test_refuses_a_head_without_table_or_target(tmp_path):
    with pytest.raises(ValueError, match="ships no embed_tokens.weight; pass the target model"):
        load_eagle3(original_layout(tmp_path / "orig"))


def test_speculators_layer_config_saved_as_a_diff_from_llamas_defaults():
    """speculators writes `transformer_layer_config` without the values equal to LlamaConfig's
    defaults: Llama 3.1 8B's head leaves out hidden_size 4096 and 32 heads."""
    cfg = Eagle3Config.from_hf({
        "speculators_model_type": "eagle3", "draft_vocab_size": 32000,
        "transformer_layer_config": {"model_type": "llama", "num_hidden_layers": 1,
                                     "vocab_size": 128256, "intermediate_size": 14336,
                                     "num_key_value_heads": 8, "rms_norm_eps": 1e-5}})
    layer = cfg.layer
    shape = (layer.hidden_size, layer.num_heads, layer.num_kv_heads, layer.head_dim)
    assert shape == (4096, 32, 8, 128)
    assert (cfg.draft_vocab_size, cfg.target_vocab_size, cfg.aux_layer_ids) == (32000, 128256, None)


@pytest.mark.parametrize("config, message", [
    ({"architectures": ["LlamaForCausalLM"]}, r"not an EAGLE-3 drafter config \(architectures "
                                              r"\['LlamaForCausalLM'\]\)"),
    ({"speculators_model_type": "dflash"}, r"a 'dflash' speculator checkpoint; only 'eagle3'"),
    ({"speculators_model_type": "eagle3"}, "has no transformer_layer_config"),
    ({"speculators_model_type": "eagle3", "norm_before_fc": True,
      "transformer_layer_config": {"model_type": "llama"}},
     "norm_before_fc=true are not supported"),
    ({"speculators_model_type": "eagle3", "transformer_layer_config": {"model_type": "qwen3"}},
     r"a 'qwen3' decoder layer are not supported"),
    ({"speculators_model_type": "eagle3",
      "transformer_layer_config": {"model_type": "llama", "num_hidden_layers": 2}},
     "with 2 decoder layers are not supported"),
    ({"speculators_model_type": "eagle3", "target_hidden_size": 2048,
      "transformer_layer_config": {"model_type": "llama", "num_hidden_layers": 1}},
     r"target_hidden_size \(2048\) differs from its hidden_size \(4096\)"),
    ({"architectures": ["LlamaForCausalLMEagle3"], "hidden_size": 64},
     "config.json lacks vocab_size, intermediate_size, num_hidden_layers, num_attention_heads"),
])
def test_refuses_configs_it_cannot_run(config, message):
    with pytest.raises(ValueError, match=message):
        Eagle3Config.from_hf(config)


@pytest.fixture(scope="module")
def target(expected):
    """The `llama` target over the fixture's sequence, tapping layers (1, 0, 2)."""
    return target_forward(expected["input_ids"].tolist(), (1, 0, 2))


def target_forward(seq: list[int], taps: tuple[int, ...]):
    """The `llama` target over one sequence through the paged path, with `taps`:
    (final hidden [T, E], taps [T, len(taps) * E], the model)."""
    cfg = ArchConfig.from_hf(json.loads((TARGET / "config.json").read_text()))
    tensors = load_file(str(TARGET / "model.safetensors"))
    model = create_model(cfg, dtype=jnp.float32, get_tensor=tensors.__getitem__)
    kv = allocate_kv_cache(cfg, 8, 4, jnp.float32, single_device_mesh())
    inputs = pack_step([StepRequest(token_ids=seq, start_pos=0, block_ids=[1, 2, 3, 4])],
                       num_tokens=16, num_reqs=2, pages_per_req=4, page_size=4)
    graphdef, state = nnx.split(model)

    @jax.jit
    def fwd(state, kv, inputs):
        m = nnx.merge(graphdef, state)
        h, _, tapped = m(inputs.input_ids, inputs.positions, kv, inputs.md, taps=taps)
        return h, tapped

    h, tapped = fwd(state, kv, jax.tree.map(jnp.asarray, inputs))
    return np.asarray(h)[: len(seq)], np.asarray(tapped)[: len(seq)], model


def test_target_taps_match_transformers_hidden_states(expected, target):
    """The Llama forward's taps (layer id i: the residual stream entering layer i) equal
    transformers' `hidden_states[i]`, in the order asked; id L is the last layer's output
    before the final norm (transformers' last entry is after it). Taps leave the final hidden
    state as it was."""
    ref = expected["target_hidden"]  # [L + 1, T, E]
    h, tapped, model = target
    E = ref.shape[-1]
    np.testing.assert_allclose(tapped[:, :E], ref[1], atol=1e-5, rtol=0)
    np.testing.assert_allclose(tapped[:, E:2 * E], ref[0], atol=1e-6, rtol=0)
    last = rms_norm(jnp.asarray(tapped[:, 2 * E:]), model.final_norm[...],
                    model.config.rms_norm_eps)
    np.testing.assert_allclose(np.asarray(last), ref[2], atol=1e-5, rtol=0)
    np.testing.assert_allclose(h, ref[2], atol=1e-5, rtol=0)
    assert np.abs(tapped[:, 2 * E:] - ref[2]).max() > 0.1  # the tap is before the norm


def test_taps_out_of_range_are_refused(target):
    model = target[2]
    with pytest.raises(ValueError, match=r"taps \[0, 3\] must be layer ids within \[0, 2\]"):
        model(jnp.zeros(4, jnp.int32), jnp.arange(4), None, None, taps=(0, 3))
