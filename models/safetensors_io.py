"""Reading and writing safetensors files with plain numpy.

The reader memory-maps a file and hands out zero-copy views, one tensor at a time, so that a
device can read just its shard of a weight (see `loader.put_sharded`). bfloat16 and float8 come
from `ml_dtypes`. The writer streams: it lays out the header from shapes alone, then writes each
tensor as it is produced, so converting a checkpoint never holds more than one tensor in memory.

File format (https://github.com/huggingface/safetensors): 8 bytes little-endian header length N,
N bytes of JSON `{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}`,
then the data buffer; offsets are relative to the start of the buffer.
"""

from __future__ import annotations

import json
import math
import os
import pathlib
import struct
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import ml_dtypes
import numpy as np

# safetensors dtype tag <-> numpy dtype (little-endian)
_DTYPES: dict[str, np.dtype] = {
    "F64": np.dtype("<f8"),
    "F32": np.dtype("<f4"),
    "F16": np.dtype("<f2"),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
    "I64": np.dtype("<i8"),
    "I32": np.dtype("<i4"),
    "I16": np.dtype("<i2"),
    "I8": np.dtype("i1"),
    "U64": np.dtype("<u8"),
    "U32": np.dtype("<u4"),
    "U16": np.dtype("<u2"),
    "U8": np.dtype("u1"),
    "BOOL": np.dtype("?"),
}
_TAGS: dict[np.dtype, str] = {dtype: tag for tag, dtype in _DTYPES.items()}

# a header larger than this is certainly a corrupt length field (real ones are a few MB at most)
_MAX_HEADER_BYTES = 100 * 1024 * 1024


@dataclass(frozen=True, slots=True)
class TensorEntry:
    """Where one tensor lives: file, dtype, shape and byte range (absolute, within the file)."""

    file: pathlib.Path
    dtype: np.dtype
    shape: tuple[int, ...]
    begin: int
    end: int


def read_header(path: pathlib.Path) -> tuple[dict[str, TensorEntry], dict[str, str]]:
    """Parse a safetensors file's header: `({name: TensorEntry}, metadata)`.

    Raises ValueError naming the file when the header is truncated, not JSON, or describes data
    that does not fit the file.
    """
    path = pathlib.Path(path)
    size = path.stat().st_size
    with open(path, "rb") as f:
        prefix = f.read(8)
        if len(prefix) < 8:
            raise ValueError(f"{path} is not a safetensors file: only {size} bytes long.")
        (header_len,) = struct.unpack("<Q", prefix)
        if header_len > min(size - 8, _MAX_HEADER_BYTES):
            raise ValueError(
                f"{path} has a corrupt safetensors header: it claims {header_len} header bytes "
                f"but the file is {size} bytes long (truncated or not a safetensors file)."
            )
        raw = f.read(header_len)
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path} has a corrupt safetensors header (not valid JSON: {e}).") from e
    if not isinstance(header, dict):
        raise ValueError(f"{path} has a corrupt safetensors header (not a JSON object).")

    metadata = header.pop("__metadata__", None) or {}
    data_start = 8 + header_len
    entries: dict[str, TensorEntry] = {}
    for name, info in header.items():
        try:
            tag, shape, (begin, end) = info["dtype"], tuple(info["shape"]), info["data_offsets"]
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(
                f"{path}: corrupt safetensors header entry for {name!r}: {info!r}"
            ) from e
        if tag not in _DTYPES:
            raise ValueError(f"{path}: tensor {name!r} has unsupported safetensors dtype {tag!r}.")
        dtype = _DTYPES[tag]
        nbytes = math.prod(shape) * dtype.itemsize
        if not (0 <= begin <= end and end - begin == nbytes):
            raise ValueError(
                f"{path}: corrupt safetensors header: tensor {name!r} ({tag} {list(shape)}) needs "
                f"{nbytes} bytes but its data_offsets are [{begin}, {end}]."
            )
        if data_start + end > size:
            raise ValueError(
                f"{path} is truncated: tensor {name!r} ends at byte {data_start + end} "
                f"but the file has {size} bytes."
            )
        entries[name] = TensorEntry(path, dtype, shape, data_start + begin, data_start + end)
    return entries, metadata


def tensor_view(mapped: np.ndarray, entry: TensorEntry) -> np.ndarray:
    """A read-only, zero-copy view of one tensor inside a memory-mapped file (uint8 memmap)."""
    if entry.begin == entry.end:  # empty tensor: a view of zero bytes cannot be reinterpreted
        return np.empty(entry.shape, dtype=entry.dtype)
    return mapped[entry.begin : entry.end].view(entry.dtype).reshape(entry.shape)


def memmap(path: pathlib.Path) -> np.ndarray:
    return np.memmap(path, dtype=np.uint8, mode="r")


@dataclass(frozen=True, slots=True)
class PlannedTensor:
    """A tensor to be written: its name, final dtype and shape, and how to produce it."""

    name: str
    dtype: np.dtype
    shape: tuple[int, ...]
    produce: Callable[[], np.ndarray]


def write_streaming(
    path: pathlib.Path, tensors: Iterable[PlannedTensor], metadata: dict[str, str] | None = None
) -> None:
    """Write a safetensors file, producing (and dropping) one tensor at a time.

    Each produced array must match its planned dtype and shape exactly; a mismatch raises before
    anything invalid is left behind (the caller writes into a temporary directory).
    """
    planned = list(tensors)
    header: dict[str, object] = {}
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    offset = 0
    for t in planned:
        tag = _TAGS.get(np.dtype(t.dtype))
        if tag is None:
            raise ValueError(f"cannot write tensor {t.name!r} of dtype {t.dtype} to safetensors")
        nbytes = math.prod(t.shape) * np.dtype(t.dtype).itemsize
        header[t.name] = {
            "dtype": tag,
            "shape": list(t.shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
    raw += b" " * (-len(raw) % 8)  # the data buffer starts 8-byte aligned

    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for t in planned:
            array = t.produce()
            if array.shape != tuple(t.shape) or array.dtype != np.dtype(t.dtype):
                raise AssertionError(
                    f"tensor {t.name!r}: produced {array.dtype} {array.shape}, "
                    f"planned {np.dtype(t.dtype)} {tuple(t.shape)}"
                )
            f.write(np.ascontiguousarray(array).reshape(-1).view(np.uint8).data)
            del array
        f.flush()
        os.fsync(f.fileno())
