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
        v2 = qc.get("checkpoint_format", "gptq") == "gptq_v2"
        group = _group(qc)
        act_order = bool(qc.get("desc_act")) and group is not None
        return WeightFormat("int4", group, 1, source="gptq", zero_offset=0 if v2 else 1,
                            act_order=act_order)
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
                         "supported (one group, every quantized Linear alike, is)")
    (group,) = groups.values()
    w = group.get("weights") or {}
    fmt = group.get("format") or qc.get("format") or "float-quantized"
    wtype, bits, strategy = w.get("type"), int(w.get("num_bits", 0)), w.get("strategy")
    activations = _ct_activations(group.get("input_activations"))
    if wtype == "float":
        if fmt != "float-quantized" or bits != 8:
            raise ValueError(f"compressed-tensors float weights are supported as float8 (format "
                             f"float-quantized); this one is {fmt}, {bits}-bit")
        if strategy == "channel":
            return WeightFormat("fp8", None, 1, source="compressed-tensors", activations=activations)
        if strategy == "tensor":
            return WeightFormat("fp8", None, None, source="compressed-tensors",
                                activations=activations)
        if strategy == "block":
            bo, bi = (int(x) for x in w["block_structure"])
            return WeightFormat("fp8", bi, bo, source="compressed-tensors")
        raise ValueError(f"compressed-tensors float8 weights with strategy {strategy!r} are not "
                         "supported")
    if wtype != "int" or fmt not in CT_INT_FORMATS or bits not in (4, 8):
        raise ValueError(f"compressed-tensors checkpoints are supported with float8 weights "
                         f"(float-quantized) or 4- and 8-bit integer weights "
                         f"({', '.join(CT_INT_FORMATS)}); this one is {fmt}, {wtype} {bits}-bit")
    if strategy == "channel":
        in_block, out_block = None, 1
    elif strategy == "group":
        in_block, out_block = int(w["group_size"]), 1
    elif strategy == "tensor":
        in_block, out_block = None, None
    else:
        raise ValueError(f"compressed-tensors integer weights with strategy {strategy!r} are not "
                         "supported (channel, group and tensor are)")
    act_order = str(w.get("actorder") or "").lower() in ("group", "dynamic")
    if act_order and strategy != "group":
        raise ValueError(f"actorder {w.get('actorder')!r} needs the group strategy; this "
                         f"checkpoint's weights are per {strategy}")
    return WeightFormat("int4" if bits == 4 else "int8", in_block, out_block,
                        source="compressed-tensors", asymmetric=not w.get("symmetric", True),
                        act_order=act_order, activations=activations)


# compressed-tensors' integer formats: int32 words of 32 / bits values along the inputs
# (`weight_packed`), or one int8 per value (`weight`; "int-quantized" is what llm-compressor
# writes when the activations are quantized too, "naive-quantized" otherwise).
CT_INT_FORMATS = ("pack-quantized", "naive-quantized", "int-quantized")


def _ct_activations(a: dict | None) -> str | None:
    """The activation scheme of a compressed-tensors group (ACTIVATION_SCHEMES), or None
    (weight-only, or a scheme no product here takes: asymmetric, per group, not 8-bit)."""
    if not a:
        return None
    kind = {"int": "int8", "float": "fp8"}.get(a.get("type"))
    if kind is None or int(a.get("num_bits", 0)) != 8 or not a.get("symmetric", True):
        return None
    strategy = a.get("strategy")
    if a.get("dynamic") in (True, "true"):
        return f"{kind}-dynamic" if strategy == "token" else None
    return f"{kind}-static" if strategy == "tensor" else None


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


def ct_unpack(packed: np.ndarray, bits: int, length: int, axis: int) -> np.ndarray:
    """compressed-tensors' int32 words along `axis` (32 / bits values each, the lowest bits
    first, unsigned: value + 2^(bits - 1)) -> signed int8 values, `length` along `axis`."""
    per = 32 // bits
    words = np.moveaxis(np.ascontiguousarray(packed).view(np.uint32), axis, -1)
    fields = (words[..., None] >> (bits * np.arange(per, dtype=np.uint32))) & ((1 << bits) - 1)
    values = fields.reshape(*words.shape[:-1], -1)[..., :length].astype(np.int16)
    return np.moveaxis((values - (1 << (bits - 1))).astype(np.int8), -1, axis)


