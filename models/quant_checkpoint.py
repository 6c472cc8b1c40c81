"""Checkpoints quantized by other tools: their `quantization_config` and tensors.

Read (each into a `layers.quant.WeightFormat`; the decoder layers' matmul weights stay in it):
- `fp8` (transformers' FineGrainedFP8 / Qwen3-*-FP8, DeepSeek-V3): float8_e4m3fn `weight`, and
  with `weight_block_size` [bo, bi] a float32 `weight_scale_inv` per bo x bi block of [out, in]
  (the multiplier: w = q * s, despite its name); without it one `weight_scale` per tensor.
- `compressed-tensors` with float8 weights (llm-compressor's FP8 / FP8_DYNAMIC / FP8_BLOCK
  schemes): `weight` float8_e4m3fn and `weight_scale` per channel ([out, 1]), per tensor or per
  block (`block_structure`).
- `awq` (AutoAWQ's GEMM layout): `qweight` int32 [in, out / 8], eight 4-bit values per int32 in
  the order of columns 0, 2, 4, 6, 1, 3, 5, 7 (AWQ's interleave), `qzeros` int32
  [in / group, out / 8] packed alike, `scales` float16 [in / group, out]; w = (q - z) * s.
- `gptq` (auto-gptq / GPTQModel, `desc_act` false): `qweight` int32 [in / 8, out], eight
  consecutive input rows per int32 (row 8r + j in bits 4j), `qzeros` int32 [in / group, out / 8]
  packed along the outputs in order, stored minus one in the v1 format
  (`checkpoint_format` "gptq", the default; "gptq_v2" stores them as they are), `scales`
  float16 [in / group, out], `g_idx` [in] (must be i // group: act-order is refused).

Activation scales (`input_scale`, a static or dynamic `input_activations` scheme) are not
used: activations stay in the compute dtype and the weights are upcast inside the product
(weight-only, as vLLM runs FP8 checkpoints on GPUs without FP8 units).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from jaxserve.models.weight_format import FP8_DTYPE, WeightFormat

TensorGetter = Callable[[str], np.ndarray]


class UnquantizedTensor(Exception):
    """A matmul weight of a quantized checkpoint is stored as floats (an ignored layer)."""


def parse_quantization_config(qc: dict) -> WeightFormat:
    """The WeightFormat of a `quantization_config`; ValueError naming what is not supported."""
    method = qc.get("quant_method", "unknown")
    if method == "fp8":
        if qc.get("fmt", "e4m3") != "e4m3":
            raise ValueError(f"fp8 checkpoints in {qc.get('fmt')!r} are not supported (only e4m3)")
        block = qc.get("weight_block_size")
        if block is None:
            return WeightFormat("fp8", None, None, source="fp8")
        bo, bi = (int(x) for x in block)
        return WeightFormat("fp8", bi, bo, source="fp8")
    if method == "compressed-tensors":
        return _compressed_tensors(qc)
    if method == "awq":
        version = str(qc.get("version", "gemm")).lower()
        bits = int(qc.get("bits", qc.get("w_bit", 4)))
        if version != "gemm" or bits != 4 or not qc.get("zero_point", True):
            raise ValueError(f"AWQ checkpoints are supported in the 4-bit GEMM layout with zero "
                             f"points; this one is version {version!r}, {bits}-bit, zero_point "
                             f"{qc.get('zero_point')}")
        return WeightFormat("int4", _group(qc), 1, source="awq")
    if method == "gptq":
        if int(qc.get("bits", 4)) != 4:
            raise ValueError(f"GPTQ checkpoints are supported with 4 bits; this one has "
                             f"{qc.get('bits')}")
        if qc.get("desc_act"):
            raise ValueError("this GPTQ checkpoint uses act-order (desc_act: true: g_idx assigns "
                             "input rows to groups out of order), which jaxserve does not support; "
                             "use a desc_act false GPTQ, an AWQ, FP8 or float checkpoint")
        v2 = qc.get("checkpoint_format", "gptq") == "gptq_v2"
        return WeightFormat("int4", _group(qc), 1, source="gptq", zero_offset=0 if v2 else 1)
    bits = qc.get("bits")
    what = f"{method}" + (f", {bits}-bit" if bits else "")
    raise ValueError(
        f"this checkpoint is pre-quantized (quantization_config: {what}), which jaxserve cannot "
        "serve (it reads fp8, compressed-tensors float8, AWQ and GPTQ 4-bit). Use the float "
        "checkpoint, optionally with --quantization int8/fp8/int4 to quantize it at load, or a "
        "GGUF file."
    )


def _group(qc: dict) -> int | None:
    g = int(qc.get("group_size", qc.get("q_group_size", 128)))
    return None if g == -1 else g


def _compressed_tensors(qc: dict) -> WeightFormat:
    groups = qc.get("config_groups") or {}
    if len(groups) != 1:
        raise ValueError(f"compressed-tensors checkpoints with {len(groups)} config groups are not "
                         "supported (one float8 group is)")
    (group,) = groups.values()
    w = group.get("weights") or {}
    fmt = qc.get("format", "float-quantized")
    if fmt != "float-quantized" or w.get("type") != "float" or int(w.get("num_bits", 0)) != 8:
        raise ValueError(f"compressed-tensors checkpoints are supported with float8 weights "
                         f"(format float-quantized); this one is {fmt}, {w.get('type')} "
                         f"{w.get('num_bits')}-bit")
    strategy = w.get("strategy")
    if strategy == "channel":
        return WeightFormat("fp8", None, 1, source="compressed-tensors")
    if strategy == "tensor":
        return WeightFormat("fp8", None, None, source="compressed-tensors")
    if strategy == "block":
        bo, bi = (int(x) for x in w["block_structure"])
        return WeightFormat("fp8", bi, bo, source="compressed-tensors")
    raise ValueError(f"compressed-tensors float8 weights with strategy {strategy!r} are not "
                     "supported")


def _base(name: str) -> str:
    if not name.endswith(".weight"):
        raise KeyError(name)
    return name.removesuffix(".weight")


def _scale_name(fmt: WeightFormat) -> str:
    blockwise_fp8 = fmt.source == "fp8" and fmt.in_block is not None
    return ".weight_scale_inv" if blockwise_fp8 else ".weight_scale"


def _expand(scale: np.ndarray, shape: tuple[int, int]) -> np.ndarray:
    """Scales per block of an [out, in] weight ([so, si], [so], [1] or a scalar), repeated
    over their blocks to `shape` (blocks at the edges cropped, as the formats' ceil division
    leaves them)."""
    s = np.asarray(scale, np.float32)
    s = s.reshape(1, 1) if s.size == 1 else (s.reshape(-1, 1) if s.ndim == 1 else s)
    out, inn = shape
    bo, bi = -(-out // s.shape[0]), -(-inn // s.shape[1])
    return np.repeat(np.repeat(s, bo, axis=0), bi, axis=1)[:out, :inn]


def _nibbles(packed: np.ndarray) -> np.ndarray:
    """int32 words -> their eight 4-bit fields, lowest first: [..., 8] uint8."""
    words = np.ascontiguousarray(packed).view(np.uint32)
    return ((words[..., None] >> (4 * np.arange(8, dtype=np.uint32))) & 15).astype(np.uint8)


AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # field i of a word holds column AWQ_ORDER[i] of its eight


def awq_unpack_columns(packed: np.ndarray) -> np.ndarray:
    """AWQ's [rows, cols / 8] int32 -> [rows, cols] uint8 (undoing the interleave)."""
    fields = _nibbles(packed)  # [rows, cols/8, 8]
    out = np.empty_like(fields)
    out[..., list(AWQ_ORDER)] = fields
    return out.reshape(packed.shape[0], -1)


