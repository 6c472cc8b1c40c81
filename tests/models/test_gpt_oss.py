"""gpt-oss on its fixtures (tests/data/arch/gpt_oss: q/k/v/o biases, attention sinks, a sliding
layer beside a full one, yarn RoPE, top-2 of 8 biased experts with a clamped SwiGLU whose
limit the fixture's activations cross; gpt_oss_mxfp4: the same model with its experts stored
as MXFP4 blocks and scales, as the hub's checkpoints store them): transformers' float32
logits and greedy tokens, batched and one at a time, through each paged-attention kernel and
each MoE implementation, tensor-parallel over 2 simulated devices with the experts kept
packed; MXFP4 decoded bit for bit as transformers decodes it; how config.json is read.
Served: tests/server/test_2026_models_serve.py; every MoE implementation on the float fixture:
test_arch_parity."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jaxserve.backends.cpu.kernels.attention  # noqa: F401 - registers the "cpu" kernel
from jaxserve.backends.base import layer_features_covered
from jaxserve.backends.cpu.layer import FEATURES as CPU_FUSED_LAYER_FEATURES
from jaxserve.models.arch_config import ArchConfig
from jaxserve.models.gpt_oss import mxfp4_kept
from jaxserve.models.layers.linear import QuantizedParam, module_weights
from jaxserve.models.layers.quant import decode_mxfp4
from jaxserve.models.layers.rotary import attention_factor, layer_rope_spec
from jaxserve.models.sharding import DEFAULT_RULES, EXPERT_PARALLEL_RULES
from jaxserve.models.weights import create_model
from jaxserve.parallel.mesh import make_mesh
from tests.models.model_utils import PagedRunner
from tests.models.test_arch_parity import load_fixture

GREEDY_TOKENS = 8


def _seqs(expected) -> list[list[int]]:
    return [expected["tokens_0"].tolist(), expected["tokens_1"].tolist()]


def _assert_logits(out, expected) -> None:
    for i in range(len(out)):
        np.testing.assert_allclose(out[i], expected[f"logits_{i}"], atol=1e-4, rtol=0)


def _generate(runner, seqs, ids) -> tuple[list, list[list[int]]]:
    """Prefill `seqs` (as requests `ids`) in one step, then greedy-decode GREEDY_TOKENS each,
    all together: (each prompt's logits, each continuation)."""
    prompt = runner.step([(i, s, 0) for i, s in zip(ids, seqs)], num_tokens=32, num_reqs=4,
                         pages_per_req=8)
    tokens = [[int(np.argmax(lg[-1]))] for lg in prompt]
    for _ in range(GREEDY_TOKENS - 1):
        out = runner.step([(i, [t[-1]], len(s) + len(t) - 1) for i, s, t in zip(ids, seqs, tokens)],
                          num_tokens=8, num_reqs=4, pages_per_req=8)
        for t, lg in zip(tokens, out):
            t.append(int(np.argmax(lg[-1])))
    return prompt, tokens


def test_greedy_tokens_batched_and_alone_match_transformers(data_dir):
    """Both prompts in one step then decoded side by side: transformers' logits and its
    `generate` tokens; each prompt alone gives the same."""
    cfg, tensors, expected = load_fixture(data_dir, "gpt_oss")
    model = create_model(cfg, dtype=jnp.float32, get_tensor=tensors.__getitem__)
    assert not layer_features_covered(model, CPU_FUSED_LAYER_FEATURES)  # sinks: its own layer
    runner = PagedRunner(model, page_size=4, num_pages=24)
    seqs = _seqs(expected)
    prompt, tokens = _generate(runner, seqs, [0, 1])
    _assert_logits(prompt, expected)
    assert tokens == [expected[f"greedy_{i}"].tolist() for i in range(2)]
    for i in range(2):
        alone_prompt, alone = _generate(runner, [seqs[i]], [2 + i])
        np.testing.assert_allclose(alone_prompt[0], prompt[i], atol=1e-5, rtol=0)
        assert alone == [tokens[i]]


# Each attention kernel (sinks, window, biases) beside one MoE implementation each, on the
# MXFP4 experts (decoded in the step: the whole stack, per (tile, expert) pair, ...).
@pytest.mark.parametrize("impl, moe_impl", [("reference", "dense"), ("tpu-interpret", "ragged"),
                                            ("gpu-interpret", "tiled"),
                                            ("cpu", "tiled-or-dense")])
def test_each_attention_kernel_and_moe_impl_on_mxfp4_experts(data_dir, impl, moe_impl):
    cfg, tensors, expected = load_fixture(data_dir, "gpt_oss_mxfp4")
    model = create_model(cfg, dtype=jnp.float32, get_tensor=tensors.__getitem__,
                         attention_impl=impl, moe_impl=moe_impl)
    assert isinstance(model.layers[0].x_gate, QuantizedParam)
    runner = PagedRunner(model, page_size=8, num_pages=8)
    seqs = _seqs(expected)
    _assert_logits(runner.step([(0, seqs[0], 0), (1, seqs[1], 0)], num_tokens=32, num_reqs=4,
                               pages_per_req=4), expected)


def test_tensor_parallel_chunked_prefill_and_decode_with_packed_experts(data_dir):
    """Over 2 simulated devices (heads, sinks, the experts' intermediate dim and its MXFP4
    exponent blocks split): the first sequence in chunks of 5, then token by token while the
    second prefills in chunks of 3 beside it; the sliding layer's window spans earlier
    steps; the logits stay transformers' (on the decoded weights)."""
    cfg, tensors, expected = load_fixture(data_dir, "gpt_oss_mxfp4")
    mesh = make_mesh(1, 2)
    model = create_model(cfg, dtype=jnp.float32, get_tensor=tensors.__getitem__, mesh=mesh)
    layer = model.layers[0]
    assert layer.wq[...].sharding.spec == P(None, "model", None)
    assert layer.sinks[...].sharding.spec == P("model")
    assert layer.x_down[...].dtype == jnp.uint8
    assert layer.x_down[...].sharding.spec == P(None, "model", None)  # codes [X, F / 2, E]
    assert layer.x_down_qscale[...].sharding.spec == P(None, "model", None)  # [X, F / 32, E]
    runner = PagedRunner(model, page_size=4, num_pages=16, seed=1, mesh=mesh)
    a, b = _seqs(expected)
    out = [[], []]
    plan = [[(0, 0, 5)], [(0, 5, 10)], [(0, 10, 11), (1, 0, 3)], [(0, 11, 12), (1, 3, 6)],
            [(0, 12, 13), (1, 6, 7)]]
    for step in plan:
        chunks = [(s, (a, b)[s][lo:hi], lo) for s, lo, hi in step]
        for (s, _, _), logits in zip(chunks, runner.step(chunks, num_tokens=16, num_reqs=4,
                                                         pages_per_req=4)):
            out[s].append(logits)
    _assert_logits([np.concatenate(o) for o in out], expected)


# ------------------------------------------------------------------ MXFP4


def _bits(a) -> np.ndarray:
    return np.asarray(a, np.float32).view(np.uint32)


def test_mxfp4_experts_decode_bit_for_bit_as_transformers(data_dir):
    """Layer 0's blocks and scales: the loader's decoding, and the packed device weights'
    (as the step decodes them), equal transformers' `convert_moe_packed_tensors` bit for bit
    ([X, in, out]; gate_up's columns: gate and up interleaved)."""
    _, tensors, expected = load_fixture(data_dir, "gpt_oss_mxfp4")
    pre = "model.layers.0.mlp.experts."
    for proj in ("gate_up_proj", "down_proj"):
        want = expected[f"decoded_{proj}"]
        got = np.swapaxes(decode_mxfp4(tensors[pre + proj + "_blocks"],
                                       tensors[pre + proj + "_scales"]), 1, 2)
        assert got.shape == want.shape and np.abs(want).max() > 0
        np.testing.assert_array_equal(_bits(got), _bits(want))
    cfg, _, _ = load_fixture(data_dir, "gpt_oss_mxfp4")
    model = create_model(cfg, dtype=jnp.float32, get_tensor=tensors.__getitem__)
    p = module_weights(model.layers[0])
    decoded = jax.jit(lambda ws: [w.dequantize() for w in ws])
    gate, up, down = (np.asarray(w) for w in decoded([p["x_gate"], p["x_up"], p["x_down"]]))
    gate_up = expected["decoded_gate_up_proj"]
    np.testing.assert_array_equal(_bits(gate), _bits(gate_up[..., 0::2]))
    np.testing.assert_array_equal(_bits(up), _bits(gate_up[..., 1::2]))
    np.testing.assert_array_equal(_bits(down), _bits(expected["decoded_down_proj"]))


def test_mxfp4_experts_upcast_where_blocks_do_not_split(data_dir):
    """Over 4 devices each device's slice of the intermediate dim (64 / 4) is half a block:
    the experts are decoded at load, float, and the logits are the same."""
    cfg, tensors, expected = load_fixture(data_dir, "gpt_oss_mxfp4")
    rules = dict(DEFAULT_RULES)
    assert mxfp4_kept(cfg, None, make_mesh(1, 2), rules)
    assert not mxfp4_kept(cfg, None, make_mesh(1, 4), rules)
    assert not mxfp4_kept(cfg, "int8", None, rules)
    mesh = make_mesh(1, 4)
    model = create_model(cfg, dtype=jnp.float32, get_tensor=tensors.__getitem__, mesh=mesh)
    assert model.layers[0].x_down[...].dtype == jnp.float32
    runner = PagedRunner(model, page_size=8, num_pages=8, mesh=mesh)
    seqs = _seqs(expected)
    _assert_logits(runner.step([(0, seqs[0], 0), (1, seqs[1], 0)], num_tokens=32, num_reqs=4,
                               pages_per_req=4), expected)


def test_the_fixture_crosses_the_swiglu_clamp(data_dir):
    """The fixture's limit (0.5) matters: with gpt-oss's usual 7 the logits move far off."""
    cfg, tensors, expected = load_fixture(data_dir, "gpt_oss")
    model = create_model(dataclasses.replace(cfg, swiglu_limit=7.0), dtype=jnp.float32,
                         get_tensor=tensors.__getitem__, moe_impl="dense")
    out = PagedRunner(model, page_size=8, num_pages=8).step(
        [(0, _seqs(expected)[0], 0)], num_tokens=16, num_reqs=4, pages_per_req=4)
    assert np.abs(out[0] - expected["logits_0"]).max() > 1e-2


# ------------------------------------------------------------------ config.json

# gpt-oss-20b's config.json (transformers 4.55's keys: rope_scaling, experts_per_token)
HUB = {
    "architectures": ["GptOssForCausalLM"], "attention_bias": True, "eos_token_id": 200002,
    "experts_per_token": 4, "head_dim": 64, "hidden_act": "silu", "hidden_size": 2880,
    "initial_context_length": 4096, "intermediate_size": 2880,
    "layer_types": ["sliding_attention", "full_attention"] * 12,
    "max_position_embeddings": 131072, "model_type": "gpt_oss", "num_attention_heads": 64,
    "num_experts_per_tok": 4, "num_hidden_layers": 24, "num_key_value_heads": 8,
    "num_local_experts": 32, "pad_token_id": 199999,
    "quantization_config": {"modules_to_not_convert": ["model.layers.*.self_attn",
                                                       "model.layers.*.mlp.router",
                                                       "model.embed_tokens", "lm_head"],
                            "quant_method": "mxfp4"},
    "rms_norm_eps": 1e-05,
    "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0,
                     "original_max_position_embeddings": 4096, "rope_type": "yarn",
                     "truncate": False},
    "rope_theta": 150000, "sliding_window": 128, "swiglu_limit": 7.0,
    "tie_word_embeddings": False, "vocab_size": 201088,
}


