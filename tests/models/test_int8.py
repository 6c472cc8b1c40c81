"""Weight-only int8: the weights stay int8 on the device, products convert them inside the
dot, logits stay close to the float model's; sharded == unsharded; packing skips them. And a
GPU's one-row products (computed on two rows) give the one-row values."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jaxserve.models import interface as features
from jaxserve.models.arch_config import ArchConfig
from jaxserve.models.layers.linear import (
    QuantizedParam,
    QuantizedWeight,
    dense,
    dequantize,
    embedding_lookup,
    quantize_int8,
)
from jaxserve.models.sharding import single_device_mesh
from jaxserve.models.weights import create_model

from jaxserve.backends.cpu import layer as cpu_layer
from jaxserve.backends.base import DevicePlan
from jaxserve.backends.cpu import CpuBackend
from jaxserve.parallel.mesh import make_mesh
from tests.models.model_utils import PagedRunner
from tests.models.test_arch_parity import load_fixture


@pytest.mark.parametrize("spec,shape", [("te,ehd->thd", (64, 4, 16)), ("thd,hde->te", (4, 16, 96)),
                                        ("te,ef->tf", (64, 128)), ("ne,ve->nv", (160, 64))])
def test_per_channel_product_equals_dequantized(spec, shape):
    rng = np.random.default_rng(0)
    w = rng.standard_normal(shape).astype(np.float32)
    q, s = quantize_int8(w, spec)
    assert q.dtype == np.int8 and s.dtype == np.float32 and q.ndim == s.ndim
    deq = np.asarray(dequantize(jnp.asarray(q), jnp.asarray(s), jnp.float32))
    assert np.abs(deq - w).max() <= np.abs(w).max() / 127 * 0.5 + 1e-6  # half a step at most
    xs = spec.split(",")[0]
    x = jnp.asarray(rng.standard_normal([{"t": 5, "n": 5}.get(c, 0) or dict(zip(spec.split(",")[1].split("->")[0], shape))[c] for c in xs]), jnp.float32)
    got = dense(spec, x, QuantizedWeight(jnp.asarray(q), jnp.asarray(s), "float32"))
    np.testing.assert_allclose(np.asarray(got), np.asarray(dense(spec, x, jnp.asarray(deq))), rtol=1e-5, atol=1e-4)



@pytest.mark.parametrize("spec,shape", [("te,ehd->thd", (64, 4, 16)), ("thd,hde->te", (4, 16, 96)),
                                        ("te,ef->tf", (64, 128))])
def test_a_gpus_two_row_product_of_one_row_is_the_one_row_product(spec, shape, monkeypatch):
    """On a GPU `dense` computes a one-row product on two rows (the row and a zero row) and
    keeps the first (XLA:GPU's one-row products reread their weights): here the GPU's branch is
    taken on the CPU, for float and int8 weights, and gives the one-row product's values."""
    rng = np.random.default_rng(1)
    w = rng.standard_normal(shape).astype(np.float32)
    q, s = quantize_int8(w, spec)
    sizes = dict(zip(spec.split(",")[1].split("->")[0], shape))
    x = jnp.asarray(rng.standard_normal([sizes.get(c, 1) for c in spec.split(",")[0]]), jnp.float32)
    weights = (jnp.asarray(w), QuantizedWeight(jnp.asarray(q), jnp.asarray(s), "float32"))
    one_row = [np.asarray(dense(spec, x, wt)) for wt in weights]
    taken = []

    def the_gpus_branch(*args, cuda, **_):
        taken.append(cuda)
        return cuda(*args)

    monkeypatch.setattr(jax.lax, "platform_dependent", the_gpus_branch)
    for wt, want in zip(weights, one_row):
        got = np.asarray(dense(spec, x, wt))
        assert got.shape == want.shape and got.shape[0] == 1
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)  # the order of the sums
    assert len(taken) == 2

