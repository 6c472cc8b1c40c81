"""A roofline model of one served step per chip: PREDICTED step times, not measured ones.

For a Llama-shaped model on a tensor-parallel mesh of n chips (jaxserve's `tp` rules on a 1 x n
mesh), one step of T tokens over R sequences costs each chip:

- bytes it must move through HBM: its weights (every weight once per step, whatever T), the KV
  cache its attention reads (each sequence's context, on the chip's KV heads) and writes (the
  step's tokens), and the activations the layers pass between kernels;
- flops: 2 x T x (its matmul weights) + the LM head on R rows + attention (q.k and p.v over each
  query's context);
- collectives: per layer two all-reduces of [T, hidden] (attention output, MLP down), and the
  sampler's all-gather of the [R, vocab] float32 logits; ring algorithms' wire bytes.

and its time is `max(bytes / HBM bandwidth, flops / peak) + wire bytes / link bandwidth +
collectives x latency`: compute and memory overlap perfectly, collectives do not overlap with
either (in tensor-parallel decode each all-reduce sits between two matmuls that need it).

Weights per chip follow the rules exactly as `shard-plan` lays them out (`abstract_model` and
`sharding.spec_entries` on an abstract mesh, nothing compiled): a dimension the mesh does not
divide is replicated, so with more chips than KV heads (Llama-3-70B on 16) the K/V projections
and the KV cache are whole on every chip, and each chip's attention reads the whole cache.
`kv_head_copies` models the other layout, each KV head copied so that the copies divide the
mesh (8 KV heads as 16 on 16 chips), which jaxserve does not implement.

Assumptions (docs/performance.md): bfloat16 (or int8) weights, bfloat16 KV cache; 100 % of the
published HBM bandwidth and peak flops (real kernels reach 70-90 %); activations at 2 bytes,
each layer reading and writing its hidden state ~10 times plus its q/k/v, attention and MLP
outputs once; collective latency `COLLECTIVE_LATENCY_S` each; the sampler, embedding gather and
norms' flops left out.
"""

from __future__ import annotations

import dataclasses
import math

from jaxserve.tools.chips import CHIPS, Chip

BF16 = 2
COLLECTIVE_LATENCY_S = 10e-6  # per collective (small-message all-reduce over ICI / NVLink)
HIDDEN_PASSES = 10  # hidden-state reads + writes per layer and token (norms, residuals, ops)


@dataclasses.dataclass(frozen=True)
class Shapes:
    layers: int
    hidden: int
    intermediate: int
    vocab: int
    q_heads: int
    kv_heads: int
    head_dim: int

    @classmethod
    def from_hf(cls, hf: dict) -> Shapes:
        from jaxserve.models.arch_config import ArchConfig

        c = ArchConfig.from_hf(hf)
        return cls(
            c.num_layers,
            c.hidden_size,
            c.intermediate_size,
            c.vocab_size,
            c.num_heads,
            c.num_kv_heads,
            c.head_dim,
        )


@dataclasses.dataclass(frozen=True)
class Layout:
    """Per-chip sizes of a model on a 1 x n tensor-parallel mesh."""

    chips: int
    weight_bytes: int  # per chip, as the rules place them
    matmul_params: float  # per chip: the weights one token multiplies (no embedding table)
    lm_head_params: float  # per chip
    kv_bytes_per_token: int  # per chip (all layers, K and V)
    local_q_heads: int  # query heads whose attention this chip computes
    replicated: tuple[str, ...]  # what the rules asked to split but the shapes did not allow


