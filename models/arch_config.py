"""ArchConfig: the architecture hyper-parameters of a model, parsed from an HF `config.json`.

Both transformers layouts are read: 4.x (`rope_theta`, `rope_scaling`, `rope_local_base_freq`,
top-level `partial_rotary_factor`) and 5.x (`rope_parameters`, nested by layer type for
models whose layer types have their own RoPE, e.g. Gemma 3).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from jaxserve.models.family_fields import (
    DEEPSEEK_V3,
    FULL_ATTENTION,
    GEMMA4,
    GPT_OSS,
    SLIDING_ATTENTION,
    deepseek_fields,
    gemma4_fields,
    moe_fields,
    opt_float,
)
from jaxserve.models.weight_format import WeightFormat
from jaxserve.models.quant_checkpoint import parse_quantization_config

_SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "dynamic", "longrope",
                         "proportional")


# Families whose decoder is Llama's (with flags); the others have their own model files.
_GEMMA = ("Gemma2ForCausalLM", "Gemma3ForCausalLM", "Gemma4ForCausalLM")
_MOE = ("MixtralForCausalLM", "Qwen3MoeForCausalLM", GPT_OSS, DEEPSEEK_V3)
# Families whose HF config sets `tie_word_embeddings` by default when config.json omits it.
_TIED_BY_DEFAULT = _GEMMA
# Activation names -> ours ("silu", "gelu_tanh", "gelu").
_ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_new": "gelu_tanh",
                "gelu_fast": "gelu_tanh", "gelu": "gelu"}


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """One RoPE scaling recipe (transformers' `rope_type` and its parameters)."""

    rope_type: str = "default"
    factor: float = 1.0
    # llama3
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    # yarn
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True
    # yarn and longrope: the cos/sin multiplier (None: derived from the factor)
    attention_factor: float | None = None
    # longrope: per-frequency divisors for sequences within / beyond the original length
    short_factor: tuple[float, ...] = ()
    long_factor: tuple[float, ...] = ()
    # proportional (Gemma 4): the rotated fraction of the head; the other frequencies are zero
    # (those dims pass through), and the exponents divide by the whole head dim
    partial_rotary_factor: float = 1.0


@dataclasses.dataclass(frozen=True)
class ArchConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling = RopeScaling()
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    qkv_bias: bool = False  # Qwen2
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False  # Qwen3, Gemma 3: RMSNorm over head_dim of q and k, per head
    # The window of the sliding-window layers (all layers when `layer_types` is empty).
    sliding_window: int | None = None
    # Per layer, FULL_ATTENTION or SLIDING_ATTENTION; empty: every layer alike.
    layer_types: tuple[str, ...] = ()
    # RoPE of the sliding-window layers when it differs from the full layers' (Gemma 3).
    local_rope_theta: float | None = None
    local_rope_scaling: RopeScaling | None = None
    partial_rotary_factor: float = 1.0  # the rotated fraction of each head (Phi-4-mini: 0.75)
    # Per-frequency divisors of the inverse frequencies (llama.cpp's `rope_freqs` tensor, which
    # is how GGUF files carry Llama 3.1's rope scaling); written by the GGUF converter.
    rope_freq_factors: tuple[float, ...] = ()
    hidden_act: str = "silu"  # "silu" | "gelu_tanh" | "gelu"
    # Gemma: attention scale query_pre_attn_scalar ** -0.5; tanh soft caps.
    query_pre_attn_scalar: float | None = None
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    # Mixture of experts (Mixtral, Qwen3-MoE)
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    moe_layers: tuple[bool, ...] = ()  # per layer: routed experts (True) or the dense MLP
    # Gemma 4: the full-attention layers' own head dim and KV heads (None: as the others'), their
    # values being their keys' projection (`attention_k_eq_v`); per-layer input embeddings of
    # this width per layer (0: none) from a table of this many tokens; the last
    # `num_kv_shared_layers` layers read the KV of the last earlier layer of their type instead
    # of projecting their own, with MLPs twice as wide when `double_wide_mlp`; a dense MLP
    # beside the routed experts in each MoE layer.
    global_head_dim: int | None = None
    global_kv_heads: int | None = None
    global_k_eq_v: bool = False
    per_layer_input_size: int = 0
    per_layer_vocab_size: int = 0
    num_kv_shared_layers: int = 0
    double_wide_mlp: bool = False
    # gpt-oss: the experts' clamped SwiGLU (gate clamped above at the limit, up to +-limit;
    # gate * sigmoid(alpha * gate) * (up + 1)); None: the experts use `hidden_act`.
    swiglu_limit: float | None = None
    swiglu_alpha: float = 1.702
    # DeepSeek V2/V3 multi-head latent attention (MLA; models/deepseek_v3.py): queries through a
    # rank-`q_lora_rank` bottleneck (None: one projection); keys and values from one latent of
    # `kv_lora_rank` (0: not MLA) plus a shared roped key of `qk_rope_head_dim`, which is all
    # the cache holds; each head's key is `qk_nope_head_dim` + `qk_rope_head_dim` wide, its
    # value `v_head_dim`. `rope_interleave`: the checkpoint's rotary dims are in pairs.
    q_lora_rank: int | None = None
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    rope_interleave: bool = False
    # DeepSeek V3's routing (`noaux_tc`): sigmoid scores, the experts in `n_group` groups of
    # which the `topk_group` best (by the sum of each group's two best biased scores) are
    # eligible, the chosen weights times `routed_scaling_factor`; `n_shared_experts` experts'
    # width of an always-on MLP beside them; `num_mtp_layers` multi-token prediction layers
    # stored after the decoder layers (loaded, not run by the forward pass).
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    n_shared_experts: int = 0
    num_mtp_layers: int = 0
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    # The checkpoint's storage, not the architecture: its matmul weights are int8 with one scale
    # per this many values along the contracted dims (a GGUF Q8_0 file's conversion: 32). A
    # float model dequantizes them at load; `--quantization int8` keeps them (and quantizes any
    # float weight in the same layout). None: float weights.
    int8_block_size: int | None = None
    # The checkpoint's storage: a format of another tool's quantization_config (FP8, AWQ, GPTQ;
    # models/quant_checkpoint.py) that the decoder layers' matmul weights keep on the device.
    weight_format: WeightFormat | None = None
    # The checkpoint's storage: the MoE experts' weights are MXFP4 (`*_blocks` / `*_scales`,
    # quantization_config `mxfp4`: gpt-oss); the other weights are float.
    mxfp4_experts: bool = False
    # The checkpoint's (query heads, KV heads) when the model is served with zero heads appended
    # (`with_kv_heads`: lane-dense KV pages for the TPU kernel); None: served as stored.
    checkpoint_heads: tuple[int, int] | None = None

    def kv_padding_blocker(self) -> str | None:
        """Why zero KV heads cannot be appended to this model (`with_kv_heads`); None: they can."""
        if self.is_mla:
            return "multi-head latent attention (one latent row per token)"
        if self.global_kv_heads is not None or self.global_head_dim is not None:
            return "layers of different head shapes"
        if self.weight_format is not None:
            return f"weights stored as {self.weight_format.describe()}"
        return None

    def with_kv_heads(self, kv_heads: int) -> ArchConfig:
        """This model served with `kv_heads` KV heads: the checkpoint's heads first, then zero KV
        heads, each with `q_per_kv` zero query heads appended after the real ones (so every real
        query head keeps its KV head) and zero input rows of the output projection: the added
        heads attend over zero keys and values and add exactly zero (DESIGN §9, "Lane-dense KV
        pages"). The loader pads the weights (models/weights.py, `pad_heads`). ValueError where
        the model cannot be padded (`kv_padding_blocker`)."""
        base = self.checkpoint_config()
        if kv_heads == base.num_kv_heads:
            return base
        blocker = base.kv_padding_blocker()
        if kv_heads < base.num_kv_heads or blocker is not None:
            raise ValueError(f"{base.architecture}: cannot serve {base.num_kv_heads} KV heads as "
                             f"{kv_heads}" + (f" ({blocker})" if blocker else ""))
        return dataclasses.replace(base, num_heads=base.q_per_kv * kv_heads, num_kv_heads=kv_heads,
                                   checkpoint_heads=(base.num_heads, base.num_kv_heads))

    def checkpoint_config(self) -> ArchConfig:
        """The model as its checkpoint stores it (without heads appended by `with_kv_heads`)."""
        if self.checkpoint_heads is None:
            return self
        hq, hkv = self.checkpoint_heads
        return dataclasses.replace(self, num_heads=hq, num_kv_heads=hkv, checkpoint_heads=None)

    def kv_padding_note(self) -> str | None:
        """The start-up log's line on appended KV heads (None: none appended)."""
        if self.checkpoint_heads is None:
            return None
        hkv = self.checkpoint_heads[1]
        grow = (self.num_kv_heads - hkv) / hkv * 100
        return (f"KV heads padded {hkv} -> {self.num_kv_heads} for lane-dense TPU pages "
                f"(+{grow:.0f} % KV bytes)")

    @property
    def q_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    def layer_window(self, i: int) -> int | None:
        """The attention window of layer i (None: the whole context)."""
        if self.sliding_window is None:
            return None
        if self.layer_types and self.layer_types[i] != SLIDING_ATTENTION:
            return None
        return self.sliding_window

    def layer_rope(self, i: int) -> tuple[float, RopeScaling]:
        """(theta, scaling) of layer i's RoPE."""
        if self.layer_window(i) is not None and self.local_rope_theta is not None:
            return self.local_rope_theta, self.local_rope_scaling or RopeScaling()
        return self.rope_theta, self.rope_scaling

    def layer_is_global(self, i: int) -> bool:
        """Whether layer i attends over the whole context (not a sliding-window layer)."""
        return not self.layer_types or self.layer_types[i] != SLIDING_ATTENTION

    def layer_head_dim(self, i: int) -> int:
        if self.global_head_dim is not None and self.layer_is_global(i):
            return self.global_head_dim
        return self.head_dim

    def layer_kv_heads(self, i: int) -> int:
        if self.global_kv_heads is not None and self.layer_is_global(i):
            return self.global_kv_heads
        return self.num_kv_heads

    def layer_k_eq_v(self, i: int) -> bool:
        """Whether layer i's values are its keys' projection (no value projection)."""
        return self.global_k_eq_v and self.layer_is_global(i)

    def kv_source(self, i: int) -> int:
        """The layer whose keys and values layer i attends over: itself, or for the last
        `num_kv_shared_layers` layers the last earlier layer of the same type (window)."""
        first_shared = self.num_layers - self.num_kv_shared_layers
        if i < first_shared:
            return i
        same = [j for j in range(first_shared) if self.layer_window(j) == self.layer_window(i)]
        return same[-1]

    @property
    def num_kv_cache_layers(self) -> int:
        """Layers with KV arrays of their own in the paged cache: all but the sharing ones,
        which come last (so layer i's arrays are the cache's `kv_source(i)`-th)."""
        return self.num_layers - self.num_kv_shared_layers

    @property
    def is_mla(self) -> bool:
        """Whether attention is multi-head latent attention (the cache holds latent rows)."""
        return self.kv_lora_rank > 0

    @property
    def kv_cache_arrays(self) -> int:
        """Cache arrays per layer: K and V, or (MLA) one array of latent rows."""
        return 1 if self.is_mla else 2

    @property
    def kv_cache_heads(self) -> int:
        """KV heads of each layer's cache array: the most of any layer (a layer with fewer
        repeats each head: query head groups read the same values); MLA: one latent row."""
        if self.is_mla:
            return 1
        return max(self.layer_kv_heads(i) for i in range(self.num_layers))

    @property
    def kv_cache_head_dim(self) -> int:
        """Head dim of each layer's cache array: the widest layer's (narrower heads are
        zero-padded, which changes no score and no output value); MLA: the latent and the
        roped shared key, side by side."""
        if self.is_mla:
            return self.kv_lora_rank + self.qk_rope_head_dim
        return max(self.layer_head_dim(i) for i in range(self.num_layers))

    def layer_intermediate_size(self, i: int) -> int:
        if self.double_wide_mlp and self.kv_source(i) != i:
            return 2 * self.intermediate_size
        return self.intermediate_size

    def is_moe_layer(self, i: int) -> bool:
        if not self.num_experts:
            return False
        return self.moe_layers[i] if self.moe_layers else True

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> ArchConfig:
        archs = hf.get("architectures") or []
        if not archs:
            raise ValueError("config.json has no 'architectures' entry; cannot pick a model class.")
        arch = archs[0]
        mxfp4 = _mxfp4_experts(arch, hf)
        block, weight_format = (None, None) if mxfp4 else _stored_quantization(hf)
        moe = arch in _MOE or (arch == GEMMA4 and bool(hf.get("enable_moe_block")))
        if weight_format is not None and moe:
            raise ValueError(f"{weight_format.describe()} checkpoints of mixture-of-experts models "
                             f"({arch}) are not supported yet; use the float checkpoint")
        num_heads = int(hf["num_attention_heads"])
        hidden = int(hf["hidden_size"])
        head_dim = hf.get("head_dim") or hidden // num_heads
        num_kv = int(hf.get("num_key_value_heads") or num_heads)
        num_layers = int(hf["num_hidden_layers"])
        max_pos = int(hf.get("max_position_embeddings", 2048))
        if num_heads % num_kv:
            raise ValueError(f"num_attention_heads ({num_heads}) must be a multiple of num_key_value_heads ({num_kv}).")
        if arch == GPT_OSS:  # transformers' default (the config may leave it out)
            head_dim = hf.get("head_dim") or 64
        act_name = (hf.get("hidden_activation") or hf.get("hidden_act")
                    or ("gelu_pytorch_tanh" if arch in _GEMMA else "silu"))  # as transformers
        act = _ACTIVATIONS.get(act_name)
        allowed = ("gelu_tanh", "gelu") if arch in _GEMMA else ("silu",)
        if act not in allowed:
            raise ValueError(f"hidden_act {act_name!r} is not supported for {arch} (supported: "
                             f"{', '.join(k for k, v in _ACTIVATIONS.items() if v in allowed)}).")
        sliding, layer_types = _parse_layers(arch, hf, num_layers)
        rope, local = _parse_rope(arch, hf, max_pos)
        # Qwen2 always has q/k/v biases; the others follow `attention_bias` (all four; gpt-oss's
        # default: on).
        attn_bias = bool(hf.get("attention_bias", arch == GPT_OSS)) and arch != "Qwen2ForCausalLM"
        eos = hf.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        params = hf.get("rope_parameters") if isinstance(hf.get("rope_parameters"), dict) else {}
        flat_params = params if not _nested(params) else params.get(FULL_ATTENTION) or {}
        partial = float(flat_params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0)) or 1.0)
        if arch == GEMMA4:
            partial = 1.0  # proportional RoPE rotates its fraction itself (RopeScaling)
        gemma = {}
        if arch == GPT_OSS:
            gemma = dict(swiglu_limit=float(hf.get("swiglu_limit", 7.0)),
                         swiglu_alpha=float(hf.get("swiglu_alpha", 1.702)))
        elif arch == DEEPSEEK_V3:
            gemma = deepseek_fields(hf)
            head_dim = gemma["qk_rope_head_dim"]  # the rotated width (as transformers' config)
        elif arch == GEMMA4:
            gemma = gemma4_fields(hf, layer_types, num_layers, num_kv, head_dim)
        elif arch in _GEMMA:
            gemma = dict(
                query_pre_attn_scalar=float(hf.get("query_pre_attn_scalar", 256)),
                final_logit_softcapping=opt_float(hf.get("final_logit_softcapping", 30.0 if arch == _GEMMA[0] else None)),
                # transformers applies the attention soft cap in Gemma 2 only (Gemma 3 ignores the key)
                attn_logit_softcapping=(opt_float(hf.get("attn_logit_softcapping", 50.0))
                                        if arch == "Gemma2ForCausalLM" else None),
            )
        return cls(
            architecture=arch,
            vocab_size=int(hf["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(hf["intermediate_size"]),
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=num_kv,
            head_dim=int(head_dim),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope_theta=rope[0],
            rope_scaling=rope[1],
            local_rope_theta=local[0] if local else None,
            local_rope_scaling=local[1] if local else None,
            partial_rotary_factor=partial,
            rope_freq_factors=tuple(float(x) for x in hf.get("rope_freq_factors") or ()),
            max_position_embeddings=max_pos,
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", arch in _TIED_BY_DEFAULT)),
            qkv_bias=arch == "Qwen2ForCausalLM" or attn_bias,
            o_bias=attn_bias,
            mlp_bias=bool(hf.get("mlp_bias", False)),
            qk_norm=arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "Gemma3ForCausalLM",
                             GEMMA4),
            sliding_window=int(sliding) if sliding else None,
            layer_types=layer_types,
            hidden_act=act,
            **gemma,
            **moe_fields(arch, hf, num_layers),
            eos_token_ids=eos_ids,
            bos_token_id=hf.get("bos_token_id"),
            int8_block_size=block,
            weight_format=weight_format,
            mxfp4_experts=mxfp4,
        )


def _mxfp4_experts(arch: str, hf: dict[str, Any]) -> bool:
    """Whether the checkpoint stores its experts as MXFP4 (gpt-oss's `quant_method` "mxfp4",
    the rest of the model float); refused for architectures whose checkpoints never do."""
    qc = hf.get("quantization_config")
    if not isinstance(qc, dict) or qc.get("quant_method") != "mxfp4":
        return False
    if arch != GPT_OSS:
        raise ValueError(f"MXFP4 checkpoints are supported for {GPT_OSS} (its experts); "
                         f"this one is {arch}")
    return True


def _stored_quantization(hf: dict[str, Any]) -> tuple[int | None, WeightFormat | None]:
    """(the block size of a GGUF Q8_0 conversion's int8 weights (jaxserve's own layout), the
    format of a checkpoint quantized by another tool); (None, None) for a float checkpoint.
    Formats jaxserve cannot read (bitsandbytes, AWQ GEMV, act-order GPTQ, ...) are refused by
    name instead of failing on a tensor name or shape."""
    qc = hf.get("quantization_config")
    if not qc:
        return None, None
    if not isinstance(qc, dict):
        qc = {}
    if qc.get("quant_method") == "gguf" and qc.get("weight_type") == "Q8_0":
        return int(qc["block_size"]), None
    if (qc.get("quant_method") == "compressed-tensors" and not qc.get("config_groups")
            and qc.get("kv_cache_scheme")):
        return None, None  # only the KV cache's scales (runner/kv_scales.py): float weights
    return None, parse_quantization_config(qc)


def _nested(params: dict) -> bool:
    return isinstance(params, dict) and any(k in params for k in (FULL_ATTENTION, SLIDING_ATTENTION))


def _parse_layers(arch: str, hf: dict[str, Any], num_layers: int) -> tuple[int | None, tuple[str, ...]]:
    """(the sliding window, per-layer types) as transformers derives them for `arch`."""
    window = hf.get("sliding_window", 512 if arch == GEMMA4 else 128 if arch == GPT_OSS else None)
    types = tuple(hf.get("layer_types") or ())
    if types and len(types) != num_layers:
        raise ValueError(f"layer_types lists {len(types)} layers, num_hidden_layers is {num_layers}")
    unknown = set(types) - {FULL_ATTENTION, SLIDING_ATTENTION}
    if unknown:
        raise ValueError(f"layer types {sorted(unknown)} are not supported (only full and sliding attention).")
    if arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        # the window applies only with use_sliding_window, to the layers from max_window_layers on
        window = window if hf.get("use_sliding_window") else None
        if not types and window:
            start = int(hf.get("max_window_layers", num_layers))
            types = tuple(SLIDING_ATTENTION if i >= start else FULL_ATTENTION for i in range(num_layers))
    elif arch == "Qwen3MoeForCausalLM":
        window = window if hf.get("use_sliding_window") else None  # then on every layer
        types = ()
    elif arch in _GEMMA:
        if not types:
            period = 2 if arch == "Gemma2ForCausalLM" else int(hf.get("sliding_window_pattern", 6))
            types = tuple(SLIDING_ATTENTION if (i + 1) % period else FULL_ATTENTION for i in range(num_layers))
        if arch == GEMMA4:  # transformers makes the last layer a full-attention one
            types = types[:-1] + (FULL_ATTENTION,)
    elif arch == GPT_OSS:  # transformers' default: sliding and full layers alternating
        if not types:
            types = tuple(SLIDING_ATTENTION if (i + 1) % 2 else FULL_ATTENTION for i in range(num_layers))
    elif arch in ("MistralForCausalLM", "MixtralForCausalLM", "Phi3ForCausalLM"):
        types = ()  # the window (if any) applies to every layer
    else:
        if SLIDING_ATTENTION in types or hf.get("use_sliding_window"):
            raise ValueError(f"{arch} with sliding-window layers is not supported.")
        window, types = None, ()
    if not window:
        window = None
        if SLIDING_ATTENTION in types:  # transformers runs such layers as full attention
            types = ()
    if types and all(t == SLIDING_ATTENTION for t in types):
        types = ()
    if types and all(t == FULL_ATTENTION for t in types):
        window, types = None, ()
    return window, types


def _parse_rope(arch: str, hf: dict[str, Any], max_pos: int
                ) -> tuple[tuple[float, RopeScaling], tuple[float, RopeScaling] | None]:
    """((theta, scaling) of the full-attention layers, that of the sliding layers or None)."""
    params = hf.get("rope_parameters") or {}
    scaling = hf.get("rope_scaling") or {}
    if arch == GEMMA4 and not params:  # transformers' defaults
        params = {SLIDING_ATTENTION: dict(rope_type="default", rope_theta=10_000.0),
                  FULL_ATTENTION: dict(rope_type="proportional", partial_rotary_factor=0.25,
                                       rope_theta=1_000_000.0)}
    if arch == GPT_OSS and not params and not scaling:  # transformers' default: yarn x32
        params = dict(rope_type="yarn", factor=32.0, beta_fast=32.0, beta_slow=1.0, truncate=False,
                      original_max_position_embeddings=4096)
    if _nested(params):  # transformers 5: one dict per layer type
        full = {**scaling, **(params.get(FULL_ATTENTION) or {})}
        local = params.get(SLIDING_ATTENTION)
        glob = _rope_from_dict(arch, full, hf, max_pos)
        return glob, (_rope_from_dict(arch, local, hf, max_pos, theta_key=None) if local else None)
    glob = _rope_from_dict(arch, {**scaling, **params}, hf, max_pos)
    if arch == "Gemma3ForCausalLM":  # transformers 4.x: the sliding layers' base frequency
        return glob, (float(hf.get("rope_local_base_freq", 10000.0)), RopeScaling())
    return glob, None


def _rope_from_dict(arch: str, d: dict[str, Any], hf: dict[str, Any], max_pos: int,
                    theta_key: str | None = "rope_theta") -> tuple[float, RopeScaling]:
    default_theta = {"Gemma3ForCausalLM": 1_000_000.0, GPT_OSS: 150_000.0}.get(arch, 10000.0)
    theta = float(d.get("rope_theta") or (hf.get(theta_key) if theta_key else None) or default_theta)
    rope_type = d.get("rope_type", d.get("type", "default")) or "default"
    if arch == "Phi3ForCausalLM" and rope_type in ("su", "yarn"):
        rope_type = "longrope"  # what transformers' Phi3Config does with these old names
    if rope_type not in _SUPPORTED_ROPE_TYPES:
        raise ValueError(f"rope type {rope_type!r} is not supported; supported: {_SUPPORTED_ROPE_TYPES}.")
    if rope_type == "default":
        return theta, RopeScaling()
    if rope_type == "proportional":
        return theta, RopeScaling(
            rope_type=rope_type, factor=float(d.get("factor", 1.0) or 1.0),
            partial_rotary_factor=float(d.get("partial_rotary_factor", 1.0) or 1.0))
    # Phi-3 keeps the pretraining length at the top level, and it has priority there.
    original = hf.get("original_max_position_embeddings") or d.get("original_max_position_embeddings")
    original = int(original if original is not None else max_pos)  # transformers' default
    factor = d.get("factor")
    if factor is None:
        factor = max_pos / original if rope_type in ("yarn", "longrope") else 1.0
    return theta, RopeScaling(
        rope_type=rope_type,
        factor=float(factor),
        low_freq_factor=float(d.get("low_freq_factor", 1.0)),
        high_freq_factor=float(d.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=original,
        beta_fast=float(d.get("beta_fast") or 32.0),
        beta_slow=float(d.get("beta_slow") or 1.0),
        mscale=opt_float(d.get("mscale")),
        mscale_all_dim=opt_float(d.get("mscale_all_dim")),
        truncate=bool(d.get("truncate", True)),
        attention_factor=opt_float(d.get("attention_factor")),
        short_factor=tuple(float(x) for x in d.get("short_factor") or ()),
        long_factor=tuple(float(x) for x in d.get("long_factor") or ()),
    )
