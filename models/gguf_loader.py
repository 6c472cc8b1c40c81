"""GGUF files (llama.cpp's format) → a Hugging Face model directory.

- Every tensor is read in its HF layout: a GGUF tensor of dims `[ne0, ne1, ...]` (fastest
  first) is the row-major numpy array with those dims reversed, i.e. HF's `[out, in]`; what
  llama.cpp's converter changed per architecture (Q/K row order, Gemma's stored 1 + w, stacked
  experts, Phi-3's rope factors as tensors) is undone as `gguf_arch.py` describes.
- Float and block types are dequantized with `gguf.quants.dequantize` to float32 (for Q4_1,
  the K types and the IQ4 types this reproduces ggml's own float32 values bit for bit). Every
  type but Q8_0 is stored dequantized (float32) in the converted directory: the K and IQ4
  blocks are not kept on the device.
- A Q8_0 file (one whose only quantized type is Q8_0) keeps its blocks: each Q8_0 tensor is
  written as its int8 values plus one float16 scale per 32 values along the row
  (`<name>` + BLOCK_SCALE_SUFFIX), and config.json says so in its `quantization_config`. The
  model loader dequantizes them (the same d * q float32 values as above) for a float model,
  or keeps them as they are with `--quantization int8` (models/weights.py). The cache then
  holds ~1.06 bytes per weight instead of float32's 4.
- config.json comes from the architecture's metadata keys; `tie_word_embeddings` is true when
  the file has no `output.weight`.

The tokenizer is built in `gguf_tokenizer.py`. `convert_gguf` writes the whole directory.
"""

from __future__ import annotations

import logging
import math
import pathlib
from typing import Any

import numpy as np
from jaxserve.models import gguf_arch, gguf_tokenizer
from jaxserve.models.gguf_arch import (  # noqa: F401  (re-exported: the tests and the tokenizer use them)
    HFTensor,
    Metadata,
    metadata_value,
    permute_qk,
    reverse_permute_qk,
)
from jaxserve.models.loader import BLOCK_SCALE_SUFFIX
from jaxserve.models.safetensors_io import PlannedTensor, write_streaming

logger = logging.getLogger(__name__)

try:  # the `gguf` package is a hard dependency; import errors surface with a clear message below
    import gguf
    from gguf import GGMLQuantizationType as QT
except ImportError as _e:  # pragma: no cover - exercised only in broken installs
    raise ImportError("reading GGUF files needs the `gguf` package (pip install gguf)") from _e

# Types we dequantize (each one has a test). `gguf` can dequantize more; add them here with a test.
# The K-quants and IQ4 types are those of llama.cpp's Q*_K_S/M/L and IQ4_XS files (IQ4_NL is
# also its fallback for a Q2_K/Q3_K/IQ4_XS tensor whose rows are not a multiple of 256).
SUPPORTED_TYPES: frozenset[QT] = frozenset(
    {QT.F32, QT.F16, QT.BF16, QT.Q8_0, QT.Q4_0, QT.Q4_1, QT.Q5_0, QT.Q5_1, QT.Q2_K, QT.Q3_K,
     QT.Q4_K, QT.Q5_K, QT.Q6_K, QT.IQ4_NL, QT.IQ4_XS}
)
SUPPORTED_ARCHITECTURES = sorted(gguf_arch.ARCHITECTURES)
Q8_0_BLOCK = 32  # values per Q8_0 block (one float16 scale + 32 int8 values: 34 bytes)

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


def config_from_gguf(reader: gguf.GGUFReader) -> dict[str, Any]:
    """A complete HF `config.json` dict for the model in a GGUF file (weights' storage aside)."""
    return gguf_arch.config_from_metadata(Metadata(reader))


# --------------------------------------------------------------------------- tensors


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
    """One GGUF tensor as float32 in HF shape, as stored (nothing undone; see `float_values`)."""
    return float_values(HFTensor(tensor.name, tensor))


def _source(h: HFTensor) -> tuple[np.ndarray, tuple[int, ...]]:
    """The GGUF data behind an HF tensor (one expert's slice of a stacked tensor) and its HF shape."""
    shape = hf_shape(h.source)
    if h.expert is None:
        return h.source.data, shape
    return h.source.data[h.expert], shape[1:]