def layout(
    hf: dict, chips: int, kv_head_copies: int = 1, quantization: str | None = None
) -> Layout:
    """The per-chip sizes of `hf` (an HF config) on `chips` chips under the `tp` rules, with
    bfloat16 weights or `quantization="int8"` (jaxserve's int8 weights and their scales)."""
    import jax
    import numpy as np

    from jaxserve.models import sharding as ax
    from jaxserve.models.arch_config import ArchConfig
    from jaxserve.models.weights import abstract_model

    cfg = ArchConfig.from_hf(hf)
    if kv_head_copies > 1:  # each KV head copied: more (identical) KV heads to split
        cfg = dataclasses.replace(cfg, num_kv_heads=cfg.num_kv_heads * kv_head_copies)
    mesh = jax.sharding.AbstractMesh((1, chips), ("data", "model"))
    rules = ax.load_rules("tp")
    _, state, _ = abstract_model(cfg, dtype=np.dtype("bfloat16"), quantization=quantization)
    weight = matmul = lm_head = 0.0
    replicated: list[str] = []
    for path, var in jax.tree_util.tree_leaves_with_path(
        state, is_leaf=lambda v: hasattr(v, "get_metadata")
    ):
        shape = var.get_value().shape
        axes = var.get_metadata().get("logical_axes") or (None,) * len(shape)
        split = math.prod(
            ax.mesh_axes_size(mesh, granted)
            for _, granted in ax.spec_entries(axes, shape, mesh, rules)
        )
        asked = math.prod(
            ax.mesh_axes_size(mesh, tuple(a for a in asked if a in mesh.shape))
            for asked, _ in ax.spec_entries(axes, shape, mesh, rules)
        )
        name = ".".join(str(getattr(k, "key", getattr(k, "name", k))) for k in path)
        local = math.prod(shape) / split
        weight += local * np.dtype(var.get_value().dtype).itemsize
        if name.endswith("_qscale"):
            continue
        if asked > split:
            leaf = name.split(".")[-1]
            if leaf not in replicated:
                replicated.append(leaf)
        if name.startswith("lm_head") or (name.startswith("embed") and cfg.tie_word_embeddings):
            lm_head += local
        elif not name.startswith("embed") and len(shape) >= 2:
            matmul += local
    kv_split = chips if cfg.num_kv_heads % chips == 0 else 1
    kv_per_token = 2 * cfg.num_layers * (cfg.num_kv_heads // kv_split) * cfg.head_dim * BF16
    q_split = kv_split  # query heads follow their KV head (attention's shard_map)
    return Layout(
        chips,
        int(weight),
        matmul,
        lm_head,
        kv_per_token,
        cfg.num_heads // q_split,
        tuple(replicated),
    )


@dataclasses.dataclass(frozen=True)
class StepCost:
    """Per chip, one step."""

    weight_bytes: float
    kv_bytes: float  # read + written
    activation_bytes: float
    flops: float
    collectives: int
    wire_bytes: float

    @property
    def bytes(self) -> float:
        return self.weight_bytes + self.kv_bytes + self.activation_bytes


def step_cost(
    shapes: Shapes, lay: Layout, *, tokens: int, seqs: int, context: int, prefill: bool
) -> StepCost:
    """A decode step (`seqs` sequences, one token each, each attending over `context` tokens)
    or a prefill step (`tokens` new tokens of `seqs` sequences starting from empty, causal)."""
    n, L, E, D = lay.chips, shapes.layers, shapes.hidden, shapes.head_dim
    kv_heads_local = lay.kv_bytes_per_token // (2 * L * D * BF16)
    if prefill:
        per_seq = tokens // seqs
        keys_read = seqs * per_seq * (per_seq + 1) / 2  # (query, key) pairs under the causal mask
        kv_bytes = 2 * tokens * lay.kv_bytes_per_token  # written once, read once by the kernel
    else:
        keys_read = seqs * context
        kv_bytes = (seqs * context + tokens) * lay.kv_bytes_per_token
    attention_flops = 4 * keys_read * lay.local_q_heads * D * L
    flops = 2 * tokens * lay.matmul_params + 2 * seqs * lay.lm_head_params + attention_flops
    qkv_out = (lay.local_q_heads + 2 * kv_heads_local) * D
    per_token_layer = (
        HIDDEN_PASSES * E + 2 * qkv_out + lay.local_q_heads * D + 3 * shapes.intermediate / n
    )
    activation_bytes = tokens * L * per_token_layer * BF16 + seqs * shapes.vocab / n * 4
    collectives = wire = 0.0
    if n > 1:
        collectives = 2 * L + 1
        wire = 2 * L * 2 * (n - 1) / n * tokens * E * BF16 + (n - 1) / n * seqs * shapes.vocab * 4
    return StepCost(lay.weight_bytes, kv_bytes, activation_bytes, flops, int(collectives), wire)


@dataclasses.dataclass(frozen=True)
class Prediction:
    seconds: float
    memory_s: float
    compute_s: float
    collective_s: float

    @property
    def bound(self) -> str:
        return "memory" if self.memory_s >= self.compute_s else "compute"


def predict(cost: StepCost, chip: Chip, latency_s: float = COLLECTIVE_LATENCY_S) -> Prediction:
    memory_s = cost.bytes / chip.hbm_bandwidth
    compute_s = cost.flops / chip.peak_flops
    collective_s = cost.wire_bytes / chip.link_bandwidth + cost.collectives * latency_s
    return Prediction(max(memory_s, compute_s) + collective_s, memory_s, compute_s, collective_s)


def fits(lay: Layout, chip: Chip, kv_tokens: int, headroom: float = 0.9) -> bool:
    """Weights and `kv_tokens` tokens of KV cache within `headroom` of the chip's HBM."""
    return lay.weight_bytes + kv_tokens * lay.kv_bytes_per_token <= headroom * chip.hbm_bytes


__all__ = [
    "CHIPS",
    "Layout",
    "Prediction",
    "Shapes",
    "StepCost",
    "fits",
    "layout",
    "predict",
    "step_cost",
]
