"""FP8 (fp8 block-wise, compressed-tensors float8), AWQ and GPTQ checkpoints: loaded in their
own format (float8_e4m3fn or packed int4 on the device), their logits equal the model built
from the reference dequantization of the same checkpoint, greedy tokens equal.

Each fixture is the tiny Llama of tests/data/arch/llama quantized here and written as the
format's tools write it (transformers cannot run these formats on a CPU: its FP8 and
compressed-tensors kernels need a GPU, AWQ and GPTQ need autoawq / gptqmodel's kernels):
- fp8: per [bo, bi] block scale = amax / 448, values (w / scale) as float8_e4m3fn, the scales
  in `weight_scale_inv` (transformers' FineGrainedFP8 / DeepSeek-V3 layout, Qwen3-8B-FP8's
  config keys);
- compressed-tensors: llm-compressor's FP8 schemes, `weight_scale` per channel ([out, 1],
  dynamic per-token activations) or per tensor (with a static `input_scale`, not used);
- AWQ: AutoAWQ's pseudo-quantization (per group: scale = (max - min) / 15 in float16, zero =
  round(-min / scale)), `qweight` [in, out / 8] int32 with WQLinear_GEMM's column order
  0, 2, 4, 6, 1, 3, 5, 7 per word, `qzeros` packed alike, `scales` [in / group, out] float16;
- GPTQ: auto-gptq's symmetric 4-bit (scale = 2 amax / 15, zero 8; round-to-nearest: GPTQ's
  error feedback changes which values, not the layout), `qweight` [in / 8, out] (input row
  8r + j in bits 4j), `qzeros` stored minus one (the v1 format), `g_idx` = i // group.
The reference dequantization is the float32 (q - zero) * scale the quantizer encoded.
"""

from __future__ import annotations

import functools
import json

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx
from jaxserve.models.arch_config import ArchConfig
from jaxserve.backends.cpu import CpuBackend
from jaxserve.config import CacheConfig, ModelConfig
from jax.sharding import NamedSharding, PartitionSpec as P
from jaxserve.backends.base import Backend
from jaxserve.models.layers.linear import (
    QuantizedParam,
    QuantizedProduct,
    QuantizedWeight,
    dense,
    param_weight,
    prepare_fp8_products,
    prepare_quantized_products,
    scale_shape,
)
from jaxserve.models.layers.quant import pack_int4, quantize_fp8_blocks, unpack_int4
from jaxserve.models.llama import LAYER_SPECS
from jaxserve.models.safetensors_io import PlannedTensor, write_streaming
from jaxserve.models.sharding import single_device_mesh
from jaxserve.models.weights import abstract_model, create_model, load_model
from jaxserve.parallel.mesh import make_mesh

from tests.models.model_utils import PagedRunner
from tests.models.test_arch_parity import load_fixture

TINY = dict(architectures=["LlamaForCausalLM"], vocab_size=64, hidden_size=64,
            intermediate_size=128, num_hidden_layers=1, num_attention_heads=4)
PROJ = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
F8 = np.dtype(ml_dtypes.float8_e4m3fn)