def test_hub_config_reads_as_transformers_builds_it():
    cfg = ArchConfig.from_hf(HUB)
    assert cfg.mxfp4_experts and cfg.weight_format is None
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size) == (32, 4, 2880)
    assert cfg.qkv_bias and cfg.o_bias and not cfg.tie_word_embeddings
    assert [cfg.layer_window(i) for i in range(4)] == [128, None, 128, None]
    assert (cfg.swiglu_limit, cfg.swiglu_alpha, cfg.head_dim) == (7.0, 1.702, 64)
    spec = layer_rope_spec(cfg, 0)
    assert spec.theta == 150000.0 and spec.scaling.rope_type == "yarn"
    assert (spec.scaling.factor, spec.scaling.truncate) == (32.0, False)
    assert spec.scaling.original_max_position_embeddings == 4096
    assert attention_factor(spec) == pytest.approx(0.1 * np.log(32) + 1)
    # an expert's contracted dims are 90 blocks of 32: kept packed over 2 devices, not 4;
    # over 8 with the experts split whole (expert-parallel)
    assert mxfp4_kept(cfg, None, make_mesh(1, 2), dict(DEFAULT_RULES))
    assert not mxfp4_kept(cfg, None, make_mesh(1, 4), dict(DEFAULT_RULES))
    assert mxfp4_kept(cfg, None, make_mesh(1, 8), dict(EXPERT_PARALLEL_RULES))


