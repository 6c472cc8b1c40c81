"""GGUF reading: dequantization per type (against reference decoders written from ggml's block
layouts), shape conventions, the Q/K permutation, config and names, errors and the conversion
cache, on small written files (the bundled default model: test_gguf_default_model.py)."""

from __future__ import annotations

import functools
import json
import os
import pathlib
import shutil
import time

import gguf
import jax
import ml_dtypes
import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT

from jaxserve.models import gguf_loader, loader
from tests.models.ggml_reference import random_k_blocks, reference_dequantize

RNG = np.random.default_rng(1234)

# ----------------------------------------------------------------------------- writing test files


def write_gguf(
    path: pathlib.Path,
    tensors: dict[str, tuple[np.ndarray, QT | None]],
    arch: str = "llama",
    metadata: bool = True,
    **cfg,
) -> pathlib.Path:
    w = gguf.GGUFWriter(path, arch)
    if metadata:
        c = {"layers": 1, "hidden": 64, "ffn": 96, "heads": 4, "kv_heads": 2, "ctx": 128, "theta": 10000.0}
        c.update(cfg)
        w.add_block_count(c["layers"])
        w.add_context_length(c["ctx"])
        w.add_embedding_length(c["hidden"])
        w.add_feed_forward_length(c["ffn"])
        w.add_head_count(c["heads"])
        w.add_head_count_kv(c["kv_heads"])
        w.add_layer_norm_rms_eps(1e-5)
        w.add_rope_freq_base(c["theta"])
        w.add_rope_dimension_count(c["hidden"] // c["heads"])
        tokens, types, merges = tiny_vocab()
        w.add_vocab_size(len(tokens))
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("default")
        w.add_token_list(tokens)
        w.add_token_types(types)
        w.add_token_merges(merges)
        w.add_bos_token_id(1)
        w.add_eos_token_id(2)
        w.add_pad_token_id(2)
        w.add_unk_token_id(0)
        w.add_add_bos_token(False)
        w.add_chat_template(TEMPLATE)
    for name, (array, raw_dtype) in tensors.items():
        w.add_tensor(name, array, raw_dtype=raw_dtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
)
CONTROL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def tiny_vocab() -> tuple[list[str], list[int], list[str]]:
    from jaxserve.models.gguf_tokenizer import bytes_to_unicode

    alphabet = list(bytes_to_unicode().values())
    merges = ["h e", "l l", "he ll", "hell o", "Ġ w"]
    merged = ["he", "ll", "hell", "hello", "Ġw"]
    tokens = CONTROL + alphabet + merged
    return tokens, [3] * len(CONTROL) + [1] * (len(tokens) - len(CONTROL)), merges


def tiny_model(
    layers=1, hidden=64, ffn=96, heads=4, kv_heads=2, tied=True
) -> dict[str, np.ndarray]:
    """Random HF-layout float32 weights of a tiny Llama."""
    vocab = len(tiny_vocab()[0])
    hd = hidden // heads
    w = {"model.embed_tokens.weight": (vocab, hidden), "model.norm.weight": (hidden,)}
    if not tied:
        w["lm_head.weight"] = (vocab, hidden)
    for i in range(layers):
        p = f"model.layers.{i}."
        w |= {
            p + "input_layernorm.weight": (hidden,),
            p + "post_attention_layernorm.weight": (hidden,),
            p + "self_attn.q_proj.weight": (heads * hd, hidden),
            p + "self_attn.k_proj.weight": (kv_heads * hd, hidden),
            p + "self_attn.v_proj.weight": (kv_heads * hd, hidden),
            p + "self_attn.o_proj.weight": (hidden, heads * hd),
            p + "mlp.gate_proj.weight": (ffn, hidden),
            p + "mlp.up_proj.weight": (ffn, hidden),
            p + "mlp.down_proj.weight": (hidden, ffn),
        }
    return {k: RNG.standard_normal(s).astype(np.float32) for k, s in w.items()}


HF_TO_GGUF = {
    "model.embed_tokens": "token_embd",
    "model.norm": "output_norm",
    "lm_head": "output",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def to_gguf_name(hf: str) -> str:
    stem, kind = hf.rsplit(".", 1)
    if stem.startswith("model.layers."):
        _, _, layer, rest = stem.split(".", 3)
        return f"blk.{layer}.{HF_TO_GGUF[rest]}.{kind}"
    return f"{HF_TO_GGUF[stem]}.{kind}"


def llama_cpp_tensors(
    hf: dict[str, np.ndarray], heads=4, kv_heads=2
) -> dict[str, tuple[np.ndarray, None]]:
    """What llama.cpp's converter writes: GGUF names, Q/K rows permuted."""
    out = {}
    for name, w in hf.items():
        if "q_proj" in name:
            w = gguf_loader.permute_qk(w, heads)
        elif "k_proj" in name:
            w = gguf_loader.permute_qk(w, kv_heads)
        out[to_gguf_name(name)] = (np.ascontiguousarray(w), None)
    return out


@pytest.fixture
def tiny_gguf(tmp_path) -> tuple[pathlib.Path, dict[str, np.ndarray]]:
    hf = tiny_model()
    return write_gguf(tmp_path / "tiny.gguf", llama_cpp_tensors(hf)), hf


# ----------------------------------------------------------------------------- dequantization


def _read_single(path: pathlib.Path) -> gguf.ReaderTensor:
    reader = gguf_loader.open_gguf(path)
    (tensor,) = reader.tensors
    return tensor


@pytest.mark.parametrize("qtype", [QT.F32, QT.F16, QT.BF16])
def test_dequantize_float_types(tmp_path, qtype):
    x = RNG.standard_normal((6, 40)).astype(np.float32)  # [out, in]: GGUF dims are [40, 6]
    if qtype == QT.F32:
        stored, raw, expected = x, None, x
    elif qtype == QT.F16:
        stored, raw, expected = x.astype(np.float16), None, x.astype(np.float16).astype(np.float32)
    else:
        stored, raw = gguf.quants.quantize(x, QT.BF16), QT.BF16
        expected = x.astype(ml_dtypes.bfloat16).astype(np.float32)
    tensor = _read_single(write_gguf(tmp_path / "t.gguf", {"w": (stored, raw)}, metadata=False))
    assert tensor.tensor_type == qtype and list(tensor.shape) == [40, 6]
    got = gguf_loader.dequantize_tensor(tensor)
    assert got.dtype == np.float32 and got.shape == (6, 40)
    np.testing.assert_array_equal(got, expected)


@pytest.mark.parametrize("qtype", [QT.Q8_0, QT.Q4_0, QT.Q4_1, QT.Q5_0, QT.Q5_1])
def test_dequantize_block_types(tmp_path, qtype):
    rows, cols = 5, 96  # three 32-blocks per row
    x = RNG.standard_normal((rows, cols)).astype(np.float32)
    raw = gguf.quants.quantize(x, qtype)
    tensor = _read_single(write_gguf(tmp_path / "t.gguf", {"w": (raw, qtype)}, metadata=False))
    assert tensor.tensor_type == qtype and list(tensor.shape) == [cols, rows]
    got = gguf_loader.dequantize_tensor(tensor)
    assert got.shape == (rows, cols) and got.dtype == np.float32
    np.testing.assert_array_equal(got, reference_dequantize(qtype, raw, rows, cols))
    # and it approximates the input, row for row (no transposition anywhere)
    step = {QT.Q8_0: 1 / 127, QT.Q4_0: 1 / 7, QT.Q4_1: 1 / 15, QT.Q5_0: 1 / 15, QT.Q5_1: 1 / 31}[
        qtype
    ]
    assert np.all(np.abs(got - x) <= step * np.abs(x).max(axis=1, keepdims=True) * 1.1 + 1e-3)


@pytest.mark.parametrize("qtype", [QT.Q2_K, QT.Q3_K, QT.Q4_K, QT.Q5_K, QT.Q6_K, QT.IQ4_NL,
                                   QT.IQ4_XS])
def test_dequantize_k_and_iq4_quants(tmp_path, qtype):
    # the gguf package cannot quantize these types, so the blocks are random bytes with sane
    # float16 scales, in the type's exact block layout
    rows, cols = 3, 512
    raw = random_k_blocks(qtype, rows, cols)
    tensor = _read_single(write_gguf(tmp_path / "t.gguf", {"w": (raw, qtype)}, metadata=False))
    assert tensor.tensor_type == qtype and list(tensor.shape) == [cols, rows]
    got = gguf_loader.dequantize_tensor(tensor)
    assert got.shape == (rows, cols) and got.dtype == np.float32
    want = reference_dequantize(qtype, raw, rows, cols)  # written from ggml's layouts
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(want, gguf.quants.dequantize(raw, qtype))  # gguf's own
    assert np.isfinite(want).all() and len(np.unique(want)) > 32  # not degenerate blocks


@pytest.mark.parametrize("qtype", [QT.IQ2_XXS, QT.IQ3_S])
def test_unsupported_type_names_type_and_tensor(tmp_path, qtype):
    block_elems, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    raw = np.zeros((2, 256 // block_elems * block_bytes), np.uint8)
    tensor = _read_single(
        write_gguf(tmp_path / "t.gguf", {"blk.0.ffn_up.weight": (raw, qtype)}, metadata=False)
    )
    with pytest.raises(ValueError, match=f"'blk.0.ffn_up.weight'.*{qtype.name}"):
        gguf_loader.dequantize_tensor(tensor)


def test_unsupported_type_in_model_fails_before_writing(tmp_path):
    hf = tiny_model()
    tensors = llama_cpp_tensors(hf)
    elems, block_bytes = gguf.GGML_QUANT_SIZES[QT.IQ2_XXS]
    tensors["blk.0.ffn_up.weight"] = (np.zeros((96, 256 // elems * block_bytes), np.uint8),
                                      QT.IQ2_XXS)
    path = write_gguf(tmp_path / "m.gguf", tensors, ffn=96)
    with pytest.raises(ValueError, match="'blk.0.ffn_up.weight'.*IQ2_XXS"):
        loader.resolve_model(path, cache_dir=tmp_path / "cache")
    assert not any((tmp_path / "cache" / "models").iterdir())  # nothing half-written left behind


# The tensor types llama.cpp's quantizer (llama_tensor_get_type in llama-quant.cpp) picks for a
# 2-layer Llama (GQA 2, an output matrix of its own, every row a multiple of 256) in its
# Q5_K_M and Q3_K_M presets; a pair is (layer 0, layer 1). Q5_K_M: Q5_K, with Q6_K for the
# output and for attn_v and ffn_down where use_more_bits(layer, 2) holds (layer 1 only).
# Q3_K_M: Q3_K, with Q5_K for attn_v of the first two layers, Q4_K for attn_output and
# ffn_down, Q6_K for the output. The embedding takes the preset's type; norms stay F32.
PRESETS = {
    "Q5_K_M": {"token_embd": QT.Q5_K, "output": QT.Q6_K, "attn_q": QT.Q5_K, "attn_k": QT.Q5_K,
               "attn_v": (QT.Q5_K, QT.Q6_K), "attn_output": QT.Q5_K, "ffn_gate": QT.Q5_K,
               "ffn_up": QT.Q5_K, "ffn_down": (QT.Q5_K, QT.Q6_K)},
    "Q3_K_M": {"token_embd": QT.Q3_K, "output": QT.Q6_K, "attn_q": QT.Q3_K, "attn_k": QT.Q3_K,
               "attn_v": QT.Q5_K, "attn_output": QT.Q4_K, "ffn_gate": QT.Q3_K,
               "ffn_up": QT.Q3_K, "ffn_down": QT.Q4_K},
}


def preset_type(preset: str, gguf_name: str) -> QT:
    parts = gguf_name.split(".")
    qtype = PRESETS[preset][parts[-2]]
    return qtype[int(parts[1])] if isinstance(qtype, tuple) else qtype


@functools.partial(jax.jit, static_argnums=0)
def _shared_forward(graphdef, state, kv, inputs):
    from flax import nnx

    m = nnx.merge(graphdef, state)
    h, kv = m(inputs.input_ids, inputs.positions, kv, inputs.md)
    return m.compute_logits(h), kv


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_k_quant_preset_model_equals_its_dequantized_reference(tmp_path, preset):
    """A tiny Llama written with GGUFWriter in a K_M preset's tensor types (random blocks,
    sane scales) loads into exactly gguf's dequantized weights and gives the logits of the
    model built from them."""
    import jax.numpy as jnp
    from flax import nnx

    from jaxserve.models.arch_config import ArchConfig
    from jaxserve.models.weights import create_model
    from tests.models.model_utils import PagedRunner

    heads, kv_heads, size = 4, 2, dict(layers=2, hidden=256, ffn=256)
    hf = tiny_model(tied=False, heads=heads, kv_heads=kv_heads, **size)
    tensors, reference = {}, {}
    for hf_name, x in hf.items():
        name = to_gguf_name(hf_name)
        if x.ndim == 1:  # norms
            tensors[name], reference[hf_name] = (x, None), x
            continue
        qtype = preset_type(preset, name)
        raw = random_k_blocks(qtype, *x.shape, scale=(1e-4, 1e-3))
        tensors[name] = (raw, qtype)
        w = gguf.quants.dequantize(raw, qtype).reshape(x.shape)
        if ".attn_q." in name or ".attn_k." in name:  # stored in llama.cpp's row order
            w = gguf_loader.reverse_permute_qk(w, heads if ".attn_q." in name else kv_heads)
        reference[hf_name] = w
    path = write_gguf(tmp_path / f"{preset}.gguf", tensors, heads=heads, kv_heads=kv_heads, **size)
    types = {t.name: t.tensor_type for t in gguf_loader.open_gguf(path).tensors}
    assert types == {name: preset_type(preset, name) if x[1] is not None else QT.F32
                     for name, x in tensors.items()}
    want_types = {QT.Q5_K, QT.Q6_K} if preset == "Q5_K_M" else {QT.Q3_K, QT.Q4_K, QT.Q5_K, QT.Q6_K}
    assert set(types.values()) == want_types | {QT.F32}
    ckpt = loader.load_checkpoint(loader.resolve_model(path, cache_dir=tmp_path / "cache"))
    assert "quantization_config" not in ckpt.config  # dequantized, as Q4_K (only Q8_0 keeps blocks)
    for name, w in reference.items():
        got = ckpt.get_tensor(name)
        assert got.dtype == np.float32
        np.testing.assert_array_equal(got, w, err_msg=name)
    cfg = ArchConfig.from_hf(ckpt.config)
    tokens = [RNG.integers(3, cfg.vocab_size, n).tolist() for n in (9, 4)]

    # both models (and both presets) through one compiled forward: only the weights differ
    models = [create_model(cfg, dtype=jnp.float32, get_tensor=get)
              for get in (ckpt.get_tensor, reference.__getitem__)]

    def logits(model):
        runner = PagedRunner(model, page_size=4, num_pages=8)
        graphdef, state = nnx.split(model)
        runner.fwd = lambda kv, inputs: _shared_forward(graphdef, state, kv, inputs)
        out = runner.step([(0, tokens[0], 0), (1, tokens[1], 0)], num_tokens=16, num_reqs=4,
                          pages_per_req=4)
        return np.concatenate(out)

    got, want = logits(models[0]), logits(models[1])
    assert np.isfinite(want).all() and want.std() > 1e-3
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(got.argmax(-1), want.argmax(-1))


# ----------------------------------------------------------------------------- permutation


@pytest.mark.parametrize("n_head,head_dim", [(9, 64), (3, 64), (4, 16), (2, 128)])
def test_qk_permutation_round_trip(n_head, head_dim):
    w = RNG.standard_normal((n_head * head_dim, 7)).astype(np.float32)
    permuted = gguf_loader.permute_qk(w, n_head)
    assert not np.array_equal(permuted, w)
    np.testing.assert_array_equal(gguf_loader.reverse_permute_qk(permuted, n_head), w)
    np.testing.assert_array_equal(
        gguf_loader.permute_qk(gguf_loader.reverse_permute_qk(w, n_head), n_head), w
    )
    # llama.cpp's layout, by index: GGUF row h*hd + 2j + s holds HF row h*hd + s*hd/2 + j
    for h in range(n_head):
        for j in range(head_dim // 2):
            for s in range(2):
                np.testing.assert_array_equal(
                    permuted[h * head_dim + 2 * j + s], w[h * head_dim + s * head_dim // 2 + j]
                )
    bias = RNG.standard_normal(n_head * head_dim).astype(np.float32)
    np.testing.assert_array_equal(
        gguf_loader.reverse_permute_qk(gguf_loader.permute_qk(bias, n_head), n_head), bias
    )


def test_reverse_permute_rejects_odd_rows():
    with pytest.raises(ValueError, match="un-permute"):
        gguf_loader.reverse_permute_qk(np.zeros((9, 4), np.float32), 3)


# ----------------------------------------------------------------------------- names and config


def test_unknown_tensor_names_the_tensor(tmp_path):
    tensors = llama_cpp_tensors(tiny_model())
    tensors["blk.0.ssm_conv1d.weight"] = (np.zeros((4, 8), np.float32), None)
    with pytest.raises(ValueError, match="'blk.0.ssm_conv1d.weight' has no Hugging Face counterpart"):
        loader.resolve_model(write_gguf(tmp_path / "m.gguf", tensors), cache_dir=tmp_path / "cache")


@pytest.mark.parametrize("tied", [True, False])
def test_tiny_model_converts_exactly(tmp_path, tied):
    hf = tiny_model(layers=2, tied=tied)
    path = write_gguf(tmp_path / "tiny.gguf", llama_cpp_tensors(hf), layers=2)
    out = loader.resolve_model(path, cache_dir=tmp_path / "cache")
    ckpt = loader.load_checkpoint(out)
    cfg = ckpt.config
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["model_type"] == "llama"
    assert (cfg["num_hidden_layers"], cfg["hidden_size"], cfg["intermediate_size"]) == (2, 64, 96)
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]) == (4, 2, 16)
    assert cfg["vocab_size"] == len(tiny_vocab()[0]) and cfg["max_position_embeddings"] == 128
    assert cfg["tie_word_embeddings"] is tied and cfg["rope_theta"] == 10000.0
    assert cfg["rms_norm_eps"] == pytest.approx(1e-5) and cfg["hidden_act"] == "silu"
    assert (cfg["bos_token_id"], cfg["eos_token_id"], cfg["pad_token_id"]) == (1, 2, 2)
    assert ckpt.tensor_names() == sorted(hf)
    for name, expected in hf.items():
        got = ckpt.get_tensor(name)
        assert got.dtype == np.float32
        np.testing.assert_array_equal(got, expected, err_msg=name)
    gen = json.loads((out / "generation_config.json").read_text())
    assert gen["eos_token_id"] == 2 and gen["bos_token_id"] == 1


def test_tiny_tokenizer(tiny_gguf, tmp_path):
    out = loader.resolve_model(tiny_gguf[0], cache_dir=tmp_path / "cache")
    tok = loader.load_tokenizer(out)
    tokens = tiny_vocab()[0]
    ids = tok("hello world<|im_end|>", add_special_tokens=True)["input_ids"]
    assert ids[0] == tokens.index("hello") and ids[-1] == 2 and tokens.index("Ġw") in ids
    assert tok.decode(ids) == "hello world<|im_end|>"
    assert tok.decode(ids, skip_special_tokens=True) == "hello world"
    assert (
        tok.eos_token == "<|im_end|>" and tok.bos_token == "<|im_start|>" and tok.pad_token_id == 2
    )
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    assert text == "<|im_start|>user\nhi<|im_end|>\n"
    tcfg = json.loads((out / "tokenizer_config.json").read_text())
    assert tcfg["chat_template"] == TEMPLATE and tcfg["add_bos_token"] is False
    special = json.loads((out / "special_tokens_map.json").read_text())
    assert special["eos_token"] == "<|im_end|>"


def test_byte_level_fallback_matches_transformers(tiny_gguf):
    from jaxserve.models import gguf_tokenizer

    reader = gguf_loader.open_gguf(tiny_gguf[0])
    tok, _ = gguf_tokenizer.tokenizer_metadata(reader)
    ours = gguf_tokenizer._byte_level_backend(tok)
    theirs = gguf_tokenizer.build_backend("llama", tok)
    assert json.loads(ours.to_str()) == json.loads(theirs.to_str())


# ----------------------------------------------------------------------------- errors


def test_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.gguf"):
        gguf_loader.open_gguf(tmp_path / "nope.gguf")
    with pytest.raises(ValueError, match="not found on this machine"):
        loader.resolve_model(tmp_path / "nope.gguf")


def test_not_gguf(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"PK\x03\x04 definitely a zip")
    with pytest.raises(ValueError, match="not a GGUF file"):
        gguf_loader.open_gguf(bad)


@pytest.mark.parametrize("fraction", [0.0005, 0.01, 0.3, 0.6, 0.999])
def test_truncated_file(tiny_gguf, tmp_path, fraction):
    data = tiny_gguf[0].read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: max(6, int(len(data) * fraction))])
    with pytest.raises(ValueError, match="truncated"):
        loader.resolve_model(cut, cache_dir=tmp_path / "cache")


def test_unsupported_architecture(tmp_path):
    path = write_gguf(
        tmp_path / "q.gguf",
        {"token_embd.weight": (np.zeros((4, 8), np.float32), None)},
        arch="gpt2",
        metadata=False,
    )
    with pytest.raises(ValueError, match="architecture 'gpt2' is not supported; supported: gemma3, llama, phi3, "
                       "qwen2, qwen3, qwen3moe"):
        loader.resolve_model(path, cache_dir=tmp_path / "cache")


def test_missing_tensors(tmp_path):
    tensors = llama_cpp_tensors(tiny_model())
    del tensors["blk.0.attn_v.weight"]
    path = write_gguf(tmp_path / "m.gguf", tensors)
    with pytest.raises(ValueError, match="lacks 1 tensors.*v_proj"):
        loader.resolve_model(path, cache_dir=tmp_path / "cache")


# ----------------------------------------------------------------------------- the cache


def test_cache_is_atomic_and_reused(tiny_gguf, tmp_path, monkeypatch):
    path, _ = tiny_gguf
    cache = tmp_path / "cache"

    def crash(*args, **kwargs):
        raise RuntimeError("simulated crash while writing weights")

    with monkeypatch.context() as m:
        m.setattr(gguf_loader, "write_streaming", crash)
        with pytest.raises(RuntimeError, match="simulated crash"):
            loader.resolve_model(path, cache_dir=cache)
    assert list((cache / "models").iterdir()) == []  # no half cache, no leftover tmp dir

    out = loader.resolve_model(path, cache_dir=cache)
    assert out.parent == cache / "models" and out.name.startswith("tiny-")
    assert (out / "jaxserve_conversion.json").is_file()
    with monkeypatch.context() as m:  # a second call must not convert again
        m.setattr(gguf_loader, "convert_gguf", crash)
        assert loader.resolve_model(str(path), cache_dir=cache) == out

    # an incomplete directory under the final name (not ours) is replaced
    (out / "jaxserve_conversion.json").unlink()
    again = loader.resolve_model(path, cache_dir=cache)
    assert again == out and (out / "jaxserve_conversion.json").is_file()

    # a changed file gets a new cache entry
    os.utime(path, ns=(time.time_ns(), time.time_ns() + 10**9))
    assert loader.resolve_model(path, cache_dir=cache) != out


def test_directory_with_single_gguf(tiny_gguf, tmp_path):
    folder = tmp_path / "folder"
    folder.mkdir()
    shutil.copy(tiny_gguf[0], folder / "m.gguf")
    out = loader.resolve_model(folder, cache_dir=tmp_path / "cache")
    assert (out / "config.json").is_file()


def test_default_cache_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert loader.default_cache_dir() == tmp_path / "jaxserve"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert loader.default_cache_dir() == pathlib.Path.home() / ".cache" / "jaxserve"


def test_llama3_rope_freqs_round_trip(tmp_path, data_dir):
    """A Llama 3.1-style model (llama3 rope scaling) written as llama.cpp does: Q/K permuted,
    the scaling as `rope_freqs` divisors, no rope_scaling metadata. Converted back, jaxserve
    applies the divisors and reproduces transformers' logits of the original."""
    import json

    import jax.numpy as jnp
    from safetensors.numpy import load_file

    from jaxserve.models.arch_config import ArchConfig
    from jaxserve.models.layers.rotary import inverse_frequencies
    from jaxserve.models.loader import load_checkpoint
    from jaxserve.models.weights import create_model
    from tests.models.model_utils import PagedRunner

    src = data_dir / "arch" / "llama"
    hf_cfg = json.loads((src / "config.json").read_text())
    cfg = ArchConfig.from_hf(hf_cfg)
    assert cfg.rope_scaling.rope_type == "llama3"
    plain = ArchConfig.from_hf({**hf_cfg, "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
                                "rope_scaling": None})
    factors = inverse_frequencies(plain) / inverse_frequencies(cfg)  # llama.cpp's rope_freqs
    hf = load_file(str(src / "model.safetensors"))
    tensors = llama_cpp_tensors(hf, heads=cfg.num_heads, kv_heads=cfg.num_kv_heads)
    tensors["rope_freqs.weight"] = (factors.astype(np.float32), None)
    path = write_gguf(tmp_path / "l31.gguf", tensors, layers=cfg.num_layers, hidden=cfg.hidden_size,
                      ffn=cfg.intermediate_size, heads=cfg.num_heads, kv_heads=cfg.num_kv_heads,
                      theta=cfg.rope_theta)
    # the tiny vocabulary of write_gguf is smaller than the fixture's: only the weights matter here
    out = tmp_path / "out"
    out.mkdir()
    config = gguf_loader.convert_gguf(path, out)
    assert config["rope_freq_factors"] == pytest.approx(factors.tolist())
    ckpt = load_checkpoint(out)
    got_cfg = ArchConfig.from_hf({**ckpt.config, "vocab_size": cfg.vocab_size})
    assert got_cfg.rope_scaling.rope_type == "default"
    np.testing.assert_allclose(inverse_frequencies(got_cfg), inverse_frequencies(cfg), rtol=1e-6)
    model = create_model(got_cfg, dtype=jnp.float32, get_tensor=ckpt.get_tensor)
    expected = load_file(str(src / "expected.safetensors"))
    runner = PagedRunner(model, page_size=4, num_pages=16)
    seqs = [expected["tokens_0"].tolist(), expected["tokens_1"].tolist()]
    outs = runner.step([(0, seqs[0], 0), (1, seqs[1], 0)], num_tokens=32, num_reqs=4, pages_per_req=8)
    for i in range(2):
        np.testing.assert_allclose(outs[i], expected[f"logits_{i}"], atol=1e-4, rtol=0)
