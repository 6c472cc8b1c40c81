"""GGUF files of the tiny architecture fixtures (tests/data/arch/*), laid out as llama.cpp's
convert_hf_to_gguf.py writes them: tensor names from the `gguf` package's own name map (the
converter's `map_tensor_name`), its metadata keys per architecture, Llama's Q/K rows permuted,
Gemma's norms stored as 1 + w, Phi-3's LongRoPE factors as tensors, each MoE layer's experts
stacked into one [X, out, in] tensor per projection. Storage types follow the converter's
`--outtype`: F32; F16 or Q8_0 for every tensor of two or more dims except the MoE router (F32),
with rows not divisible by 32 in F16 for Q8_0; 1-D tensors (norms, rope factors) stay F32.

Two departures from the converter, both needed to reproduce the transformers fixtures:
- qwen3moe: `expert_weights_norm` is written from `norm_topk_prob` (the converter does not write
  it and llama.cpp always renormalizes; the fixture does not), and its dense layer
  (`mlp_only_layers`) is named with the generic `ffn_gate/up/down` names, which llama.cpp's
  qwen3moe tensor list lacks;
- a 128-token vocabulary (byte-level BPE, or sentencepiece for gemma3 and phi3) stands in for
  the fixtures' absent tokenizer.
"""

from __future__ import annotations

import json
import pathlib
import re

import gguf
import numpy as np
from gguf import GGMLQuantizationType as QT
from jaxserve.models.gguf_loader import permute_qk
from safetensors.numpy import load_file

# fixture -> llama.cpp architecture
FIXTURES = {"qwen2": "qwen2", "qwen3": "qwen3", "qwen3_moe": "qwen3moe", "gemma3": "gemma3",
            "phi3": "phi3", "mixtral": "llama"}
_EXPERT = re.compile(r"model\.layers\.(\d+)\.(mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)\.weight")

BPE_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
)
GEMMA_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<start_of_turn>{{ m['role'] }}\n{{ m['content'] }}"
    "<end_of_turn>\n{% endfor %}"
)
PHI3_TEMPLATE = "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|end|>\n{% endfor %}"


def fixture(data_dir: pathlib.Path, name: str) -> tuple[dict, dict[str, np.ndarray]]:
    d = data_dir / "arch" / name
    return json.loads((d / "config.json").read_text()), load_file(str(d / "model.safetensors"))


def write_fixture_gguf(data_dir: pathlib.Path, name: str, path: pathlib.Path, qtype: QT = QT.F32) -> pathlib.Path:
    hf, tensors = fixture(data_dir, name)
    return write_gguf(path, FIXTURES[name], hf, tensors, qtype)


def write_gguf(path: pathlib.Path, arch: str, hf: dict, tensors: dict[str, np.ndarray],
               qtype: QT = QT.F32) -> pathlib.Path:
    """A GGUF file of `arch` as llama.cpp's converter writes it: `hf`'s config as metadata, a
    vocabulary, the HF `tensors` renamed (and permuted) as llama.cpp names them, in `qtype`."""
    w = gguf.GGUFWriter(path, arch)
    _metadata(w, arch, hf)
    _vocabulary(w, arch, hf["vocab_size"])
    for gguf_name, x in llama_cpp_tensors(arch, hf, tensors).items():
        array, raw_dtype = _encode(gguf_name, x, qtype)
        w.add_tensor(gguf_name, array, raw_dtype=raw_dtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def llama_cpp_tensors(arch: str, hf: dict, tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """GGUF name -> float32 array in numpy (HF) layout, as the converter produces them."""
    layers = hf["num_hidden_layers"]
    model_arch = next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == arch)
    names, generic = gguf.get_tensor_name_map(model_arch, layers), gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, layers)

    def gguf_name(hf_name: str) -> str:
        found = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if found is None and arch == "qwen3moe":
            found = generic.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        assert found is not None, hf_name
        return found

    out: dict[str, np.ndarray] = {}
    experts: dict[tuple[str, str, str], dict[int, np.ndarray]] = {}
    for hf_name, x in tensors.items():
        x = np.asarray(x, np.float32)
        if m := _EXPERT.match(hf_name):
            layer, block, j, proj = m.groups()
            experts.setdefault((layer, block, proj), {})[int(j)] = x
            continue
        if arch == "llama" and ".q_proj." in hf_name:
            x = permute_qk(x, hf["num_attention_heads"])
        elif arch == "llama" and ".k_proj." in hf_name:
            x = permute_qk(x, hf["num_key_value_heads"])
        if arch == "gemma3" and hf_name.endswith("norm.weight"):
            x = x + np.float32(1.0)  # Gemma3RMSNorm's (1 + w), stored for llama.cpp's norm
        out[gguf_name(hf_name)] = x
    for (layer, block, proj), per_expert in experts.items():  # merged: [X, out, in]
        stacked = np.stack([per_expert[j] for j in range(len(per_expert))])
        out[gguf_name(f"model.layers.{layer}.{block}.experts.{proj}.weight")] = stacked
    if arch == "phi3":
        rope = hf["rope_parameters"]
        out["rope_factors_long.weight"] = np.asarray(rope["long_factor"], np.float32)
        out["rope_factors_short.weight"] = np.asarray(rope["short_factor"], np.float32)
    return out


