"""Phi-3 / Phi-4 (`Phi3ForCausalLM`): the Llama decoder, with its q/k/v and gate/up projections
stored fused in the checkpoint and LongRoPE scaling (Phi-4-mini also rotates only part of each
head: `partial_rotary_factor`).

The fused checkpoint tensors are split at load time into the Llama layer's separate weights:
they shard like Llama's (heads and MLP columns over the model axis), and a packing backend
fuses them again for its own product kernel. The layer then computes exactly Llama's, so the
model declares Llama's layer features (plus partial_rotary when it applies).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
from jaxserve.models.arch_config import ArchConfig
from jaxserve.models.llama import LlamaForCausalLM, TensorGetter, llama_weight_map


class Phi3ForCausalLM(LlamaForCausalLM):
    @classmethod
    def hf_weight_map(cls, cfg: ArchConfig) -> dict[str, Callable[[TensorGetter], np.ndarray]]:
        return phi3_weight_map(cfg)


def phi3_weight_map(cfg: ArchConfig) -> dict[str, Callable[[TensorGetter], np.ndarray]]:
    E, Hq, Hkv, D, F = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size
    m = llama_weight_map(cfg)
    bounds = {"wq": (0, Hq * D, Hq), "wk": (Hq * D, (Hq + Hkv) * D, Hkv), "wv": ((Hq + Hkv) * D, (Hq + 2 * Hkv) * D, Hkv)}

    def qkv(i: int, lo: int, hi: int, heads: int):
        # qkv_proj.weight: [(Hq + 2 Hkv) * D, E] -> rows lo:hi -> [E, H, D]
        return lambda get: get(f"model.layers.{i}.self_attn.qkv_proj.weight")[lo:hi].T.reshape(E, heads, D)

    def gate_up(i: int, half: int):
        # gate_up_proj.weight: [2F, E], gate first -> [E, F]
        return lambda get: get(f"model.layers.{i}.mlp.gate_up_proj.weight")[half * F:(half + 1) * F].T

    for i in range(cfg.num_layers):
        for name, (lo, hi, heads) in bounds.items():
            m[f"layers.{i}.{name}"] = qkv(i, lo, hi, heads)
        m[f"layers.{i}.w_gate"] = gate_up(i, 0)
        m[f"layers.{i}.w_up"] = gate_up(i, 1)
    return m