def gptq_unpack_rows(packed: np.ndarray) -> np.ndarray:
    """GPTQ's qweight [in / 8, out] int32 -> [in, out] uint8."""
    fields = _nibbles(packed)  # [in/8, out, 8]
    return fields.transpose(0, 2, 1).reshape(-1, packed.shape[1])


def gptq_unpack_columns(packed: np.ndarray) -> np.ndarray:
    """GPTQ's qzeros [groups, out / 8] int32 -> [groups, out] uint8."""
    return _nibbles(packed).reshape(packed.shape[0], -1)


class FormatTensors:
    """A quantized checkpoint's tensors by the HF name of the float weight they replace
    ("...q_proj.weight"), each as an [out, in] array: `values` (float8_e4m3fn, or int4 values
    0..15 as uint8), `scales` and `zeros` (float32, repeated over their blocks), and
    `dequantized` (float32 values, for any weight asked for as floats)."""

    def __init__(self, get_tensor: TensorGetter, fmt: WeightFormat,
                 has_tensor: Callable[[str], bool]):
        self.get, self.fmt, self.has = get_tensor, fmt, has_tensor

    def quantized(self, name: str) -> bool:
        base = _base(name) if name.endswith(".weight") else None
        if base is None:
            return False
        if self.fmt.kind == "int4":
            return self.has(base + ".qweight")
        return self.has(name) and self.get(name).dtype == FP8_DTYPE

    def values(self, name: str) -> np.ndarray:
        if not self.quantized(name):
            raise UnquantizedTensor(name)
        base = _base(name)
        if self.fmt.kind == "fp8":
            return self.get(name)
        qweight = self.get(base + ".qweight")
        if self.fmt.source == "awq":
            return awq_unpack_columns(qweight).T  # [in, out] -> [out, in]
        g_idx = base + ".g_idx"
        values = gptq_unpack_rows(qweight)  # [in, out]
        if self.has(g_idx) and self.fmt.in_block is not None:
            rows = np.arange(values.shape[0]) // self.fmt.in_block
            if not np.array_equal(np.asarray(self.get(g_idx)), rows):
                raise ValueError(f"{g_idx} is not i // group_size: act-order GPTQ is not supported")
        return values.T

    def _shape(self, base: str) -> tuple[int, int]:
        if self.fmt.kind == "fp8":
            return self.get(base + ".weight").shape
        scales = self.get(base + ".scales")
        rows = self.get(base + ".qweight").shape[0]
        return scales.shape[1], rows * (8 if self.fmt.source == "gptq" else 1)

    def scales(self, name: str) -> np.ndarray:
        base = _base(name)
        shape = self._shape(base)
        if self.fmt.kind == "fp8":
            return _expand(self.get(base + _scale_name(self.fmt)), shape)
        return _expand(np.asarray(self.get(base + ".scales"), np.float32).T, shape)

    def zeros(self, name: str) -> np.ndarray:
        base = _base(name)
        packed = self.get(base + ".qzeros")
        z = awq_unpack_columns(packed) if self.fmt.source == "awq" else gptq_unpack_columns(packed)
        z = z.astype(np.float32) + self.fmt.zero_offset  # [groups, out]
        return _expand(z.T, self._shape(base))

    def dequantized(self, name: str) -> np.ndarray:
        if not self.quantized(name):
            return self.get(name)
        w = self.values(name).astype(np.float32)
        if self.fmt.kind == "int4":
            w = w - self.zeros(name)
        return w * self.scales(name)
