"""The LoRA adapters' weights in their device slots (which adapter holds which slot is the
scheduler's: core/adapter_slots.py).

Per decoder layer and target (q/k/v/o, gate/up/down), A and B of every slot stacked:
A [S, in..., R] and B [S, R, out...] (S = max_loras, R = max_lora_rank; zero-padded ranks and
untargeted modules add nothing). They travel to the compiled step after the model's weights
(models/layers/lora.py computes with them) and are laid out like the weight they adapt (A split
as its input dims, B as its output dims). Writing an adapter into a slot runs one small
executable compiled at start-up (the slot index is an argument): the steps never recompile.
Adapters read from disk are kept in a host LRU of max_cpu_loras, padded to the slot's shapes.
"""

from __future__ import annotations

import collections

import jax
import numpy as np
from jax.sharding import Mesh

from jaxserve.config import LoRAConfig
from jaxserve.lora_request import LoRARequest
from jaxserve.models.arch_config import ArchConfig
from jaxserve.models.lora import TARGETS, load_adapter, target_shapes
from jaxserve.models import sharding as ax
from jaxserve.models.sharding import DEFAULT_RULES, named_sharding

# Each target's logical axes (input dims, output dims): those of the weight it adapts.
_Q, _KV, _E, _F = (ax.Q_HEADS, ax.HEAD_DIM), (ax.KV_HEADS, ax.HEAD_DIM), (ax.EMBED,), (ax.MLP,)
TARGET_AXES = {
    "wq": (_E, _Q),
    "wk": (_E, _KV),
    "wv": (_E, _KV),
    "wo": (_Q, _E),
    "w_gate": (_E, _F),
    "w_up": (_E, _F),
    "w_down": (_F, _E),
}
_ORDER = tuple(sorted(TARGETS))  # the leaves' order: as jax flattens a layer's dict


class LoRAWeights:
    def __init__(self, cfg: ArchConfig, config: LoRAConfig, dtype, mesh: Mesh, rules=None):
        if cfg.checkpoint_heads is not None:  # adapters hold the checkpoint's heads
            raise ValueError(f"LoRA adapters hold the checkpoint's heads: not supported on a model "
                             f"served with zero KV heads appended ({cfg.kv_padding_note()}); the "
                             f"engine's plan appends none with --enable-lora")
        self.cfg, self.config = cfg, config
        self.dtype = np.dtype(dtype)
        S, R = config.max_loras, config.max_lora_rank
        rules = DEFAULT_RULES if rules is None else rules
        shapes = target_shapes(cfg)
        self.shapes: list[tuple[tuple[int, ...], tuple[int, ...]]] = []  # per leaf, one slot's
        self.shardings = []
        for _ in range(cfg.num_layers):
            for t in _ORDER:
                (ins, outs), (in_axes, out_axes) = shapes[t], TARGET_AXES[t]
                for shape, axes in (
                    ((S, *ins, R), (None, *in_axes, None)),
                    ((S, R, *outs), (None, None, *out_axes)),
                ):
                    self.shapes.append(shape)
                    self.shardings.append(named_sharding(axes, shape, mesh, rules))
        self.treedef = jax.tree.structure(
            [{t: (0, 0) for t in TARGETS} for _ in range(cfg.num_layers)]
        )
        self._host: collections.OrderedDict[int, list[np.ndarray]] = collections.OrderedDict()
        self._write = None

    @property
    def nbytes(self) -> int:
        return sum(int(np.prod(s)) for s in self.shapes) * self.dtype.itemsize

    def zeros(self) -> list[jax.Array]:
        """Every slot empty: the arrays the step starts with (the runner keeps them)."""
        return [
            jax.device_put(np.zeros(s, self.dtype), sh)
            for s, sh in zip(self.shapes, self.shardings)
        ]

    def abstract(self) -> list[jax.ShapeDtypeStruct]:
        return [
            jax.ShapeDtypeStruct(s, self.dtype, sharding=sh)
            for s, sh in zip(self.shapes, self.shardings)
        ]

    def compile_writer(self, scope, replicated) -> None:
        """The slot writer, compiled (or loaded from the executable cache) once."""
        leaves = self.abstract()
        values = [jax.ShapeDtypeStruct(s[1:], self.dtype, sharding=replicated) for s in self.shapes]
        index = jax.ShapeDtypeStruct((), np.int32, sharding=replicated)

        def write(leaves, index, values):
            return [
                jax.lax.dynamic_update_index_in_dim(x, v.astype(x.dtype), index, 0)
                for x, v in zip(leaves, values)
            ]

        self._write = scope.get(
            "lora-write-slot",
            (leaves, index, values),
            lambda: (
                jax.jit(write, out_shardings=self.shardings).lower(leaves, index, values).compile()
            ),
        )

    def host_copy(self, lora: LoRARequest) -> list[np.ndarray]:
        """The adapter's slot contents (one array per leaf), from the host LRU or its files."""
        aid = lora.lora_int_id
        if aid in self._host:
            self._host.move_to_end(aid)
            return self._host[aid]
        adapter = load_adapter(lora.lora_path, self.cfg, self.config.max_lora_rank, lora.lora_name)
        values, i = [], 0
        for layer in range(self.cfg.num_layers):
            for t in _ORDER:
                a_shape, b_shape = self.shapes[i][1:], self.shapes[i + 1][1:]
                a, b = np.zeros(a_shape, self.dtype), np.zeros(b_shape, self.dtype)
                got = adapter.weights.get((layer, t))
                if got is not None:
                    r = adapter.rank
                    a[..., :r] = got[0]
                    b[:r] = got[1]
                values += [a, b]
                i += 2
        self._host[aid] = values
        while len(self._host) > self.config.max_cpu_loras:
            self._host.popitem(last=False)
        return values

    def forget(self, lora_int_id: int) -> None:
        self._host.pop(lora_int_id, None)

    def write(
        self, leaves: list[jax.Array], slot: int, values: list[np.ndarray]
    ) -> list[jax.Array]:
        """`leaves` with an adapter's contents (`host_copy`) in slot `slot` (1..max_loras). Not
        donated: a step still in flight may read the old arrays."""
        return self._write(leaves, np.int32(slot - 1), values)