def test_block_scales_like_q8_0():
    rng = np.random.default_rng(1)
    w = rng.standard_normal((64, 96)).astype(np.float32)
    q, s = quantize_int8(w, "te,ef->tf", block=32)
    assert s.shape == (2, 96)
    x = jnp.asarray(rng.standard_normal((3, 64)), jnp.float32)
    deq = dequantize(jnp.asarray(q), jnp.asarray(s), jnp.float32)
    np.testing.assert_allclose(np.asarray(dense("te,ef->tf", x, QuantizedWeight(jnp.asarray(q), jnp.asarray(s)))),
                               np.asarray(x @ deq), rtol=1e-5, atol=1e-5)
    qe, se = quantize_int8(w.T.copy(), "ne,ve->nv", block=32)  # an embedding [V, E] in blocks of 32
    rows = embedding_lookup(QuantizedWeight(jnp.asarray(qe), jnp.asarray(se)), jnp.asarray([0, 5]))
    np.testing.assert_allclose(np.asarray(rows), np.asarray(dequantize(jnp.asarray(qe), jnp.asarray(se), jnp.float32))[[0, 5]])


def test_blocks_span_the_contracted_dims_together():
    """Blocks run over the contracted dims flattened in the weight's axis order (a checkpoint
    row's order): with head_dim 16, a block of 32 of o_proj's input covers two heads."""
    from jaxserve.models.layers.linear import block_scales, scale_shape

    assert scale_shape((4, 16, 96), "thd,hde->te", 32) == (2, 1, 96)
    assert scale_shape((4, 64, 96), "thd,hde->te", 32) == (4, 2, 96)
    assert scale_shape((64, 4, 16), "te,ehd->thd", 32) == (2, 4, 16)
    assert scale_shape((8, 32, 64), "txf,xfe->txe", 32) == (8, 1, 64)
    assert scale_shape((4, 16, 96), "thd,hde->te", None) == (1, 1, 96)
    with pytest.raises(ValueError, match="do not tile"):
        scale_shape((3, 24, 8), "thd,hde->te", 32)
    rng = np.random.default_rng(2)
    rows = rng.standard_normal((96, 64)).astype(np.float32)  # HF o_proj [E, Hq * D]
    w = rows.T.reshape(4, 16, 96)  # ours [Hq, D, E]
    q, s = quantize_int8(w, "thd,hde->te", block=32)
    q_rows, s_rows = quantize_int8(rows, "ti,oi->to", block=32)  # blocks along HF's rows
    np.testing.assert_array_equal(q, q_rows.T.reshape(4, 16, 96))
    np.testing.assert_array_equal(s, s_rows.reshape(96, 2, 1).transpose(1, 2, 0))
    expanded = np.repeat(s_rows, 32, axis=-1).T.reshape(4, 16, 96)  # as the loader derives them
    np.testing.assert_array_equal(block_scales(expanded, s.shape), s)
    with pytest.raises(ValueError, match="not constant"):
        block_scales(rng.standard_normal((4, 16, 96)).astype(np.float32), s.shape)


def _logits(model, expected, mesh=None):
    runner = PagedRunner(model, page_size=4, num_pages=16, mesh=mesh)
    seqs = [expected["tokens_0"].tolist(), expected["tokens_1"].tolist()]
    out = runner.step([(0, seqs[0], 0), (1, seqs[1], 0)], num_tokens=32, num_reqs=4, pages_per_req=8)
    return np.concatenate(out)


@pytest.mark.parametrize("name", ["llama", "gemma3", "qwen3_moe"])
def test_int8_model_close_to_float(data_dir, name):
    cfg, tensors, expected = load_fixture(data_dir, name)
    model = create_model(cfg, dtype=jnp.float32, get_tensor=tensors.__getitem__, quantization="int8")
    assert features.INT8_WEIGHTS in model.layer_features
    layer = model.layers[0]
    assert isinstance(layer.wq, QuantizedParam) and layer.wq[...].dtype == jnp.int8
    assert layer.wq_qscale[...].shape == (1, cfg.num_heads, cfg.head_dim)
    assert model.embed[...].dtype == jnp.int8 and layer.input_norm[...].dtype == jnp.float32
    if name == "qwen3_moe":
        assert layer.w_gate[...].dtype == jnp.int8 and layer.w_gate_qscale[...].shape == (8, 1, 32)
    want = np.concatenate([expected["logits_0"], expected["logits_1"]])
    got = _logits(model, expected)
    # int8 rounding moves the logits by a few percent (these tiny random models have no
    # outliers to protect; MoE routing may flip; gemma3 measured 0.08: its embedding, attention and
    # MLP each contribute ~0.05), never like a wrong model
    rel = np.linalg.norm(got - want) / np.linalg.norm(want)
    assert rel < 0.12
    assert (got.argmax(-1) == want.argmax(-1)).mean() >= 0.85


