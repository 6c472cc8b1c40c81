"""Gemma 4 (text, `Gemma4ForCausalLM`): Gemma 3's decoder with these differences (each a
declared layer feature, models/interface.py):

- RMSNorm multiplies by w, not (1 + w) (the checkpoints store the whole scale); the values
  are RMS-normed too, without a scale (`v_norm`); attention scores are not scaled (q/k norms
  set their size: `attn_scale`, 1);
- the full-attention layers have their own, wider heads (`global_head_dim`, e.g. 512 beside
  256) and may have fewer KV heads whose values are the keys' projection (no v_proj:
  `attention_k_eq_v`, 26B-A4B and 31B). The paged cache has one shape for every layer: the
  most KV heads and the widest head of any layer (`ArchConfig.kv_cache_heads`); a layer with
  fewer KV heads repeats each (its query groups read the same values), narrower heads are
  zero-padded (no score and no output value changes) (`per_layer_head_dims`);
- the full-attention layers' RoPE is "proportional": pairs over the whole (wide) head, the
  first quarter with the usual frequencies, the rest with frequency zero (layers/rotary.py);
- per-layer input embeddings (E2B, E4B: `per_layer_inputs`): a second table gives each
  token a small vector per layer, added to a projection of the token's embedding; after its
  MLP each layer gates its residual stream with it: h += norm(proj(gelu(gate(h)) * ple_i));
- the last `num_kv_shared_layers` layers project no keys or values: each attends over the
  cache of the last earlier layer of its type, read as that layer wrote it this step
  (`kv_shared_layers`; the cache has arrays for the other layers only); with
  `use_double_wide_mlp` their MLPs are twice as wide;
- each layer's output is multiplied by a per-layer scalar (`layer_scalar`);
- the MoE variant (26B-A4B: `moe`) keeps the dense MLP and adds routed experts beside it, on
  the same residual: the MLP's output and the experts' output are each normed, added, and
  normed once more before the residual add. The router reads the unnormed residual through
  a scale-free RMSNorm, a learned per-dim scale and hidden ** -0.5; softmax, top-k,
  renormalised, times a learned per-expert scale; the experts are gelu-tanh gated
  (layers/moe.py's shared grouped products);
- the final logits are soft-capped only when the config sets final_logit_softcapping.

Not served: bidirectional attention (`use_bidirectional_attention="all"`, refused in
ArchConfig), the vision and audio towers (Gemma4ForConditionalGeneration).
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
from jaxserve.models.gemma import Gemma2ForCausalLM, gemma_features
from jaxserve.models.interface import AttentionMetadata, KVCache
from jaxserve.models.layers.attention import paged_attention, paged_attention_read
from jaxserve.models.layers.linear import (
    dense,
    dense_group,
    embedding_lookup,
    module_weights,
    param_weight,
)
from jaxserve.models.layers.moe import EXPERT_SPECS, moe_mlp
from jaxserve.models.layers.moe import check_impl as check_moe_impl
from jaxserve.models.layers.norm import rms_norm
from jaxserve.models.layers.rotary import apply_rotary, layer_rope_spec
from jaxserve.models.llama import LAYER_SPECS, TensorGetter, _param, add_weight, rope_for_step
from jaxserve.models.moe import ROUTER_SPEC
from jaxserve.models.sharding import logical_to_spec, mesh_axes_size
from jaxserve.pallas_kernels.kv_quant import attention_dtype
from jaxserve.models.layers.quant import weight_format

# Per-layer input embeddings: the gate [E, P] and projection [P, E] of each layer, and the
# model-wide projection of the token embedding onto every layer's inputs [E, L, P].
PLE_SPECS = {"ple_gate": "te,ep->tp", "ple_proj": "tp,pe->te", "ple_model_proj": "te,elp->tlp"}


def gemma4_features(cfg: ArchConfig, quantization: str | None) -> frozenset[str]:
    out = set(gemma_features(cfg, quantization)) - {features.ONE_PLUS_W_NORM}
    out |= {features.RMS_NORM, features.V_NORM, features.LAYER_SCALAR}
    dims = {(cfg.layer_head_dim(i), cfg.layer_kv_heads(i)) for i in range(cfg.num_layers)}
    for flag, name in (
        (len(dims) > 1, features.PER_LAYER_HEAD_DIMS),
        (cfg.global_k_eq_v, features.K_EQ_V),
        (cfg.per_layer_input_size > 0, features.PER_LAYER_INPUTS),
        (cfg.num_kv_shared_layers > 0, features.KV_SHARED_LAYERS),
        (cfg.num_experts > 0, features.MOE),
    ):
        if flag:
            out.add(name)
    return frozenset(out)


class Gemma4DecoderLayer(nnx.Module):
    """One Gemma 4 layer's weights (`wk`, `wv`, `k_norm` only where it projects its own keys
    and values), its attention spec, RoPE table and which layer's KV it reads."""

    def __init__(
        self,
        cfg: ArchConfig,
        i: int,
        dtype,
        rngs: nnx.Rngs | None,
        *,
        attn_spec,
        rope,
        quantization: str | None,
        mesh,
        rules,
    ):
        self.attn_spec = attn_spec
        self.rope = rope
        self.kv_source = cfg.kv_source(i)
        self.shares_kv = self.kv_source != i  # reads kv_source's cache, projects no keys or values
        self.k_eq_v = cfg.layer_k_eq_v(i)
        self.head_dim = D = cfg.layer_head_dim(i)
        self.is_moe = cfg.is_moe_layer(i)
        self.expert_axis = self.mlp_axis = None
        E, F, Hq, Hkv = (
            cfg.hidden_size,
            cfg.layer_intermediate_size(i),
            cfg.num_heads,
            cfg.layer_kv_heads(i),
        )
        s = 0.02 * 2
        p = lambda shape, axes, **kw: _param(rngs, shape, axes, dtype, s, **kw)  # noqa: E731
        fmt = weight_format(cfg, quantization)
        w = lambda name, shape, axes: add_weight(
            self,
            name,
            rngs,
            shape,
            axes,
            dtype,
            s,  # noqa: E731
            LAYER_SPECS[name],
            quantization,
            cfg.int8_block_size,
            fmt,
        )
        for name in ("input_norm", "post_attn_norm", "post_norm", "post_mlp_norm"):
            setattr(self, name, p((E,), (ax.EMBED,), ones=True))
        self.layer_scalar = p((1,), (None,), ones=True)
        w("wq", (E, Hq, D), (ax.EMBED, ax.Q_HEADS, ax.HEAD_DIM))
        self.q_norm = p((D,), (ax.HEAD_DIM,), ones=True)
        if not self.shares_kv:
            w("wk", (E, Hkv, D), (ax.EMBED, ax.KV_HEADS, ax.HEAD_DIM))
            if not self.k_eq_v:
                w("wv", (E, Hkv, D), (ax.EMBED, ax.KV_HEADS, ax.HEAD_DIM))
            self.k_norm = p((D,), (ax.HEAD_DIM,), ones=True)
        w("wo", (Hq, D, E), (ax.Q_HEADS, ax.HEAD_DIM, ax.EMBED))
        if cfg.qkv_bias:
            self.bq = p((Hq, D), (ax.Q_HEADS, ax.HEAD_DIM))
            if not self.shares_kv:
                self.bk = p((Hkv, D), (ax.KV_HEADS, ax.HEAD_DIM))
                if not self.k_eq_v:
                    self.bv = p((Hkv, D), (ax.KV_HEADS, ax.HEAD_DIM))
        if cfg.o_bias:
            self.bo = p((E,), (ax.EMBED,))
        w("w_gate", (E, F), (ax.EMBED, ax.MLP))
        w("w_up", (E, F), (ax.EMBED, ax.MLP))
        w("w_down", (F, E), (ax.MLP, ax.EMBED))
        P = cfg.per_layer_input_size
        if P:
            self.ple_gate = p((E, P), (ax.EMBED, None))
            self.ple_proj = p((P, E), (None, ax.EMBED))
            self.ple_norm = p((E,), (ax.EMBED,), ones=True)
        if self.is_moe:
            X, Fx = cfg.num_experts, cfg.moe_intermediate_size
            self.router = p((E, X), (ax.EMBED, None))
            self.router_scale = p((E,), (ax.EMBED,), ones=True)
            self.expert_scale = p((X,), (None,), ones=True)
            for name in ("post_mlp_norm_1", "pre_moe_norm", "post_moe_norm"):
                setattr(self, name, p((E,), (ax.EMBED,), ones=True))
            up_axes, down_axes = (ax.EXPERT, ax.EMBED, ax.MLP), (ax.EXPERT, ax.MLP, ax.EMBED)
            q = quantization
            for name, shape, axes in (
                ("x_gate", (X, E, Fx), up_axes),
                ("x_up", (X, E, Fx), up_axes),
                ("x_down", (X, Fx, E), down_axes),
            ):
                add_weight(
                    self,
                    name,
                    rngs,
                    shape,
                    axes,
                    dtype,
                    0.04,
                    EXPERT_SPECS["w" + name[1:]],
                    q,
                    cfg.int8_block_size,
                )
            if mesh is not None:  # as MoeDecoderLayer: the mesh axes the experts split over
                spec = logical_to_spec(up_axes, (X, E, Fx), mesh, rules)
                split = [a if a is not None and mesh_axes_size(mesh, a) > 1 else None for a in spec]
                self.expert_axis, self.mlp_axis = split[0], split[2]