class FormatTensors:
    """A quantized checkpoint's tensors by the HF name of the float weight they replace
    ("...q_proj.weight"), each as an [out, in] array: `values` (float8_e4m3fn, int4 values
    0..15 as uint8, or int8), `scales` and `zeros` (float32, repeated over their blocks),
    `perm` (act-order: the input order that makes each group contiguous, which `values`,
    `scales` and `zeros` are given in; None when the groups already are), `input_scale` (a
    static activation scale) and `dequantized` (float32 values in the checkpoint's input
    order, for any weight asked for as floats)."""

    def __init__(self, get_tensor: TensorGetter, fmt: WeightFormat,
                 has_tensor: Callable[[str], bool]):
        self.get, self.fmt, self.has = get_tensor, fmt, has_tensor
        self._ct_int = fmt.source == "compressed-tensors" and fmt.kind in ("int4", "int8")

    def quantized(self, name: str) -> bool:
        base = _base(name) if name.endswith(".weight") else None
        if base is None:
            return False
        if self._ct_int:
            return self.has(base + ".weight_packed") or (
                self.has(name) and self.get(name).dtype == np.int8)
        if self.fmt.kind == "int4":
            return self.has(base + ".qweight")
        return self.has(name) and self.get(name).dtype == FP8_DTYPE

    def _ct_values(self, base: str) -> np.ndarray:
        """compressed-tensors' signed integer values [out, in] (int8)."""
        if not self.has(base + ".weight_packed"):
            return np.asarray(self.get(base + ".weight"))
        shape = [int(x) for x in np.asarray(self.get(base + ".weight_shape"))]
        bits = 4 if self.fmt.kind == "int4" else 8
        values = ct_unpack(self.get(base + ".weight_packed"), bits, shape[1], axis=1)
        if values.shape != tuple(shape):
            raise ValueError(f"{base}.weight_packed unpacks to {values.shape}, not its "
                             f"weight_shape {tuple(shape)}")
        return values

    def _raw_values(self, base: str) -> np.ndarray:
        """[out, in] in the checkpoint's input order."""
        if self.fmt.kind == "fp8":
            return self.get(base + ".weight")
        if self._ct_int:
            v = self._ct_values(base)
            return (v.astype(np.int16) + 8).astype(np.uint8) if self.fmt.kind == "int4" else v
        qweight = self.get(base + ".qweight")
        if self.fmt.source == "awq":
            return awq_unpack_columns(qweight).T  # [in, out] -> [out, in]
        g_idx = base + ".g_idx"
        values = gptq_unpack_rows(qweight)  # [in, out]
        if self.has(g_idx) and self.fmt.in_block is not None and not self.fmt.act_order:
            rows = np.arange(values.shape[0]) // self.fmt.in_block
            if not np.array_equal(np.asarray(self.get(g_idx)), rows):
                raise ValueError(f"{g_idx} is not i // group_size, and the config does not say "
                                 "desc_act: true")
        return values.T

    def _g_idx(self, base: str) -> np.ndarray | None:
        """The group of each input (act-order checkpoints), or None (groups of consecutive
        inputs)."""
        if not self.fmt.act_order:
            return None
        name = base + (".weight_g_idx" if self._ct_int else ".g_idx")
        return np.asarray(self.get(name)).astype(np.int64) if self.has(name) else None

    def perm(self, name: str) -> np.ndarray | None:
        """The input order of `values` (act-order): inputs sorted by group, stable."""
        if not self.quantized(name):
            return None
        g_idx = self._g_idx(_base(name))
        if g_idx is None:
            return None
        return np.argsort(g_idx, kind="stable").astype(np.int32)

    def values(self, name: str) -> np.ndarray:
        if not self.quantized(name):
            raise UnquantizedTensor(name)
        v = self._raw_values(_base(name))
        perm = self.perm(name)
        return v if perm is None else v[:, perm]

    def _shape(self, base: str) -> tuple[int, int]:
        if self.fmt.kind == "fp8":
            return self.get(base + ".weight").shape
        if self._ct_int:
            if self.has(base + ".weight_shape"):
                return tuple(int(x) for x in np.asarray(self.get(base + ".weight_shape")))
            return self.get(base + ".weight").shape
        scales = self.get(base + ".scales")
        rows = self.get(base + ".qweight").shape[0]
        return scales.shape[1], rows * (8 if self.fmt.source == "gptq" else 1)

    def _per_input(self, base: str, grid: np.ndarray) -> np.ndarray:
        """Per-group values [out or 1, groups] (scales or zeros) -> [out, in], in `values`'
        input order."""
        shape = self._shape(base)
        g_idx = self._g_idx(base)
        if g_idx is None:
            return _expand(grid, shape)
        full = np.broadcast_to(grid, (shape[0], grid.shape[1]))[:, g_idx]
        return full[:, np.argsort(g_idx, kind="stable")]

    def _scale_grid(self, base: str) -> np.ndarray:
        if self.fmt.kind == "fp8":
            return np.asarray(self.get(base + _scale_name(self.fmt)), np.float32)
        if self._ct_int:
            s = np.asarray(self.get(base + ".weight_scale"), np.float32)
            return s.reshape(1, 1) if s.size == 1 else s.reshape(s.shape[0], -1)
        return np.asarray(self.get(base + ".scales"), np.float32).T

    def scales(self, name: str) -> np.ndarray:
        base = _base(name)
        return self._per_input(base, self._scale_grid(base))

    def _zero_grid(self, base: str) -> np.ndarray:
        if self._ct_int:
            groups = self._scale_grid(base).shape
            name = base + ".weight_zero_point"
            if not self.fmt.asymmetric or not self.has(name):
                z = np.zeros(groups, np.float32)
            else:
                stored = np.asarray(self.get(name))
                if stored.dtype == np.int32:  # pack-quantized: packed along the outputs
                    bits = 4 if self.fmt.kind == "int4" else 8
                    stored = ct_unpack(stored, bits, groups[0], axis=0)
                z = stored.astype(np.float32).reshape(groups)
            return z + 8 if self.fmt.kind == "int4" else z  # int4 values are stored unsigned
        packed = self.get(base + ".qzeros")
        z = awq_unpack_columns(packed) if self.fmt.source == "awq" else gptq_unpack_columns(packed)
        return (z.astype(np.float32) + self.fmt.zero_offset).T  # [out, groups]

    def zeros(self, name: str) -> np.ndarray:
        base = _base(name)
        return self._per_input(base, self._zero_grid(base))

    def input_scale(self, name: str) -> np.ndarray | None:
        """The static per-tensor activation scale of weight `name` ([1] float32), or None."""
        base = name.removesuffix(".weight")
        if not self.fmt.static_activations or not self.has(base + ".input_scale"):
            return None
        return np.asarray(self.get(base + ".input_scale"), np.float32).reshape(1)

    def dequantized(self, name: str) -> np.ndarray:
        if not self.quantized(name):
            return self.get(name)
        w = self.values(name).astype(np.float32)
        if self.fmt.has_zeros:
            w = w - self.zeros(name)
        w = w * self.scales(name)
        perm = self.perm(name)
        if perm is not None:
            w[:, perm] = w.copy()
        return w
