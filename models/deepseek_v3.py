"""DeepSeek V3 (`DeepseekV3ForCausalLM`, transformers' `deepseek_v3`; V2-Lite's shapes with
`q_lora_rank` None): multi-head latent attention (MLA) and a mixture of experts with shared
experts and group-limited routing.

Attention (per layer; H heads, C = kv_lora_rank, Dn/Dr = qk_nope/qk_rope_head_dim, Dv =
v_head_dim):

- queries: x -> q_a_proj -> RMSNorm (epsilon 1e-6, not the config's) -> q_b_proj (or one q_proj when q_lora_rank is None),
  [T, H, Dn + Dr], split into q_nope and q_rope;
- keys and values come from one projection, kv_a_proj_with_mqa: x -> [C + Dr]; its first C
  columns RMS-normed are the latent c, the last Dr the key part k_rope shared by every head.
  transformers expands them per head through kv_b_proj ([H, Dn + Dv, C]: W_UK, W_UV):
  k_h = [W_UK_h c, k_rope], v_h = W_UV_h c;
- RoPE on the rope parts only (YaRN with mscale / mscale_all_dim in V3). With
  `rope_interleave` (V3's default) the checkpoint's rotary dims are in pairs (x0, x1), (x2,
  x3), ..., which transformers rotates and writes back de-interleaved (evens, then odds);
  here the weights' rotary rows are permuted at load (`_deinterleave`) and the usual
  rotate-half RoPE applied, which gives the same scores;
- the scores scale is (Dn + Dr) ** -0.5 times YaRN's mscale(factor, mscale_all_dim) squared.

What the paged cache holds, and how attention reads it: one row per token per layer, [c,
rope(k_rope)] (C + Dr = 576 in V3), not per-head K and V. Absorbed (decode, and the cached
context): q_nope_h W_UK_h is a C-wide query, so [q_nope_h W_UK_h, rope(q_rope_h)] scores
against the rows as multi-query attention with one 576-wide head
(pallas_kernels/mla_paged_attention); the value is the rows' first C columns, and each head's
output is mapped by W_UV_h, then o_proj. A step whose requests have long chunks attends to its
own rows expanded per head instead (keys Dn + Dr = 192 wide, values Dv), merged with the
absorbed context by log-sum-exp; models/layers/mla.py's `mla_attention` chooses per step
shape.

The MLP: dense in the first `first_k_dense_replace` layers; then `n_routed_experts` routed
experts (layers/moe.py's grouped products) plus `n_shared_experts` always-on experts, one MLP
of that many times the expert width. Routing (`noaux_tc`, `route_noaux_tc`): sigmoid scores;
the scores plus `e_score_correction_bias` choose (the bias only chooses): the experts in
`n_group` groups, the `topk_group` groups with the largest sum of their two best biased
scores eligible, the top-k of those; the weights are the unbiased scores of the chosen,
renormalised (norm_topk_prob), times routed_scaling_factor.

Multi-token prediction: a checkpoint stores `num_nextn_predict_layers` MTP layers after the
decoder layers (`model.layers.{num_hidden_layers + k}.*`: enorm, hnorm, eh_proj,
shared_head.norm and a full decoder layer). They are loaded and kept on the model (`mtp`) but
not run by the forward pass: with speculative_config method "deepseek_mtp" the drafting step
runs the first (`DeepseekV3MtpLayer.paged_step`) on the forward's output, the final hidden
state; their embedding and output head are the model's own (DeepSeek shares them; the copies
a checkpoint stores are not read).

A quantized KV cache (`--kv-cache-dtype fp8` or int8) holds the rows as one-byte pages with two
scales per layer, the latent columns' and the roped ones' (models/layers/mla.py,
runner/kv_scales.py).

Not served: int8 / FP8 weights (V3's hub checkpoint is blockwise FP8: the float conversion
loads), LoRA, DeepSeek V2's own architecture (softmax routing).
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
from jaxserve.models.interface import AttentionMetadata, KVCache
from jaxserve.models.layers.attention import AttentionSpec, layer_kv_scale
from jaxserve.models.layers.linear import dense, module_weights
from jaxserve.models.layers.mla import mla_attention
from jaxserve.models.layers.norm import rms_norm
from jaxserve.models.layers.moe import check_impl as check_moe_impl
from jaxserve.models.layers.moe import moe_mlp
from jaxserve.models.layers.rotary import apply_rotary, layer_rope_spec, rope_tables
from jaxserve.models.llama import HEAD_SPECS, LlamaForCausalLM, TensorGetter, _param, rope_for_step
from jaxserve.models.moe import ROUTER_SPEC
from jaxserve.models.sharding import logical_to_spec, mesh_axes_size

# The `dense` spec of each decoder-layer product (the ones of a plain [in, out] matrix and of
# the per-head q and o products are Llama's, so a backend's product kernel packs them).
MLA_SPECS = {
    "wq": "te,ehd->thd", "wq_a": "te,ef->tf", "wq_b": "te,ehd->thd", "wkv_a": "te,ef->tf",
    "wo": "thd,hde->te",
    "w_gate": "te,ef->tf", "w_up": "te,ef->tf", "w_down": "tf,fe->te",
    "s_gate": "te,ef->tf", "s_up": "te,ef->tf", "s_down": "tf,fe->te",
}
# The epsilon of the RMSNorms inside attention (q_a_layernorm, kv_a_layernorm): transformers'
# and DeepSeek's default, not the config's rms_norm_eps.
LORA_NORM_EPS = 1e-6
# The MTP layer's joint projection of [normed embedding, normed hidden] [T, 2E] -> [T, E].
MTP_SPEC = "ta,ae->te"


def yarn_mscale(scale: float, m: float) -> float:
    return 1.0 if scale <= 1 else 0.1 * m * float(np.log(scale)) + 1.0


def softmax_scale(cfg: ArchConfig) -> float:
    """(qk_nope + qk_rope) ** -0.5, times YaRN's mscale(factor, mscale_all_dim) squared (the
    DeepSeek reference and transformers' `yarn_apply_mscale`)."""
    scale = (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim) ** -0.5
    rs = cfg.rope_scaling
    if rs.rope_type != "default" and rs.mscale_all_dim:
        m = yarn_mscale(rs.factor, rs.mscale_all_dim)
        scale *= m * m
    return scale