def float_values(h: HFTensor) -> np.ndarray:
    """An HF tensor as float32: dequantized, rows reordered, offset removed."""
    check_supported_type(h.source)
    data, shape = _source(h)
    values = np.asarray(gguf.quants.dequantize(data, h.source.tensor_type), np.float32)
    if values.shape != shape:
        if math.prod(values.shape) != math.prod(shape):
            raise ValueError(
                f"GGUF tensor {h.source.name!r}: dequantized to {values.shape}, expected {shape}"
            )
        values = values.reshape(shape)
    if h.rows is not None:
        values = h.rows(values)
    if h.offset:
        values = values - np.float32(h.offset)
    return values


def q8_0_blocks(h: HFTensor) -> tuple[np.ndarray, np.ndarray]:
    """A Q8_0 HF tensor as stored: (int8 values [..., in], float16 scales [..., in / 32]), rows
    reordered like the values. `values = q * scale` per block of 32 along the last dim."""
    data, shape = _source(h)
    blocks = np.asarray(data).reshape(*shape[:-1], shape[-1] // Q8_0_BLOCK, 2 + Q8_0_BLOCK)
    scale = np.ascontiguousarray(blocks[..., :2]).view(np.float16)[..., 0]
    q = np.ascontiguousarray(blocks[..., 2:]).view(np.int8).reshape(shape)
    if h.rows is not None:
        q, scale = h.rows(q), h.rows(scale)
    return q, scale


def is_q8_0_file(reader: gguf.GGUFReader) -> bool:
    """Whether the file is a Q8_0 model: Q8_0 is its only quantized type (llama.cpp's
    `--outtype q8_0` keeps norms and routers in F32 and rows not divisible by 32 in F16)."""
    types = {t.tensor_type for t in reader.tensors}
    return QT.Q8_0 in types and types <= {QT.Q8_0, QT.F32, QT.F16, QT.BF16}


def planned_tensors(tensors: list[HFTensor], keep_q8_0: bool = False) -> list[PlannedTensor]:
    """The safetensors tensors of `tensors`, as lazy producers sorted by name (checked up front):
    float32, or with `keep_q8_0` each Q8_0 tensor's int8 values and float16 block scales."""
    planned = []
    for h in tensors:
        check_supported_type(h.source)
        shape = _source(h)[1]
        if keep_q8_0 and h.source.tensor_type == QT.Q8_0 and not h.offset:
            scale_shape = (*shape[:-1], shape[-1] // Q8_0_BLOCK)
            planned.append(PlannedTensor(h.name, np.dtype(np.int8), shape,
                                         lambda h=h: q8_0_blocks(h)[0]))
            planned.append(PlannedTensor(h.name + BLOCK_SCALE_SUFFIX, np.dtype(np.float16), scale_shape,
                                         lambda h=h: q8_0_blocks(h)[1]))
        else:
            planned.append(PlannedTensor(h.name, np.dtype(np.float32), shape, lambda h=h: float_values(h)))
    names = [p.name for p in planned]
    if len(set(names)) != len(names):
        raise ValueError("GGUF file maps two tensors onto the same HF name")
    return sorted(planned, key=lambda p: p.name)


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

    Files: config.json, generation_config.json, model.safetensors (float32, or int8 + block
    scales for a Q8_0 file's Q8_0 tensors), tokenizer.json, tokenizer_config.json (with
    chat_template), special_tokens_map.json, chat_template.jinja. Returns the config. Peak memory
    is one dequantized tensor plus the tokenizer.
    """
    import json

    gguf_path, out_dir = pathlib.Path(gguf_path), pathlib.Path(out_dir)
    reader = open_gguf(gguf_path)
    meta = Metadata(reader)
    spec = gguf_arch.architecture(meta)
    config = gguf_arch.config_from_metadata(meta)
    # validates names, types and completeness before any heavy work
    hf = spec.hf_tensors(meta, config)
    spec.check_complete(meta, config)
    tensors = planned_tensors(hf, keep_q8_0=is_q8_0_file(reader))
    if any(t.name.endswith(BLOCK_SCALE_SUFFIX) for t in tensors):
        config["quantization_config"] = {"quant_method": "gguf", "weight_type": "Q8_0",
                                         "block_size": Q8_0_BLOCK}

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
