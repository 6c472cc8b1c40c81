"""The runner <-> model contract.

A model is called once per step on one flat, padded token batch:

    hidden, kv_cache = model(input_ids [T], positions [T], kv_cache, attn_metadata)
    logits = model.compute_logits(hidden[selected])        # [N, V] float32

`AttentionMetadata` (defined with the kernels) describes the ragged batch; `KVCache` holds the
paged keys and values, one array per layer. The runner owns both and donates the cache to
the step.
"""

from __future__ import annotations

import dataclasses
from typing import Protocol

import jax

from jaxserve.models.arch_config import ArchConfig
from jaxserve.pallas_kernels.ragged_paged_attention.metadata import AttentionMetadata

__all__ = ["AttentionMetadata", "CausalLM", "KVCache", "KV_CACHE_AXES"]

# Layer features: what a model's decoder layer computes, declared by the model as
# `layer_features` (a frozenset of these names). A backend may replace the model's layer by a
# fused implementation only when it implements every declared feature (a positive check: a
# model with a feature the backend does not know keeps its own layer). New architectures add
# names here for what they do differently.
RMS_NORM = "rms_norm"  # pre-attention and pre-MLP RMSNorm with weight w (x * w)
ROPE = "rope"  # rotary embedding of q and k (tables from the model)
GQA = "gqa"  # grouped-query attention over the paged cache
SILU_GLU = "silu_glu"  # MLP: down(silu(gate(x)) * up(x))
SLIDING_WINDOW = "sliding_window"
QKV_BIAS = "qkv_bias"
O_BIAS = "o_bias"
MLP_BIAS = "mlp_bias"
QK_NORM = "qk_norm"  # RMSNorm of q and k per head
# Layers that differ from each other in attention window or RoPE table (e.g. Gemma's
# sliding-window and global layers, Qwen2's upper sliding layers): each layer carries its own
# attention spec and RoPE table, so a fused layer reading one model-wide spec does not apply.
PER_LAYER_ATTENTION = "per_layer_attention"
ROPE_PER_REQUEST = "rope_per_request"  # RoPE angles depend on the request's length (longrope, dynamic)
PARTIAL_ROTARY = "partial_rotary"  # only the first part of each head is rotated (Phi-4-mini)
ATTN_SCALE = "attn_scale"  # attention scale other than head_dim ** -0.5 (Gemma's query_pre_attn_scalar)
ONE_PLUS_W_NORM = "one_plus_w_norm"  # RMSNorm computing x * (1 + w) (Gemma)
POST_NORMS = "post_norms"  # extra RMSNorms after attention and after the MLP, before the residual adds
GELU_TANH_GLU = "gelu_tanh_glu"  # MLP: down(gelu_tanh(gate(x)) * up(x)) (Gemma)
EMBED_SCALE = "embed_scale"  # embeddings multiplied by sqrt(hidden) (Gemma)
ATTN_SOFT_CAP = "attn_soft_cap"  # attention scores soft-capped: c * tanh(s / c) (Gemma 2)
FINAL_SOFT_CAP = "final_soft_cap"  # logits soft-capped (Gemma 2)
MOE = "moe"  # a routed mixture of experts in place of (some layers') MLP (Gemma 4: beside it)
V_NORM = "v_norm"  # RMSNorm (no scale) of v per head (Gemma 4)
LAYER_SCALAR = "layer_scalar"  # each layer's output times a learned scalar (Gemma 4)
# Layers whose heads differ in width or KV head count (Gemma 4's full-attention layers): the
# cache holds the largest, narrower ones padded (models/gemma4.py)
PER_LAYER_HEAD_DIMS = "per_layer_head_dims"
K_EQ_V = "k_eq_v"  # values are the keys' projection (no v projection) in some layers (Gemma 4)
# a per-layer token embedding, gated into each layer's output (Gemma 4)
PER_LAYER_INPUTS = "per_layer_inputs"
KV_SHARED_LAYERS = "kv_shared_layers"  # layers reading an earlier layer's KV cache (Gemma 4)
# multi-head latent attention over a cache of latent rows (DeepSeek V2/V3: models/deepseek_v3.py)
MLA = "mla"
INT8_WEIGHTS = "int8_weights"  # weight-only int8 matmul weights with per-channel scales
ATTENTION_SINKS = "attention_sinks"  # a learned sink logit per query head in the softmax (gpt-oss)
# MoE experts' activation: gate clamped above, up clamped both ways, gate * sigmoid(a gate) *
# (up + 1) (gpt-oss)
CLAMPED_SWIGLU = "clamped_swiglu"

# Logical axes of each layer's k and v viewed per head, [pages, page_size, kv_heads, head_dim].
# The arrays are stored [pages, page_size, kv_heads * head_dim] (one token's heads in one
# lane-dense row: ragged_paged_attention/metadata.py), split as the merge of these axes' specs
# (`sharding.merge_minor_dims`, runner/kv_cache.py).
KV_CACHE_AXES = ("pages", None, "kv_heads", "head_dim")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
    """One K and one V array per layer (separate arrays, so each is updated in place); a model
    whose last layers read an earlier layer's KV (Gemma 4) has arrays for the others only
    (`ArchConfig.num_kv_cache_layers`); a multi-head latent attention model (DeepSeek) has one
    array of latent rows per layer in `k` and none in `v`."""

    k: tuple[jax.Array, ...]  # L x [N, page_size, Hkv * D]
    v: tuple[jax.Array, ...]  # L x [N, page_size, Hkv * D], or () (MLA)

    @property
    def num_layers(self) -> int:
        return len(self.k)

    @property
    def num_pages(self) -> int:
        return self.k[0].shape[0]

    @property
    def page_size(self) -> int:
        return self.k[0].shape[1]


class CausalLM(Protocol):
    config: ArchConfig
    # What the decoder layer computes (names above); backends check it before fusing.
    layer_features: frozenset[str]
    # The model's products, for a backend that lays weights out for its own product kernel:
    # (decoder-layer weight name -> `dense` spec, fused groups, LM head specs); the CPU
    # backend's packing reads them (jaxserve/backends/cpu/packing.py).
    product_specs: tuple

    def __call__(
        self,
        input_ids: jax.Array,
        positions: jax.Array,
        kv_cache: KVCache,
        md: AttentionMetadata,
        layer_impl=None,  # a backend's replacement for the decoder layer (see jaxserve/backends)
    ) -> tuple[jax.Array, KVCache]: ...

    def compute_logits(self, hidden: jax.Array) -> jax.Array: ...
