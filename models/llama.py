"""The Llama family: Llama 2/3/3.1, SmolLM2 (and the shared decoder the Qwen and Mistral
families reuse).

Each decoder layer owns its own weight arrays and its own KV-cache arrays, and the layers run
as an unrolled Python loop. On XLA:CPU this is what keeps the step fast: inside a `lax.scan`
over layer-stacked weights (or with a layer-stacked cache) XLA copies each layer's slice before
using it, and bfloat16 products lose their fast path. Measured on SmolLM2 (30 layers, 32
requests, bfloat16): matmuls 65 ms per decode step unrolled with per-layer arrays, 159 ms
with stacked weights sliced per layer, 219 ms in a scan. The price is compile time, which grows
with depth (about 3-5 s per bucket for SmolLM2 instead of under 1 s).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh
from jaxserve.models import interface as features
from jaxserve.models import sharding as ax
from jaxserve.models.arch_config import ArchConfig
from jaxserve.models.interface import AttentionMetadata, KVCache
from jaxserve.models.layers.attention import AttentionSpec, layer_kv_scale, paged_attention
from jaxserve.models.layers.linear import (
    INPUT_SCALE_SUFFIX,
    PERM_SUFFIX,
    SCALE_SUFFIX,
    ZERO_SUFFIX,
    QuantizedParam,
    dense,
    dense_group,
    embedding_lookup,
    module_weights,
    param_weight,
    quantize_int8,
    scale_shape,
)
from jaxserve.models.layers.quant import (
    pack_int4,
    quantize_fp8_blocks,
    quantize_int4_blocks,
    quantize_int8_blocks,
    weight_format,
)
from jaxserve.models.weight_format import WeightFormat
from jaxserve.models.layers.lora import LoRABatch, add_lora
from jaxserve.models.layers.norm import rms_norm
from jaxserve.models.layers.rotary import RopeSpec, apply_rotary, layer_rope_spec, rope_tables
from jaxserve.models.sharding import DEFAULT_RULES
from jaxserve.pallas_kernels.kv_quant import attention_dtype

# A checkpoint tensor getter: HF tensor name -> numpy array.
TensorGetter = Callable[[str], np.ndarray]

# The `dense` spec of each decoder-layer matmul weight, and of the LM head (separate [E, V];
# tied to the [V, E] embedding).
LAYER_SPECS = {
    "wq": "te,ehd->thd", "wk": "te,ehd->thd", "wv": "te,ehd->thd", "wo": "thd,hde->te",
    "w_gate": "te,ef->tf", "w_up": "te,ef->tf", "w_down": "tf,fe->te",
}
HEAD_SPECS = ("ne,ev->nv", "ne,ve->nv")
# The embedding table [V, E] is quantized like the tied LM head: one scale per row.
EMBED_SPEC = HEAD_SPECS[1]
# Weights sharing an input that a packing backend fuses into one product.
FUSED = {"wqkv": ("wq", "wk", "wv"), "w_gate_up": ("w_gate", "w_up")}


def layer_features(cfg: ArchConfig, quantization: str | None = None) -> frozenset[str]:
    """What this family's decoder layer computes (see models/interface.py)."""
    out = {features.RMS_NORM, features.ROPE, features.GQA, features.SILU_GLU}
    windows = {cfg.layer_window(i) for i in range(cfg.num_layers)}
    ropes = {layer_rope_spec(cfg, i) for i in range(cfg.num_layers)}
    for flag, name in ((windows != {None}, features.SLIDING_WINDOW), (cfg.qkv_bias, features.QKV_BIAS),
                       (cfg.o_bias, features.O_BIAS), (cfg.mlp_bias, features.MLP_BIAS),
                       (cfg.qk_norm, features.QK_NORM),
                       (len(windows) > 1 or len(ropes) > 1, features.PER_LAYER_ATTENTION),
                       (cfg.rotary_dim != cfg.head_dim, features.PARTIAL_ROTARY),
                       (quantized_weights(cfg, quantization), features.INT8_WEIGHTS)):
        if flag:
            out.add(name)
    return frozenset(out)


def quantized_weights(cfg: ArchConfig, quantization: str | None) -> bool:
    """Whether the model's matmul weights are quantized (at load or in the checkpoint)."""
    return quantization is not None or cfg.weight_format is not None


