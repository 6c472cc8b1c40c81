"""Quantized checkpoints written by the tools (tests/data/quant/, made by
scripts/make_quant_fixtures.py): llm-compressor's compressed-tensors integer weights
(pack-quantized, naive-quantized, int-quantized; 4 and 8 bits; symmetric and asymmetric; per
channel and per group; GPTQ with actorder "group"), W8A8 int8 and FP8 (dynamic and static
activation scales), and AutoAWQ's GEMM checkpoint.

Each fixture holds the tool's checkpoint of one tiny random Llama, the decoder weights as
compressed-tensors' own decompressor gives them back (reference.safetensors) and transformers'
float32 logits of a model with those weights (expected.safetensors). Loaded by jaxserve, the
weights stay in their format on the device, dequantize exactly to the tool's, and the prompt
log-probs equal the reference's to 1e-4 with the same greedy tokens: weight-only, as the CPU
multiplies. Where a chip multiplies int8 or FP8, W8A8 checkpoints quantize the activations
too; those products are checked here against their own reference (`quantize_activations`).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import pathlib

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file

from jaxserve.models.arch_config import ArchConfig
from jaxserve.models.layers.linear import (
    QuantizedParam,
    QuantizedWeight,
    activation_products,
    dense,
    param_weight,
    prepare_fp8_products,
    prepare_int8_products,
    prepare_quantized_products,
)
from jaxserve.models.llama import LAYER_SPECS
from jaxserve.models.loader import load_checkpoint
from jaxserve.models.weights import create_model, load_model
from jaxserve.parallel.mesh import make_mesh

from tests.models.model_utils import PagedRunner

QUANT = pathlib.Path(__file__).resolve().parent.parent / "data" / "quant"
NAMES = sorted(d.name for d in QUANT.iterdir() if (d / "config.json").is_file())

# What each fixture's quantization_config reads as: (kind, in_block, out_block, zeros,
# act-order, activations, format of the weights' tensors)
FORMATS = {
    "w4a16": ("int4", 32, 1, False, False, None, "pack-quantized"),
    "w4a16-asym": ("int4", 32, 1, True, False, None, "pack-quantized"),
    "w4a16-channel": ("int4", None, 1, False, False, None, "pack-quantized"),
    "w4a16-gptq": ("int4", 32, 1, False, False, None, "pack-quantized"),
    "w4a16-gptq-actorder": ("int4", 32, 1, False, True, None, "pack-quantized"),
    "w4a16-naive-asym": ("int4", 32, 1, True, False, None, "naive-quantized"),
    "w8a16": ("int8", None, 1, False, False, None, "pack-quantized"),
    "w8a16-asym-group": ("int8", 32, 1, True, False, None, "pack-quantized"),
    "w8a16-naive": ("int8", None, 1, False, False, None, "naive-quantized"),
    "w8a8": ("int8", None, 1, False, False, "int8-dynamic", "int-quantized"),
    "w8a8-static": ("int8", None, 1, False, False, "int8-static", "int-quantized"),
    "fp8-dynamic": ("fp8", None, 1, False, False, "fp8-dynamic", "float-quantized"),
    "fp8-static": ("fp8", None, None, False, False, "fp8-static", "float-quantized"),
    # AutoAWQ's own checkpoint (its GEMM layout), the reference its own dequantize_gemm
    "awq": ("int4", 32, 1, True, False, None, "awq"),
    # GPTQModel's desc_act checkpoint (act-order g_idx), the reference its dequantize_weight
    "gptq-desc-act": ("int4", 32, 1, True, True, None, "gptq"),
}


def _config(name: str) -> dict:
    return json.loads((QUANT / name / "config.json").read_text())


@functools.cache
def _fixture(name: str):
    """(the float tensors of the reference model: the tool's dequantized decoder weights and
    the checkpoint's float ones, transformers' expected logits)."""
    d = QUANT / name
    ckpt = load_checkpoint(d)
    tensors = {k: ckpt.get_tensor(k) for k in ckpt.tensor_names()
               if ckpt.tensor_info(k)[1] in (np.float32, np.float16) and k.endswith(".weight")}
    tensors.update(load_file(str(d / "reference.safetensors")))
    return tensors, load_file(str(d / "expected.safetensors"))


@functools.partial(jax.jit, static_argnums=0)
def _forward(graphdef, state, kv, inputs):
    m = nnx.merge(graphdef, state)
    h, kv = m(inputs.input_ids, inputs.positions, kv, inputs.md)
    return m.compute_logits(h), kv


def _logprobs(model, expected, mesh=None) -> np.ndarray:
    """Prompt log-probs of the two sequences (one step of both, on shuffled pages)."""
    runner = PagedRunner(model, page_size=4, num_pages=32, mesh=mesh)
    graphdef, state = nnx.split(model)
    runner.fwd = lambda kv, inputs: _forward(graphdef, state, kv, inputs)
    seqs = [expected["tokens_0"].tolist(), expected["tokens_1"].tolist()]
    out = runner.step([(0, seqs[0], 0), (1, seqs[1], 0)], num_tokens=64, num_reqs=4,
                      pages_per_req=16)
    return np.asarray(jax.nn.log_softmax(jnp.asarray(np.concatenate(out)), axis=-1))


@functools.cache
def _reference_logprobs(name: str) -> np.ndarray:
    tensors, expected = _fixture(name)
    cfg = ArchConfig.from_hf({**_config(name), "quantization_config": None})
    return _logprobs(create_model(cfg, dtype=jnp.float32, get_tensor=tensors.__getitem__), expected)


@functools.cache
def _model(name: str):
    return load_model(QUANT / name, dtype=jnp.float32)


def _expected_logprobs(expected) -> np.ndarray:
    logits = np.concatenate([expected["logits_0"], expected["logits_1"]])
    return np.asarray(jax.nn.log_softmax(jnp.asarray(logits), axis=-1))


def test_every_fixture_is_known():
    assert set(NAMES) == set(FORMATS)


@pytest.mark.parametrize("name", NAMES)
def test_config_reads_as_the_tool_wrote_it(name):
    kind, in_block, out_block, zeros, act_order, activations, fmt = FORMATS[name]
    qc = _config(name)["quantization_config"]
    if fmt == "awq":
        assert qc["quant_method"] == "awq" and qc["version"] == "gemm"
    elif fmt == "gptq":
        assert qc["quant_method"] == "gptq" and qc["desc_act"] and qc["checkpoint_format"] == "gptq"
    else:
        assert qc["quant_method"] == "compressed-tensors"
        assert (qc["config_groups"]["group_0"].get("format") or qc["format"]) == fmt
    wf = ArchConfig.from_hf(_config(name)).weight_format
    assert (wf.kind, wf.in_block, wf.out_block, wf.has_zeros, wf.act_order, wf.activations) == (
        kind, in_block, out_block, zeros or kind == "int4", act_order, activations)


def _natural_order(w: np.ndarray, perm, spec: str) -> np.ndarray:
    """An act-order weight dequantized in its stored input order -> the checkpoint's."""
    if perm is None:
        return w
    from jaxserve.models.layers.linear import contracted_axes

    axes = list(contracted_axes(spec))
    rest = [a for a in range(w.ndim) if a not in axes]
    moved = np.transpose(w, axes + rest)
    flat = moved.reshape(-1, *moved.shape[len(axes):])
    out = np.empty_like(flat)
    out[np.asarray(perm)] = flat
    return np.transpose(out.reshape(moved.shape), np.argsort(axes + rest))


