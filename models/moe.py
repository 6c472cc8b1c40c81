"""Mixture-of-experts families: Mixtral and Qwen3-MoE.

Their attention is the Llama decoder's (Mixtral: Mistral's, with an optional window; Qwen3-MoE:
Qwen3's, with q/k norms), reused as is. The MLP of an MoE layer is a router and a stack of
SiLU-gated experts: `w_gate`, `w_up` [X, E, F] and `w_down` [X, F, E], whose first dim is the
`expert` logical axis (replicated by default; sharded over the mesh by
sharding.EXPERT_PARALLEL_RULES), computed by `layers/moe.py` (grouped: each expert only on
the tokens routed to it). Qwen3-MoE may keep a dense MLP in some layers (`mlp_only_layers`,
`decoder_sparse_step`).

Checkpoints: the hub's per-expert tensors (Mixtral `block_sparse_moe.experts.{j}.w1/w3/w2`,
Qwen3-MoE `mlp.experts.{j}.gate_proj/up_proj/down_proj`) and the stacked layout transformers
5 uses in memory (`experts.gate_up_proj` [X, 2F, E], `experts.down_proj` [X, E, F]) both load.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
from flax import nnx
from jaxserve.models import interface as features
from jaxserve.models import sharding as ax
from jaxserve.models.arch_config import ArchConfig
from jaxserve.models.layers.linear import dense
from jaxserve.models.layers.moe import EXPERT_SPECS, moe_mlp
from jaxserve.models.layers.moe import check_impl as check_moe_impl
from jaxserve.models.layers.rotary import layer_rope_spec
from jaxserve.models.llama import (
    DecoderLayer,
    LlamaForCausalLM,
    TensorGetter,
    _param,
    add_weight,
    layer_features,
    llama_weight_map,
)
from jaxserve.models.sharding import logical_to_spec, mesh_axes_size

ROUTER_SPEC = "te,ex->tx"


class MoeDecoderLayer(DecoderLayer):
    """Llama's attention weights; then either the dense MLP or a router and stacked experts."""

    def __init__(self, cfg: ArchConfig, dtype, rngs: nnx.Rngs | None, *, layer_index: int, mesh, rules, **kw):
        moe = cfg.is_moe_layer(layer_index)
        super().__init__(cfg, dtype, rngs, mlp=not moe, **kw)
        self.is_moe = moe
        self.expert_axis = self.mlp_axis = None
        if not moe:
            return
        E, F, X = cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts
        q = kw.get("quantization")
        self.router = _param(rngs, (E, X), (ax.EMBED, None), dtype, 0.1)
        up_axes, down_axes = (ax.EXPERT, ax.EMBED, ax.MLP), (ax.EXPERT, ax.MLP, ax.EMBED)
        for name, shape, axes in (("w_gate", (X, E, F), up_axes), ("w_up", (X, E, F), up_axes),
                                  ("w_down", (X, F, E), down_axes)):
            add_weight(self, name, rngs, shape, axes, dtype, 0.04, EXPERT_SPECS[name], q, cfg.int8_block_size)
        if mesh is not None:  # which mesh axes the experts and their intermediate dim split over
            spec = logical_to_spec(up_axes, (X, E, F), mesh, rules)
            split = [a if a is not None and mesh_axes_size(mesh, a) > 1 else None for a in spec]
            self.expert_axis, self.mlp_axis = split[0], split[2]


