"""llama.cpp's GGUF conventions per architecture: metadata keys -> HF config, tensor names -> HF
names, and what llama.cpp's converter (convert_hf_to_gguf.py) did to the tensors that must be
undone. One `GGUFArch` per `general.architecture` (`ARCHITECTURES`); names and keys follow the
`gguf` package's `MODEL_TENSORS`, `TENSOR_NAMES` and `Keys` tables.

What the converter changes, per architecture:

- llama: Q and K rows permuted per head for llama.cpp's interleaved rotary layout (undone by
  `reverse_permute_qk`, biases too); Llama 3.1's rope scaling stored as `rope_freqs` divisors.
  A llama file with experts (`llama.expert_count`) is Mixtral.
- qwen2, qwen3, qwen3moe, gemma3, phi3: llama.cpp rotates them in HF's rotate-half layout (its
  NEOX mode), so their Q/K rows are stored as in HF: nothing to undo.
- gemma3: every norm weight (`*norm.weight`, q/k norms and the final norm included) is stored
  as 1 + w, since llama.cpp's RMSNorm multiplies by w and Gemma's by (1 + w): 1 is subtracted
  back. The local layers' RoPE base and the 5 local : 1 global pattern are llama.cpp's fixed
  Gemma 3 values unless the file says otherwise (`rope.freq_base_swa`,
  `attention.sliding_window_pattern`); the attention scale is llama.cpp's (head_dim ** -0.5,
  (hidden / heads) ** -0.5 for the 62-layer 27B) unless `attention.scale` is set.
- phi3: q/k/v stay fused (`attn_qkv`) and so do gate/up (`ffn_up`, 2 x feed_forward_length
  rows, gate first), as in HF. LongRoPE is written as two tensors (`rope_factors_long`,
  `rope_factors_short`) plus `rope.scaling.attn_factor` and `.original_context_length`, with
  no scaling type; a sliding window of 0 means none.
- MoE (llama/Mixtral, qwen3moe): each layer's experts are stacked into one [X, out, in] tensor
  per projection (`ffn_gate_exps`, `ffn_up_exps`, `ffn_down_exps`) and the router is
  `ffn_gate_inp` [X, E]; they are split back into the hub's per-expert tensors. qwen3moe files
  carry no `expert_weights_norm` (llama.cpp renormalizes the top-k weights, as Qwen3-MoE's
  released configs do); when present it sets `norm_topk_prob`. A qwen3moe layer without a
  router is read as a dense MLP layer (`mlp_only_layers`).
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable, Mapping
from typing import Any

import gguf
import numpy as np

# --------------------------------------------------------------------------- metadata


def metadata_value(reader: gguf.GGUFReader, key: str, default: Any = None) -> Any:
    """One metadata value as a Python value (str, int, float, bool or a list of them)."""
    field = reader.fields.get(key)
    if field is None:
        return default
    return field.contents()


class Metadata:
    """A GGUF file's metadata, read with the architecture's key prefix, and its tensors by name."""

    def __init__(self, reader: gguf.GGUFReader):
        self.reader = reader
        self.arch = metadata_value(reader, "general.architecture")
        self.tensors = {t.name: t for t in reader.tensors}

    def get(self, key: str, default: Any = None) -> Any:
        """`{arch}.{key}`, e.g. get("attention.head_count"). float32 values come back as the
        shortest decimal that rounds to them (1e-05, not 9.999999747378752e-06): the value
        the converter started from."""
        field = self.reader.fields.get(f"{self.arch}.{key}")
        if field is None:
            return default
        value = field.contents()
        if field.types == [gguf.GGUFValueType.FLOAT32]:
            return _decimal(value)
        return value

    def required(self, key: str) -> Any:
        value = self.get(key)
        if value is None:
            raise ValueError(f"GGUF file is missing the metadata key '{self.arch}.{key}', which a "
                             "model needs.")
        if isinstance(value, list):
            raise ValueError(  # noqa: TRY004 (a file's value, not a caller's type)
                f"GGUF key '{self.arch}.{key}' is per layer ({value[:4]}...); only one value for "
                "all layers is supported.")
        return value

    def floats(self, tensor_name: str) -> list[float]:
        """A small tensor that belongs in the config (rope factors), as floats."""
        t = self.tensors[tensor_name]
        return [_decimal(x) for x in gguf.quants.dequantize(t.data, t.tensor_type).reshape(-1)]


def _decimal(x) -> float:
    """A float32 as the shortest decimal that rounds to it."""
    return float(str(np.float32(x)))


# --------------------------------------------------------------------------- tensors


@dataclasses.dataclass(frozen=True)
class HFTensor:
    """One HF tensor read from one GGUF tensor: `expert` picks a slice of a stacked expert tensor;
    `rows` reorders rows (llama.cpp's Q/K order: applies to values and block scales alike);
    `offset` is subtracted from the values (Gemma's stored 1 + w)."""

    name: str
    source: gguf.ReaderTensor
    expert: int | None = None
    rows: Callable[[np.ndarray], np.ndarray] | None = None
    offset: float = 0.0


def permute_qk(weights: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's forward permutation of Q/K rows (HF layout -> GGUF layout); for tests."""
    rows = weights.shape[0]
    w = weights.reshape(n_head, 2, rows // n_head // 2, *weights.shape[1:])
    return w.swapaxes(1, 2).reshape(weights.shape)


def reverse_permute_qk(weights: np.ndarray, n_head: int) -> np.ndarray:
    """Undo `permute_qk`: GGUF row order -> HF row order (weights `[rows, ...]`, biases `[rows]`)."""
    rows = weights.shape[0]
    if rows % (2 * n_head):
        raise ValueError(
            f"cannot un-permute {rows} rows over {n_head} heads (need an even head dim)"
        )
    w = weights.reshape(n_head, rows // n_head // 2, 2, *weights.shape[1:])
    return w.swapaxes(2, 1).reshape(weights.shape)


_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_BLOCK_RE = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")
_GLOBAL_RE = re.compile(r"^([a-z_]+)\.(weight|bias)$")
ROUTER = "ffn_gate_inp"
EXPERT_PARTS = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")  # gate, up, down

# GGUF block tensor -> HF name inside "model.layers.{i}." (without .weight / .bias)
LLAMA_LAYER = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
QK_NORMS = {"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
GEMMA_LAYER = {
    **LLAMA_LAYER,
    **QK_NORMS,
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
PHI3_LAYER = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_qkv": "self_attn.qkv_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_up": "mlp.gate_up_proj",  # gate and up fused, gate first
    "ffn_down": "mlp.down_proj",
}
LLAMA_MLP = ("ffn_gate", "ffn_up", "ffn_down")


@dataclasses.dataclass(frozen=True)
class GGUFArch:
    """One llama.cpp architecture as read by jaxserve."""

    architecture: str  # the HF class
    model_type: str
    layer: Mapping[str, str]  # GGUF block tensor -> HF name in "model.layers.{i}."
    dense_mlp: tuple[str, ...] = LLAMA_MLP  # the layer entries of a dense MLP
    # The architecture's own config keys: (metadata, base config) -> updates.
    config: Callable[[Metadata, dict[str, Any]], dict[str, Any]] = lambda m, c: {}
    # MoE layers: (HF block prefix, per-expert HF names of gate, up, down); None: no experts.
    experts: tuple[str, tuple[str, str, str]] | None = None
    permute_qk: bool = False  # llama.cpp's interleaved rotary row order (llama only)
    norm_offset: float = 0.0  # stored norm weights are w + offset (Gemma: 1)
    partial_rotary: bool = False  # rope.dimension_count may be less than the head dim (Phi-3)
    config_tensors: frozenset[str] = frozenset()  # tensors that go into the config

    def hf_tensors(self, m: Metadata, config: dict[str, Any]) -> list[HFTensor]:
        """Every HF tensor of the file (unknown GGUF tensors raise ValueError)."""
        out: list[HFTensor] = []
        for t in m.reader.tensors:
            if t.name in self.config_tensors:
                continue
            if (g := _GLOBAL_RE.match(t.name)) and g.group(1) in _GLOBAL_NAMES:
                part, kind = g.groups()
                offset = self.norm_offset if part.endswith("norm") else 0.0
                out.append(HFTensor(f"{_GLOBAL_NAMES[part]}.{kind}", t, offset=offset))
            elif (b := _BLOCK_RE.match(t.name)) and b.group(2) in self.layer:
                out.append(self._layer_tensor(t, *b.groups(), config))
            elif b and self.experts and b.group(2) == ROUTER:
                out.append(HFTensor(f"model.layers.{b.group(1)}.{self.experts[0]}.gate.{b.group(3)}", t))
            elif b and self.experts and b.group(2) in EXPERT_PARTS and b.group(3) == "weight":
                block, names = self.experts
                hf = names[EXPERT_PARTS.index(b.group(2))]
                num = int(t.shape[-1])  # GGUF dims are fastest first: [in, out, X]
                out += [HFTensor(f"model.layers.{b.group(1)}.{block}.experts.{j}.{hf}.weight", t, expert=j)
                        for j in range(num)]
            else:
                raise ValueError(f"GGUF tensor {t.name!r} has no Hugging Face counterpart in "
                                 f"{self.architecture} (unsupported).")
        return out

    def _layer_tensor(self, t, layer: str, part: str, kind: str, config) -> HFTensor:
        name = f"model.layers.{layer}.{self.layer[part]}.{kind}"
        rows = None
        if self.permute_qk and part in ("attn_q", "attn_k"):
            heads = config["num_attention_heads" if part == "attn_q" else "num_key_value_heads"]
            rows = lambda w, h=heads: reverse_permute_qk(w, h)
        offset = self.norm_offset if part.endswith("norm") and kind == "weight" else 0.0
        return HFTensor(name, t, rows=rows, offset=offset)

    def check_complete(self, m: Metadata, config: dict[str, Any]) -> None:
        """Every tensor a model of this architecture needs is in the file."""
        needed = ["token_embd.weight", "output_norm.weight"]
        if not config["tie_word_embeddings"]:
            needed.append("output.weight")
        attention = [p for p in self.layer if p not in self.dense_mlp]
        for i in range(config["num_hidden_layers"]):
            moe = self.experts is not None and f"blk.{i}.{ROUTER}.weight" in m.tensors
            parts = attention + list((ROUTER, *EXPERT_PARTS) if moe else self.dense_mlp)
            needed += [f"blk.{i}.{p}.weight" for p in parts]
        missing = [n for n in needed if n not in m.tensors]
        if missing:
            shown = ", ".join(f"{n} ({self._hf_name(n)})" for n in missing[:5])
            raise ValueError(f"GGUF file lacks {len(missing)} tensors a {self.architecture} model "
                             f"needs: {shown}{' …' if len(missing) > 5 else ''}")

    def _hf_name(self, gguf_name: str) -> str:
        b = _BLOCK_RE.match(gguf_name)
        if b and b.group(2) in self.layer:
            return f"model.layers.{b.group(1)}.{self.layer[b.group(2)]}.{b.group(3)}"
        if b and self.experts:  # the router or stacked experts
            return f"model.layers.{b.group(1)}.{self.experts[0]}"
        g = _GLOBAL_RE.match(gguf_name)
        return f"{_GLOBAL_NAMES[g.group(1)]}.{g.group(2)}" if g else gguf_name


# --------------------------------------------------------------------------- config


def base_config(m: Metadata, spec: GGUFArch) -> dict[str, Any]:
    """The config keys every architecture reads the same way."""
    hidden = int(m.required("embedding_length"))
    n_head = int(m.required("attention.head_count"))
    n_head_kv = int(m.get("attention.head_count_kv") or n_head)
    rope_dim = m.get("rope.dimension_count")
    head_dim = m.get("attention.key_length") or (None if spec.partial_rotary else rope_dim) or hidden // n_head
    head_dim = int(head_dim)
    vocab = m.get("vocab_size")
    if vocab is None and "token_embd.weight" in m.tensors:
        vocab = int(m.tensors["token_embd.weight"].shape[-1])  # GGUF dims: [hidden, vocab]
    if vocab is None and (tokens := m.reader.fields.get("tokenizer.ggml.tokens")) is not None:
        vocab = len(tokens.data)
    if vocab is None:
        raise ValueError("GGUF file has neither a vocabulary size nor a token embedding.")
    ffn = m.required("feed_forward_length") if m.get("feed_forward_length") is not None \
        else m.required("expert_feed_forward_length")
    max_pos = int(m.get("context_length") or 2048)
    theta = float(m.get("rope.freq_base") or 10000.0)

    def token_id(name: str) -> int | None:
        value = metadata_value(m.reader, f"tokenizer.ggml.{name}")
        return None if value is None else int(value)

    cfg: dict[str, Any] = {
        "architectures": [spec.architecture],
        "model_type": spec.model_type,
        "vocab_size": int(vocab),
        "hidden_size": hidden,
        "intermediate_size": int(ffn),
        "num_hidden_layers": int(m.required("block_count")),
        "num_attention_heads": n_head,
        "num_key_value_heads": n_head_kv,
        "head_dim": head_dim,
        "max_position_embeddings": max_pos,
        "rms_norm_eps": float(m.get("attention.layer_norm_rms_epsilon") or 1e-6),
        "rope_theta": theta,
        "rope_parameters": rope_parameters(m, theta, max_pos),
        "rope_scaling": None,
        "hidden_act": "silu",
        "attention_bias": "blk.0.attn_q.bias" in m.tensors,
        "attention_dropout": 0.0,
        "mlp_bias": "blk.0.ffn_up.bias" in m.tensors,
        "tie_word_embeddings": "output.weight" not in m.tensors,
        "bos_token_id": token_id("bos_token_id"),
        "eos_token_id": token_id("eos_token_id"),
        "pad_token_id": token_id("padding_token_id"),
        "initializer_range": 0.02,
        "use_cache": True,
        "torch_dtype": "float32",
        "dtype": "float32",
    }
    if spec.partial_rotary and rope_dim and int(rope_dim) != head_dim:
        cfg["partial_rotary_factor"] = int(rope_dim) / head_dim
    return cfg


def rope_parameters(m: Metadata, theta: float, max_pos: int) -> dict[str, Any]:
    """transformers' `rope_parameters` from the `rope.scaling.*` keys (none, linear, yarn)."""
    kind = m.get("rope.scaling.type")
    if kind in (None, "none"):
        return {"rope_type": "default", "rope_theta": theta}
    factor = float(m.required("rope.scaling.factor"))
    if kind == "linear":
        return {"rope_type": "linear", "factor": factor, "rope_theta": theta}
    if kind == "yarn":
        params: dict[str, Any] = {"rope_type": "yarn", "factor": factor, "rope_theta": theta}
        if (orig := m.get("rope.scaling.original_context_length")) is not None:
            params["original_max_position_embeddings"] = int(orig)
        for key, name in (("yarn_beta_fast", "beta_fast"), ("yarn_beta_slow", "beta_slow")):
            if (value := m.get(f"rope.scaling.{key}")) is not None:
                params[name] = float(value)
        if m.get("rope.scaling.yarn_log_multiplier"):
            raise ValueError("GGUF yarn scaling with a log multiplier (DeepSeek's mscale) is not supported.")
        attn = m.get("rope.scaling.attn_factor")
        if attn is not None and float(attn) != 1.0:  # llama.cpp multiplies yarn's own factor by it
            params["attention_factor"] = float(attn) * (0.1 * math.log(factor) + 1.0)
        return params
    raise ValueError(f"GGUF rope scaling {kind!r} is not supported for {m.arch} (supported: linear, yarn).")


def _llama_config(m: Metadata, cfg: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {"pretraining_tp": 1}
    if "rope_freqs.weight" in m.tensors:
        out["rope_freq_factors"] = m.floats("rope_freqs.weight")
    if m.get("expert_count"):
        out.update(architectures=["MixtralForCausalLM"], model_type="mixtral",
                   num_local_experts=int(m.required("expert_count")),
                   num_experts_per_tok=int(m.required("expert_used_count")), sliding_window=None)
    return out


def _qwen3moe_config(m: Metadata, cfg: dict[str, Any]) -> dict[str, Any]:
    layers = cfg["num_hidden_layers"]
    moe_ffn = m.get("expert_feed_forward_length")
    if moe_ffn is None:
        gate = next((t for n, t in m.tensors.items() if n.endswith(".ffn_gate_exps.weight")), None)
        if gate is None:
            raise ValueError(f"GGUF file is missing '{m.arch}.expert_feed_forward_length'.")
        moe_ffn = int(gate.shape[1])  # GGUF dims [hidden, ffn, experts]
    return {
        "num_experts": int(m.required("expert_count")),
        "num_experts_per_tok": int(m.required("expert_used_count")),
        "moe_intermediate_size": int(moe_ffn),
        "norm_topk_prob": bool(m.get("expert_weights_norm", True)),
        "decoder_sparse_step": 1,
        "mlp_only_layers": [i for i in range(layers) if f"blk.{i}.{ROUTER}.weight" not in m.tensors],
        "use_sliding_window": False,
    }


GEMMA3_LOCAL_THETA = 10000.0  # llama.cpp's fixed base of Gemma 3's local layers
GEMMA3_PATTERN = 6  # ... and its 5 local : 1 global layers


def _gemma3_config(m: Metadata, cfg: dict[str, Any]) -> dict[str, Any]:
    layers, head_dim = cfg["num_hidden_layers"], cfg["head_dim"]
    if (scale := m.get("attention.scale")) is not None:
        scalar = float(scale) ** -2
    elif layers == 62:  # llama.cpp's Gemma 3 27B: (hidden / heads) ** -0.5
        scalar = cfg["hidden_size"] / cfg["num_attention_heads"]
    else:
        scalar = head_dim
    scalar = int(scalar) if float(scalar).is_integer() else scalar  # an int in transformers' config
    window = m.get("attention.sliding_window")
    pattern = m.get("attention.sliding_window_pattern", GEMMA3_PATTERN)
    if not window:
        sliding = [False] * layers
    elif isinstance(pattern, list):
        sliding = [bool(p) for p in pattern]
    else:
        sliding = [(i + 1) % int(pattern) != 0 for i in range(layers)]
    local = {"rope_type": "default", "rope_theta": float(m.get("rope.freq_base_swa") or GEMMA3_LOCAL_THETA)}
    out = {
        "hidden_activation": "gelu_pytorch_tanh",
        "query_pre_attn_scalar": scalar,
        "sliding_window": int(window) if window else None,
        "layer_types": ["sliding_attention" if s else "full_attention" for s in sliding],
        "rope_parameters": {"full_attention": cfg["rope_parameters"], "sliding_attention": local},
        "attn_logit_softcapping": None,
        "final_logit_softcapping": m.get("final_logit_softcapping"),
        "hidden_act": "gelu_pytorch_tanh",
    }
    return out


def _phi3_config(m: Metadata, cfg: dict[str, Any]) -> dict[str, Any]:
    window = m.get("attention.sliding_window")
    out: dict[str, Any] = {"sliding_window": int(window) if window else None}
    if (orig := m.get("rope.scaling.original_context_length")) is not None:
        out["original_max_position_embeddings"] = int(orig)
    if "rope_factors_long.weight" in m.tensors:
        params = {"rope_type": "longrope", "rope_theta": cfg["rope_theta"],
                  "long_factor": m.floats("rope_factors_long.weight"),
                  "short_factor": m.floats("rope_factors_short.weight")}
        if orig is not None:
            params["original_max_position_embeddings"] = int(orig)
        if (attn := m.get("rope.scaling.attn_factor")) is not None:
            params["attention_factor"] = float(attn)
        out["rope_parameters"] = params
    return out


ARCHITECTURES: dict[str, GGUFArch] = {
    "llama": GGUFArch("LlamaForCausalLM", "llama", LLAMA_LAYER, config=_llama_config, permute_qk=True,
                      experts=("block_sparse_moe", ("w1", "w3", "w2")),
                      config_tensors=frozenset({"rope_freqs.weight"})),
    "qwen2": GGUFArch("Qwen2ForCausalLM", "qwen2", LLAMA_LAYER),
    "qwen3": GGUFArch("Qwen3ForCausalLM", "qwen3", {**LLAMA_LAYER, **QK_NORMS}),
    "qwen3moe": GGUFArch("Qwen3MoeForCausalLM", "qwen3_moe", {**LLAMA_LAYER, **QK_NORMS},
                         config=_qwen3moe_config, experts=("mlp", ("gate_proj", "up_proj", "down_proj"))),
    "gemma3": GGUFArch("Gemma3ForCausalLM", "gemma3_text", GEMMA_LAYER, config=_gemma3_config,
                       norm_offset=1.0),
    "phi3": GGUFArch("Phi3ForCausalLM", "phi3", PHI3_LAYER, dense_mlp=("ffn_up", "ffn_down"),
                     config=_phi3_config, partial_rotary=True,
                     config_tensors=frozenset({"rope_factors_long.weight", "rope_factors_short.weight"})),
}


def architecture(m: Metadata) -> GGUFArch:
    if m.arch not in ARCHITECTURES:
        raise ValueError(f"GGUF architecture {m.arch!r} is not supported; supported: "
                         f"{', '.join(sorted(ARCHITECTURES))}.")
    return ARCHITECTURES[m.arch]


def config_from_metadata(m: Metadata) -> dict[str, Any]:
    """A complete HF `config.json` dict for the model in a GGUF file."""
    spec = architecture(m)
    cfg = base_config(m, spec)
    cfg.update(spec.config(m, cfg))
    return cfg
