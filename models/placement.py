"""Host dtype conversion and sharded placement of weights.

`put_sharded` builds one `jax.Array` with `jax.make_array_from_callback`: each device's callback
slices (and converts) only its own block of the source, typically a memory-mapped checkpoint
tensor, so no device ever needs a full host copy of a sharded weight.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import ml_dtypes
import numpy as np

if TYPE_CHECKING:
    import jax

_DTYPE_NAMES = {
    "float32": np.float32,
    "fp32": np.float32,
    "f32": np.float32,
    "float16": np.float16,
    "fp16": np.float16,
    "f16": np.float16,
    "half": np.float16,
    "bfloat16": ml_dtypes.bfloat16,
    "bf16": ml_dtypes.bfloat16,
}


def to_numpy_dtype(dtype: Any) -> np.dtype:
    """A numpy dtype from a name ('bfloat16', 'fp16', …), numpy, ml_dtypes or jax.numpy dtype."""
    if isinstance(dtype, str) and dtype.lower() in _DTYPE_NAMES:
        return np.dtype(_DTYPE_NAMES[dtype.lower()])
    try:
        return np.dtype(dtype)
    except TypeError as e:
        raise ValueError(f"unknown dtype {dtype!r}") from e


def convert_dtype(array: np.ndarray, dtype: Any) -> np.ndarray:
    """`array` as `dtype` (float32/float16/bfloat16 and friends), rounding to nearest even.

    Half ↔ bfloat16 goes through float32, which holds both exactly, so the one rounding step is
    the same as casting from float32. Returns `array` itself when nothing changes.
    """
    target = to_numpy_dtype(dtype)
    if array.dtype == target:
        return array
    source = array.dtype
    if (
        _is_float(source)
        and _is_float(target)
        and np.float32 not in (source, target)
        and source.itemsize < 4  # float16/bfloat16/float8: exact in float32
    ):
        array = array.astype(np.float32)
    return array.astype(target)


def _is_float(dtype: np.dtype) -> bool:
    return dtype.kind == "f" or dtype in _ML_FLOATS


_ML_FLOATS = {
    np.dtype(ml_dtypes.bfloat16),
    np.dtype(ml_dtypes.float8_e4m3fn),
    np.dtype(ml_dtypes.float8_e5m2),
}


def put_sharded(
    source: np.ndarray | Callable[..., np.ndarray],
    sharding: jax.sharding.Sharding,
    dtype: Any,
    *,
    shape: tuple[int, ...] | None = None,
) -> jax.Array:
    """One weight as a `jax.Array` laid out by `sharding`, each device reading only its shard.

    `source` is a numpy array (typically a memory-mapped `get_tensor` view), or a zero-argument
    callable returning one (called once), or, when `shape` is given, a callable taking a
    tuple of slices and returning just that block. Each shard is converted to `dtype` on the host
    and copied (never aliased to the file) on its way to the device.
    """
    import jax

    target = to_numpy_dtype(dtype)
    if callable(source) and not isinstance(source, np.ndarray):
        if shape is None:
            source = np.asarray(source())
        else:
            block = source

            def read(index: tuple[slice, ...]) -> np.ndarray:
                return _host_shard(np.asarray(block(index)), target)

            return jax.make_array_from_callback(tuple(shape), sharding, read)
    array = source
    if shape is not None and tuple(shape) != array.shape:
        raise ValueError(f"shape {tuple(shape)} does not match the array's {array.shape}")

    def read_slice(index: tuple[slice, ...]) -> np.ndarray:
        return _host_shard(array[index], target)

    return jax.make_array_from_callback(array.shape, sharding, read_slice)


def _host_shard(block: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """A shard in host memory of its own (a plain ndarray, never a view into a mapped file)."""
    if block.dtype == dtype:
        return np.array(block, copy=True, subok=False)
    return np.asarray(convert_dtype(block, dtype))