def _param(rngs: nnx.Rngs | None, shape, axes, dtype, scale: float, ones: bool = False) -> nnx.Param:
    if ones:
        value = jnp.ones(shape, dtype)
        if rngs is not None:  # random but near one, so tests notice a missing norm
            value = value + 0.1 * jax.random.normal(rngs.params(), shape, dtype)
    else:
        value = scale * jax.random.normal(rngs.params(), shape, dtype) if rngs is not None else jnp.zeros(shape, dtype)
    return nnx.Param(value, logical_axes=axes)


def add_weight(module: nnx.Module, name: str, rngs: nnx.Rngs | None, shape, axes, dtype, scale: float,
               spec: str, quantization: str | None, block: int | None = None,
               fmt: WeightFormat | None = None) -> None:
    """Matmul weight `name` of `module`: a float parameter, or with quantization="int8" an int8
    `QuantizedParam` and its scales (`name` + SCALE_SUFFIX): per output channel, or per `block`
    values along the contracted dims (`ArchConfig.int8_block_size`: a Q8_0 checkpoint); with
    `fmt` (see `weight_format`) a weight in that format."""
    if fmt is not None:
        add_format_weight(module, name, rngs, shape, axes, dtype, scale, spec, fmt)
        return
    if quantization is None:
        setattr(module, name, _param(rngs, shape, axes, dtype, scale))
        return
    if quantization != "int8":
        raise ValueError(f"quantization {quantization!r} is not supported (only 'int8')")
    value = scale * jax.random.normal(rngs.params(), shape, jnp.float32) if rngs is not None else jnp.zeros(shape)
    q, s = quantize_int8(value, spec, block)
    scale_axes = tuple(None if n == 1 and m != 1 else a for a, n, m in zip(axes, s.shape, shape))
    setattr(module, name, QuantizedParam(q, logical_axes=axes, spec=spec, compute_dtype=jnp.dtype(dtype).name))
    setattr(module, name + SCALE_SUFFIX, nnx.Param(s, logical_axes=scale_axes))