@pytest.mark.parametrize("name", NAMES)
def test_weights_stay_in_their_format_and_equal_the_tools_dequantization(name):
    """Each decoder weight on the device: packed int4 (half a byte a value), int8 or
    float8_e4m3fn, with float32 scales (and zeros); dequantized (and, act-order, put back in
    input order) it equals the tool's own dequantization of the checkpoint
    (compressed-tensors' decompressor, AutoAWQ's dequantize_gemm)."""
    model = _model(name)
    tensors, _ = _fixture(name)
    kind = FORMATS[name][0]
    weight_map = type(model).hf_weight_map(model.config)
    for i, layer in enumerate(model.layers):
        assert isinstance(layer.w_down, QuantizedParam)
        stored = {"int4": jnp.uint8, "int8": jnp.int8, "fp8": jnp.float8_e4m3fn}[kind]
        assert layer.w_down[...].dtype == stored
        if kind == "int4":  # [F, E] packed along F
            assert layer.w_down[...].shape == (64, 64)
        for wname in LAYER_SPECS:
            w = param_weight(layer, wname)
            want = weight_map[f"layers.{i}.{wname}"](tensors.__getitem__)
            got = _natural_order(np.asarray(w.dequantize(jnp.float32)), w.perm,
                                 LAYER_SPECS[wname])
            np.testing.assert_allclose(got, want, rtol=1e-6, atol=0, err_msg=f"layers.{i}.{wname}")
    if FORMATS[name][4]:  # act-order: the fixture's groups really are out of order
        assert any(not np.array_equal(np.asarray(param_weight(layer, n).perm),
                                      np.arange(param_weight(layer, n).perm.size))
                   for layer in model.layers for n in LAYER_SPECS)


