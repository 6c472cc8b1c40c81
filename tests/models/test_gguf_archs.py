"""GGUF beyond Llama: each tiny architecture fixture written as llama.cpp's converter lays it out
(tests/models/gguf_fixtures.py), read back through `resolve_model` (the conversion cache) and
the model loader. F32 files give transformers' logits; F16 and Q8_0 files give the logits of
the fixture with the same rounding applied to its weights, and stay close to transformers';
a Q8_0 file loaded with `--quantization int8` keeps its int8 blocks on the device and gives the
dequantized model's logits."""

from __future__ import annotations

import dataclasses
import json

import gguf
import jax.numpy as jnp
import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT
from jaxserve.models import gguf_arch, loader
from jaxserve.models.arch_config import ArchConfig
from jaxserve.models.layers.linear import QuantizedParam
from jaxserve.models.weights import create_model
from safetensors.numpy import load_file

from tests.models import gguf_fixtures
from tests.models.gguf_fixtures import FIXTURES, write_fixture_gguf
from tests.models.model_utils import PagedRunner

NAMES = sorted(FIXTURES)


@pytest.fixture(scope="module")
def converted(tmp_path_factory, data_dir):
    """(fixture, type) -> the converted HF directory (each written and converted once)."""
    root = tmp_path_factory.mktemp("gguf-archs")
    done = {}

    def get(name: str, qtype: QT = QT.F32):
        if (name, qtype) not in done:
            path = write_fixture_gguf(data_dir, name, root / f"{name}-{qtype.name}.gguf", qtype)
            done[name, qtype] = loader.resolve_model(path, cache_dir=root / "cache")
        return done[name, qtype]

    return get


def _logits(model, expected) -> np.ndarray:
    runner = PagedRunner(model, page_size=4, num_pages=16)
    seqs = [expected["tokens_0"].tolist(), expected["tokens_1"].tolist()]
    out = runner.step([(0, seqs[0], 0), (1, seqs[1], 0)], num_tokens=32, num_reqs=4, pages_per_req=8)
    return np.concatenate(out)


def _load(path, quantization=None):
    ckpt = loader.load_checkpoint(path)
    cfg = ArchConfig.from_hf(ckpt.config)
    return create_model(cfg, dtype=jnp.float32, get_tensor=ckpt.get_tensor, quantization=quantization)


def _expected(data_dir, name):
    expected = load_file(str(data_dir / "arch" / name / "expected.safetensors"))
    return expected, np.concatenate([expected["logits_0"], expected["logits_1"]])


@pytest.mark.parametrize("name", NAMES)
def test_config_equals_the_fixtures(converted, data_dir, name):
    got = ArchConfig.from_hf(json.loads((converted(name) / "config.json").read_text()))
    want = ArchConfig.from_hf(json.loads((data_dir / "arch" / name / "config.json").read_text()))
    if name == "phi3":  # llama.cpp stores LongRoPE's attention factor; transformers derives it
        assert got.rope_scaling.attention_factor == pytest.approx((1 + np.log(4) / np.log(8)) ** 0.5)
        got = dataclasses.replace(got, rope_scaling=dataclasses.replace(got.rope_scaling, attention_factor=None))
    assert got == want


@pytest.mark.parametrize("name", NAMES)
def test_f32_logits_equal_transformers(converted, data_dir, name):
    expected, want = _expected(data_dir, name)
    np.testing.assert_allclose(_logits(_load(converted(name)), expected), want, atol=1e-4, rtol=0)


def _rounded_fixture(data_dir, name: str, qtype: QT) -> dict[str, np.ndarray]:
    """The fixture's weights rounded as the converter's `--outtype` rounds them."""
    _, tensors = gguf_fixtures.fixture(data_dir, name)
    out = {}
    for key, x in tensors.items():
        if x.ndim < 2 or key.endswith(("mlp.gate.weight", "block_sparse_moe.gate.weight")):  # kept F32
            out[key] = x
        elif qtype == QT.Q8_0 and x.shape[-1] % 32 == 0:
            out[key] = gguf.quants.dequantize(gguf.quants.quantize(x, QT.Q8_0), QT.Q8_0).reshape(x.shape)
        else:
            out[key] = x.astype(np.float16).astype(np.float32)
    return out