class MixtralForCausalLM(LlamaForCausalLM):
    layer_class = MoeDecoderLayer
    supports_lora = False  # the experts' products have no LoRA terms

    def __init__(self, config: ArchConfig, *, moe_impl: str = "ragged", **kw):
        super().__init__(config, moe_impl=moe_impl, **kw)
        # The grouped-product implementation (one of layers/moe.py's MOE_IMPLS), as the
        # engine's backend planned it; static, so part of the compiled step's graph.
        self.moe_impl = check_moe_impl(moe_impl)

    @staticmethod
    def features(cfg: ArchConfig, quantization: str | None) -> frozenset[str]:
        return layer_features(cfg, quantization) | {features.MOE}

    def make_layer(self, cfg, i, dtype, rngs, spec, quantization, mesh, rules):
        return MoeDecoderLayer(cfg, dtype, rngs, layer_index=i, mesh=mesh, rules=rules, attn_spec=spec,
                               rope=layer_rope_spec(cfg, i), quantization=quantization)

    def mlp(self, layer, p, x):
        if not layer.is_moe:
            return super().mlp(layer, p, x)
        cfg = self.config
        logits = dense(ROUTER_SPEC, x, p["router"])  # [T, X] float32
        mesh = self.mesh if self.mesh is not None and self.mesh.size > 1 else None
        return moe_mlp(x, logits, p["w_gate"], p["w_up"], p["w_down"], top_k=cfg.num_experts_per_tok,
                       normalize=cfg.norm_topk_prob, impl=self.moe_impl, mesh=mesh,
                       expert_axis=layer.expert_axis, mlp_axis=layer.mlp_axis)

    @classmethod
    def hf_weight_map(cls, cfg: ArchConfig) -> dict[str, Callable[[TensorGetter], np.ndarray]]:
        return moe_weight_map(cfg, *_HUB_NAMES[cfg.architecture])


class Qwen3MoeForCausalLM(MixtralForCausalLM):
    """Qwen3-MoE: Qwen3's attention (q/k norms), top-k routing optionally renormalized
    (norm_topk_prob), dense MLPs in `mlp_only_layers`."""


# architecture -> (MoE block prefix, router name, per-expert gate, up, down names)
_HUB_NAMES = {
    "MixtralForCausalLM": ("block_sparse_moe", "gate", ("w1", "w3", "w2")),
    "Qwen3MoeForCausalLM": ("mlp", "gate", ("gate_proj", "up_proj", "down_proj")),
}


def moe_weight_map(cfg: ArchConfig, block: str, router: str, expert_names: tuple[str, str, str]
                   ) -> dict[str, Callable[[TensorGetter], np.ndarray]]:
    F, X = cfg.moe_intermediate_size, cfg.num_experts
    m = llama_weight_map(cfg)
    gate_n, up_n, down_n = expert_names

    def stacked(i: int, which: str):
        pre = f"model.layers.{i}.{block}."

        def get_w(get: TensorGetter) -> np.ndarray:
            try:  # the hub's per-expert [out, in] tensors
                if which == "down":
                    return np.stack([np.asarray(get(f"{pre}experts.{j}.{down_n}.weight")).T for j in range(X)])
                name = gate_n if which == "gate" else up_n
                return np.stack([np.asarray(get(f"{pre}experts.{j}.{name}.weight")).T for j in range(X)])
            except KeyError:  # transformers 5's stacked tensors
                if which == "down":
                    return np.swapaxes(np.asarray(get(f"{pre}experts.down_proj")), 1, 2)  # [X, E, F] -> [X, F, E]
                gu = np.asarray(get(f"{pre}experts.gate_up_proj"))  # [X, 2F, E], gate first
                half = gu[:, :F] if which == "gate" else gu[:, F:]
                return np.swapaxes(half, 1, 2)  # [X, E, F]

        return get_w

    for i in range(cfg.num_layers):
        if not cfg.is_moe_layer(i):
            continue
        for name in ("w_gate", "w_up", "w_down"):
            m.pop(f"layers.{i}.{name}")
        m[f"layers.{i}.router"] = _transposed(f"model.layers.{i}.{block}.{router}.weight")  # [X, E] -> [E, X]
        m[f"layers.{i}.w_gate"] = stacked(i, "gate")
        m[f"layers.{i}.w_up"] = stacked(i, "up")
        m[f"layers.{i}.w_down"] = stacked(i, "down")
    return m


def _transposed(name: str) -> Callable[[TensorGetter], np.ndarray]:
    return lambda get: np.asarray(get(name)).T