@pytest.mark.parametrize("name", NAMES)
def test_prompt_logprobs_equal_the_dequantized_reference(name):
    """Prompt log-probs (float32, weight-only products) within 1e-4 of the float model of the
    tool's dequantized weights, in jaxserve and in transformers; the same greedy token at every
    position."""
    got = _logprobs(_model(name), _fixture(name)[1])
    ref = _reference_logprobs(name)
    hf = _expected_logprobs(_fixture(name)[1])
    assert np.abs(got - ref).max() < 1e-4
    assert np.abs(got - hf).max() < 1e-4
    np.testing.assert_array_equal(got.argmax(-1), ref.argmax(-1))
    np.testing.assert_array_equal(got.argmax(-1), hf.argmax(-1))


@pytest.mark.parametrize("name", ["w4a16-gptq-actorder", "w4a16-asym"])
def test_tensor_parallel_equals_the_reference(name):
    """Over a 1x2 mesh (heads and the MLP dim split; act-order inputs gathered in the stored
    order, scales split with their groups) the log-probs equal the reference's."""
    mesh = make_mesh(1, 2)
    model = load_model(QUANT / name, dtype=jnp.float32, mesh=mesh)
    layer = model.layers[0]
    assert layer.w_down[...].sharding.spec[0] == "model" and layer.wq[...].sharding.spec[1] == "model"
    got = _logprobs(model, _fixture(name)[1], mesh)
    assert np.abs(got - _reference_logprobs(name)).max() < 1e-4
    np.testing.assert_array_equal(got.argmax(-1), _reference_logprobs(name).argmax(-1))


def test_int4_act_order_through_the_product_kernel():
    """An act-order weight of the fixture marked for the TPU product kernel (interpreted here):
    the activations are gathered before the kernel, and the product equals XLA's."""
    model = load_model(QUANT / "w4a16-gptq-actorder", dtype=jnp.float32)
    x = jnp.asarray(np.random.default_rng(3).standard_normal((8, 128)).astype(np.float32))
    want = dense(LAYER_SPECS["w_down"], x, param_weight(model.layers[1], "w_down"))
    assert prepare_quantized_products(model, "tpu-interpret") == 14
    w = param_weight(model.layers[1], "w_down")
    assert w.product is not None and w.perm is not None
    got = dense(LAYER_SPECS["w_down"], x, w)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=0,
                               atol=1e-5 * float(jnp.abs(want).max()))


def _int8_qdq_product(x, q, scale, input_scale=None):
    """numpy: x [T, K] quantized to int8 per token (amax / 127, or the static scale), times
    the int8 weight [K, N], in float64, scaled back."""
    x = np.asarray(x, np.float64)
    sx = (np.abs(x).max(-1, keepdims=True) / 127.0 if input_scale is None
          else np.full((x.shape[0], 1), float(input_scale)))
    xq = np.clip(np.round(x / sx), -128, 127)
    return (xq @ np.asarray(q, np.float64)) * sx * np.asarray(scale, np.float64).reshape(1, -1)