# the relative drift of the logits from transformers' float32 ones, measured: F16 <= 2.6e-3,
# Q8_0 0.014-0.024 (gemma3 0.099: six layers, four norms each, no soft cap to damp it)
DRIFT = {QT.F16: 0.01, QT.Q8_0: 0.05}


@pytest.mark.parametrize("qtype", [QT.F16, QT.Q8_0], ids=["F16", "Q8_0"])
@pytest.mark.parametrize("name", NAMES)
def test_quantized_files(converted, data_dir, name, qtype):
    expected, want = _expected(data_dir, name)
    got = _logits(_load(converted(name, qtype)), expected)
    cfg = ArchConfig.from_hf(json.loads((data_dir / "arch" / name / "config.json").read_text()))
    rounded = _rounded_fixture(data_dir, name, qtype)
    same_rounding = _logits(create_model(cfg, dtype=jnp.float32, get_tensor=rounded.__getitem__), expected)
    np.testing.assert_allclose(got, same_rounding, atol=1e-4, rtol=0)
    rel = np.linalg.norm(got - want) / np.linalg.norm(want)
    assert rel < DRIFT[qtype] * (2.5 if name == "gemma3" and qtype == QT.Q8_0 else 1)
    assert (got.argmax(-1) == want.argmax(-1)).mean() >= 0.9