def route_noaux_tc(logits: jax.Array, bias: jax.Array, *, top_k: int, n_group: int,
                   topk_group: int, normalize: bool, scaling: float
                   ) -> tuple[jax.Array, jax.Array]:
    """DeepSeek V3's routing of router logits [T, X] -> (weights [T, k] float32, expert ids
    [T, k] int32); see the module docstring."""
    T, X = logits.shape
    scores = jax.nn.sigmoid(logits.astype(jnp.float32))
    choice = scores + bias.astype(jnp.float32)
    groups = choice.reshape(T, n_group, X // n_group)
    group_scores = jnp.sum(jax.lax.top_k(groups, 2)[0], axis=-1)  # [T, G]
    _, best = jax.lax.top_k(group_scores, topk_group)
    eligible = jnp.zeros((T, n_group), bool).at[jnp.arange(T)[:, None], best].set(True)
    eligible = jnp.repeat(eligible, X // n_group, axis=1)
    _, ids = jax.lax.top_k(jnp.where(eligible, choice, -jnp.inf), top_k)
    weights = jnp.take_along_axis(scores, ids, axis=1)
    if normalize:
        weights = weights / (jnp.sum(weights, axis=-1, keepdims=True) + 1e-20)
    return weights * np.float32(scaling), ids.astype(jnp.int32)


class DeepseekV3DecoderLayer(nnx.Module):
    """One layer's weights: MLA's projections (the key/value up-projection kept as the two
    absorbed halves `w_uk` [H, Dn, C], `w_uv` [H, C, Dv]), then a dense MLP or the routed and
    shared experts."""

    def __init__(self, cfg: ArchConfig, dtype, rngs: nnx.Rngs | None, *, moe: bool,
                 attn_spec: AttentionSpec, rope, mesh, rules):
        self.attn_spec = attn_spec
        self.rope = rope
        self.is_moe = moe
        self.expert_axis = self.mlp_axis = None
        E, H, C = cfg.hidden_size, cfg.num_heads, cfg.kv_lora_rank
        Dn, Dr, Dv = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        Q = cfg.q_lora_rank
        s = 0.04
        p = lambda shape, axes, **kw: _param(rngs, shape, axes, dtype, s, **kw)
        self.input_norm = p((E,), (ax.EMBED,), ones=True)
        self.post_norm = p((E,), (ax.EMBED,), ones=True)
        if Q is None:
            self.wq = p((E, H, Dn + Dr), (ax.EMBED, ax.Q_HEADS, ax.HEAD_DIM))
        else:
            self.wq_a = p((E, Q), (ax.EMBED, None))
            self.q_a_norm = p((Q,), (None,), ones=True)
            self.wq_b = p((Q, H, Dn + Dr), (None, ax.Q_HEADS, ax.HEAD_DIM))
        self.wkv_a = p((E, C + Dr), (ax.EMBED, None))
        self.kv_a_norm = p((C,), (None,), ones=True)
        self.w_uk = p((H, Dn, C), (ax.Q_HEADS, ax.HEAD_DIM, None))
        self.w_uv = p((H, C, Dv), (ax.Q_HEADS, None, ax.HEAD_DIM))
        self.wo = p((H, Dv, E), (ax.Q_HEADS, ax.HEAD_DIM, ax.EMBED))
        if cfg.o_bias:  # attention_bias: q_a_proj, kv_a_proj_with_mqa and o_proj
            if Q is not None:
                self.bq_a = p((Q,), (None,))
            self.bkv_a = p((C + Dr,), (None,))
            self.bo = p((E,), (ax.EMBED,))
        if not moe:
            F = cfg.intermediate_size
            self.w_gate = p((E, F), (ax.EMBED, ax.MLP))
            self.w_up = p((E, F), (ax.EMBED, ax.MLP))
            self.w_down = p((F, E), (ax.MLP, ax.EMBED))
            return
        X, F = cfg.num_experts, cfg.moe_intermediate_size
        # the router in float32 whatever the model's dtype (as the checkpoints keep it)
        self.router = _param(rngs, (E, X), (ax.EMBED, None), jnp.float32, s)
        self.e_bias = _param(rngs, (X,), (None,), jnp.float32, 0.1)
        up_axes, down_axes = (ax.EXPERT, ax.EMBED, ax.MLP), (ax.EXPERT, ax.MLP, ax.EMBED)
        self.x_gate = p((X, E, F), up_axes)
        self.x_up = p((X, E, F), up_axes)
        self.x_down = p((X, F, E), down_axes)
        if cfg.n_shared_experts:
            Fs = F * cfg.n_shared_experts
            self.s_gate = p((E, Fs), (ax.EMBED, ax.MLP))
            self.s_up = p((E, Fs), (ax.EMBED, ax.MLP))
            self.s_down = p((Fs, E), (ax.MLP, ax.EMBED))
        if mesh is not None:  # as MoeDecoderLayer: the mesh axes the experts split over
            spec = logical_to_spec(up_axes, (X, E, F), mesh, rules)
            split = [a if a is not None and mesh_axes_size(mesh, a) > 1 else None for a in spec]
            self.expert_axis, self.mlp_axis = split[0], split[2]


class DeepseekV3MtpLayer(nnx.Module):
    """One multi-token prediction layer: the norms of the next token's embedding (`enorm`) and
    of the main model's hidden state (`hnorm`), their joint projection `eh_proj` [2E, E], a
    decoder layer (`block`) and its output norm (`final_norm`, the checkpoint's
    shared_head.norm). Not run by the model's forward: the drafting step runs it
    (`paged_step`, `logits`; jaxserve/runner/draft_head_step.py `MtpHead`).

    At position p it reads the hidden state h the model computed there (after the model's
    final norm: what the LM head reads, as vLLM passes it) and the embedding of the token at
    p + 1 (zeroed at position 0, as vLLM does): x = eh_proj([enorm(embed), hnorm(h)]), the
    decoder layer over x at position p (its own latent rows in its own paged cache), and its
    output out predicts the token at p + 2 through lm_head(final_norm(out)). A chained draft
    takes out as its h (vLLM's: the output before the norm)."""

    def __init__(self, cfg: ArchConfig, dtype, rngs: nnx.Rngs | None, *, attn_spec, rope, mesh,
                 rules):
        E = cfg.hidden_size
        p = lambda shape, axes, **kw: _param(rngs, shape, axes, dtype, 0.04, **kw)
        self.enorm = p((E,), (ax.EMBED,), ones=True)
        self.hnorm = p((E,), (ax.EMBED,), ones=True)
        self.eh_proj = p((2 * E, E), (None, ax.EMBED))
        self.final_norm = p((E,), (ax.EMBED,), ones=True)
        self.block = DeepseekV3DecoderLayer(cfg, dtype, rngs, moe=cfg.num_experts > 0,
                                            attn_spec=attn_spec, rope=rope, mesh=mesh,
                                            rules=rules)

    def paged_step(self, model, input_ids: jax.Array, positions: jax.Array, hidden: jax.Array,
                   cache: jax.Array, md: AttentionMetadata) -> tuple[jax.Array, jax.Array]:
        """The layer over a flat ragged batch described by `md` (`model`: the DeepSeek model
        whose embedding, attention and MLP code it uses): `input_ids` [T] the next tokens,
        `hidden` [T, E] the model's (or the previous chained pass's) hidden states, `cache`
        its one layer of latent rows. Returns (the layer's output [T, E], cache)."""
        embeds = model.embed_tokens(input_ids)
        embeds = jnp.where((positions == 0)[:, None], jnp.zeros_like(embeds), embeds)
        x = jnp.concatenate([model.norm(embeds, self.enorm[...]),
                             model.norm(hidden, self.hnorm[...])], axis=-1)
        h = dense(MTP_SPEC, x, self.eh_proj[...])
        layer = self.block
        p = module_weights(layer)
        rope = rope_tables(layer.rope, positions, md)
        attn, cache = model.attention(layer, p, model.norm(h, p["input_norm"]), rope, cache, md)
        h = h + attn
        return h + model.mlp(layer, p, model.norm(h, p["post_norm"])), cache

    def logits(self, model, out: jax.Array) -> jax.Array:
        """The layer's outputs [N, E] -> float32 logits [N, V] (the model's LM head)."""
        return model.compute_logits(model.norm(out, self.final_norm[...]))


class DeepseekV3ForCausalLM(LlamaForCausalLM):
    product_specs = (MLA_SPECS, {}, HEAD_SPECS)
    layer_class = DeepseekV3DecoderLayer
    supports_lora = False  # the adapters' targets are Llama's projections

    def __init__(self, config: ArchConfig, *, moe_impl: str = "ragged", **kw):
        if kw.get("quantization") is not None or config.weight_format is not None:
            raise ValueError("DeepseekV3ForCausalLM serves float weights only (no --quantization, "
                             "no quantized checkpoint); convert the checkpoint to bfloat16")
        super().__init__(config, moe_impl=moe_impl, **kw)
        self.moe_impl = check_moe_impl(moe_impl)
        cfg, rngs, dtype = config, kw.get("rngs"), kw.get("dtype", jnp.float32)
        self.attn_spec = self.layers[0].attn_spec
        self.mtp = nnx.List([
            DeepseekV3MtpLayer(cfg, dtype, rngs, attn_spec=self.attn_spec,
                               rope=layer_rope_spec(cfg, 0), mesh=kw.get("mesh"),
                               rules=dict(self.rules))
            for _ in range(cfg.num_mtp_layers)])

    @staticmethod
    def features(cfg: ArchConfig, quantization: str | None) -> frozenset[str]:
        out = {features.RMS_NORM, features.ROPE, features.MLA, features.SILU_GLU,
               features.ATTN_SCALE}
        if cfg.num_experts:
            out.add(features.MOE)
        return frozenset(out)

    def make_layer(self, cfg, i, dtype, rngs, spec, quantization, mesh, rules):
        spec = AttentionSpec(sm_scale=softmax_scale(cfg), impl=spec.impl)
        return DeepseekV3DecoderLayer(cfg, dtype, rngs, moe=cfg.is_moe_layer(i), attn_spec=spec,
                                      rope=layer_rope_spec(cfg, i), mesh=mesh, rules=dict(rules))

    # ------------------------------------------------------------------ forward
    def __call__(self, input_ids: jax.Array, positions: jax.Array, kv_cache: KVCache,
                 md: AttentionMetadata, layer_impl=None, lora=None) -> tuple[jax.Array, KVCache]:
        """As LlamaForCausalLM's, each layer writing and reading its array of latent rows
        (`kv_cache.k`; there are no V arrays)."""
        if layer_impl is not None or lora is not None:
            raise ValueError("DeepseekV3ForCausalLM runs its own decoder layers, without LoRA")
        with jax.named_scope("embed"):
            h = self.embed_tokens(input_ids)
        ropes = rope_for_step(self.layers, positions, md)
        caches = list(kv_cache.k)
        for i, layer in enumerate(self.layers):
            with jax.named_scope(f"layer_{i}"):
                p = module_weights(layer)
                if (kv_scale := layer_kv_scale(layer)) is not None:  # a quantized cache's
                    p["kv_scale"] = kv_scale
                with jax.named_scope("attention"):
                    attn, caches[i] = self.attention(layer, p, self.norm(h, p["input_norm"]),
                                                     ropes[layer.rope], caches[i], md)
                    h = h + attn
                with jax.named_scope("mlp"):
                    h = h + self.mlp(layer, p, self.norm(h, p["post_norm"]))
        with jax.named_scope("final_norm"):
            h = self.norm(h, self.final_norm[...])
        return h, KVCache(k=tuple(caches), v=())

    def attention(self, layer, p, x, rope, cache, md):
        """MLA of normed x [T, E] over this layer's latent rows -> ([T, E] float32, cache)."""
        cfg = self.config
        C, Dn = cfg.kv_lora_rank, cfg.qk_nope_head_dim
        if cfg.q_lora_rank is None:
            q = dense(MLA_SPECS["wq"], x, p["wq"])  # [T, H, Dn + Dr]
        else:
            qa = dense(MLA_SPECS["wq_a"], x, p["wq_a"])
            if "bq_a" in p:
                qa = qa + p["bq_a"]
            q = dense(MLA_SPECS["wq_b"], rms_norm(qa, p["q_a_norm"], LORA_NORM_EPS), p["wq_b"])
        kv = dense(MLA_SPECS["wkv_a"], x, p["wkv_a"])  # [T, C + Dr]
        if "bkv_a" in p:
            kv = kv + p["bkv_a"]
        latent = rms_norm(kv[:, :C], p["kv_a_norm"], LORA_NORM_EPS)  # [T, C]
        k_rope = apply_rotary(kv[:, None, C:], *rope)[:, 0]  # [T, Dr]
        q_rope = apply_rotary(q[..., Dn:], *rope)  # [T, H, Dr]
        v, cache = mla_attention(q[..., :Dn], q_rope, latent, k_rope, cache, md, layer.attn_spec,
                                 p["w_uk"], p["w_uv"], self.mesh, dict(self.rules),
                                 kv_scale=p.get("kv_scale"))  # [T, H, Dv]
        o = dense(MLA_SPECS["wo"], v, p["wo"])
        if "bo" in p:
            o = o + p["bo"]
        return o, cache

    def mlp(self, layer, p, x):
        """The dense MLP, or the routed experts plus the shared ones, on normed x [T, E]."""
        if not layer.is_moe:
            return _glu(p, x, "w_")
        cfg = self.config
        logits = dense(ROUTER_SPEC, x.astype(jnp.float32), p["router"])
        routing = route_noaux_tc(logits, p["e_bias"], top_k=cfg.num_experts_per_tok,
                                 n_group=cfg.n_group, topk_group=cfg.topk_group,
                                 normalize=cfg.norm_topk_prob, scaling=cfg.routed_scaling_factor)
        mesh = self.mesh if self.mesh is not None and self.mesh.size > 1 else None
        y = moe_mlp(x, None, p["x_gate"], p["x_up"], p["x_down"], top_k=cfg.num_experts_per_tok,
                    normalize=cfg.norm_topk_prob, impl=self.moe_impl, mesh=mesh,
                    expert_axis=layer.expert_axis, mlp_axis=layer.mlp_axis, routing=routing)
        if cfg.n_shared_experts:
            y = y + _glu(p, x, "s_")
        return y

    # ------------------------------------------------------------------ weights
    @classmethod
    def hf_weight_map(cls, cfg: ArchConfig) -> dict[str, Callable[[TensorGetter], np.ndarray]]:
        return deepseek_v3_weight_map(cfg)


def _glu(p, x, prefix: str) -> jax.Array:
    gate = dense(MLA_SPECS["w_gate"], x, p[prefix + "gate"])
    up = dense(MLA_SPECS["w_up"], x, p[prefix + "up"])
    return dense(MLA_SPECS["w_down"], jax.nn.silu(gate) * up, p[prefix + "down"])


def _deinterleave(n: int) -> np.ndarray:
    """The order taking interleaved rotary pairs (x0, x1), (x2, x3), ... to rotate-half's
    layout (evens, then odds)."""
    return np.concatenate([np.arange(0, n, 2), np.arange(1, n, 2)])


def deepseek_v3_weight_map(cfg: ArchConfig) -> dict[str, Callable[[TensorGetter], np.ndarray]]:
    """Our parameter path -> its builder from a DeepSeek V3 checkpoint's tensors (the hub's
    per-expert tensors or transformers 5's stacked ones), the MTP layers' included."""
    E, H, C = cfg.hidden_size, cfg.num_heads, cfg.kv_lora_rank
    Dn, Dr, Dv = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
    X, F = cfg.num_experts, cfg.moe_intermediate_size
    rope_order = _deinterleave(Dr) if cfg.rope_interleave else np.arange(Dr)

    def get(name: str, fn=lambda w: w):
        return lambda g: fn(np.asarray(g(name)))

    def q_heads(w):  # [H * (Dn + Dr), in] -> [in, H, Dn + Dr], rotary rows de-interleaved
        w = w.reshape(H, Dn + Dr, -1)
        w = np.concatenate([w[:, :Dn], w[:, Dn:][:, rope_order]], axis=1)
        return np.ascontiguousarray(np.transpose(w, (2, 0, 1)))

    kv_rows = np.concatenate([np.arange(C), C + rope_order])

    def experts(pre: str, which: str):
        def build(g):
            try:  # the hub's per-expert [out, in] tensors
                name = {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}[which]
                return np.stack([np.asarray(g(f"{pre}experts.{j}.{name}.weight")).T
                                 for j in range(X)])
            except KeyError:  # transformers 5's stacked tensors
                if which == "down":
                    return np.swapaxes(np.asarray(g(f"{pre}experts.down_proj")), 1, 2)
                gu = np.asarray(g(f"{pre}experts.gate_up_proj"))  # [X, 2F, E], gate first
                return np.swapaxes(gu[:, :F] if which == "gate" else gu[:, F:], 1, 2)
        return build

    def layer(pre: str, ours: str, moe: bool) -> dict:
        a = pre + "self_attn."
        m = {
            "input_norm": get(pre + "input_layernorm.weight"),
            "post_norm": get(pre + "post_attention_layernorm.weight"),
            "wkv_a": get(a + "kv_a_proj_with_mqa.weight", lambda w: w[kv_rows].T),
            "kv_a_norm": get(a + "kv_a_layernorm.weight"),
            "w_uk": get(a + "kv_b_proj.weight", lambda w: w.reshape(H, Dn + Dv, C)[:, :Dn]),
            "w_uv": get(a + "kv_b_proj.weight",
                        lambda w: np.transpose(w.reshape(H, Dn + Dv, C)[:, Dn:], (0, 2, 1))),
            "wo": get(a + "o_proj.weight", lambda w: w.T.reshape(H, Dv, E)),
        }
        if cfg.q_lora_rank is None:
            m["wq"] = get(a + "q_proj.weight", q_heads)
        else:
            m["wq_a"] = get(a + "q_a_proj.weight", lambda w: w.T)
            m["q_a_norm"] = get(a + "q_a_layernorm.weight")
            m["wq_b"] = get(a + "q_b_proj.weight", q_heads)
        if cfg.o_bias:
            if cfg.q_lora_rank is not None:
                m["bq_a"] = get(a + "q_a_proj.bias")
            m["bkv_a"] = get(a + "kv_a_proj_with_mqa.bias", lambda b: b[kv_rows])
            m["bo"] = get(a + "o_proj.bias")
        mlp = pre + "mlp."
        if not moe:
            for ours_name, theirs in (("w_gate", "gate_proj"), ("w_up", "up_proj"),
                                      ("w_down", "down_proj")):
                m[ours_name] = get(f"{mlp}{theirs}.weight", lambda w: w.T)
        else:
            m["router"] = get(mlp + "gate.weight", lambda w: w.T)
            m["e_bias"] = get(mlp + "gate.e_score_correction_bias")
            for which in ("gate", "up", "down"):
                m["x_" + which] = experts(mlp, which)
            if cfg.n_shared_experts:
                for which in ("gate", "up", "down"):
                    m["s_" + which] = get(f"{mlp}shared_experts.{which}_proj.weight", lambda w: w.T)
        return {f"{ours}{k}": v for k, v in m.items()}

    out = {"embed": get("model.embed_tokens.weight"), "final_norm": get("model.norm.weight")}
    if not cfg.tie_word_embeddings:
        out["lm_head"] = get("lm_head.weight", lambda w: w.T)
    for i in range(cfg.num_layers):
        out.update(layer(f"model.layers.{i}.", f"layers.{i}.", cfg.is_moe_layer(i)))
    for k in range(cfg.num_mtp_layers):
        pre = f"model.layers.{cfg.num_layers + k}."
        out.update({
            f"mtp.{k}.enorm": get(pre + "enorm.weight"),
            f"mtp.{k}.hnorm": get(pre + "hnorm.weight"),
            f"mtp.{k}.eh_proj": get(pre + "eh_proj.weight", lambda w: w.T),
            f"mtp.{k}.final_norm": get(pre + "shared_head.norm.weight"),
        })
        out.update(layer(pre, f"mtp.{k}.block.", cfg.num_experts > 0))
    return out