def _blocks(w, bo, bi):
    o, i = w.shape
    return w.reshape(o // bo, bo, i // bi, bi)


def fp8_blockwise(w, bo, bi):
    """(tensors by suffix, dequantized) as transformers' FineGrainedFP8 stores a weight."""
    b = _blocks(w, bo, bi)
    scale = (np.abs(b).max(axis=(1, 3), keepdims=True) / 448.0).astype(np.float32)
    q = np.clip(b / scale, -448, 448).astype(F8)
    deq = (q.astype(np.float32) * scale).reshape(w.shape)
    return {"weight": q.reshape(w.shape), "weight_scale_inv": scale[:, 0, :, 0]}, deq


def fp8_channel(w, per_tensor=False):
    """llm-compressor's FP8 (per channel) / FP8 static (per tensor, with an input scale)."""
    amax = np.abs(w).max() if per_tensor else np.abs(w).max(axis=1, keepdims=True)
    scale = np.asarray(amax / 448.0, np.float32).reshape((1,) if per_tensor else (-1, 1))
    q = np.clip(w / scale, -448, 448).astype(F8)
    out = {"weight": q, "weight_scale": scale}
    if per_tensor:
        out["input_scale"] = np.asarray([0.05], np.float32)
    return out, q.astype(np.float32) * scale


def _pack_words(values, order):
    """[rows, cols] 0..15 -> [rows, cols / 8] int32, field i of each word = column order[i]."""
    rows, cols = values.shape
    words = np.zeros((rows, cols // 8), np.uint32)
    for i, c in enumerate(order):
        words |= values[:, c::8].astype(np.uint32) << np.uint32(4 * i)
    return words.view(np.int32)


def awq_gemm(w, group):
    """AutoAWQ's pseudo_quantize_tensor + WQLinear_GEMM.from_linear on an [out, in] weight."""
    out, inn = w.shape
    g = w.reshape(out, inn // group, group)
    hi, lo = g.max(axis=2), g.min(axis=2)
    scale = (np.maximum(hi - lo, 1e-5) / 15).astype(np.float16)  # [out, groups]
    s = scale.astype(np.float32)
    zero = np.clip(-np.round(lo / s), 0, 15)
    q = np.clip(np.round(g / s[..., None]) + zero[..., None], 0, 15).astype(np.uint8)
    q = q.reshape(out, inn)
    deq = ((q.reshape(g.shape) - zero[..., None]) * s[..., None]).reshape(w.shape)
    order = (0, 2, 4, 6, 1, 3, 5, 7)
    return {"qweight": _pack_words(q.T, order),
            "qzeros": _pack_words(zero.T.astype(np.uint8), order),
            "scales": scale.T.copy()}, deq.astype(np.float32)


def gptq_v1(w, group):
    """auto-gptq's symmetric 4-bit QuantLinear.pack on an [out, in] weight (desc_act false)."""
    out, inn = w.shape
    g = w.reshape(out, inn // group, group)
    scale = (2 * np.abs(g).max(axis=2) / 15).astype(np.float16)  # [out, groups]
    s = scale.astype(np.float32)
    zero = np.full(s.shape, 8.0, np.float32)
    q = np.clip(np.round(g / s[..., None]) + 8, 0, 15).astype(np.uint8).reshape(out, inn)
    deq = ((q.reshape(g.shape).astype(np.float32) - 8) * s[..., None]).reshape(w.shape)
    qt = q.T  # [in, out]
    qweight = np.zeros((inn // 8, out), np.uint32)
    for j in range(8):
        qweight |= qt[j::8].astype(np.uint32) << np.uint32(4 * j)
    stored_zero = (zero - 1).T.astype(np.uint8)  # the v1 format's offset
    return {"qweight": qweight.view(np.int32), "qzeros": _pack_words(stored_zero, range(8)),
            "scales": scale.T.copy(),
            "g_idx": (np.arange(inn) // group).astype(np.int32)}, deq.astype(np.float32)




def gptq_act_order(w, group, seed=0):
    """auto-gptq's desc_act true layout: inputs assigned to groups in a permuted order
    (`g_idx`), qweight rows still in input order; symmetric as `gptq_v1`."""
    out, inn = w.shape
    g_idx = np.empty(inn, np.int32)
    g_idx[np.random.default_rng(seed).permutation(inn)] = np.arange(inn) // group
    scale = np.stack([2 * np.abs(w[:, g_idx == k]).max(axis=1) / 15
                      for k in range(inn // group)], axis=1).astype(np.float16)  # [out, groups]
    s = scale.astype(np.float32)[:, g_idx]
    q = np.clip(np.round(w / s) + 8, 0, 15).astype(np.uint8)
    deq = (q.astype(np.float32) - 8) * s
    qweight = np.zeros((inn // 8, out), np.uint32)
    for j in range(8):
        qweight |= q.T[j::8].astype(np.uint32) << np.uint32(4 * j)
    stored_zero = np.full((inn // group, out), 7, np.uint8)
    return {"qweight": qweight.view(np.int32), "qzeros": _pack_words(stored_zero, range(8)),
            "scales": scale.T.copy(), "g_idx": g_idx}, deq.astype(np.float32)


def _ct(strategy: str, activations: dict) -> dict:
    """A compressed-tensors quantization_config as llm-compressor writes it for float8."""
    weights = {"num_bits": 8, "type": "float", "strategy": strategy, "symmetric": True,
               "dynamic": False}
    return {"quant_method": "compressed-tensors", "format": "float-quantized",
            "quantization_status": "compressed", "ignore": ["lm_head"],
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights,
                                          "input_activations": activations}}}


FORMATS = {
    "fp8-block": (lambda w: fp8_blockwise(w, 32, 32),
                  {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                   "weight_block_size": [32, 32]}),
    "ct-fp8-channel": (fp8_channel, _ct("channel", {"num_bits": 8, "type": "float",
                                                    "strategy": "token", "dynamic": True})),
    "ct-fp8-tensor-static": (lambda w: fp8_channel(w, per_tensor=True),
                             _ct("tensor", {"num_bits": 8, "type": "float", "strategy": "tensor",
                                            "dynamic": False})),
    "awq": (lambda w: awq_gemm(w, 32),
            {"quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": True,
             "version": "gemm"}),
    "gptq": (lambda w: gptq_v1(w, 32),
             {"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": False, "sym": True,
              "checkpoint_format": "gptq"}),
    "gptq-act-order": (lambda w: gptq_act_order(w, 32),
                       {"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": True,
                        "sym": True, "checkpoint_format": "gptq"}),
}


def write_checkpoint(path, data_dir, name):
    """The llama fixture in format `name` at `path`; returns (float tensors of the reference
    dequantization, transformers' expected outputs of the float model)."""
    quantize, qc = FORMATS[name]
    config = json.loads((data_dir / "arch" / "llama" / "config.json").read_text())
    _, tensors, expected = load_fixture(data_dir, "llama")
    stored, reference = {}, {}
    for key, w in tensors.items():
        if any(f".{p}.weight" in key for p in PROJ):
            parts, deq = quantize(np.asarray(w, np.float32))
            base = key.removesuffix(".weight")
            stored.update({f"{base}.{suffix}": t for suffix, t in parts.items()})
            reference[key] = deq
        else:
            stored[key] = reference[key] = np.asarray(w)
    path.mkdir()
    (path / "config.json").write_text(json.dumps({**config, "quantization_config": qc}))
    write_streaming(path / "model.safetensors",
                    [PlannedTensor(k, v.dtype, v.shape, lambda v=v: v)
                     for k, v in sorted(stored.items())])
    return reference, expected


@functools.partial(jax.jit, static_argnums=0)
def _forward(graphdef, state, kv, inputs):
    """make_forward's step, compiled once per model structure (the references share one)."""
    m = nnx.merge(graphdef, state)
    h, kv = m(inputs.input_ids, inputs.positions, kv, inputs.md)
    return m.compute_logits(h), kv


def _logits(model, expected, mesh=None):
    runner = PagedRunner(model, page_size=4, num_pages=16, mesh=mesh)
    graphdef, state = nnx.split(model)
    runner.fwd = lambda kv, inputs: _forward(graphdef, state, kv, inputs)
    seqs = [expected["tokens_0"].tolist(), expected["tokens_1"].tolist()]
    out = runner.step([(0, seqs[0], 0), (1, seqs[1], 0)], num_tokens=32, num_reqs=4,
                      pages_per_req=8)
    return np.concatenate(out)


def _reference_config(path):
    config = json.loads((path / "config.json").read_text())
    return ArchConfig.from_hf({**config, "quantization_config": None})


def _assert_weights_equal(model, reference, rtol=1e-6):
    """Every decoder-layer matmul weight of `model`, dequantized in the step's way, equals the
    reference's (laid out by the model's weight map)."""
    weight_map = type(model).hf_weight_map(model.config)
    for i, layer in enumerate(model.layers):
        for name in LAYER_SPECS:
            want = weight_map[f"layers.{i}.{name}"](reference.__getitem__)
            got = np.asarray(param_weight(layer, name).dequantize(jnp.float32))
            np.testing.assert_allclose(got, want, rtol=rtol, atol=1e-7,
                                       err_msg=f"layers.{i}.{name}")


# Run through the model (each format compiles its own step): FP8 per block (dequantized in the
# step) and per channel (converted in the dot), int4; GPTQ and per-tensor FP8 are checked weight
# by weight (their products are the same code as AWQ's and per-channel FP8's).
# act-order GPTQ runs too: its rows are reordered at load and the activations gathered.
RUN = ("fp8-block", "ct-fp8-channel", "awq", "gptq-act-order")


@pytest.mark.parametrize("name", list(FORMATS))
def test_checkpoint_equals_reference_dequantization(tmp_path, data_dir, name):
    reference, expected = write_checkpoint(tmp_path / name, data_dir, name)
    model = load_model(tmp_path / name, dtype=jnp.float32)
    layer = model.layers[0]
    assert isinstance(layer.w_down, QuantizedParam) and model.embed[...].dtype == jnp.float32
    kind = model.config.weight_format.kind
    if kind == "fp8":
        assert layer.wq[...].dtype == jnp.float8_e4m3fn
    else:  # two 4-bit values a byte, packed along the contracted dim
        assert layer.w_down[...].dtype == jnp.uint8 and layer.w_down[...].shape == (96 // 2, 64)
        assert layer.wo[...].shape == (4, 8, 64) and layer.w_down_qzero[...].shape == (3, 64)
    scales = {"fp8-block": (2, 2, 1),  # 32 x 32 blocks of q_proj [Hq * D, E]: each spans two heads
              "ct-fp8-channel": (1, 4, 16), "ct-fp8-tensor-static": (1, 1, 1), "awq": (2, 4, 16)}
    assert layer.wq_qscale[...].shape == scales.get(name, (2, 4, 16))
    if model.config.weight_format.act_order:  # stored in group order: gathered inputs
        assert layer.w_down_qperm[...].shape == (96,)
    else:
        _assert_weights_equal(model, reference)
    if name not in RUN:
        return
    ref = _logits(create_model(_reference_config(tmp_path / name), dtype=jnp.float32,
                               get_tensor=reference.__getitem__), expected)
    got = _logits(model, expected)
    np.testing.assert_allclose(got, ref, atol=2e-5 * np.abs(ref).max(), rtol=0)
    np.testing.assert_array_equal(got.argmax(-1), ref.argmax(-1))  # greedy tokens
    # and the format's rounding away from transformers' float model stays small
    want = np.concatenate([expected["logits_0"], expected["logits_1"]])
    # measured: 0.060-0.069 (fp8: three mantissa bits), 0.25-0.26 (int4, groups of 32)
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < (0.1 if kind == "fp8" else 0.35)


def test_int4_sharded_equals_unsharded(tmp_path, data_dir):
    """AWQ over a 1x2 mesh: packed values, scales and zeros split along the MLP dim and the
    heads as float weights are (down_proj's 3 groups do not split in 2: its scales are
    replicated); the logits equal the unsharded model's."""
    _, expected = write_checkpoint(tmp_path / "awq", data_dir, "awq")
    mesh = make_mesh(1, 2)
    sharded = load_model(tmp_path / "awq", dtype=jnp.float32, mesh=mesh)
    layer = sharded.layers[0]
    assert layer.w_down[...].sharding.spec[0] == "model"  # [F / 2, E], F split
    assert layer.wq[...].sharding.spec[1] == "model"
    assert layer.wq_qzero[...].sharding.spec[1] == "model"
    single = load_model(tmp_path / "awq", dtype=jnp.float32)
    np.testing.assert_allclose(_logits(sharded, expected, mesh), _logits(single, expected),
                               atol=1e-4, rtol=0)


def test_int4_packing_round_trips():
    v = np.random.default_rng(0).integers(0, 16, (6, 4, 8)).astype(np.uint8)
    for axis in range(3):
        p = pack_int4(v, axis) if v.shape[axis] % 2 == 0 else None
        if p is not None:
            assert p.shape[axis] == v.shape[axis] // 2
            np.testing.assert_array_equal(unpack_int4(p, axis), v)
            np.testing.assert_array_equal(np.asarray(unpack_int4(jnp.asarray(p), axis)), v)


@pytest.mark.parametrize("qc,match", [
    ({"quant_method": "gptq", "bits": 3, "group_size": 32}, "4 bits"),
    ({"quant_method": "awq", "bits": 4, "group_size": 32, "version": "gemv"}, "GEMM layout"),
    ({"quant_method": "bitsandbytes"}, "pre-quantized \\(quantization_config: bitsandbytes\\)"),
])
def test_unsupported_formats_are_refused_by_name(qc, match):
    hf = dict(TINY, hidden_size=32, intermediate_size=64, num_attention_heads=2,
              quantization_config=qc)
    with pytest.raises(ValueError, match=match):
        ArchConfig.from_hf(hf)


@pytest.mark.parametrize("quantization", ["fp8", "int4"])
def test_quantization_at_load(data_dir, quantization):
    """--quantization fp8 / int4 on a float checkpoint: per-channel e4m3, or a scale and zero
    per group of 32 (128 and 64 do not divide the fixture's dims), each weight within its
    format's rounding of the float one."""
    cfg, tensors, _ = load_fixture(data_dir, "llama")
    model = create_model(cfg, dtype=jnp.float32, get_tensor=tensors.__getitem__,
                         quantization=quantization)
    layer = model.layers[1]
    assert isinstance(layer.wv, QuantizedParam) and model.lm_head[...].dtype == jnp.float32
    assert layer.wq_qscale[...].shape == ((1, 4, 16) if quantization == "fp8" else (2, 4, 16))
    weight_map = type(model).hf_weight_map(cfg)
    for name in LAYER_SPECS:
        w = weight_map[f"layers.1.{name}"](tensors.__getitem__)
        err = np.abs(np.asarray(param_weight(layer, name).dequantize(jnp.float32)) - w).max()
        assert err <= np.abs(w).max() * (2**-4 if quantization == "fp8" else 1 / 15)


def test_fp8_products_where_the_chip_has_them():
    """prepare_fp8_products (a backend whose plan has FP8 products: H100/H200) marks FP8
    weights with per-channel scales for an FP8 x FP8 product (activations scaled per token
    into e4m3), leaves block-scaled ones upcast; the product stays within e4m3's rounding."""
    def abstract(hf, quantization=None):
        graphdef, state, _ = abstract_model(ArchConfig.from_hf(hf), dtype=jnp.bfloat16,
                                            quantization=quantization)
        return nnx.merge(graphdef, state)

    model = abstract(TINY, "fp8")
    assert model.layers[0].w_up.get_metadata()["compute_dtype"] == "bfloat16"
    assert prepare_fp8_products(model) == 7
    assert model.layers[0].w_up.get_metadata()["compute_dtype"] == "float8_e4m3fn"
    blocked = abstract({**TINY, "quantization_config": FORMATS["fp8-block"][1]})
    assert prepare_fp8_products(blocked) == 0
    plan = CpuBackend().plan(ModelConfig(), CacheConfig(), single_device_mesh())
    assert plan.fp8_products is False
    rng = np.random.default_rng(1)
    w32 = rng.standard_normal((64, 128)).astype(np.float32)
    q, scale = quantize_fp8_blocks(w32, [1, 64, 128, 1])  # one scale per output channel
    w = QuantizedWeight(jnp.asarray(q), jnp.asarray(scale), "float8_e4m3fn")
    x = jnp.asarray(rng.standard_normal((8, 64)), jnp.float32)
    want = x @ w.dequantize(jnp.float32)
    got = dense("te,ef->tf", x, w)
    assert float(jnp.linalg.norm(got - want) / jnp.linalg.norm(want)) < 0.06


def test_the_product_kernel_follows_the_tpu_attention_kernel():
    """The plan's quantized products: the TPU kernel where attention runs the TPU kernel (its
    interpreter with "tpu-interpret"), XLA's elsewhere (the CPU, reference attention)."""
    mesh = single_device_mesh()
    tpu = Backend("tpu")
    assert tpu.plan(ModelConfig(), CacheConfig(), mesh).quant_matmul_impl == "tpu"
    reference = ModelConfig(attention_impl="reference")
    assert tpu.plan(reference, CacheConfig(), mesh).quant_matmul_impl == "xla"
    cpu = ModelConfig(dtype="float32")  # (an "auto" dtype is measured on this CPU)
    assert CpuBackend().plan(cpu, CacheConfig(), mesh).quant_matmul_impl == "xla"
    interpret = ModelConfig(dtype="float32", attention_impl="tpu-interpret")
    assert CpuBackend().plan(interpret, CacheConfig(), mesh).quant_matmul_impl == "tpu-interpret"


def test_prepare_quantized_products_marks_the_weights_whose_split_the_scales_follow():
    """int4 over a 1x2 mesh: every decoder weight is marked with the kernel and its placement,
    except the down projection, whose 3 groups of 64 do not split in 2 (it keeps XLA's
    product); FP8 all 7 (one scale per channel), the int8 / float weights none."""
    def abstract(hf, quantization):
        graphdef, state, _ = abstract_model(ArchConfig.from_hf(hf), dtype=jnp.bfloat16,
                                            quantization=quantization, mesh=make_mesh(1, 2))
        return nnx.merge(graphdef, state)

    hf = dict(TINY, intermediate_size=192)
    model = abstract(hf, "int4")
    assert prepare_quantized_products(model, "tpu") == 6
    layer = model.layers[0]
    assert "product" not in layer.w_down.get_metadata()
    product = layer.wo.get_metadata()["product"]
    assert product.impl == "tpu" and product.specs[0] == P("model", None, None)
    assert prepare_quantized_products(abstract(hf, "fp8"), "tpu") == 7
    assert prepare_quantized_products(abstract(hf, "int8"), "tpu") == 0


@pytest.mark.parametrize("spec,shape,split", [
    ("thd,hde->te", (4, 32, 128), P("model", None, None)),  # heads split: partial sums, summed
    ("te,ef->tf", (128, 256), P(None, "model")),  # output channels split
])
def test_dense_through_the_kernel_per_shard_equals_xla(spec, shape, split):
    """An int4 weight (groups of 32 along its contracted dims) split over a 1x2 mesh: `dense`
    through the product kernel (interpreted), per shard inside a shard_map, equals XLA's
    dequantize-then-dot."""
    rng = np.random.default_rng(len(shape))
    mesh = make_mesh(1, 2)
    nc = len(spec.split(",")[0]) - 1
    sshape = scale_shape(shape, spec, 32)
    values = rng.integers(0, 16, shape).astype(np.uint8)
    place = lambda a, s: jax.device_put(a, NamedSharding(mesh, s))  # noqa: E731
    scale_split = P(*(a if m > 1 else None for a, m in zip(split, sshape)))
    q = place(pack_int4(values, nc - 1), split)
    scale = place(rng.uniform(0.01, 0.1, sshape).astype(np.float32), scale_split)
    zero = place(rng.integers(0, 16, sshape).astype(np.float32), scale_split)
    x = jnp.asarray(rng.standard_normal((8, *shape[:nc])).astype(np.float32))
    product = QuantizedProduct("tpu-interpret", mesh, (split, scale_split))
    weight = lambda p: QuantizedWeight(q, scale, "float32", zero, nc - 1, p)  # noqa: E731
    got = jax.jit(lambda x: dense(spec, x, weight(product)))(x)
    want = jax.jit(lambda x: dense(spec, x, weight(None)))(x)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5 * np.abs(want).max(),
                               rtol=0)