class Gemma4ForCausalLM(Gemma2ForCausalLM):
    layer_class = Gemma4DecoderLayer
    supports_lora = False  # the adapters' targets assume one head shape for every layer
    # A quantized cache's scales are per layer and KV head: they would need mapping onto the
    # KV-sharing layers' source arrays and the repeated heads (runner/kv_scales.py)
    supports_quantized_kv_cache = False

    def __init__(self, config: ArchConfig, *, moe_impl: str = "ragged", **kw):
        super().__init__(config, moe_impl=moe_impl, **kw)
        self.moe_impl = check_moe_impl(moe_impl)
        cfg, rngs, dtype = config, kw.get("rngs"), kw.get("dtype", jnp.float32)
        L, P, E = cfg.num_layers, cfg.per_layer_input_size, cfg.hidden_size
        if P:
            self.ple_embed = _param(
                rngs, (cfg.per_layer_vocab_size, L * P), (ax.VOCAB, None), dtype, 0.5
            )
            self.ple_model_proj = _param(rngs, (E, L, P), (ax.EMBED, None, None), dtype, 0.05)
            self.ple_model_norm = _param(rngs, (P,), (None,), dtype, 0.0, ones=True)

    @staticmethod
    def features(cfg: ArchConfig, quantization: str | None) -> frozenset[str]:
        return gemma4_features(cfg, quantization)

    def make_layer(self, cfg, i, dtype, rngs, spec, quantization, mesh, rules):
        return Gemma4DecoderLayer(
            cfg,
            i,
            dtype,
            rngs,
            attn_spec=spec,
            rope=layer_rope_spec(cfg, i),
            quantization=quantization,
            mesh=mesh,
            rules=rules,
        )

    def norm(self, x: jax.Array, w: jax.Array | None) -> jax.Array:
        return rms_norm(x, w, self.config.rms_norm_eps)

    # ------------------------------------------------------------------ forward
    def __call__(
        self,
        input_ids: jax.Array,
        positions: jax.Array,
        kv_cache: KVCache,
        md: AttentionMetadata,
        layer_impl=None,
        lora=None,
    ) -> tuple[jax.Array, KVCache]:
        """As LlamaForCausalLM's, with the per-layer inputs computed once from the tokens and
        each layer reading (and, unless it shares another's, writing) its KV cache arrays."""
        if layer_impl is not None or lora is not None:
            raise ValueError("Gemma4ForCausalLM runs its own decoder layers, without LoRA adapters")
        with jax.named_scope("embed"):
            h = self.embed_tokens(input_ids)  # [T, E] float32
            ple = self.per_layer_inputs(input_ids, h) if self.config.per_layer_input_size else None
        ropes = rope_for_step(self.layers, positions, md)
        k_caches, v_caches = list(kv_cache.k), list(kv_cache.v)
        for i, layer in enumerate(self.layers):
            with jax.named_scope(f"layer_{i}"):
                p = module_weights(layer)
                c = layer.kv_source
                h, k_caches[c], v_caches[c] = self._layer(
                    layer,
                    p,
                    h,
                    ropes[layer.rope],
                    k_caches[c],
                    v_caches[c],
                    md,
                    None if ple is None else ple[:, i],
                )
        with jax.named_scope("final_norm"):
            h = self.norm(h, self.final_norm[...])
        return h, KVCache(k=tuple(k_caches), v=tuple(v_caches))

    def per_layer_inputs(self, input_ids: jax.Array, h: jax.Array) -> jax.Array:
        """Each token's input to every layer, [T, L, P] float32: its row of the per-layer
        table (times sqrt(P), rounded to the weights' dtype) plus the normed projection of its
        scaled embedding `h` (times hidden ** -0.5), over sqrt(2)."""
        cfg = self.config
        L, P = cfg.num_layers, cfg.per_layer_input_size
        scale = np.float32(np.asarray(P**0.5, np.dtype(self.dtype)))
        tokens = (
            embedding_lookup(param_weight(self, "ple_embed"), input_ids).reshape(-1, L, P) * scale
        )
        proj = dense(PLE_SPECS["ple_model_proj"], h, self.ple_model_proj[...]) * np.float32(
            cfg.hidden_size**-0.5
        )
        proj = self.norm(proj, self.ple_model_norm[...])
        return (proj + tokens) * np.float32(2.0**-0.5)

    def _layer(self, layer, p, h, rope, k_cache, v_cache, md, ple=None):
        with jax.named_scope("attention"):
            attn, k_cache, v_cache = self.attention(
                layer, p, self.norm(h, p["input_norm"]), rope, k_cache, v_cache, md
            )
            h = h + self.norm(attn, p["post_attn_norm"])
        with jax.named_scope("mlp"):
            y = self.mlp(layer, p, self.norm(h, p["post_norm"]))
            if layer.is_moe:
                y = self.norm(y, p["post_mlp_norm_1"]) + self.norm(
                    self.experts(layer, p, h), p["post_moe_norm"]
                )
            h = h + self.norm(y, p["post_mlp_norm"])
        if ple is not None:
            with jax.named_scope("per_layer_input"):
                g = (
                    jax.nn.gelu(dense(PLE_SPECS["ple_gate"], h, p["ple_gate"]), approximate=True)
                    * ple
                )
                h = h + self.norm(dense(PLE_SPECS["ple_proj"], g, p["ple_proj"]), p["ple_norm"])
        return h * p["layer_scalar"].astype(jnp.float32), k_cache, v_cache

    def attention(self, layer, p, x, rope, k_cache, v_cache, md):
        """Self-attention of normed x [T, E]: over the layer's own cache, which it writes, or
        (a KV-sharing layer) over its source layer's, as that layer wrote it this step."""
        cfg = self.config
        D, Dc, Hc = layer.head_dim, cfg.kv_cache_head_dim, cfg.kv_cache_heads
        if "wqkv" in p:  # packed together for a CPU product kernel
            q, k, v = dense_group(LAYER_SPECS["wq"], x, p["wqkv"])
        else:
            q = dense(LAYER_SPECS["wq"], x, p["wq"])  # [T, Hq, D]
            if not layer.shares_kv:
                k = dense(LAYER_SPECS["wk"], x, p["wk"])  # [T, Hkv, D]
                v = k if layer.k_eq_v else dense(LAYER_SPECS["wv"], x, p["wv"])
        if cfg.qkv_bias:
            q = q + p["bq"]
        q = apply_rotary(self.norm(q, p["q_norm"]), *rope)
        q = _pad_dim(q, Dc).astype(attention_dtype(k_cache.dtype, self.dtype))
        if layer.shares_kv:  # the source layer's cache (this layer's spec: the same window)
            attn = paged_attention_read(
                q, k_cache, v_cache, md, layer.attn_spec, self.mesh, dict(self.rules)
            )
        else:
            if cfg.qkv_bias:
                k = k + p["bk"]
                v = k if layer.k_eq_v else v + p["bv"]
            k = apply_rotary(self.norm(k, p["k_norm"]), *rope)
            v = self.norm(v, None)
            k, v = (_pad_dim(_repeat_heads(y, Hc), Dc) for y in (k, v))
            attn, k_cache, v_cache = paged_attention(
                q, k, v, k_cache, v_cache, md, layer.attn_spec, self.mesh, dict(self.rules)
            )
        attn = attn[..., :D]  # [T, Hq, D]
        o = dense(LAYER_SPECS["wo"], attn, p["wo"])
        if cfg.o_bias:
            o = o + p["bo"]
        return o, k_cache, v_cache

    def experts(self, layer, p, h):
        """The routed experts on the residual h [T, E] -> [T, E] float32."""
        cfg = self.config
        r = (
            self.norm(h, None)
            * p["router_scale"].astype(jnp.float32)
            * np.float32(cfg.hidden_size**-0.5)
        )
        logits = dense(ROUTER_SPEC, r, p["router"])  # [T, X]
        mesh = self.mesh if self.mesh is not None and self.mesh.size > 1 else None
        return moe_mlp(
            self.norm(h, p["pre_moe_norm"]),
            logits,
            p["x_gate"],
            p["x_up"],
            p["x_down"],
            top_k=cfg.num_experts_per_tok,
            normalize=True,
            impl=self.moe_impl,
            mesh=mesh,
            expert_axis=layer.expert_axis,
            mlp_axis=layer.mlp_axis,
            expert_scale=p["expert_scale"],
            act=cfg.hidden_act,
        )

    # ------------------------------------------------------------------ weights
    @classmethod
    def hf_weight_map(cls, cfg: ArchConfig) -> dict[str, Callable[[TensorGetter], np.ndarray]]:
        return gemma4_weight_map(cfg)


