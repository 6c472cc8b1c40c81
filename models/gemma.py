"""Gemma 2 and Gemma 3 (text): Llama's attention with Gemma's own norms, MLP and embedding.

What Gemma computes differently from the Llama decoder (each a declared layer feature):
- RMSNorm multiplies by (1 + w), in float32 (`one_plus_w_norm`), also for Gemma 3's q/k norms;
- four norms per layer: before and after attention, before and after the MLP; the "after"
  norms apply to the branch output before its residual add (`post_norms`);
- the MLP is down(gelu_tanh(gate(x)) * up(x)) (`gelu_tanh_glu`);
- embeddings are multiplied by sqrt(hidden), rounded to the weights' dtype (`embed_scale`);
- attention scale query_pre_attn_scalar ** -0.5 (`attn_scale`); Gemma 2 soft-caps the attention
  scores and the final logits (c * tanh(x / c)) (`attn_soft_cap`, `final_soft_cap`);
- sliding-window layers alternate with global ones (Gemma 2: 1:1; Gemma 3: 5 local : 1
  global, the local layers with their own RoPE base, the global ones with the scaled RoPE).
  Each layer carries its window and RoPE table (`per_layer_attention`).

The attention block itself (projections, optional q/k norm, RoPE, paged attention with the
layer's spec) is the Llama decoder's, reused as is.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jaxserve.models import interface as features
from jaxserve.models import sharding as ax
from jaxserve.models.arch_config import ArchConfig
from jaxserve.models.layers.linear import dense, dense_group
from jaxserve.models.layers.lora import add_lora
from jaxserve.models.layers.rotary import layer_rope_spec
from jaxserve.models.llama import (
    LAYER_SPECS,
    DecoderLayer,
    LlamaForCausalLM,
    TensorGetter,
    _param,
    llama_weight_map,
    quantized_weights,
)


def gemma_features(cfg: ArchConfig, quantization: str | None) -> frozenset[str]:
    out = {features.ONE_PLUS_W_NORM, features.ROPE, features.GQA, features.GELU_TANH_GLU,
           features.POST_NORMS, features.EMBED_SCALE}
    windows = {cfg.layer_window(i) for i in range(cfg.num_layers)}
    ropes = {layer_rope_spec(cfg, i) for i in range(cfg.num_layers)}
    for flag, name in ((windows != {None}, features.SLIDING_WINDOW),
                       (len(windows) > 1 or len(ropes) > 1, features.PER_LAYER_ATTENTION),
                       (cfg.query_pre_attn_scalar not in (None, cfg.head_dim), features.ATTN_SCALE),
                       (cfg.attn_logit_softcapping is not None, features.ATTN_SOFT_CAP),
                       (cfg.final_logit_softcapping is not None, features.FINAL_SOFT_CAP),
                       (cfg.qk_norm, features.QK_NORM), (cfg.qkv_bias, features.QKV_BIAS),
                       (cfg.o_bias, features.O_BIAS),
                       (cfg.rotary_dim != cfg.head_dim, features.PARTIAL_ROTARY),
                       (quantized_weights(cfg, quantization), features.INT8_WEIGHTS)):
        if flag:
            out.add(name)
    return frozenset(out)


def one_plus_w_rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """Gemma's RMSNorm: x / rms(x) * (1 + w), float32 throughout. x: [..., E] -> float32."""
    x32 = x.astype(jnp.float32)
    var = jnp.mean(jnp.square(x32), axis=-1, keepdims=True)
    return x32 * jax.lax.rsqrt(var + eps) * (1.0 + weight.astype(jnp.float32))


class GemmaDecoderLayer(DecoderLayer):
    """The Llama layer's weights (its `post_norm` is Gemma's pre-MLP norm) plus the norms of
    the attention and MLP outputs."""

    def __init__(self, cfg: ArchConfig, dtype, rngs: nnx.Rngs | None, **kw):
        super().__init__(cfg, dtype, rngs, **kw)
        E = cfg.hidden_size
        self.post_attn_norm = _param(rngs, (E,), (ax.EMBED,), dtype, 0.0, ones=True)
        self.post_mlp_norm = _param(rngs, (E,), (ax.EMBED,), dtype, 0.0, ones=True)


class Gemma2ForCausalLM(LlamaForCausalLM):
    layer_class = GemmaDecoderLayer

    @staticmethod
    def features(cfg: ArchConfig, quantization: str | None) -> frozenset[str]:
        return gemma_features(cfg, quantization)

    def norm(self, x: jax.Array, w: jax.Array) -> jax.Array:
        return one_plus_w_rms_norm(x, w, self.config.rms_norm_eps)

    def embed_tokens(self, input_ids: jax.Array) -> jax.Array:
        # transformers multiplies by sqrt(hidden) rounded to the weights' dtype
        scale = np.float32(np.asarray(self.config.hidden_size**0.5, np.dtype(self.dtype)))
        return super().embed_tokens(input_ids) * scale

    def _layer(self, layer, p, h, rope, k_cache, v_cache, md):
        with jax.named_scope("attention"):
            attn, k_cache, v_cache = self.attention(layer, p, self.norm(h, p["input_norm"]), rope,
                                                    k_cache, v_cache, md)
            h = h + self.norm(attn, p["post_attn_norm"])
        with jax.named_scope("mlp"):
            h = h + self.norm(self.mlp(layer, p, self.norm(h, p["post_norm"])), p["post_mlp_norm"])
        return h, k_cache, v_cache

    def mlp(self, layer, p, x):
        """down(gelu(gate(x)) * up(x)) (tanh approximation unless the config says exact)."""
        if "w_gate_up" in p:
            gate, up = dense_group(LAYER_SPECS["w_gate"], x, p["w_gate_up"])
        else:
            gate = dense(LAYER_SPECS["w_gate"], x, p["w_gate"])  # [T, F]
            up = dense(LAYER_SPECS["w_up"], x, p["w_up"])
        gate = add_lora(p, "w_gate", LAYER_SPECS["w_gate"], x, gate)
        up = add_lora(p, "w_up", LAYER_SPECS["w_up"], x, up)
        act = jax.nn.gelu(gate, approximate=self.config.hidden_act == "gelu_tanh") * up
        return add_lora(p, "w_down", LAYER_SPECS["w_down"], act,
                        dense(LAYER_SPECS["w_down"], act, p["w_down"]))  # [T, E]

    def compute_logits(self, hidden: jax.Array) -> jax.Array:
        logits = super().compute_logits(hidden)
        cap = self.config.final_logit_softcapping
        if cap is not None:
            logits = cap * jnp.tanh(logits / cap)
        return logits

    @classmethod
    def hf_weight_map(cls, cfg: ArchConfig) -> dict[str, Callable[[TensorGetter], np.ndarray]]:
        m = llama_weight_map(cfg)

        def norm(name: str):
            return lambda get: get(name)

        for i in range(cfg.num_layers):
            pre = f"model.layers.{i}."
            m[f"layers.{i}.post_norm"] = norm(pre + "pre_feedforward_layernorm.weight")
            m[f"layers.{i}.post_attn_norm"] = norm(pre + "post_attention_layernorm.weight")
            m[f"layers.{i}.post_mlp_norm"] = norm(pre + "post_feedforward_layernorm.weight")
        return m


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    """Gemma 3 text models: Gemma 2's layer with q/k norms and no attention soft cap, 5 local
    layers per global one, the local layers with their own RoPE base (ArchConfig)."""