def test_transformers_defaults_for_keys_left_out():
    """GptOssConfig's defaults: the even layers slide (window 128), yarn x32 over 4096
    positions without truncation on theta 150000, attention biases on, swiglu 7 / 1.702."""
    minimal = {k: HUB[k] for k in ("architectures", "hidden_size", "intermediate_size",
                                   "num_attention_heads", "num_hidden_layers",
                                   "num_local_experts", "vocab_size")}
    cfg = ArchConfig.from_hf(minimal)
    assert cfg.layer_types[:2] == ("sliding_attention", "full_attention")
    assert cfg.sliding_window == 128 and cfg.qkv_bias and cfg.o_bias
    assert (cfg.head_dim, cfg.num_experts_per_tok, cfg.swiglu_limit) == (64, 4, 7.0)
    assert not cfg.mxfp4_experts
    rope = cfg.rope_scaling
    assert (cfg.rope_theta, rope.rope_type, rope.factor, rope.truncate) == (150000.0, "yarn",
                                                                           32.0, False)
    assert rope.original_max_position_embeddings == 4096


def test_mxfp4_checkpoints_of_other_architectures_are_refused():
    with pytest.raises(ValueError, match="MXFP4 checkpoints are supported for GptOssForCausalLM"):
        ArchConfig.from_hf({**HUB, "architectures": ["MixtralForCausalLM"],
                            "num_experts_per_tok": 2})
