"""EAGLE-3 draft heads for Llama-family targets: the model, the config of its two checkpoint
layouts, and a draft step over a dense context or the drafter's own paged cache (loading one:
models/eagle3_checkpoint.py).

An EAGLE-3 drafter predicts the target's next tokens from the target's own hidden states:

- `fc` [A*H -> H] projects the concatenation of A (three) hidden states the target computed
  for a token (a low, a middle and a high layer: `aux_layer_ids`) to one H-wide hidden state;
- one decoder layer whose attention reads concat(input_norm(embedding of the input token),
  hidden_norm(hidden)), 2*H wide, so q/k/v project from 2*H; its residual is the hidden part
  (normed first with `norm_before_residual`), then the usual SiLU-gated MLP;
- a final norm and an `lm_head` over a reduced draft vocabulary of `draft_vocab_size` tokens,
  draft id d standing for target id d + d2t[d] (`t2d` marks the target ids that have one);
- the embedding table is the target's (checkpoints usually ship none; one they ship is used).

Drafting a chain: the first draft of a position takes `fc` of the target's taps there (with the
token the target just produced as input); each later draft takes the layer's own output for
the previous draft (before the final norm; after it with `norm_output`, EAGLE 3.1) and the
previous draft's token, one position further. A draft's attention sees the drafter's keys of
the context (the first-draft pass over the prompt and accepted tokens) and those of its own
chain's earlier drafts.

The layer is split where attention goes (`project_qkv`, `finish_layer`): `__call__` puts
`dense_attention` over a `DenseKV` context with an explicit mask between them, `paged_step`
the engine's paged attention (`layers.attention.paged_attention`) over the drafter's own
one-layer paged cache.

Checkpoint layouts (`Eagle3Config.from_hf`):

- `speculators` (the layout of the `speculators` library's trainer and converter, which vLLM
  reads): config.json with `"speculators_model_type":
  "eagle3"`, a `transformer_layer_config` (the layer's Llama config; its vocab_size is the
  target's), `draft_vocab_size`, optional `eagle_aux_hidden_state_layer_ids`,
  `norm_before_residual`, `norm_output`; tensors `fc.weight`, `layers.0.*`, `norm.weight`,
  `lm_head.weight`, `d2t`, `t2d`, optional `embed_tokens.weight`.
- the original EAGLE-3 repositories: config.json of a Llama with architectures
  ["LlamaForCausalLMEagle3"] and `draft_vocab_size` (its vocab_size the target's; the same
  optional keys); the same tensors, the layer's under `midlayer.*`.

What the drafter reads of the target is checked by `Eagle3Config.target_layer_ids` (hidden
size, vocabulary, layer ids); the target's side of the taps is `LlamaForCausalLM.__call__`'s
`taps` argument (models/llama.py).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from jaxserve.models import sharding as ax
from jaxserve.models.arch_config import ArchConfig
from jaxserve.models.interface import AttentionMetadata
from jaxserve.models.layers.attention import AttentionSpec, paged_attention
from jaxserve.models.layers.linear import dense, embedding_lookup
from jaxserve.models.layers.norm import rms_norm
from jaxserve.models.layers.rotary import RopeSpec, apply_rotary, layer_rope_spec, rope_tables
from jaxserve.models.llama import LAYER_SPECS, _param, attention_spec
from jaxserve.models.sharding import DEFAULT_RULES
from jaxserve.pallas_kernels.kv_quant import attention_dtype

SPECULATORS, ORIGINAL = "speculators", "eagle3"
# The original repositories' architecture names (vLLM accepts both).
ORIGINAL_ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")
# Each layout's prefix of the decoder layer's tensors.
LAYER_PREFIX = {SPECULATORS: "layers.0.", ORIGINAL: "midlayer."}
# transformers' LlamaConfig defaults, for a `transformer_layer_config` saved as a diff from them.
LLAMA_DEFAULTS = dict(vocab_size=32000, hidden_size=4096, intermediate_size=11008,
                      num_hidden_layers=32, num_attention_heads=32, rms_norm_eps=1e-6,
                      max_position_embeddings=2048)
# What an original EAGLE-3 config.json (a whole Llama config) must state.
ORIGINAL_REQUIRED = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads")
FC_SPEC = "ta,ae->te"
HEAD_SPEC = "te,ev->tv"


def default_aux_layer_ids(num_layers: int) -> tuple[int, int, int]:
    """The target layers an EAGLE-3 head reads when its config names none (vLLM's and
    speculators' default): (2, L // 2, L - 3). Layer id i is the hidden state entering target
    layer i (id L: the last layer's output, before the final norm)."""
    return 2, num_layers // 2, num_layers - 3


@dataclasses.dataclass(frozen=True)
class Eagle3Config:
    """An EAGLE-3 drafter: its decoder layer's config (`layer`: hidden size, heads, RoPE, norm
    eps; `layer.vocab_size` is the target's vocabulary), its draft vocabulary, the target layers
    it reads (None: `default_aux_layer_ids` of the target), its norm options, and the layout
    its checkpoint was written in."""

    layer: ArchConfig
    draft_vocab_size: int
    aux_layer_ids: tuple[int, ...] | None = None
    norm_before_residual: bool = False
    norm_output: bool = False
    layout: str = SPECULATORS

    @property
    def hidden_size(self) -> int:
        return self.layer.hidden_size

    @property
    def target_vocab_size(self) -> int:
        return self.layer.vocab_size

    @property
    def num_aux(self) -> int:
        return len(self.aux_layer_ids) if self.aux_layer_ids is not None else 3

    @property
    def reduced_vocab(self) -> bool:
        """Whether the draft vocabulary is a subset of the target's (d2t / t2d present)."""
        return self.draft_vocab_size != self.target_vocab_size

    @classmethod
    def from_hf(cls, hf: Mapping[str, Any]) -> Eagle3Config:
        """The drafter described by a config.json of either layout; ValueError naming what is
        missing or unsupported otherwise."""
        kind = hf.get("speculators_model_type")
        archs = list(hf.get("architectures") or [])
        if kind is not None:
            if kind != "eagle3":
                raise ValueError(f"this is a {kind!r} speculator checkpoint; only 'eagle3' "
                                 "drafters are supported")
            layer = hf.get("transformer_layer_config")
            if not isinstance(layer, dict):
                raise ValueError("the eagle3 speculator config.json has no "
                                 "transformer_layer_config object (the draft layer's Llama config)")
            layout, aux = SPECULATORS, hf.get("eagle_aux_hidden_state_layer_ids")
            for flag in ("norm_before_fc", "fc_norm"):
                if hf.get(flag):
                    raise ValueError(f"eagle3 drafters with {flag}=true are not supported")
        elif any(a in ORIGINAL_ARCHITECTURES for a in archs):
            layer, layout, aux = dict(hf), ORIGINAL, hf.get("eagle_aux_hidden_state_layer_ids")
        else:
            raise ValueError(
                f"not an EAGLE-3 drafter config (architectures {archs}): expected a speculators "
                "config (\"speculators_model_type\": \"eagle3\") or an original EAGLE-3 one "
                f"(architectures {list(ORIGINAL_ARCHITECTURES)})")
        model_type = layer.get("model_type", "llama")
        if model_type != "llama":
            raise ValueError(f"EAGLE-3 drafters with a {model_type!r} decoder layer are not "
                             "supported (only 'llama')")
        if layout == ORIGINAL:
            missing = [k for k in ORIGINAL_REQUIRED if k not in layer]
            if missing:
                raise ValueError(f"the EAGLE-3 config.json lacks {', '.join(missing)}")
        else:  # speculators saves the layer's config as its difference from LlamaConfig's defaults
            layer = {**LLAMA_DEFAULTS, **layer}
        layer_cfg = ArchConfig.from_hf({**layer, "architectures": ["LlamaForCausalLM"]})
        target_hidden = hf.get("target_hidden_size")
        if target_hidden is not None and int(target_hidden) != layer_cfg.hidden_size:
            raise ValueError(f"the drafter's target_hidden_size ({target_hidden}) differs from its "
                             f"hidden_size ({layer_cfg.hidden_size}); such drafters are not "
                             "supported")
        if layer_cfg.num_layers != 1:
            raise ValueError(f"EAGLE-3 drafters with {layer_cfg.num_layers} decoder layers are not "
                             "supported (only 1)")
        if layer_cfg.qkv_bias or layer_cfg.mlp_bias:
            raise ValueError("EAGLE-3 drafters with attention or MLP biases are not supported")
        draft_vocab = int(hf.get("draft_vocab_size") or layer_cfg.vocab_size)
        if not 0 < draft_vocab <= layer_cfg.vocab_size:
            raise ValueError(f"draft_vocab_size {draft_vocab} must be in [1, vocab_size "
                             f"{layer_cfg.vocab_size}]")
        if aux is not None and (not isinstance(aux, list) or not aux
                                or not all(isinstance(i, int) for i in aux)):
            raise ValueError("eagle_aux_hidden_state_layer_ids must be a list of layer ids; "
                             f"got {aux!r}")
        return cls(layer=layer_cfg, draft_vocab_size=draft_vocab,
                   aux_layer_ids=None if aux is None else tuple(aux),
                   norm_before_residual=bool(hf.get("norm_before_residual", False)),
                   norm_output=bool(hf.get("norm_output", False)), layout=layout)

    def with_kv_heads(self, kv_heads: int) -> Eagle3Config:
        """This drafter with its layer served with `kv_heads` KV heads (0: its checkpoint's):
        zero KV heads appended for lane-dense TPU pages as a target's are
        (`ArchConfig.with_kv_heads`; the loader pads the weights, `load_eagle3`)."""
        layer = self.layer.with_kv_heads(kv_heads) if kv_heads else self.layer.checkpoint_config()
        return dataclasses.replace(self, layer=layer)

    def target_layer_ids(self, target: ArchConfig) -> tuple[int, ...]:
        """The target layers this drafter reads, checked against `target` (ValueError naming
        the mismatch: hidden size, vocabulary, layer ids out of range)."""
        if target.hidden_size != self.hidden_size:
            raise ValueError(f"the EAGLE-3 drafter's hidden size ({self.hidden_size}) differs from "
                             f"the target's ({target.hidden_size})")
        if target.vocab_size != self.target_vocab_size:
            raise ValueError(f"the EAGLE-3 drafter's target vocabulary ({self.target_vocab_size}) "
                             f"differs from the target's vocab_size ({target.vocab_size})")
        ids = self.aux_layer_ids or default_aux_layer_ids(target.num_layers)
        if len(set(ids)) != len(ids) or min(ids) < 0 or max(ids) > target.num_layers:
            raise ValueError(f"the EAGLE-3 drafter reads target layers {list(ids)}, which must be "
                             f"distinct and within [0, {target.num_layers}] for this "
                             f"{target.num_layers}-layer target")
        return tuple(ids)


class VocabMap(nnx.Variable):
    """An integer or boolean lookup table of the drafter (d2t, t2d): not a trained weight."""


class Eagle3Layer(nnx.Module):
    """The drafter's decoder layer: Llama's, with q/k/v over the 2*H-wide concatenation of the
    normed input embedding and the normed hidden state (`hidden_norm`)."""

    def __init__(self, cfg: ArchConfig, dtype, rngs: nnx.Rngs | None, *, attn_spec: AttentionSpec,
                 rope: RopeSpec):
        self.attn_spec = attn_spec
        self.rope = rope
        E, F = cfg.hidden_size, cfg.intermediate_size
        Hq, Hkv, D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        p = lambda shape, axes, **kw: _param(rngs, shape, axes, dtype, 0.04, **kw)
        self.input_norm = p((E,), (ax.EMBED,), ones=True)
        self.hidden_norm = p((E,), (ax.EMBED,), ones=True)
        self.wq = p((2 * E, Hq, D), (None, ax.Q_HEADS, ax.HEAD_DIM))
        self.wk = p((2 * E, Hkv, D), (None, ax.KV_HEADS, ax.HEAD_DIM))
        self.wv = p((2 * E, Hkv, D), (None, ax.KV_HEADS, ax.HEAD_DIM))
        self.wo = p((Hq, D, E), (ax.Q_HEADS, ax.HEAD_DIM, ax.EMBED))
        self.post_norm = p((E,), (ax.EMBED,), ones=True)
        self.w_gate = p((E, F), (ax.EMBED, ax.MLP))
        self.w_up = p((E, F), (ax.EMBED, ax.MLP))
        self.w_down = p((F, E), (ax.MLP, ax.EMBED))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DenseKV:
    """The drafter's keys and values so far, dense (no pages): [S, Hkv, D] each, post-RoPE."""

    k: jax.Array
    v: jax.Array

    @classmethod
    def empty(cls, cfg: Eagle3Config, dtype=jnp.float32) -> DenseKV:
        shape = (0, cfg.layer.num_kv_heads, cfg.layer.head_dim)
        return cls(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype))

    def append(self, k: jax.Array, v: jax.Array) -> DenseKV:
        return DenseKV(jnp.concatenate([self.k, k.astype(self.k.dtype)]),
                       jnp.concatenate([self.v, v.astype(self.v.dtype)]))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DraftStep:
    """One draft per input token: `logits` [T, draft_vocab] float32, the argmax as a draft id
    (`draft_ids`) and as a target id (`target_ids`), and `hidden` [T, H], what the next draft
    of the chain takes as its hidden state."""

    logits: jax.Array
    draft_ids: jax.Array
    target_ids: jax.Array
    hidden: jax.Array


def dense_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array, sm_scale: float
                    ) -> jax.Array:
    """Softmax attention of q [T, Hq, D] over k, v [S, Hkv, D] (grouped query heads: head h
    reads KV head h // (Hq // Hkv)) where mask [T, S] allows -> float32 [T, Hq, D]."""
    T, Hq, D = q.shape
    Hkv = k.shape[1]
    qg = q.astype(jnp.float32).reshape(T, Hkv, Hq // Hkv, D)
    scores = jnp.einsum("tkgd,skd->kgts", qg, k.astype(jnp.float32)) * sm_scale
    scores = jnp.where(mask[None, None], scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1)
    out = jnp.einsum("kgts,skd->tkgd", probs, v.astype(jnp.float32))
    return out.reshape(T, Hq, D)


class Eagle3Drafter(nnx.Module):
    """An EAGLE-3 draft head (see the module docstring). Parameters: `embed` [V, H] (the
    target's table unless the checkpoint ships one), `fc` [A*H, H], `layer`, `final_norm`,
    `lm_head` [H, Vd]; lookup tables `d2t` int32 [Vd] and `t2d` bool [V]."""

    def __init__(self, config: Eagle3Config, *, dtype=jnp.float32, rngs: nnx.Rngs | None = None,
                 attention_impl: str = "auto"):
        cfg = config.layer
        self.config = config
        self.dtype = dtype
        E, V, Vd = cfg.hidden_size, cfg.vocab_size, config.draft_vocab_size
        self.embed = _param(rngs, (V, E), (ax.VOCAB, ax.EMBED), dtype, 0.5)
        self.fc = _param(rngs, (config.num_aux * E, E), (None, ax.EMBED), dtype, 0.05)
        self.layer = Eagle3Layer(cfg, dtype, rngs, attn_spec=attention_spec(cfg, 0, attention_impl),
                                 rope=layer_rope_spec(cfg, 0))
        self.final_norm = _param(rngs, (E,), (ax.EMBED,), dtype, 0.0, ones=True)
        self.lm_head = _param(rngs, (E, Vd), (ax.EMBED, ax.VOCAB), dtype, 0.05)
        # The identity mapping until loaded (a random drafter maps draft id d to target id d).
        self.d2t = VocabMap(jnp.zeros((Vd,), jnp.int32), logical_axes=(None,))
        self.t2d = VocabMap(jnp.arange(V) < Vd, logical_axes=(None,))

    # ------------------------------------------------------------------ pieces
    def combine_hidden(self, aux_hidden: jax.Array) -> jax.Array:
        """The target's taps of each token, concatenated [T, A*H] -> the hidden state its
        first draft takes, [T, H] float32."""
        return dense(FC_SPEC, aux_hidden, self.fc[...])

    def embed_tokens(self, input_ids: jax.Array) -> jax.Array:
        return embedding_lookup(self.embed[...], input_ids)

    def norm(self, x: jax.Array, w: nnx.Param) -> jax.Array:
        return rms_norm(x, w[...], self.config.layer.rms_norm_eps)

    def draft_vocab_embeddings(self) -> jax.Array:
        """The embedding rows of the draft vocabulary, [Vd, H] float32: row d is the target
        token d + d2t[d]'s (what `draft_embeddings` reads instead of the whole table)."""
        return self.embed_tokens(self.draft_to_target(jnp.arange(self.config.draft_vocab_size)))

    def draft_embeddings(self, rows: jax.Array, target_ids: jax.Array) -> jax.Array:
        """The embeddings [N, H] of tokens `target_ids` [N] that the head drafted (each is in the
        draft vocabulary), read from `rows` (`draft_vocab_embeddings`): equal to
        `embed_tokens(target_ids)` for such tokens."""
        targets = self.draft_to_target(jnp.arange(self.config.draft_vocab_size))
        return rows[jnp.argmax(target_ids[:, None] == targets[None], axis=1)]

    def project_qkv(self, input_ids: jax.Array, positions: jax.Array, hidden: jax.Array,
                    md: AttentionMetadata | None = None, embeds: jax.Array | None = None):
        """The layer up to attention: (q [T, Hq, D], k, v [T, Hkv, D] with RoPE at
        `positions`, the residual [T, H]). `md`: the step's attention metadata, which RoPE
        scalings that depend on the request's length (longrope, dynamic) need. `embeds`: the
        tokens' embeddings [T, H] float32 when the caller has them (None: looked up)."""
        layer = self.layer
        if embeds is None:
            embeds = self.embed_tokens(input_ids)
        embeds = self.norm(embeds, layer.input_norm)
        normed = self.norm(hidden, layer.hidden_norm)
        residual = normed if self.config.norm_before_residual else hidden.astype(jnp.float32)
        x = jnp.concatenate([embeds, normed], axis=-1)  # [T, 2H]
        q = dense(LAYER_SPECS["wq"], x, layer.wq[...])
        k = dense(LAYER_SPECS["wk"], x, layer.wk[...])
        v = dense(LAYER_SPECS["wv"], x, layer.wv[...])
        cos, sin = rope_tables(layer.rope, positions, md)
        return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), v, residual

    def finish_layer(self, attn: jax.Array, residual: jax.Array) -> jax.Array:
        """The layer after attention: attention output [T, Hq, D] -> the layer's output [T, H]."""
        layer = self.layer
        h = residual + dense(LAYER_SPECS["wo"], attn, layer.wo[...])
        x = self.norm(h, layer.post_norm)
        gate = dense(LAYER_SPECS["w_gate"], x, layer.w_gate[...])
        up = dense(LAYER_SPECS["w_up"], x, layer.w_up[...])
        return h + dense(LAYER_SPECS["w_down"], jax.nn.silu(gate) * up, layer.w_down[...])

    def head(self, layer_out: jax.Array) -> DraftStep:
        """The drafts from the layer's output [T, H]: logits, greedy ids, the next hidden."""
        normed = self.norm(layer_out, self.final_norm)
        logits = dense(HEAD_SPEC, normed, self.lm_head[...])
        draft_ids = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        return DraftStep(logits=logits, draft_ids=draft_ids,
                         target_ids=self.draft_to_target(draft_ids),
                         hidden=normed if self.config.norm_output else layer_out)

    def draft_to_target(self, draft_ids: jax.Array) -> jax.Array:
        """Draft-vocabulary ids -> target-vocabulary ids (d + d2t[d])."""
        return draft_ids + self.d2t[...][draft_ids]

    # ------------------------------------------------------------------ forward
    def __call__(self, input_ids: jax.Array, positions: jax.Array, hidden: jax.Array,
                 kv: DenseKV, mask: jax.Array | None = None) -> tuple[DraftStep, DenseKV]:
        """One draft step for T tokens: `input_ids` [T] (target ids), `positions` [T], `hidden`
        [T, H] (`combine_hidden` of the target's taps for a first draft, the previous step's
        `DraftStep.hidden` after that), `kv` the keys and values written before ([S, ...]).
        `mask` [T, S + T] bool: which keys (the earlier ones, then this step's) each token
        sees; None: all earlier ones and this step's causally (one sequence: its context, then
        one chain). Returns the step's drafts and `kv` with this step's keys and values
        appended."""
        q, k, v, residual = self.project_qkv(input_ids, positions, hidden)
        kv = kv.append(k, v)
        if mask is None:
            S, T = kv.k.shape[0] - q.shape[0], q.shape[0]
            mask = jnp.concatenate([jnp.ones((T, S), bool), jnp.tril(jnp.ones((T, T), bool))],
                                   axis=1)
        attn = dense_attention(q, kv.k, kv.v, mask, self.layer.attn_spec.sm_scale)
        return self.head(self.finish_layer(attn, residual)), kv

    def paged_step(self, input_ids: jax.Array, positions: jax.Array, hidden: jax.Array,
                   k_cache: jax.Array, v_cache: jax.Array, md: AttentionMetadata,
                   mesh: Mesh | None = None, rules: ax.Rules = DEFAULT_RULES
                   ) -> tuple[DraftStep, jax.Array, jax.Array]:
        """`__call__` over the drafter's own paged cache (one layer's K and V pages, as the
        runner allocates them for `config.layer`): the step's tokens are a flat ragged batch
        described by `md`, each attending causally over its request's cached keys, as the
        target's layers do. Returns the drafts and the updated caches."""
        out, k_cache, v_cache = self.paged_layer(input_ids, positions, hidden, k_cache, v_cache,
                                                 md, mesh, rules)
        return self.head(out), k_cache, v_cache

    def paged_layer(self, input_ids: jax.Array, positions: jax.Array, hidden: jax.Array,
                    k_cache: jax.Array, v_cache: jax.Array, md: AttentionMetadata,
                    mesh: Mesh | None = None, rules: ax.Rules = DEFAULT_RULES,
                    embeds: jax.Array | None = None) -> tuple[jax.Array, jax.Array, jax.Array]:
        """`paged_step` up to the head: (the layer's output [T, H], the updated caches).
        `embeds`: as `project_qkv`'s."""
        q, k, v, residual = self.project_qkv(input_ids, positions, hidden, md, embeds)
        attn, k_cache, v_cache = paged_attention(
            q.astype(attention_dtype(k_cache.dtype, self.dtype)), k, v, k_cache, v_cache, md,
            self.layer.attn_spec, mesh, rules)
        return self.finish_layer(attn, residual), k_cache, v_cache