@pytest.mark.parametrize("name", ["w8a8", "w8a8-static"])
def test_w8a8_int8_products_where_the_chip_has_them(name):
    """W8A8 on a chip with int8 products (`DevicePlan.int8_products`; the CPU has none, so the
    test marks the model itself): every decoder weight multiplies int8 x int8 into int32, the
    activations scaled per token (amax / 127, vLLM's) or by the checkpoint's static
    input_scale; each product equals that quantize-then-multiply in float64, and (dynamic) the
    model's log-probs stay near the weight-only ones."""
    model = load_model(QUANT / name, dtype=jnp.float32)
    layer = model.layers[0]
    static = name.endswith("static")
    if static:  # the checkpoint's calibrated scale, read
        stored = load_checkpoint(QUANT / name).get_tensor("model.layers.0.mlp.up_proj.input_scale")
        assert float(layer.w_up_qinput[...][0]) == float(np.asarray(stored).reshape(()))
    assert prepare_int8_products(model) == (14, 0)
    assert activation_products(model) == {"int8": 14}
    w = param_weight(layer, "w_up")
    assert w.compute_dtype == "int8"
    x = np.random.default_rng(0).standard_normal((5, 64)).astype(np.float32)
    got = np.asarray(dense("te,ef->tf", jnp.asarray(x), w))
    want = _int8_qdq_product(x, w.q, w.scale, w.input_scale[0] if static else None)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    if not static:  # int8 activations move the log-probs by their rounding only
        act = _logprobs(model, _fixture(name)[1])
        assert np.abs(act - _reference_logprobs(name)).max() < 0.1


@pytest.mark.parametrize("name", ["fp8-dynamic", "fp8-static"])
def test_fp8_products_take_the_checkpoints_activation_scales(name):
    """FP8 W8A8 on a chip with FP8 products (H100/H200): FP8_DYNAMIC scales each token into
    e4m3 (amax / 448), the static scheme by its calibrated input_scale; each product equals
    that e4m3 rounding of the activations times the stored weight."""
    model = load_model(QUANT / name, dtype=jnp.float32)
    assert prepare_fp8_products(model) == 14
    w = param_weight(model.layers[1], "w_gate")
    x = np.random.default_rng(1).standard_normal((4, 64)).astype(np.float32)
    if name == "fp8-static":
        sx = np.full((4, 1), float(np.asarray(w.input_scale)[0]), np.float32)
        assert sx[0, 0] > 0
    else:
        sx = np.abs(x).max(-1, keepdims=True) / 448.0
    xq = np.clip(x / sx, -448, 448).astype(ml_dtypes.float8_e4m3fn).astype(np.float64)
    scale = np.asarray(w.scale, np.float64).reshape(1, -1)
    want = (xq @ np.asarray(w.q).astype(np.float64)) * sx * scale
    got = np.asarray(dense("te,ef->tf", jnp.asarray(x), w))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


def test_int8_products_leave_weight_only_schemes_alone():
    """W8A16 (weight-only in the checkpoint) and `--quantization int8` are never given int8
    activations; an asymmetric or group-scaled int8 weight stays weight-only."""
    assert prepare_int8_products(load_model(QUANT / "w8a16", dtype=jnp.float32)) == (0, 0)
    assert prepare_int8_products(_model("w8a16-asym-group")) == (0, 0)


@pytest.mark.parametrize("qc,match", [
    ({"format": "pack-quantized", "weights": dict(num_bits=2, type="int", strategy="group",
                                                  group_size=32, symmetric=True)}, "2-bit"),
    ({"format": "marlin-24", "weights": dict(num_bits=4, type="int", strategy="group",
                                             group_size=32, symmetric=True)}, "marlin-24"),
    ({"format": "pack-quantized", "weights": dict(num_bits=4, type="int", strategy="block",
                                                  block_structure=[32, 32], symmetric=True)},
     "strategy 'block'"),
])
def test_unsupported_compressed_tensors_schemes_are_refused_by_name(qc, match):
    group = {"targets": ["Linear"], "weights": qc["weights"]}
    hf = {**_config("w4a16"), "quantization_config": {
        "quant_method": "compressed-tensors", "format": qc["format"],
        "config_groups": {"group_0": group}}}
    with pytest.raises(ValueError, match=match):
        ArchConfig.from_hf(hf)


def test_the_weights_are_the_quantized_bytes():
    """A W4A16 checkpoint's decoder weights take about a quarter of the float32 weights'
    device bytes plus their scales: values packed two a byte."""
    def nbytes(model):
        return sum(int(np.prod(v.shape)) * v.dtype.itemsize
                   for layer in model.layers for v in jax.tree.leaves(nnx.state(layer)))

    tensors, _ = _fixture("w4a16")
    cfg = ArchConfig.from_hf({**_config("w4a16"), "quantization_config": None})
    float_model = create_model(cfg, dtype=jnp.float32, get_tensor=tensors.__getitem__)
    assert nbytes(_model("w4a16")) < 0.25 * nbytes(float_model)