def _repeat_heads(x: jax.Array, heads: int) -> jax.Array:
    """[T, H, D] -> [T, heads, D], each head repeated heads / H times (query head groups keep
    reading the head they read)."""
    return x if x.shape[1] == heads else jnp.repeat(x, heads // x.shape[1], axis=1)


def _pad_dim(x: jax.Array, dim: int) -> jax.Array:
    """[T, H, D] -> [T, H, dim], zeros after D."""
    return x if x.shape[-1] == dim else jnp.pad(x, ((0, 0), (0, 0), (0, dim - x.shape[-1])))


def gemma4_weight_map(cfg: ArchConfig) -> dict[str, Callable[[TensorGetter], np.ndarray]]:
    """Our parameter path -> its builder from transformers' Gemma 4 tensors."""
    E, Hq = cfg.hidden_size, cfg.num_heads
    L, P = cfg.num_layers, cfg.per_layer_input_size

    def get(name: str, fn=lambda w: w):
        return lambda g: fn(np.asarray(g(name)))

    m = {"embed": get("model.embed_tokens.weight"), "final_norm": get("model.norm.weight")}
    if not cfg.tie_word_embeddings:
        m["lm_head"] = get("lm_head.weight", lambda w: w.T)
    if P:
        m["ple_embed"] = get("model.embed_tokens_per_layer.weight")
        m["ple_model_proj"] = get(
            "model.per_layer_model_projection.weight", lambda w: w.T.reshape(E, L, P)
        )
        m["ple_model_norm"] = get("model.per_layer_projection_norm.weight")
    for i in range(L):
        pre, ours = f"model.layers.{i}.", f"layers.{i}."
        D, Hkv = cfg.layer_head_dim(i), cfg.layer_kv_heads(i)
        names = {
            "input_norm": "input_layernorm.weight",
            "post_attn_norm": "post_attention_layernorm.weight",
            "post_norm": "pre_feedforward_layernorm.weight",
            "post_mlp_norm": "post_feedforward_layernorm.weight",
            "layer_scalar": "layer_scalar",
            "q_norm": "self_attn.q_norm.weight",
        }
        convert = {
            "wq": ("self_attn.q_proj.weight", lambda w, H=Hq, D=D: w.T.reshape(E, H, D)),
            "wo": ("self_attn.o_proj.weight", lambda w, D=D: w.T.reshape(Hq, D, E)),
            "w_gate": ("mlp.gate_proj.weight", lambda w: w.T),
            "w_up": ("mlp.up_proj.weight", lambda w: w.T),
            "w_down": ("mlp.down_proj.weight", lambda w: w.T),
        }
        if cfg.qkv_bias:
            convert["bq"] = ("self_attn.q_proj.bias", lambda b, D=D: b.reshape(Hq, D))
        if cfg.o_bias:
            names["bo"] = "self_attn.o_proj.bias"
        if cfg.kv_source(i) == i:
            names["k_norm"] = "self_attn.k_norm.weight"
            convert["wk"] = ("self_attn.k_proj.weight", lambda w, H=Hkv, D=D: w.T.reshape(E, H, D))
            if cfg.qkv_bias:
                convert["bk"] = ("self_attn.k_proj.bias", lambda b, H=Hkv, D=D: b.reshape(H, D))
            if not cfg.layer_k_eq_v(i):
                convert["wv"] = (
                    "self_attn.v_proj.weight",
                    lambda w, H=Hkv, D=D: w.T.reshape(E, H, D),
                )
                if cfg.qkv_bias:
                    convert["bv"] = ("self_attn.v_proj.bias", lambda b, H=Hkv, D=D: b.reshape(H, D))
        if P:
            names["ple_norm"] = "post_per_layer_input_norm.weight"
            convert["ple_gate"] = ("per_layer_input_gate.weight", lambda w: w.T)
            convert["ple_proj"] = ("per_layer_projection.weight", lambda w: w.T)
        if cfg.is_moe_layer(i):
            F = cfg.moe_intermediate_size
            names.update(
                post_mlp_norm_1="post_feedforward_layernorm_1.weight",
                pre_moe_norm="pre_feedforward_layernorm_2.weight",
                post_moe_norm="post_feedforward_layernorm_2.weight",
                router_scale="router.scale",
                expert_scale="router.per_expert_scale",
            )
            convert.update(
                router=("router.proj.weight", lambda w: w.T),  # [X, E] -> [E, X]
                x_gate=(
                    "experts.gate_up_proj",
                    lambda w, F=F: np.swapaxes(w[:, :F], 1, 2),
                ),  # [X, E, F]
                x_up=("experts.gate_up_proj", lambda w, F=F: np.swapaxes(w[:, F:], 1, 2)),
                x_down=(
                    "experts.down_proj",
                    lambda w: np.swapaxes(w, 1, 2),
                ),  # [X, E, F] -> [X, F, E]
            )
        for k, v in names.items():
            m[ours + k] = get(pre + v)
        for k, (v, fn) in convert.items():
            m[ours + k] = get(pre + v, fn)
    return m
