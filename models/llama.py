"""The Llama family: Llama 2/3/3.1, SmolLM2 (and the shared decoder the Qwen and Mistral
families reuse).

Per-layer weights are stacked along a leading `layers` axis and the decoder runs as one
`lax.scan`, so compile time does not grow with depth. The KV cache travels in the scan carry
and is updated in place.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from jaxserve.models import sharding as ax
from jaxserve.models.arch_config import ArchConfig
from jaxserve.models.interface import AttentionMetadata, KVCache
from jaxserve.models.layers.attention import AttentionSpec, paged_attention
from jaxserve.models.layers.linear import dense
from jaxserve.models.layers.norm import rms_norm
from jaxserve.models.layers.rotary import apply_rotary, inverse_frequencies

# A checkpoint tensor getter: HF tensor name -> numpy array.
TensorGetter = Callable[[str], np.ndarray]


def _param(rngs: nnx.Rngs | None, shape, axes, dtype, scale: float, ones: bool = False) -> nnx.Param:
    if ones:
        value = jnp.ones(shape, dtype)
        if rngs is not None:  # random but near one, so tests notice a missing norm
            value = value + 0.1 * jax.random.normal(rngs.params(), shape, dtype)
    else:
        value = scale * jax.random.normal(rngs.params(), shape, dtype) if rngs is not None else jnp.zeros(shape, dtype)
    return nnx.Param(value, logical_axes=axes)


class DecoderLayers(nnx.Module):
    """All decoder layers, each weight stacked over a leading [L] axis."""

    def __init__(self, cfg: ArchConfig, dtype, rngs: nnx.Rngs | None):
        L, E, F = cfg.num_layers, cfg.hidden_size, cfg.intermediate_size
        Hq, Hkv, D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        s = 0.02 * 2
        p = lambda shape, axes, **kw: _param(rngs, shape, axes, dtype, s, **kw)  # noqa: E731
        self.input_norm = p((L, E), (ax.LAYERS, ax.EMBED), ones=True)
        self.wq = p((L, E, Hq, D), (ax.LAYERS, ax.EMBED, ax.Q_HEADS, ax.HEAD_DIM))
        self.wk = p((L, E, Hkv, D), (ax.LAYERS, ax.EMBED, ax.KV_HEADS, ax.HEAD_DIM))
        self.wv = p((L, E, Hkv, D), (ax.LAYERS, ax.EMBED, ax.KV_HEADS, ax.HEAD_DIM))
        self.wo = p((L, Hq, D, E), (ax.LAYERS, ax.Q_HEADS, ax.HEAD_DIM, ax.EMBED))
        if cfg.qkv_bias:
            self.bq = p((L, Hq, D), (ax.LAYERS, ax.Q_HEADS, ax.HEAD_DIM))
            self.bk = p((L, Hkv, D), (ax.LAYERS, ax.KV_HEADS, ax.HEAD_DIM))
            self.bv = p((L, Hkv, D), (ax.LAYERS, ax.KV_HEADS, ax.HEAD_DIM))
        if cfg.o_bias:
            self.bo = p((L, E), (ax.LAYERS, ax.EMBED))
        if cfg.qk_norm:
            self.q_norm = p((L, D), (ax.LAYERS, ax.HEAD_DIM), ones=True)
            self.k_norm = p((L, D), (ax.LAYERS, ax.HEAD_DIM), ones=True)
        self.post_norm = p((L, E), (ax.LAYERS, ax.EMBED), ones=True)
        self.w_gate = p((L, E, F), (ax.LAYERS, ax.EMBED, ax.MLP))
        self.w_up = p((L, E, F), (ax.LAYERS, ax.EMBED, ax.MLP))
        self.w_down = p((L, F, E), (ax.LAYERS, ax.MLP, ax.EMBED))
        if cfg.mlp_bias:
            self.b_gate = p((L, F), (ax.LAYERS, ax.MLP))
            self.b_up = p((L, F), (ax.LAYERS, ax.MLP))
            self.b_down = p((L, E), (ax.LAYERS, ax.EMBED))


class LlamaForCausalLM(nnx.Module):
    """Decoder-only transformer on the paged runner contract (see models/interface.py)."""

    def __init__(
        self,
        config: ArchConfig,
        *,
        dtype=jnp.float32,
        rngs: nnx.Rngs | None = None,
        mesh: Mesh | None = None,
        attention_impl: str = "auto",
    ):
        cfg = config
        self.config = cfg
        self.dtype = dtype
        self.mesh = mesh
        self.attn_spec = AttentionSpec(
            sm_scale=cfg.head_dim**-0.5,
            sliding_window=cfg.sliding_window,
            impl=attention_impl,
        )
        V, E = cfg.vocab_size, cfg.hidden_size
        self.embed = _param(rngs, (V, E), (ax.VOCAB, ax.EMBED), dtype, 0.5)
        self.layers = DecoderLayers(cfg, dtype, rngs)
        self.final_norm = _param(rngs, (E,), (ax.EMBED,), dtype, 0.0, ones=True)
        if not cfg.tie_word_embeddings:
            self.lm_head = _param(rngs, (E, V), (ax.EMBED, ax.VOCAB), dtype, 0.05)

    # ------------------------------------------------------------------ forward
    def __call__(
        self,
        input_ids: jax.Array,  # [T] int32
        positions: jax.Array,  # [T] int32
        kv_cache: KVCache,
        md: AttentionMetadata,
    ) -> tuple[jax.Array, KVCache]:
        cfg = self.config
        with jax.named_scope("embed"):
            h = self.embed[...][input_ids].astype(jnp.float32)  # [T, E]
        layer_params = nnx.state(self.layers, nnx.Param)
        stacked = jax.tree.map(lambda v: v[...], layer_params, is_leaf=lambda x: isinstance(x, nnx.Variable))
        inv_freq = jnp.asarray(inverse_frequencies(cfg))  # [D/2], a compile-time constant

        def one_layer(carry, xs):
            h, k_cache, v_cache = carry
            p, layer = xs
            h, k_cache, v_cache = self._layer(p, layer, h, positions, inv_freq, k_cache, v_cache, md)
            return (h, k_cache, v_cache), None

        layer_ids = jnp.arange(cfg.num_layers, dtype=jnp.int32)
        (h, k_cache, v_cache), _ = jax.lax.scan(
            one_layer, (h, kv_cache.k, kv_cache.v), (stacked, layer_ids)
        )
        with jax.named_scope("final_norm"):
            h = rms_norm(h, self.final_norm[...], cfg.rms_norm_eps)
        return h, KVCache(k=k_cache, v=v_cache)

    def _layer(self, p, layer, h, positions, inv_freq, k_cache, v_cache, md):
        cfg = self.config
        with jax.named_scope("attention"):
            x = rms_norm(h, p["input_norm"], cfg.rms_norm_eps)  # [T, E]
            q = dense("te,ehd->thd", x, p["wq"])  # [T, Hq, D]
            k = dense("te,ehd->thd", x, p["wk"])  # [T, Hkv, D]
            v = dense("te,ehd->thd", x, p["wv"])
            if cfg.qkv_bias:
                q, k, v = q + p["bq"], k + p["bk"], v + p["bv"]
            if cfg.qk_norm:
                q = rms_norm(q, p["q_norm"], cfg.rms_norm_eps)
                k = rms_norm(k, p["k_norm"], cfg.rms_norm_eps)
            q = apply_rotary(q, positions, inv_freq)
            k = apply_rotary(k, positions, inv_freq)
            cache_dtype = k_cache.dtype
            attn, k_cache, v_cache = paged_attention(
                q.astype(cache_dtype), k.astype(cache_dtype), v.astype(cache_dtype),
                k_cache, v_cache, layer, md, self.attn_spec, self.mesh,
            )  # attn: [T, Hq, D]
            o = dense("thd,hde->te", attn, p["wo"])  # [T, E]
            if cfg.o_bias:
                o = o + p["bo"]
            h = h + o
        with jax.named_scope("mlp"):
            x = rms_norm(h, p["post_norm"], cfg.rms_norm_eps)
            gate = dense("te,ef->tf", x, p["w_gate"])  # [T, F]
            up = dense("te,ef->tf", x, p["w_up"])
            if cfg.mlp_bias:
                gate, up = gate + p["b_gate"], up + p["b_up"]
            down = dense("tf,fe->te", jax.nn.silu(gate) * up, p["w_down"])  # [T, E]
            if cfg.mlp_bias:
                down = down + p["b_down"]
            h = h + down
        return h, k_cache, v_cache

    def compute_logits(self, hidden: jax.Array) -> jax.Array:
        """hidden: [N, E] (after the final norm) -> float32 logits [N, V]."""
        with jax.named_scope("lm_head"):
            if self.config.tie_word_embeddings:
                return dense("ne,ve->nv", hidden, self.embed[...])
            return dense("ne,ev->nv", hidden, self.lm_head[...])

    # ------------------------------------------------------------------ weights
    @classmethod
    def hf_weight_map(cls, cfg: ArchConfig) -> dict[str, Callable[[TensorGetter], np.ndarray]]:
        """Our parameter path ("layers.wq") -> a function building it from HF tensors."""
        return llama_weight_map(cfg)


def _stack(get: TensorGetter, cfg: ArchConfig, name: str, fn: Callable[[np.ndarray], np.ndarray]):
    return np.stack([fn(get(f"model.layers.{i}.{name}")) for i in range(cfg.num_layers)])


def llama_weight_map(cfg: ArchConfig) -> dict[str, Callable[[TensorGetter], np.ndarray]]:
    E, Hq, Hkv, D = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    ident = lambda w: w  # noqa: E731
    # HF Linear weights are [out, in].
    heads_in = lambda H: (lambda w: w.T.reshape(E, H, D))  # noqa: E731  [H*D, E] -> [E, H, D]
    heads_b = lambda H: (lambda b: b.reshape(H, D))  # noqa: E731
    m: dict[str, Callable[[TensorGetter], np.ndarray]] = {
        "embed": lambda get: get("model.embed_tokens.weight"),
        "final_norm": lambda get: get("model.norm.weight"),
        "layers.input_norm": lambda get: _stack(get, cfg, "input_layernorm.weight", ident),
        "layers.post_norm": lambda get: _stack(get, cfg, "post_attention_layernorm.weight", ident),
        "layers.wq": lambda get: _stack(get, cfg, "self_attn.q_proj.weight", heads_in(Hq)),
        "layers.wk": lambda get: _stack(get, cfg, "self_attn.k_proj.weight", heads_in(Hkv)),
        "layers.wv": lambda get: _stack(get, cfg, "self_attn.v_proj.weight", heads_in(Hkv)),
        # o_proj: [E, Hq*D] -> [Hq, D, E]
        "layers.wo": lambda get: _stack(get, cfg, "self_attn.o_proj.weight", lambda w: w.T.reshape(Hq, D, E)),
        "layers.w_gate": lambda get: _stack(get, cfg, "mlp.gate_proj.weight", lambda w: w.T),
        "layers.w_up": lambda get: _stack(get, cfg, "mlp.up_proj.weight", lambda w: w.T),
        "layers.w_down": lambda get: _stack(get, cfg, "mlp.down_proj.weight", lambda w: w.T),
    }
    if cfg.qkv_bias:
        m["layers.bq"] = lambda get: _stack(get, cfg, "self_attn.q_proj.bias", heads_b(Hq))
        m["layers.bk"] = lambda get: _stack(get, cfg, "self_attn.k_proj.bias", heads_b(Hkv))
        m["layers.bv"] = lambda get: _stack(get, cfg, "self_attn.v_proj.bias", heads_b(Hkv))
    if cfg.o_bias:
        m["layers.bo"] = lambda get: _stack(get, cfg, "self_attn.o_proj.bias", ident)
    if cfg.qk_norm:
        m["layers.q_norm"] = lambda get: _stack(get, cfg, "self_attn.q_norm.weight", ident)
        m["layers.k_norm"] = lambda get: _stack(get, cfg, "self_attn.k_norm.weight", ident)
    if cfg.mlp_bias:
        m["layers.b_gate"] = lambda get: _stack(get, cfg, "mlp.gate_proj.bias", ident)
        m["layers.b_up"] = lambda get: _stack(get, cfg, "mlp.up_proj.bias", ident)
        m["layers.b_down"] = lambda get: _stack(get, cfg, "mlp.down_proj.bias", ident)
    if not cfg.tie_word_embeddings:
        m["lm_head"] = lambda get: get("lm_head.weight").T
    return m
