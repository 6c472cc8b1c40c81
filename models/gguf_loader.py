"""GGUF files (llama.cpp's format) → a standard Hugging Face model directory.

What this reproduces, and from where (transformers 5.24's legacy GGUF path, which is the one it
takes for `llama` files: `modeling_gguf_pytorch_utils.load_gguf_checkpoint`):

- every tensor is dequantized with `gguf.quants.dequantize` to float32; a GGUF tensor of dims
  `[ne0, ne1]` (fastest first) is the row-major numpy array `[ne1, ne0]`, i.e. HF's `[out, in]`;
- llama.cpp's converter permutes the rows of the Q and K projections (per head, the two rotary
  halves interleaved pairwise); `reverse_permute_qk` undoes it with `n_head` for Q and
  `n_head_kv` for K, biases included. The result equals transformers' weights bit for bit: the
  permutation only moves values;
- config keys come from the `llama.*` metadata, `tie_word_embeddings` is true when the file
  has no `output.weight`;
- `rope_freqs.weight` (how llama.cpp stores Llama 3.1's rope scaling: one divisor per
  frequency) becomes the config's `rope_freq_factors`, which jaxserve applies to the inverse
  frequencies (transformers drops it, and with it the scaling).

The tokenizer is built in `gguf_tokenizer.py`. `convert_gguf` writes the whole directory.
"""

from __future__ import annotations

import logging
import math
import pathlib
import re
from typing import Any

import numpy as np

from jaxserve.models import gguf_tokenizer
from jaxserve.models.safetensors_io import PlannedTensor, write_streaming

logger = logging.getLogger(__name__)

try:  # the `gguf` package is a hard dependency; import errors surface with a clear message below
    import gguf
    from gguf import GGMLQuantizationType as QT
except ImportError as _e:  # pragma: no cover - exercised only in broken installs
    raise ImportError("reading GGUF files needs the `gguf` package (pip install gguf)") from _e

# Types we dequantize (each one has a test). `gguf` can dequantize more; add them here with a test.
SUPPORTED_TYPES: frozenset[QT] = frozenset(
    {QT.F32, QT.F16, QT.BF16, QT.Q8_0, QT.Q4_0, QT.Q4_1, QT.Q5_0, QT.Q5_1, QT.Q4_K, QT.Q6_K}
)

# GGUF `general.architecture` -> HF `architectures` entry
SUPPORTED_ARCHITECTURES: dict[str, str] = {"llama": "LlamaForCausalLM"}

_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# tensors llama.cpp stores that are not weights (rope_freqs goes into the config)
_IGNORED = {"rope_freqs.weight"}
_BLOCK_RE = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")
_GLOBAL_RE = re.compile(r"^([a-z_]+)\.(weight|bias)$")

GGUF_MAGIC = b"GGUF"


# --------------------------------------------------------------------------- reading


def open_gguf(path: str | pathlib.Path) -> gguf.GGUFReader:
    """Open a GGUF file, turning every way it can be broken into a ValueError naming the file."""
    path = pathlib.Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {path}")
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != GGUF_MAGIC:
        raise ValueError(
            f"{path} is not a GGUF file (it does not start with the GGUF magic bytes)."
        )
    try:
        reader = gguf.GGUFReader(path)
    except Exception as e:  # the reader raises ValueError/IndexError/struct errors on short files
        raise ValueError(f"{path} is truncated or corrupt; the GGUF reader failed with: {e}") from e
    size = path.stat().st_size
    for t in reader.tensors:
        if t.data_offset + t.n_bytes > size:
            raise ValueError(
                f"{path} is truncated: tensor {t.name!r} ends at byte {t.data_offset + t.n_bytes} "
                f"but the file has {size} bytes."
            )
    return reader


def metadata_value(reader: gguf.GGUFReader, key: str, default: Any = None) -> Any:
    """One metadata value as a Python value (str, int, float, bool or a list of them)."""
    field = reader.fields.get(key)
    if field is None:
        return default
    return field.contents()


def _required(reader: gguf.GGUFReader, key: str) -> Any:
    value = metadata_value(reader, key)
    if value is None:
        raise ValueError(f"GGUF file is missing the metadata key {key!r}, which a model needs.")
    return value


def architecture(reader: gguf.GGUFReader) -> str:
    arch = metadata_value(reader, "general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"GGUF architecture {arch!r} is not supported; supported: "
            f"{', '.join(sorted(SUPPORTED_ARCHITECTURES))}."
        )
    return arch


# --------------------------------------------------------------------------- names and config