def test_int8_weights_are_not_packed(data_dir):
    cfg, tensors, expected = load_fixture(data_dir, "llama")
    model = create_model(cfg, dtype=jnp.float32, get_tensor=tensors.__getitem__, quantization="int8")
    backend = CpuBackend()
    before = _logits(model, expected)
    backend.prepare_model(model, DevicePlan("float32", "float32", "cpu", "avx512", "cpu", "ragged"))
    assert not any(isinstance(v, nnx.Param) and type(v).__name__ == "PackedParam"
                   for _, v in nnx.iter_graph(model))
    assert backend.layer_impl(model) is None and not model.layer_features <= cpu_layer.FEATURES
    np.testing.assert_array_equal(_logits(model, expected), before)


def test_int8_sharded_equals_unsharded(data_dir):
    cfg, tensors, expected = load_fixture(data_dir, "llama")
    single = create_model(cfg, dtype=jnp.float32, get_tensor=tensors.__getitem__, quantization="int8",
                          mesh=single_device_mesh())
    mesh = make_mesh(1, 2)
    sharded = create_model(cfg, dtype=jnp.float32, get_tensor=tensors.__getitem__, quantization="int8", mesh=mesh)
    assert sharded.layers[0].w_up[...].sharding.spec[1] == "model"
    assert sharded.layers[0].w_up_qscale[...].sharding.spec[1] == "model"
    np.testing.assert_allclose(_logits(sharded, expected, mesh), _logits(single, expected), atol=1e-4, rtol=0)


def test_random_int8_model_runs():
    cfg = ArchConfig.from_hf(dict(architectures=["LlamaForCausalLM"], vocab_size=64, hidden_size=32,
                                  intermediate_size=64, num_hidden_layers=1, num_attention_heads=2))
    model = create_model(cfg, dtype=jnp.bfloat16, quantization="int8", seed=1)
    assert model.layers[0].w_down[...].dtype == jnp.int8
    assert model.layers[0].w_down.get_metadata()["compute_dtype"] == "bfloat16"
    runner = PagedRunner(model, page_size=4, num_pages=8)
    (out,) = runner.step([(0, [1, 2, 3], 0)], num_tokens=16, num_reqs=1, pages_per_req=2)
    assert np.isfinite(out).all() and np.abs(out).max() > 0


def test_prequantized_checkpoint_is_refused_by_name():
    hf = dict(architectures=["LlamaForCausalLM"], vocab_size=64, hidden_size=32, intermediate_size=64,
              num_hidden_layers=1, num_attention_heads=2,
              quantization_config={"quant_method": "hqq", "bits": 4, "group_size": 128})
    with pytest.raises(ValueError, match="pre-quantized \\(quantization_config: hqq, 4-bit\\)"):
        ArchConfig.from_hf(hf)


def test_unknown_quantization():
    cfg = ArchConfig.from_hf(json.loads('{"architectures": ["LlamaForCausalLM"], "vocab_size": 64, '
                                        '"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, '
                                        '"num_attention_heads": 2}'))
    with pytest.raises(ValueError, match="quantization must be one of"):
        create_model(cfg, quantization="int3")


def test_cli_and_config_take_the_setting():
    from jaxserve.server.cli import build_parser, engine_options

    from jaxserve.config import EngineConfig, ModelConfig

    args = build_parser().parse_args(["serve", "--quantization", "int8"])
    opts = engine_options(args)
    assert opts["quantization"] == "int8"
    assert EngineConfig.from_kwargs(**opts).model.quantization == "int8"
    with pytest.raises(ValueError, match="quantization must be 'int8', 'fp8', 'int4'"):
        ModelConfig(quantization="int3")
    jax.clear_caches()
