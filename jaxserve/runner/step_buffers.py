"""A step's many small input arrays packed into one flat host buffer per dtype.

A step takes about 26 small arrays (token ids, positions, block tables, sampling parameters…).
Handing each to the compiled executable costs a host->device transfer apiece (measured on the
CPU: ~7 us each, 0.2 ms for a step's worth; on an accelerator each is a DMA with its own
latency). Packed into one int32 and one float32 buffer on the host (a concatenate per dtype),
they cost two transfers, and the compiled step slices them apart again, which costs nothing.
The packed buffers are also the whole of what a step needs besides the engine's persistent
device state: the step message a multi-host leader would send its followers.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import numpy as np

# Leaf dtype -> the buffer it travels in (bools as int32 0/1).
_GROUP = {np.dtype(np.int32): 0, np.dtype(np.bool_): 0, np.dtype(np.float32): 1}
GROUP_DTYPES = (np.int32, np.float32)


@dataclasses.dataclass(frozen=True)
class _Leaf:
    shape: tuple[int, ...]
    dtype: np.dtype
    group: int
    offset: int
    size: int


@dataclasses.dataclass(frozen=True)
class BufferLayout:
    """Where each leaf of a pytree of arrays lies in the per-dtype buffers (static per bucket)."""

    treedef: Any
    leaves: tuple[_Leaf, ...]
    sizes: tuple[int, ...]  # elements per buffer

    @classmethod
    def of(cls, tree) -> BufferLayout:
        """The layout of `tree` (numpy arrays or ShapeDtypeStructs of int32, bool, float32)."""
        flat, treedef = jax.tree.flatten(tree)
        sizes = [0] * len(GROUP_DTYPES)
        leaves = []
        for x in flat:
            dtype = np.dtype(x.dtype)
            if dtype not in _GROUP:
                raise ValueError(f"a step input of dtype {dtype} cannot be packed")
            g, n = _GROUP[dtype], math.prod(x.shape)
            leaves.append(_Leaf(tuple(x.shape), dtype, g, sizes[g], n))
            sizes[g] += n
        return cls(treedef, tuple(leaves), tuple(sizes))

    def pack(self, tree) -> tuple[np.ndarray, ...]:
        """The buffers holding `tree` (numpy, same structure and shapes as the layout's)."""
        parts: list[list[np.ndarray]] = [[] for _ in GROUP_DTYPES]
        for leaf, x in zip(self.leaves, jax.tree.leaves(tree)):
            parts[leaf.group].append(np.ravel(x))
        return tuple(np.concatenate(p).astype(dt, copy=False) if p else np.zeros(0, dt)
                     for p, dt in zip(parts, GROUP_DTYPES))

    @property
    def dtypes(self) -> tuple[np.dtype, ...]:
        return tuple(np.dtype(d) for d in GROUP_DTYPES)

    def abstract(self, sharding=None) -> tuple[jax.ShapeDtypeStruct, ...]:
        return tuple(jax.ShapeDtypeStruct((n,), dt, sharding=sharding) for n, dt in zip(self.sizes, GROUP_DTYPES))

    def unpack(self, buffers) -> Any:
        """The pytree again, from the buffers (inside the compiled step: static slices)."""
        out = []
        for leaf in self.leaves:
            x = jax.lax.slice_in_dim(buffers[leaf.group], leaf.offset, leaf.offset + leaf.size).reshape(leaf.shape)
            out.append(x != 0 if leaf.dtype == np.bool_ else x)
        return jax.tree.unflatten(self.treedef, out)

    def unpack_host(self, buffers) -> Any:
        """`unpack` on the host (numpy), for inspecting a packed step."""
        out = []
        for leaf in self.leaves:
            x = np.asarray(buffers[leaf.group][leaf.offset : leaf.offset + leaf.size]).reshape(leaf.shape)
            out.append(x.astype(np.bool_) if leaf.dtype == np.bool_ else x)
        return jax.tree.unflatten(self.treedef, out)