def hf_tensor_name(gguf_name: str) -> str | None:
    """The HF Llama name of a llama.cpp tensor; None for tensors HF has no place for.

    Raises ValueError for a name that is neither mapped nor known to be ignorable.
    """
    if gguf_name in _IGNORED:
        return None
    if m := _BLOCK_RE.match(gguf_name):
        layer, part, kind = m.groups()
        if part in _BLOCK_NAMES:
            return f"model.layers.{layer}.{_BLOCK_NAMES[part]}.{kind}"
    elif m := _GLOBAL_RE.match(gguf_name):
        part, kind = m.groups()
        if part in _GLOBAL_NAMES:
            return f"{_GLOBAL_NAMES[part]}.{kind}"
    raise ValueError(
        f"GGUF tensor {gguf_name!r} has no Hugging Face Llama counterpart (unsupported)."
    )


def config_from_gguf(reader: gguf.GGUFReader) -> dict[str, Any]:
    """A complete HF `config.json` dict for the model in a GGUF file."""
    arch = architecture(reader)

    def key(name: str) -> str:
        return f"{arch}.{name}"

    hidden = int(_required(reader, key("embedding_length")))
    n_head = int(_required(reader, key("attention.head_count")))
    n_head_kv = int(metadata_value(reader, key("attention.head_count_kv"), n_head))
    head_dim = metadata_value(reader, key("rope.dimension_count"))
    if head_dim is None:
        head_dim = metadata_value(reader, key("attention.key_length"), hidden // n_head)
    tensor_names = {t.name for t in reader.tensors}
    vocab_size = metadata_value(reader, key("vocab_size"))
    if vocab_size is None:
        tokens = reader.fields.get("tokenizer.ggml.tokens")
        vocab_size = len(tokens.data) if tokens is not None else None
    if vocab_size is None:
        embd = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
        if embd is None:
            raise ValueError("GGUF file has neither a vocabulary size nor a token embedding.")
        vocab_size = int(embd.shape[-1])
    rope_theta = float(metadata_value(reader, key("rope.freq_base"), 10000.0))
    scaling = metadata_value(reader, key("rope.scaling.type"))
    if scaling not in (None, "none"):
        raise ValueError(f"GGUF rope scaling {scaling!r} is not supported yet.")
    freq_factors = None
    if "rope_freqs.weight" in tensor_names:
        freqs = next(t for t in reader.tensors if t.name == "rope_freqs.weight")
        freq_factors = [float(x) for x in dequantize_tensor(freqs).reshape(-1)]

    def token_id(name: str) -> int | None:
        value = metadata_value(reader, f"tokenizer.ggml.{name}")
        return None if value is None else int(value)

    return {
        "architectures": [SUPPORTED_ARCHITECTURES[arch]],
        "model_type": arch,
        "vocab_size": int(vocab_size),
        "hidden_size": hidden,
        "intermediate_size": int(_required(reader, key("feed_forward_length"))),
        "num_hidden_layers": int(_required(reader, key("block_count"))),
        "num_attention_heads": n_head,
        "num_key_value_heads": n_head_kv,
        "head_dim": int(head_dim),
        "max_position_embeddings": int(metadata_value(reader, key("context_length"), 2048)),
        "rms_norm_eps": float(
            metadata_value(reader, key("attention.layer_norm_rms_epsilon"), 1e-6)
        ),
        "rope_theta": rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": rope_theta},
        "rope_scaling": None,
        **({"rope_freq_factors": freq_factors} if freq_factors else {}),
        "hidden_act": "silu",
        "attention_bias": "blk.0.attn_q.bias" in tensor_names,
        "attention_dropout": 0.0,
        "mlp_bias": "blk.0.ffn_up.bias" in tensor_names,
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "bos_token_id": token_id("bos_token_id"),
        "eos_token_id": token_id("eos_token_id"),
        "pad_token_id": token_id("padding_token_id"),
        "initializer_range": 0.02,
        "pretraining_tp": 1,
        "use_cache": True,
        "torch_dtype": "float32",
        "dtype": "float32",
    }


# --------------------------------------------------------------------------- tensors


def permute_qk(weights: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's forward permutation of Q/K rows (HF layout → GGUF layout); for tests."""
    rows = weights.shape[0]
    w = weights.reshape(n_head, 2, rows // n_head // 2, *weights.shape[1:])
    return w.swapaxes(1, 2).reshape(weights.shape)


def reverse_permute_qk(weights: np.ndarray, n_head: int) -> np.ndarray:
    """Undo `permute_qk`: GGUF row order → HF row order (weights `[rows, ...]`, biases `[rows]`)."""
    rows = weights.shape[0]
    if rows % (2 * n_head):
        raise ValueError(
            f"cannot un-permute {rows} rows over {n_head} heads (need an even head dim)"
        )
    w = weights.reshape(n_head, rows // n_head // 2, 2, *weights.shape[1:])
    return w.swapaxes(2, 1).reshape(weights.shape)


def hf_shape(tensor: gguf.ReaderTensor) -> tuple[int, ...]:
    """The numpy/HF shape of a GGUF tensor: its dims reversed (GGUF lists the fastest first)."""
    return tuple(int(d) for d in reversed(tensor.shape.tolist()))


def check_supported_type(tensor: gguf.ReaderTensor) -> None:
    if tensor.tensor_type not in SUPPORTED_TYPES:
        supported = ", ".join(sorted(t.name for t in SUPPORTED_TYPES))
        raise ValueError(
            f"GGUF tensor {tensor.name!r} has quantization type {tensor.tensor_type.name}, "
            f"which jaxserve cannot dequantize; supported: {supported}."
        )


def dequantize_tensor(tensor: gguf.ReaderTensor) -> np.ndarray:
    """One GGUF tensor as float32 in HF shape (no Q/K un-permutation; see `hf_tensor`)."""
    check_supported_type(tensor)
    values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
    shape = hf_shape(tensor)
    if values.shape != shape:
        if math.prod(values.shape) != math.prod(shape):
            raise ValueError(
                f"GGUF tensor {tensor.name!r}: dequantized to {values.shape}, expected {shape}"
            )
        values = values.reshape(shape)
    return np.asarray(values, dtype=np.float32)


def hf_tensor(tensor: gguf.ReaderTensor, config: dict[str, Any]) -> np.ndarray:
    """One GGUF tensor as HF's float32 weight: dequantized, Q/K rows un-permuted."""
    values = dequantize_tensor(tensor)
    if ".attn_q." in tensor.name:
        values = reverse_permute_qk(values, config["num_attention_heads"])
    elif ".attn_k." in tensor.name:
        values = reverse_permute_qk(values, config["num_key_value_heads"])
    return values


def planned_tensors(reader: gguf.GGUFReader, config: dict[str, Any]) -> list[PlannedTensor]:
    """Every HF tensor of the file, as lazy producers sorted by HF name (checked up front)."""
    planned = []
    for tensor in reader.tensors:
        name = hf_tensor_name(tensor.name)
        if name is None:
            logger.info("skipping GGUF tensor %s (no HF counterpart)", tensor.name)
            continue
        check_supported_type(tensor)
        planned.append(
            PlannedTensor(
                name=name,
                dtype=np.dtype(np.float32),
                shape=hf_shape(tensor),
                produce=lambda t=tensor: hf_tensor(t, config),
            )
        )
    names = [p.name for p in planned]
    if len(set(names)) != len(names):
        raise ValueError("GGUF file maps two tensors onto the same HF name")
    _check_complete(set(names), config)
    return sorted(planned, key=lambda p: p.name)


def _check_complete(names: set[str], config: dict[str, Any]) -> None:
    needed = {"model.embed_tokens.weight", "model.norm.weight"}
    if not config["tie_word_embeddings"]:
        needed.add("lm_head.weight")
    for i in range(config["num_hidden_layers"]):
        needed |= {f"model.layers.{i}.{part}.weight" for part in _BLOCK_NAMES.values()}
    missing = sorted(needed - names)
    if missing:
        shown = ", ".join(missing[:5]) + (" …" if len(missing) > 5 else "")
        raise ValueError(f"GGUF file lacks {len(missing)} tensors a Llama model needs: {shown}")


# --------------------------------------------------------------------------- the whole directory


def generation_config(config: dict[str, Any]) -> dict[str, Any]:
    out = {
        k: config[k]
        for k in ("bos_token_id", "eos_token_id", "pad_token_id")
        if config[k] is not None
    }
    return {**out, "_from_model_config": True}


def convert_gguf(gguf_path: str | pathlib.Path, out_dir: str | pathlib.Path) -> dict[str, Any]:
    """Write an HF directory for a GGUF file into `out_dir` (which must exist and be empty).

    Files: config.json, generation_config.json, model.safetensors (float32), tokenizer.json,
    tokenizer_config.json (with chat_template), special_tokens_map.json, chat_template.jinja.
    Returns the config. Peak memory is one dequantized tensor plus the tokenizer.
    """
    import json

    gguf_path, out_dir = pathlib.Path(gguf_path), pathlib.Path(out_dir)
    reader = open_gguf(gguf_path)
    config = config_from_gguf(reader)
    tensors = planned_tensors(reader, config)  # validates names/types before any heavy work

    gguf_tokenizer.save_tokenizer(reader, out_dir, config)
    write_streaming(
        out_dir / "model.safetensors",
        tensors,
        metadata={"format": "pt", "source": f"gguf:{gguf_path.name}"},
    )
    for name, payload in (
        ("config.json", config),
        ("generation_config.json", generation_config(config)),
    ):
        (out_dir / name).write_text(json.dumps(payload, indent=2, sort_keys=True) + "\n")
    return config