@pytest.mark.parametrize("name", ["phi3", "qwen3_moe", "gemma3"])
def test_q8_0_loads_as_int8_blocks(converted, data_dir, name):
    """With int8, a Q8_0 file's weights reach the device as the file's int8 values and block
    scales (no float copy, no re-quantization); logits equal the dequantized model's."""
    path = converted(name, QT.Q8_0)
    ckpt = loader.load_checkpoint(path)
    assert ckpt.config["quantization_config"] == {"quant_method": "gguf", "weight_type": "Q8_0", "block_size": 32}
    q_proj = ckpt.tensor_info("model.layers.0.self_attn.qkv_proj.weight" if name == "phi3" else
                              "model.layers.0.self_attn.q_proj.weight")
    assert q_proj[1] == np.int8  # the cache keeps the blocks: 1 byte per weight + scales
    expected, _ = _expected(data_dir, name)
    model = _load(path, quantization="int8")
    layer = model.layers[0]
    cfg = model.config
    assert cfg.int8_block_size == 32
    for w in ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down"):
        assert isinstance(getattr(layer, w), QuantizedParam) and getattr(layer, w)[...].dtype == jnp.int8
    assert model.embed[...].dtype == jnp.int8
    assert layer.wq_qscale[...].shape == (cfg.hidden_size // 32, cfg.num_heads, cfg.head_dim)
    assert layer.wo_qscale[...].shape == (cfg.num_heads // 2, 1, cfg.hidden_size)  # head_dim 16: 2 heads a block
    if name == "qwen3_moe":
        assert layer.w_down_qscale[...].shape == (8, 1, cfg.hidden_size)  # [X, F / 32, E], F = 32
    # the file's own values: the int8 weights are the Q8_0 blocks of the (permuted, fused) tensor
    reader = gguf.GGUFReader(_gguf_path(path))
    if name != "phi3":
        raw = next(t for t in reader.tensors if t.name == "blk.0.attn_q.weight")
        blocks = np.asarray(raw.data).reshape(-1, 34)
        q_file = blocks[:, 2:].copy().view(np.int8).reshape(cfg.num_heads * cfg.head_dim, cfg.hidden_size)
        np.testing.assert_array_equal(np.asarray(layer.wq[...]), q_file.T.reshape(layer.wq[...].shape))
    dequantized = _logits(_load(path), expected)
    np.testing.assert_allclose(_logits(model, expected), dequantized, atol=2e-5, rtol=1e-5)


def _gguf_path(converted_dir):
    return json.loads((converted_dir / "jaxserve_conversion.json").read_text())["source"]


def test_mixed_file_stays_float(tmp_path, data_dir):
    """A file with other quantized types besides Q8_0 (as the default model's Q4_1 with a Q8_0
    embedding) is converted to float32 as before: per-channel int8 applies to it."""
    path = write_fixture_gguf(data_dir, "qwen3", tmp_path / "q.gguf", QT.Q8_0)
    reader = gguf.GGUFReader(path)
    mixed = tmp_path / "mixed.gguf"
    w = gguf.GGUFWriter(mixed, "qwen3")
    for field in reader.fields.values():
        if not field.name.startswith(("GGUF.", "general.architecture")):
            w.add_key_value(field.name, field.contents(), field.types[0],
                            field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None)
    for t in reader.tensors:
        data = np.asarray(t.data)
        if t.name == "blk.0.ffn_down.weight":
            x = gguf.quants.dequantize(data, t.tensor_type)
            w.add_tensor(t.name, gguf.quants.quantize(x, QT.Q4_0), raw_dtype=QT.Q4_0)
        else:
            w.add_tensor(t.name, data, raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    ckpt = loader.load_checkpoint(loader.resolve_model(mixed, cache_dir=tmp_path / "cache"))
    assert "quantization_config" not in ckpt.config
    assert {ckpt.tensor_info(n)[1] for n in ckpt.tensor_names()} == {np.dtype(np.float32)}


# ----------------------------------------------------------------------------- tokenizers


@pytest.mark.parametrize("name", NAMES)
def test_tokenizer_and_chat_template(converted, name):
    tok = loader.load_tokenizer(converted(name))
    arch = FIXTURES[name]
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    if arch in ("gemma3", "phi3"):  # sentencepiece
        tokens = gguf_fixtures.spm_vocabulary(arch, 128)[0]
        ids = tok("hello world")["input_ids"]
        first = "hello" if arch == "gemma3" else "▁hello"  # Phi-3 prepends a space, Gemma does not
        assert ids == [1, tokens.index(first), tokens.index("▁world")]  # BOS added
        assert tok.decode(ids, skip_special_tokens=True) == "hello world"
        if arch == "gemma3":
            assert text == "<bos><start_of_turn>user\nhi<end_of_turn>\n"
            assert (tok.bos_token, tok.eos_token, tok.pad_token) == ("<bos>", "<eos>", "<pad>")
        else:
            assert text == "<|user|>\nhi<|end|>\n"
            assert (tok.bos_token, tok.eos_token, tok.unk_token) == ("<s>", "</s>", "<unk>")
    else:  # byte-level BPE
        tokens = gguf_fixtures.bpe_vocabulary(128)[0]
        ids = tok("hello world<|im_end|>")["input_ids"]
        assert ids == [tokens.index("hello"), tokens.index("Ġworld"), 2]
        assert tok.decode(ids, skip_special_tokens=True) == "hello world"
        assert text == "<|im_start|>user\nhi<|im_end|>\n"
        assert (tok.bos_token, tok.eos_token) == ("<|im_start|>", "<|im_end|>")
    assert len(tok) == 128
    tcfg = json.loads((converted(name) / "tokenizer_config.json").read_text())
    assert "chat_template" in tcfg and tcfg["add_bos_token"] is (arch in ("gemma3", "phi3"))


# ----------------------------------------------------------------------------- names and keys


@pytest.mark.parametrize("arch", sorted(gguf_arch.ARCHITECTURES))
def test_names_are_llama_cpps(arch):
    """Every GGUF tensor a reader maps is one llama.cpp lists for the architecture (qwen3moe's
    dense MLP layers aside: jaxserve's reading of `mlp_only_layers`)."""
    spec = gguf_arch.ARCHITECTURES[arch]
    model_arch = next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == arch)
    known = {gguf.TENSOR_NAMES[t].removeprefix("blk.{bid}.") for t in gguf.MODEL_TENSORS[model_arch]}
    ours = set(spec.layer) | {n.removesuffix(".weight") for n in spec.config_tensors}
    ours |= {"token_embd", "output_norm", "output"}
    if spec.experts:
        ours |= {gguf_arch.ROUTER, *gguf_arch.EXPERT_PARTS}
    extra = ours - known
    assert extra == (set(spec.dense_mlp) if arch == "qwen3moe" else set())


def _meta(tmp_path, arch: str, **keys) -> gguf_arch.Metadata:
    w = gguf.GGUFWriter(tmp_path / f"{arch}.gguf", arch)
    for key, value in keys.items():
        name = f"{arch}.{key.replace('__', '.')}"
        if isinstance(value, bool):
            w.add_bool(name, value)
        elif isinstance(value, int):
            w.add_uint32(name, value)
        elif isinstance(value, float):
            w.add_float32(name, value)
        elif isinstance(value, list):
            w.add_array(name, value)
        else:
            w.add_string(name, value)
    w.add_tensor("token_embd.weight", np.zeros((16, 64), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return gguf_arch.Metadata(gguf.GGUFReader(tmp_path / f"{arch}.gguf"))


BASE = {"block_count": 62, "embedding_length": 64, "feed_forward_length": 96, "attention__head_count": 4,
        "context_length": 128}


def test_config_keys(tmp_path):
    # qwen3moe: llama.cpp renormalizes the top-k weights unless the file says otherwise
    cfg = gguf_arch.config_from_metadata(_meta(tmp_path, "qwen3moe", **BASE, expert_count=8, expert_used_count=2,
                                               expert_feed_forward_length=32))
    assert cfg["norm_topk_prob"] is True and cfg["num_experts"] == 8 and cfg["moe_intermediate_size"] == 32
    assert cfg["mlp_only_layers"] == list(range(62))  # no routers in this file: every layer dense
    # gemma3 27B (62 layers): llama.cpp's attention scale (hidden / heads) ** -0.5; a pattern array
    cfg = gguf_arch.config_from_metadata(_meta(tmp_path, "gemma3", **BASE, attention__key_length=32,
                                               attention__sliding_window=8))
    assert cfg["query_pre_attn_scalar"] == 16 and cfg["head_dim"] == 32
    assert cfg["layer_types"][:6] == ["sliding_attention"] * 5 + ["full_attention"]
    assert cfg["rope_parameters"]["sliding_attention"]["rope_theta"] == 10000.0
    pattern = [True, False] * 31
    cfg = gguf_arch.config_from_metadata(_meta(tmp_path, "gemma3", **BASE, attention__sliding_window=8,
                                               attention__sliding_window_pattern=pattern,
                                               attention__scale=0.125, rope__freq_base_swa=5000.0))
    assert cfg["layer_types"][:2] == ["sliding_attention", "full_attention"]
    assert cfg["query_pre_attn_scalar"] == 64 and cfg["rope_parameters"]["sliding_attention"]["rope_theta"] == 5000
    # yarn (Qwen2.5's long-context recipe)
    cfg = gguf_arch.config_from_metadata(_meta(tmp_path, "qwen2", **BASE, rope__scaling__type="yarn",
                                               rope__scaling__factor=4.0,
                                               rope__scaling__original_context_length=32))
    assert cfg["rope_parameters"] == {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0,
                                      "original_max_position_embeddings": 32}
    assert ArchConfig.from_hf(cfg).rope_scaling.rope_type == "yarn"
    with pytest.raises(ValueError, match="rope scaling 'longrope' is not supported for qwen2"):
        gguf_arch.config_from_metadata(_meta(tmp_path, "qwen2", **BASE, rope__scaling__type="longrope",
                                             rope__scaling__factor=4.0))
    with pytest.raises(ValueError, match="per layer"):
        gguf_arch.config_from_metadata(_meta(tmp_path, "qwen2", **{**BASE, "attention__head_count": [4] * 62}))