def test_quantized_weight_keeps_its_order_out_of_the_product():
    """An act-order weight (rows stored in the order `perm` of its inputs): `dense` gathers
    the activations in that order, and the product equals the weight's in input order."""
    rng = np.random.default_rng(2)
    q = jnp.asarray(rng.integers(-127, 128, (32, 8)).astype(np.int8))
    s = jnp.asarray(rng.uniform(0.01, 0.02, (1, 8)).astype(np.float32))
    x = jnp.asarray(rng.standard_normal((3, 32)).astype(np.float32))
    plain = dense("te,ef->tf", x, QuantizedWeight(q, s))
    perm = jnp.asarray(rng.permutation(32).astype(np.int32))
    ordered = QuantizedWeight(q[perm], s, perm=perm)
    np.testing.assert_allclose(np.asarray(dense("te,ef->tf", x, ordered)), np.asarray(plain),
                               rtol=1e-5, atol=1e-5)


def test_start_up_says_how_w8a8_multiplies():
    """The log line at start-up: weight-only where the plan has no int8 (FP8) products (the
    CPU), the quantized activations where it has them."""
    from jaxserve.backends.base import DevicePlan, log_activation_products
    from jaxserve.models.weights import abstract_model

    def abstract(name):
        graphdef, state, _ = abstract_model(ArchConfig.from_hf(_config(name)), dtype=jnp.bfloat16)
        return nnx.merge(graphdef, state)

    cpu = DevicePlan(dtype="bfloat16", kv_dtype="bfloat16", attention_impl="reference",
                     matmul_impl="xla", native_sampling=None, moe_impl="dense")
    line = log_activation_products(abstract("w8a8"), cpu)
    assert "weight-only, the activations stay bfloat16 (this chip has no int8 products" in line
    chip = abstract("w8a8-static")
    assert prepare_int8_products(chip) == (14, 0)
    line = log_activation_products(chip, dataclasses.replace(cpu, int8_products=True))
    assert "14 weights multiply int8 x int8" in line and "static input_scale" in line
    fp8 = abstract("fp8-dynamic")
    assert "no FP8 products" in log_activation_products(fp8, cpu)
    prepare_fp8_products(fp8)
    line = log_activation_products(fp8, dataclasses.replace(cpu, fp8_products=True))
    assert "multiply fp8 x fp8" in line and "amax / 448" in line
    assert log_activation_products(abstract("w4a16"), cpu) is None


def test_served_over_two_devices_equals_transformers(compile_cache_dir):
    """The act-order int4 checkpoint through the server (`/v1/completions`, echo with logprobs)
    on a 1x2 mesh: the prompt's log-probs within 1e-4 of transformers' on the tool's
    dequantized weights, and the greedy next token is transformers' argmax."""
    from starlette.testclient import TestClient

    from jaxserve.config import EngineConfig
    from jaxserve.engine.async_client import AsyncEngineClient
    from jaxserve.engine.setup import build_engine
    from jaxserve.server.app import build_app
    from tests.server.conftest import app_config

    name = "w4a16-gptq-actorder"
    parts = build_engine(EngineConfig.from_kwargs(
        model=str(QUANT / name), dtype="float32", tensor_parallel_size=2, max_num_seqs=8,
        max_num_batched_tokens=64, token_buckets=(64,), request_buckets=(8,),
        compilation_cache_dir=compile_cache_dir, show_progress=False))
    expected = _fixture(name)[1]
    want = np.asarray(jax.nn.log_softmax(jnp.asarray(expected["logits_0"]), axis=-1))
    tokens = expected["tokens_0"].tolist()
    with TestClient(build_app(AsyncEngineClient.in_thread(parts), app_config())) as client:
        model = client.get("/v1/models").json()["data"][0]["id"]
        r = client.post("/v1/completions", json={
            "model": model, "prompt": tokens, "max_tokens": 1, "temperature": 0, "echo": True,
            "logprobs": 0, "return_token_ids": True})
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
    got = choice["logprobs"]["token_logprobs"][1:len(tokens)]
    ref = [want[j - 1, t] for j, t in enumerate(tokens) if j > 0]
    assert np.abs(np.asarray(got) - np.asarray(ref)).max() < 1e-4
    assert choice["token_ids"][-1] == int(want[-1].argmax())