def _encode(name: str, x: np.ndarray, qtype: QT) -> tuple[np.ndarray, QT | None]:
    if qtype == QT.F32 or x.ndim <= 1 or ".ffn_gate_inp." in name:
        return x, None
    if qtype == QT.Q8_0 and x.shape[-1] % 32 == 0:
        return gguf.quants.quantize(x, QT.Q8_0), QT.Q8_0
    return x.astype(np.float16), None


def _metadata(w: gguf.GGUFWriter, arch: str, hf: dict) -> None:
    heads, hidden = hf["num_attention_heads"], hf["hidden_size"]
    rope = hf["rope_parameters"]
    full = rope.get("full_attention", rope)
    w.add_block_count(hf["num_hidden_layers"])
    w.add_context_length(hf["max_position_embeddings"])
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(hf["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(hf["num_key_value_heads"])
    w.add_rope_freq_base(full["rope_theta"])
    w.add_layer_norm_rms_eps(hf["rms_norm_eps"])
    if hf.get("head_dim"):
        w.add_key_length(hf["head_dim"])
        w.add_value_length(hf["head_dim"])
    if arch == "llama":
        w.add_vocab_size(hf["vocab_size"])
        w.add_rope_dimension_count(hf.get("head_dim") or hidden // heads)
        if hf.get("num_local_experts"):
            w.add_expert_count(hf["num_local_experts"])
            w.add_expert_used_count(hf["num_experts_per_tok"])
    elif arch == "qwen3moe":
        w.add_expert_count(hf["num_local_experts"])
        w.add_expert_used_count(hf["num_experts_per_tok"])
        w.add_expert_feed_forward_length(hf["moe_intermediate_size"])
        w.add_expert_weights_norm(hf["norm_topk_prob"])
    elif arch == "gemma3":
        w.add_sliding_window(hf["sliding_window"])
        if full.get("rope_type") == "linear":
            w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            w.add_rope_scaling_factor(full["factor"])
    elif arch == "phi3":
        orig = rope["original_max_position_embeddings"]
        rotary = int(rope.get("partial_rotary_factor", 1.0) * hidden) // heads
        w.add_rope_scaling_orig_ctx_len(orig)
        w.add_rope_dimension_count(rotary)
        w.add_sliding_window(hf.get("sliding_window") or 0)
        scale = hf["max_position_embeddings"] / orig
        w.add_rope_scaling_attn_factors(float(np.sqrt(1 + np.log(scale) / np.log(orig))) if scale > 1 else 1.0)


# --------------------------------------------------------------------------- vocabularies


def bpe_vocabulary(size: int) -> tuple[list[str], list[int], list[str]]:
    """Byte-level BPE: 3 control tokens, the printable ASCII bytes, merges up to `size` tokens."""
    from jaxserve.models.gguf_tokenizer import bytes_to_unicode

    spell = bytes_to_unicode()
    tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"] + [spell[b] for b in range(32, 127)]
    merges = ["h e", "l l", "he ll", "hell o", "Ġ w", "o r", "Ġw or", "l d", "Ġwor ld"]
    merges += [f"Ġ {c}" for c in "abcdefghijklmnopqrstuv"]
    merges = merges[: size - len(tokens)]
    tokens += [m.replace(" ", "") for m in merges]
    assert len(tokens) == size
    return tokens, [3] * 3 + [1] * (size - 3), merges


def spm_vocabulary(arch: str, size: int) -> tuple[list[str], list[float], list[int]]:
    """Sentencepiece: the family's special tokens, "▁", letters and digits, then merged pieces
    (scores falling with the position, as in the real files), padded with unused tokens."""
    if arch == "gemma3":
        special = ["<pad>", "<bos>", "<eos>", "<unk>", "<mask>", "<start_of_turn>", "<end_of_turn>"]
    else:
        special = ["<unk>", "<s>", "</s>", "<|user|>", "<|assistant|>", "<|end|>"]
    pieces = ["▁", *"abcdefghijklmnopqrstuvwxyz", *"0123456789"]
    pieces += ["he", "ll", "hell", "hello", "▁hello", "▁w", "or", "▁wor", "ld", "▁world"]
    tokens = special + pieces
    tokens += [f"<unused{i}>" for i in range(size - len(tokens))]
    scores = [0.0] * len(special) + [-float(i) for i in range(len(pieces))] + [-1000.0] * (size - len(special) - len(pieces))
    # 1 normal, 2 unknown, 3 control, 5 unused (llama.cpp's token types)
    types = [3] * len(special) + [1] * len(pieces) + [5] * (size - len(special) - len(pieces))
    types[special.index("<unk>")] = 2
    return tokens, scores, types


def _vocabulary(w: gguf.GGUFWriter, arch: str, size: int) -> None:
    if arch in ("gemma3", "phi3"):
        tokens, scores, types = spm_vocabulary(arch, size)
        w.add_tokenizer_model("llama")
        w.add_tokenizer_pre("default")
        w.add_token_list(tokens)
        w.add_token_scores(scores)
        w.add_token_types(types)
        w.add_bos_token_id(1)
        w.add_eos_token_id(2)
        w.add_unk_token_id(tokens.index("<unk>"))
        w.add_pad_token_id(0)
        w.add_add_bos_token(True)
        w.add_add_space_prefix(False)
        w.add_chat_template(GEMMA_TEMPLATE if arch == "gemma3" else PHI3_TEMPLATE)
        return
    tokens, types, merges = bpe_vocabulary(size)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2" if arch.startswith("qwen") else "default")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_pad_token_id(0)
    w.add_add_bos_token(False)
    w.add_chat_template(BPE_TEMPLATE)
