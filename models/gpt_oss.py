"""gpt-oss (`GptOssForCausalLM`): Llama's pre-norm decoder with these differences (each a
declared layer feature, models/interface.py):

- q, k, v and o projections with biases (`attention_bias`, on by default);
- a learned attention sink per query head (`sinks` [Hq]): one more logit in each row's
  softmax, with no value: out = sum_j exp(s_j) v_j / (exp(sink) + sum_j exp(s_j)) (every
  attention implementation takes it: layers/attention.py);
- sliding-window layers (`sliding_window`, 128) alternating with full ones (`layer_types`;
  transformers' default: the even layers slide); yarn RoPE (layers/rotary.py);
- every layer's MLP is a mixture of experts: the router is a linear layer with a bias, each
  token takes the experts of its k largest logits, weighted by a softmax over those k; the
  experts have biases on gate, up and down, and a clamped SwiGLU: gate clamped to at most
  `swiglu_limit`, up to [-limit, limit], gate * sigmoid(1.702 gate) * (up + 1)
  (layers/moe.py's `ClampedSwiGLU`);
- checkpoints store the experts as MXFP4 (`quantization_config` {"quant_method": "mxfp4"}):
  `experts.gate_up_proj_blocks` [X, 2F, E / 32, 16] and `_scales` [X, 2F, E / 32] (rows: gate
  and up interleaved, gate first), `experts.down_proj_blocks` [X, E, F / 32, 16]. They are
  kept packed on the device (uint8 e2m1 codes and e8m0 exponents: `linear.mxfp4_weight`),
  decoded inside the step; where a mesh splits an expert's contracted dim into pieces that
  are not whole blocks of 32, or with `--quantization`, they are decoded at load instead
  (`mxfp4_kept`). transformers 5's float checkpoints (`experts.gate_up_proj` [X, E, 2F], gate
  and up interleaved along the last dim; `experts.down_proj` [X, F, E]) load as they are.

Not here: the Harmony chat format and its reasoning channels (the tokenizer's template and
the serving layer's parsers).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jaxserve.models import interface as features
from jaxserve.models import sharding as ax
from jaxserve.models.arch_config import ArchConfig
from jaxserve.models.layers.linear import MXFP4_PARTS, SCALE_SUFFIX, QuantizedParam, dense
from jaxserve.models.layers.moe import EXPERT_SPECS, ClampedSwiGLU, moe_mlp
from jaxserve.models.layers.moe import check_impl as check_moe_impl
from jaxserve.models.layers.quant import decode_mxfp4, mxfp4_device_layout, quantize_mxfp4
from jaxserve.models.layers.rotary import layer_rope_spec
from jaxserve.models.llama import (
    DecoderLayer,
    LlamaForCausalLM,
    TensorGetter,
    _param,
    add_weight,
    layer_features,
    llama_weight_map,
)
from jaxserve.models.moe import ROUTER_SPEC
from jaxserve.models.sharding import logical_to_spec, mesh_axes_size
from jaxserve.pallas_kernels.mxfp4 import MXFP4_BLOCK

logger = logging.getLogger(__name__)

UP_AXES = (ax.EXPERT, ax.EMBED, ax.MLP)  # x_gate, x_up [X, E, F]
DOWN_AXES = (ax.EXPERT, ax.MLP, ax.EMBED)  # x_down [X, F, E]
EXPERTS = {"x_gate": "w_gate", "x_up": "w_up", "x_down": "w_down"}  # -> EXPERT_SPECS


def gpt_oss_features(cfg: ArchConfig, quantization: str | None) -> frozenset[str]:
    out = set(layer_features(cfg, quantization)) - {features.SILU_GLU}
    return frozenset(out | {features.MOE, features.ATTENTION_SINKS, features.CLAMPED_SWIGLU})


def mxfp4_kept(cfg: ArchConfig, quantization: str | None, mesh, rules) -> bool:
    """Whether the checkpoint's MXFP4 experts stay packed on the device: no `--quantization`,
    and every device's piece of each expert's contracted dim (hidden for gate and up,
    intermediate for down) whole blocks of 32. Otherwise they are decoded at load (logged)."""
    if not cfg.mxfp4_experts:
        return False
    reason = _mxfp4_unkept_reason(cfg, quantization, mesh, rules)
    if reason is not None:
        _log_upcast(reason)
    return reason is None


def _mxfp4_unkept_reason(cfg: ArchConfig, quantization: str | None, mesh, rules) -> str | None:
    if quantization is not None:
        return f"--quantization {quantization} quantizes the decoded weights"
    E, F, X = cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts
    if E % MXFP4_BLOCK or F % MXFP4_BLOCK:
        return f"hidden {E} or intermediate {F} is not a multiple of {MXFP4_BLOCK}"
    if mesh is None:
        return None
    for axes, shape in ((UP_AXES, (X, E, F)), (DOWN_AXES, (X, F, E))):
        spec = logical_to_spec(axes, shape, mesh, rules)
        n = 1 if spec[1] is None else mesh_axes_size(mesh, spec[1])
        if (shape[1] // MXFP4_BLOCK) % n:
            return (f"{shape[1] // MXFP4_BLOCK} blocks of {MXFP4_BLOCK} of an expert's "
                    f"contracted dim do not split over {n} devices (the expert-parallel "
                    "sharding rules keep them whole)")
    return None


@functools.lru_cache(maxsize=None)
def _log_upcast(reason: str) -> None:  # once per reason (the model is built more than once)
    logger.warning("the checkpoint's MXFP4 experts are decoded to the model dtype at load: %s",
                   reason)


class GptOssDecoderLayer(DecoderLayer):
    """Llama's attention weights with biases and the sinks; the router (with its bias) and
    the stacked experts (with theirs), float or MXFP4 (`mxfp4`)."""

    def __init__(self, cfg: ArchConfig, dtype, rngs: nnx.Rngs | None, *, mesh, rules,
                 mxfp4: bool, **kw):
        super().__init__(cfg, dtype, rngs, mlp=False, **kw)
        E, F, X, Hq = cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts, cfg.num_heads
        p = lambda shape, axes, s: _param(rngs, shape, axes, dtype, s)  # noqa: E731
        self.sinks = p((Hq,), (ax.Q_HEADS,), 0.5)
        self.router = p((E, X), (ax.EMBED, None), 0.1)
        self.router_bias = p((X,), (None,), 0.1)
        self.mxfp4 = mxfp4
        for name, shape, axes in (("x_gate", (X, E, F), UP_AXES), ("x_up", (X, E, F), UP_AXES),
                                  ("x_down", (X, F, E), DOWN_AXES)):
            spec = EXPERT_SPECS[EXPERTS[name]]
            if mxfp4:
                self._add_mxfp4(name, rngs, shape, axes, spec, dtype)
            else:
                add_weight(self, name, rngs, shape, axes, dtype, 0.04, spec, kw.get("quantization"),
                           cfg.int8_block_size)
        self.b_x_gate = p((X, F), (ax.EXPERT, ax.MLP), 0.02)
        self.b_x_up = p((X, F), (ax.EXPERT, ax.MLP), 0.02)
        self.b_x_down = p((X, E), (ax.EXPERT, ax.EMBED), 0.02)
        self.expert_axis = self.mlp_axis = None
        if mesh is not None:  # as MoeDecoderLayer: the mesh axes the experts split over
            spec = logical_to_spec(UP_AXES, (X, E, F), mesh, rules)
            split = [a if a is not None and mesh_axes_size(mesh, a) > 1 else None for a in spec]
            self.expert_axis, self.mlp_axis = split[0], split[2]

    def _add_mxfp4(self, name, rngs, shape, axes, spec, dtype) -> None:
        """Expert weight `name` [X, K, N] as MXFP4: packed codes [X, K / 2, N] and exponents
        [X, K / 32, N] (random ones quantized from normal weights; zeros abstractly)."""
        X, K, N = shape
        if rngs is not None:
            w = 0.04 * jax.random.normal(rngs.params(), (X, N, K), jnp.float32)
            codes, exponents = mxfp4_device_layout(*quantize_mxfp4(w))
        else:
            codes = jnp.zeros((X, K // 2, N), jnp.uint8)
            exponents = jnp.zeros((X, K // MXFP4_BLOCK, N), jnp.uint8)
        setattr(self, name, QuantizedParam(codes, logical_axes=axes, spec=spec,
                                           compute_dtype=jnp.dtype(dtype).name, packed_axis=1,
                                           mxfp4=True))
        setattr(self, name + SCALE_SUFFIX, nnx.Param(exponents, logical_axes=axes))


class GptOssForCausalLM(LlamaForCausalLM):
    layer_class = GptOssDecoderLayer
    supports_lora = False  # the experts' products have no LoRA terms

    def __init__(self, config: ArchConfig, *, moe_impl: str = "ragged", **kw):
        super().__init__(config, moe_impl=moe_impl, **kw)
        self.moe_impl = check_moe_impl(moe_impl)  # layers/moe.py's, as the backend planned it

    @staticmethod
    def features(cfg: ArchConfig, quantization: str | None) -> frozenset[str]:
        return gpt_oss_features(cfg, quantization)

    def make_layer(self, cfg, i, dtype, rngs, spec, quantization, mesh, rules):
        return GptOssDecoderLayer(cfg, dtype, rngs, mesh=mesh, rules=rules,
                                  mxfp4=mxfp4_kept(cfg, quantization, mesh, rules),
                                  attn_spec=spec, rope=layer_rope_spec(cfg, i),
                                  quantization=quantization)

    def mlp(self, layer, p, x):
        """The routed experts on normed x [T, E] -> [T, E] float32."""
        cfg = self.config
        logits = dense(ROUTER_SPEC, x, p["router"]) + p["router_bias"].astype(jnp.float32)
        mesh = self.mesh if self.mesh is not None and self.mesh.size > 1 else None
        return moe_mlp(x, logits, p["x_gate"], p["x_up"], p["x_down"],
                       top_k=cfg.num_experts_per_tok, normalize=True, impl=self.moe_impl,
                       mesh=mesh, expert_axis=layer.expert_axis, mlp_axis=layer.mlp_axis,
                       act=ClampedSwiGLU(cfg.swiglu_limit, cfg.swiglu_alpha), select_first=True,
                       b_gate=p["b_x_gate"], b_up=p["b_x_up"], b_down=p["b_x_down"])

    @classmethod
    def hf_weight_map(cls, cfg: ArchConfig) -> dict[str, Callable[[TensorGetter], np.ndarray]]:
        return gpt_oss_weight_map(cfg)


def gpt_oss_weight_map(cfg: ArchConfig) -> dict[str, Callable]:
    """Our parameter path -> its builder from transformers' gpt-oss tensors; for MXFP4
    checkpoints each expert weight also has its (codes, exponents) builder under the name +
    MXFP4_PARTS (the float builder decodes them)."""
    m = llama_weight_map(cfg)

    def get(name: str, fn=lambda w: w):
        return lambda g: fn(np.asarray(g(name)))

    def mxfp4(name: str, rows: slice, fn):
        """fn(blocks, scales) of checkpoint pair `name` (rows: of the output channels)."""
        return lambda g: fn(np.asarray(g(name + "_blocks"))[:, rows],
                            np.asarray(g(name + "_scales"))[:, rows])

    def decoded(blocks, scales):  # [X, out, in] -> [X, in, out] float32
        return np.swapaxes(decode_mxfp4(blocks, scales), 1, 2)

    gate, up, every = slice(0, None, 2), slice(1, None, 2), slice(None)
    for i in range(cfg.num_layers):
        pre, ours = f"model.layers.{i}.", f"layers.{i}."
        for name in ("w_gate", "w_up", "w_down"):
            m.pop(ours + name)
        experts = pre + "mlp.experts."
        m[ours + "sinks"] = get(pre + "self_attn.sinks")
        m[ours + "router"] = get(pre + "mlp.router.weight", lambda w: w.T)  # [X, E] -> [E, X]
        m[ours + "router_bias"] = get(pre + "mlp.router.bias")
        m[ours + "b_x_gate"] = get(experts + "gate_up_proj_bias", lambda b: b[:, gate])
        m[ours + "b_x_up"] = get(experts + "gate_up_proj_bias", lambda b: b[:, up])
        m[ours + "b_x_down"] = get(experts + "down_proj_bias")
        if cfg.mxfp4_experts:
            for name, proj, rows in (("x_gate", "gate_up_proj", gate), ("x_up", "gate_up_proj", up),
                                     ("x_down", "down_proj", every)):
                m[ours + name] = mxfp4(experts + proj, rows, decoded)
                m[ours + name + MXFP4_PARTS] = mxfp4(experts + proj, rows, mxfp4_device_layout)
        else:  # [X, E, 2F] (gate and up interleaved along the last dim), [X, F, E]
            m[ours + "x_gate"] = get(experts + "gate_up_proj", lambda w: w[..., gate])
            m[ours + "x_up"] = get(experts + "gate_up_proj", lambda w: w[..., up])
            m[ours + "x_down"] = get(experts + "down_proj")
    return m