def add_format_weight(module: nnx.Module, name: str, rngs: nnx.Rngs | None, shape, axes, dtype,
                      scale: float, spec: str, fmt: WeightFormat) -> None:
    """Matmul weight `name` in format `fmt`: its values as a `QuantizedParam` (float8_e4m3fn,
    int8, or uint8 holding two int4 values along the last contracted dim), float32 scales and
    (int4, asymmetric int8) zeros of `scale_shape(shape, spec, fmt.in_block, fmt.out_block)`;
    act-order formats an int32 order of the contracted inputs (`PERM_SUFFIX`), formats with
    static activation scales a float32 [1] (`INPUT_SCALE_SUFFIX`)."""
    sshape = scale_shape(shape, spec, fmt.in_block, fmt.out_block)
    split = [x for n, m in zip(shape, sshape) for x in (m, n // m)]
    w = (scale * jax.random.normal(rngs.params(), shape, jnp.float32) if rngs is not None
         else jnp.zeros(shape))
    scale_axes = tuple(None if n == 1 and m != 1 else a for a, n, m in zip(axes, sshape, shape))
    meta = dict(spec=spec, compute_dtype=jnp.dtype(dtype).name)
    if fmt.activations is not None:
        meta["activations"] = fmt.activations
    if fmt.act_order:  # the contracted inputs' order of the stored rows (identity at random)
        contracted = [n for n, c in zip(shape, spec.split(",")[1].split("->")[0])
                      if c in spec.split(",")[0] and c not in spec.split("->")[1]]
        perm = jnp.arange(math.prod(contracted), dtype=jnp.int32)
        setattr(module, name + PERM_SUFFIX, nnx.Param(perm, logical_axes=(None,)))
    if fmt.static_activations:  # the checkpoint's activation scale (0: per token)
        setattr(module, name + INPUT_SCALE_SUFFIX,
                nnx.Param(jnp.zeros((1,), jnp.float32), logical_axes=(None,)))
    if fmt.kind == "fp8":
        q, s = quantize_fp8_blocks(w, split)
    elif fmt.kind == "int8":
        q, s, z = quantize_int8_blocks(w, split, fmt.asymmetric)
        if z is not None:
            setattr(module, name + ZERO_SUFFIX, nnx.Param(z, logical_axes=scale_axes))
    else:
        packed_axis = max(a for a, c in enumerate(spec.split("->")[0].split(",")[1])
                          if c in spec.split(",")[0] and c not in spec.split("->")[1])
        q, s, z = quantize_int4_blocks(w, split)
        q = pack_int4(q, packed_axis)
        meta["packed_axis"] = packed_axis
        setattr(module, name + ZERO_SUFFIX, nnx.Param(z, logical_axes=scale_axes))
    setattr(module, name, QuantizedParam(q, logical_axes=axes, **meta))
    setattr(module, name + SCALE_SUFFIX, nnx.Param(s, logical_axes=scale_axes))


class DecoderLayer(nnx.Module):
    """The weights of one decoder layer, and its attention properties: `attn_spec` (window,
    scale, soft cap, implementation) and `rope` (which RoPE table it reads)."""

    def __init__(self, cfg: ArchConfig, dtype, rngs: nnx.Rngs | None, *, attn_spec: AttentionSpec,
                 rope: RopeSpec, quantization: str | None = None, mlp: bool = True):
        self.attn_spec = attn_spec
        self.rope = rope
        E, F = cfg.hidden_size, cfg.intermediate_size
        Hq, Hkv, D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        s = 0.02 * 2
        p = lambda shape, axes, **kw: _param(rngs, shape, axes, dtype, s, **kw)
        fmt = weight_format(cfg, quantization)
        w = lambda name, shape, axes: add_weight(self, name, rngs, shape, axes, dtype, s,
                                                 LAYER_SPECS[name], quantization,
                                                 cfg.int8_block_size, fmt)
        self.input_norm = p((E,), (ax.EMBED,), ones=True)
        w("wq", (E, Hq, D), (ax.EMBED, ax.Q_HEADS, ax.HEAD_DIM))
        w("wk", (E, Hkv, D), (ax.EMBED, ax.KV_HEADS, ax.HEAD_DIM))
        w("wv", (E, Hkv, D), (ax.EMBED, ax.KV_HEADS, ax.HEAD_DIM))
        w("wo", (Hq, D, E), (ax.Q_HEADS, ax.HEAD_DIM, ax.EMBED))
        if cfg.qkv_bias:
            self.bq = p((Hq, D), (ax.Q_HEADS, ax.HEAD_DIM))
            self.bk = p((Hkv, D), (ax.KV_HEADS, ax.HEAD_DIM))
            self.bv = p((Hkv, D), (ax.KV_HEADS, ax.HEAD_DIM))
        if cfg.o_bias:
            self.bo = p((E,), (ax.EMBED,))
        if cfg.qk_norm:
            self.q_norm = p((D,), (ax.HEAD_DIM,), ones=True)
            self.k_norm = p((D,), (ax.HEAD_DIM,), ones=True)
        self.post_norm = p((E,), (ax.EMBED,), ones=True)
        if mlp:
            w("w_gate", (E, F), (ax.EMBED, ax.MLP))
            w("w_up", (E, F), (ax.EMBED, ax.MLP))
            w("w_down", (F, E), (ax.MLP, ax.EMBED))
            if cfg.mlp_bias:
                self.b_gate = p((F,), (ax.MLP,))
                self.b_up = p((F,), (ax.MLP,))
                self.b_down = p((E,), (ax.EMBED,))


def attention_spec(cfg: ArchConfig, i: int, impl: str) -> AttentionSpec:
    """Layer i's attention: scale, window, soft cap."""
    scale = cfg.query_pre_attn_scalar if cfg.query_pre_attn_scalar is not None else cfg.head_dim
    return AttentionSpec(sm_scale=scale**-0.5, sliding_window=cfg.layer_window(i),
                         soft_cap=cfg.attn_logit_softcapping, impl=impl)


def rope_for_step(layers, positions: jax.Array, md: AttentionMetadata) -> dict:
    """Each distinct RoPE table the layers read, computed once for the step: spec -> (cos, sin)."""
    tables = {}
    for layer in layers:
        if layer.rope not in tables:
            tables[layer.rope] = rope_tables(layer.rope, positions, md)
    return tables


class LlamaForCausalLM(nnx.Module):
    """Decoder-only transformer on the paged runner contract (see models/interface.py)."""

    product_specs = (LAYER_SPECS, FUSED, HEAD_SPECS)
    layer_class = DecoderLayer
    supports_lora = True  # the layers add LoRA products (models/layers/lora.py)

    def __init__(
        self,
        config: ArchConfig,
        *,
        dtype=jnp.float32,
        rngs: nnx.Rngs | None = None,
        mesh: Mesh | None = None,
        attention_impl: str = "auto",
        quantization: str | None = None,
        rules=DEFAULT_RULES,
        moe_impl: str = "ragged",  # the MoE families' grouped products (moe.py); unused here
    ):
        cfg = config
        self.config = cfg
        self.layer_features = self.features(cfg, quantization)
        self.dtype = dtype
        self.mesh = mesh
        # The sharding rules (hashable items): the attention shard_map derives its specs from them.
        self.rules = tuple(sorted(dict(rules).items()))
        self.quantization = quantization
        specs = [attention_spec(cfg, i, attention_impl) for i in range(cfg.num_layers)]
        # The model-wide spec, for a backend's fused layer (only used when the layers agree:
        # otherwise the model declares per_layer_attention).
        self.attn_spec = specs[0]
        V, E = cfg.vocab_size, cfg.hidden_size
        weight_format(cfg, quantization)  # refuses a --quantization the checkpoint contradicts
        q = quantization if quantization == "int8" else None  # the embedding and head stay float
        embed_scale = 0.5
        if q is None:
            self.embed = _param(rngs, (V, E), (ax.VOCAB, ax.EMBED), dtype, embed_scale)
        else:
            add_weight(self, "embed", rngs, (V, E), (ax.VOCAB, ax.EMBED), dtype, embed_scale, EMBED_SPEC, q,
                       cfg.int8_block_size)
        self.layers = nnx.List([
            self.make_layer(cfg, i, dtype, rngs, specs[i], quantization, mesh, rules)
            for i in range(cfg.num_layers)])
        self.final_norm = _param(rngs, (E,), (ax.EMBED,), dtype, 0.0, ones=True)
        if not cfg.tie_word_embeddings:
            add_weight(self, "lm_head", rngs, (E, V), (ax.EMBED, ax.VOCAB), dtype, 0.05, HEAD_SPECS[0], q,
                       cfg.int8_block_size)

    @staticmethod
    def features(cfg: ArchConfig, quantization: str | None) -> frozenset[str]:
        return layer_features(cfg, quantization)

    def make_layer(self, cfg, i, dtype, rngs, spec, quantization, mesh, rules):
        return self.layer_class(cfg, dtype, rngs, attn_spec=spec, rope=layer_rope_spec(cfg, i),
                                quantization=quantization)

    # ------------------------------------------------------------------ forward
    def __call__(
        self,
        input_ids: jax.Array,  # [T] int32
        positions: jax.Array,  # [T] int32
        kv_cache: KVCache,
        md: AttentionMetadata,
        layer_impl=None,
        lora: LoRABatch | None = None,
        *,
        taps: tuple[int, ...] = (),
    ) -> tuple[jax.Array, KVCache] | tuple[jax.Array, KVCache, jax.Array]:
        """`layer_impl(model, params, h, rope, k_cache, v_cache, md)`: a backend's replacement
        for `_layer` (see jaxserve/backends), used only after its capability check. `lora`: the
        step's adapter slots and each token's slot (models/layers/lora.py), or None.
        `taps`: layer ids whose hidden states an EAGLE-3 drafter reads (models/eagle3.py): id i
        is the residual stream entering layer i (transformers' `hidden_states[i]`; id L, the
        last layer's output before the final norm). With taps the result has a third item,
        their concatenation in the order given, [T, len(taps) * E] float32."""
        if any(not 0 <= i <= len(self.layers) for i in taps):
            raise ValueError(f"taps {list(taps)} must be layer ids within [0, {len(self.layers)}]")
        with jax.named_scope("embed"):
            h = self.embed_tokens(input_ids)  # [T, E] float32
        ropes = rope_for_step(self.layers, positions, md)  # cos, sin: [T, 1, R/2] per table
        k_caches, v_caches = list(kv_cache.k), list(kv_cache.v)
        tapped = {}
        for i, layer in enumerate(self.layers):
            if i in taps:
                tapped[i] = h
            with jax.named_scope(f"layer_{i}"):
                p = module_weights(layer)
                if (kv_scale := layer_kv_scale(layer)) is not None:  # a quantized cache's
                    p["kv_scale"] = kv_scale
                if lora is not None:
                    p["lora"] = (lora.layers[i], lora.onehot, lora.active)
                rope = ropes[layer.rope]
                if layer_impl is None:
                    h, k_caches[i], v_caches[i] = self._layer(layer, p, h, rope, k_caches[i], v_caches[i], md)
                else:
                    h, k_caches[i], v_caches[i] = layer_impl(self, p, h, rope, k_caches[i], v_caches[i], md)
        tapped[len(self.layers)] = h
        with jax.named_scope("final_norm"):
            h = self.norm(h, self.final_norm[...])
        kv_cache = KVCache(k=tuple(k_caches), v=tuple(v_caches))
        if taps:
            return h, kv_cache, jnp.concatenate([tapped[i].astype(jnp.float32) for i in taps], axis=-1)
        return h, kv_cache

    def embed_tokens(self, input_ids: jax.Array) -> jax.Array:
        return embedding_lookup(param_weight(self, "embed"), input_ids)

    def norm(self, x: jax.Array, w: jax.Array) -> jax.Array:
        return rms_norm(x, w, self.config.rms_norm_eps)

    def _layer(self, layer, p, h, rope, k_cache, v_cache, md):
        with jax.named_scope("attention"):
            x = self.norm(h, p["input_norm"])  # [T, E]
            attn, k_cache, v_cache = self.attention(layer, p, x, rope, k_cache, v_cache, md)
            h = h + attn
        with jax.named_scope("mlp"):
            h = h + self.mlp(layer, p, self.norm(h, p["post_norm"]))
        return h, k_cache, v_cache

    def attention(self, layer, p, x, rope, k_cache, v_cache, md):
        """Self-attention of normed x [T, E] over this layer's paged cache -> ([T, E] float32,
        k_cache, v_cache)."""
        cfg = self.config
        if "wqkv" in p:  # packed together for a CPU product kernel
            q, k, v = dense_group(LAYER_SPECS["wq"], x, p["wqkv"])
        else:
            q = dense(LAYER_SPECS["wq"], x, p["wq"])  # [T, Hq, D]
            k = dense(LAYER_SPECS["wk"], x, p["wk"])  # [T, Hkv, D]
            v = dense(LAYER_SPECS["wv"], x, p["wv"])
        q, k, v = (add_lora(p, n, LAYER_SPECS[n], x, y)
                   for n, y in (("wq", q), ("wk", k), ("wv", v)))
        if cfg.qkv_bias:
            q, k, v = q + p["bq"], k + p["bk"], v + p["bv"]
        if cfg.qk_norm:
            q = self.norm(q, p["q_norm"])
            k = self.norm(k, p["k_norm"])
        q = apply_rotary(q, *rope)
        k = apply_rotary(k, *rope)
        attn, k_cache, v_cache = paged_attention(
            q.astype(attention_dtype(k_cache.dtype, self.dtype)), k, v,
            k_cache, v_cache, md, layer.attn_spec, self.mesh, dict(self.rules),
            sinks=p.get("sinks"),  # a layer's attention-sink logits [Hq] (gpt-oss), or None
            kv_scale=p.get("kv_scale"),  # a quantized cache's scales [2, Hkv], or None
        )  # attn: [T, Hq, D]
        o = dense(LAYER_SPECS["wo"], attn, p["wo"])  # [T, E]
        o = add_lora(p, "wo", LAYER_SPECS["wo"], attn, o)
        if cfg.o_bias:
            o = o + p["bo"]
        return o, k_cache, v_cache

    def mlp(self, layer, p, x):
        """The SiLU-gated MLP of normed x [T, E] -> [T, E] float32."""
        cfg = self.config
        if "w_gate_up" in p:
            gate, up = dense_group(LAYER_SPECS["w_gate"], x, p["w_gate_up"])
        else:
            gate = dense(LAYER_SPECS["w_gate"], x, p["w_gate"])  # [T, F]
            up = dense(LAYER_SPECS["w_up"], x, p["w_up"])
        gate = add_lora(p, "w_gate", LAYER_SPECS["w_gate"], x, gate)
        up = add_lora(p, "w_up", LAYER_SPECS["w_up"], x, up)
        if cfg.mlp_bias:
            gate, up = gate + p["b_gate"], up + p["b_up"]
        act = jax.nn.silu(gate) * up
        down = dense(LAYER_SPECS["w_down"], act, p["w_down"])  # [T, E]
        down = add_lora(p, "w_down", LAYER_SPECS["w_down"], act, down)
        if cfg.mlp_bias:
            down = down + p["b_down"]
        return down

    def compute_logits(self, hidden: jax.Array) -> jax.Array:
        """hidden: [N, E] (after the final norm) -> float32 logits [N, V]."""
        with jax.named_scope("lm_head"):
            head = param_weight(self, "lm_head")  # a tied model has one only when packed
            if head is not None:
                return dense(HEAD_SPECS[0], hidden, head)
            return dense(HEAD_SPECS[1], hidden, param_weight(self, "embed"))

    # ------------------------------------------------------------------ weights
    @classmethod
    def hf_weight_map(cls, cfg: ArchConfig) -> dict[str, Callable[[TensorGetter], np.ndarray]]:
        """Our parameter path ("layers.3.wq") -> a function building it from HF tensors."""
        return llama_weight_map(cfg)


def llama_weight_map(cfg: ArchConfig) -> dict[str, Callable[[TensorGetter], np.ndarray]]:
    E, Hq, Hkv, D = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    ident = lambda w: w
    # HF Linear weights are [out, in].
    heads_in = lambda H: (lambda w: w.T.reshape(E, H, D))
    heads_b = lambda H: (lambda b: b.reshape(H, D))
    transpose = lambda w: w.T
    # Our per-layer parameter name -> (HF name inside "model.layers.{i}.", conversion).
    per_layer: dict[str, tuple[str, Callable[[np.ndarray], np.ndarray]]] = {
        "input_norm": ("input_layernorm.weight", ident),
        "post_norm": ("post_attention_layernorm.weight", ident),
        "wq": ("self_attn.q_proj.weight", heads_in(Hq)),
        "wk": ("self_attn.k_proj.weight", heads_in(Hkv)),
        "wv": ("self_attn.v_proj.weight", heads_in(Hkv)),
        "wo": ("self_attn.o_proj.weight", lambda w: w.T.reshape(Hq, D, E)),  # [E, Hq*D] -> [Hq, D, E]
        "w_gate": ("mlp.gate_proj.weight", transpose),
        "w_up": ("mlp.up_proj.weight", transpose),
        "w_down": ("mlp.down_proj.weight", transpose),
    }
    if cfg.qkv_bias:
        per_layer["bq"] = ("self_attn.q_proj.bias", heads_b(Hq))
        per_layer["bk"] = ("self_attn.k_proj.bias", heads_b(Hkv))
        per_layer["bv"] = ("self_attn.v_proj.bias", heads_b(Hkv))
    if cfg.o_bias:
        per_layer["bo"] = ("self_attn.o_proj.bias", ident)
    if cfg.qk_norm:
        per_layer["q_norm"] = ("self_attn.q_norm.weight", ident)
        per_layer["k_norm"] = ("self_attn.k_norm.weight", ident)
    if cfg.mlp_bias:
        per_layer["b_gate"] = ("mlp.gate_proj.bias", ident)
        per_layer["b_up"] = ("mlp.up_proj.bias", ident)
        per_layer["b_down"] = ("mlp.down_proj.bias", ident)

    def from_hf(hf_name: str, fn: Callable[[np.ndarray], np.ndarray]):
        return lambda get: fn(get(hf_name))

    m: dict[str, Callable[[TensorGetter], np.ndarray]] = {
        "embed": from_hf("model.embed_tokens.weight", ident),
        "final_norm": from_hf("model.norm.weight", ident),
    }
    for i in range(cfg.num_layers):
        for ours, (theirs, fn) in per_layer.items():
            m[f"layers.{i}.{ours}"] = from_hf(f"model.layers.{i}.{theirs}", fn)
    if not cfg.tie_word_embeddings:
        m["lm_head"] = from_hf("lm_head.weight", transpose)
    return m
