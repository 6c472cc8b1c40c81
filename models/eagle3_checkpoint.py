"""Loading EAGLE-3 draft heads (models/eagle3.py) from their two checkpoint layouts: which
tensor each parameter comes from (`checkpoint_tensors`), the draft/target vocabulary maps
(`vocab_maps`), the weights placed on a mesh (`load_eagle3`) or only their shapes and
shardings (`abstract_eagle3`)."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from jaxserve.models.arch_config import ArchConfig
from jaxserve.models.eagle3 import LAYER_PREFIX, Eagle3Config, Eagle3Drafter
from jaxserve.models.loader import LoadedCheckpoint, load_checkpoint
from jaxserve.models.placement import put_sharded
from jaxserve.models.sharding import DEFAULT_RULES, single_device_mesh, state_shardings
from jaxserve.models.weights import _path_key, pad_heads


@dataclasses.dataclass(frozen=True)
class CheckpointTensor:
    """Where a parameter comes from: the checkpoint's tensor `name`, its `shape` there, and the
    conversion to our layout."""

    name: str
    shape: tuple[int, ...]
    convert: Callable[[np.ndarray], np.ndarray]


def checkpoint_tensors(config: Eagle3Config) -> dict[str, CheckpointTensor]:
    """Our parameter path -> its `CheckpointTensor` in the layout of `config` (d2t, t2d and
    the embedding are handled by `load_eagle3`). HF Linear weights are [out, in]; the shapes
    are the checkpoint's (heads appended for lane-dense pages are zeros added at load)."""
    cfg = config.layer.checkpoint_config()
    E, F = cfg.hidden_size, cfg.intermediate_size
    Hq, Hkv, D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    pre = LAYER_PREFIX[config.layout]
    ident = lambda w: w
    transpose = lambda w: w.T
    heads_in = lambda H: (lambda w: w.T.reshape(2 * E, H, D))
    t = CheckpointTensor
    return {
        "fc": t("fc.weight", (E, config.num_aux * E), transpose),
        "layer.input_norm": t(pre + "input_layernorm.weight", (E,), ident),
        "layer.hidden_norm": t(pre + "hidden_norm.weight", (E,), ident),
        "layer.wq": t(pre + "self_attn.q_proj.weight", (Hq * D, 2 * E), heads_in(Hq)),
        "layer.wk": t(pre + "self_attn.k_proj.weight", (Hkv * D, 2 * E), heads_in(Hkv)),
        "layer.wv": t(pre + "self_attn.v_proj.weight", (Hkv * D, 2 * E), heads_in(Hkv)),
        "layer.wo": t(pre + "self_attn.o_proj.weight", (E, Hq * D),
                      lambda w: w.T.reshape(Hq, D, E)),
        "layer.post_norm": t(pre + "post_attention_layernorm.weight", (E,), ident),
        "layer.w_gate": t(pre + "mlp.gate_proj.weight", (F, E), transpose),
        "layer.w_up": t(pre + "mlp.up_proj.weight", (F, E), transpose),
        "layer.w_down": t(pre + "mlp.down_proj.weight", (E, F), transpose),
        "final_norm": t("norm.weight", (E,), ident),
        "lm_head": t("lm_head.weight", (config.draft_vocab_size, E), transpose),
        "embed": t("embed_tokens.weight", (cfg.vocab_size, E), ident),
    }


def vocab_maps(config: Eagle3Config, ckpt: LoadedCheckpoint) -> tuple[np.ndarray, np.ndarray]:
    """(d2t int32 [Vd], t2d bool [V]) of a checkpoint, checked: every draft id maps into the
    target vocabulary, onto exactly the ids t2d marks. A drafter over the whole target
    vocabulary may ship neither (the identity)."""
    V, Vd = config.target_vocab_size, config.draft_vocab_size
    names = set(ckpt.tensor_names())
    if "d2t" not in names or "t2d" not in names:
        if config.reduced_vocab:
            raise ValueError(f"the EAGLE-3 checkpoint's draft vocabulary ({Vd}) is smaller than "
                             f"the target's ({V}) but it lacks the "
                             f"{' and '.join(n for n in ('d2t', 't2d') if n not in names)} mapping")
        return np.zeros((Vd,), np.int32), np.ones((V,), bool)
    d2t, t2d = np.asarray(ckpt.get_tensor("d2t")), np.asarray(ckpt.get_tensor("t2d"))
    if d2t.shape != (Vd,) or t2d.shape != (V,):
        raise ValueError(f"the EAGLE-3 checkpoint's d2t has shape {d2t.shape} and t2d "
                         f"{t2d.shape}; expected ({Vd},) (draft_vocab_size) and ({V},) (the "
                         "target's vocab_size)")
    target_ids = np.arange(Vd) + d2t.astype(np.int64)
    if target_ids.min() < 0 or target_ids.max() >= V:
        raise ValueError(f"the EAGLE-3 checkpoint's d2t maps draft ids outside the target "
                         f"vocabulary [0, {V})")
    marked = t2d.astype(bool)
    if marked.sum() != Vd or not marked[target_ids].all() or len(np.unique(target_ids)) != Vd:
        raise ValueError("the EAGLE-3 checkpoint's d2t and t2d disagree: d2t must map the draft "
                         "ids onto exactly the target ids t2d marks")
    return d2t.astype(np.int32), marked


def sharded_abstract(config: Eagle3Config, dtype, mesh: Mesh | None,
                     rules: Mapping[str, str | None] | None, attention_impl: str = "auto"):
    """(graphdef, abstract state, parameter path -> sharding) of the drafter of `config` on
    `mesh` (default: one device) under `rules`: what loading places the weights by, and what
    the compile workers build its step with (`abstract_eagle3`)."""
    mesh = mesh or single_device_mesh()
    rules = DEFAULT_RULES if rules is None else rules
    abstract = nnx.eval_shape(lambda: Eagle3Drafter(config, dtype=dtype, rngs=None,
                                                     attention_impl=attention_impl))
    graphdef, abs_state = nnx.split(abstract)
    shardings = state_shardings(abs_state, mesh, rules)
    return graphdef, abs_state, {_path_key(p): s for p, s in jax.tree_util.tree_leaves_with_path(shardings)}


def abstract_eagle3(path: str | os.PathLike[str], target: ArchConfig, dtype, mesh: Mesh | None,
                    rules: Mapping[str, str | None] | None, *, attention_impl: str = "auto",
                    kv_heads: int = 0) -> Eagle3Drafter:
    """The EAGLE-3 head in `path` with abstract weights in their shardings (no memory), checked
    against the `target`: what the compile workers and the memory probes build its step with
    (`kv_heads` as `load_eagle3`'s)."""
    config = Eagle3Config.from_hf(load_checkpoint(path).config).with_kv_heads(kv_heads)
    config.target_layer_ids(target)
    graphdef, state, shardings = sharded_abstract(config, dtype, mesh, rules, attention_impl)

    def shaped(p, var):
        x = var.get_value()
        return var.replace(jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=shardings[_path_key(p)]))

    state = jax.tree_util.tree_map_with_path(shaped, state, is_leaf=lambda x: isinstance(x, nnx.Variable))
    return nnx.merge(graphdef, state)


def load_eagle3(path: str | os.PathLike[str], *, target: str | os.PathLike[str] | None = None,
                dtype=jnp.float32, mesh: Mesh | None = None,
                rules: Mapping[str, str | None] | None = None,
                attention_impl: str = "auto", kv_heads: int = 0) -> Eagle3Drafter:
    """The EAGLE-3 drafter in the HF directory `path` (either layout), weights on `mesh`.

    `target`: the target model's HF directory; the drafter is checked against its config
    (hidden size, vocabulary, the layers it reads), and its embedding table is used when the
    drafter ships none (which then needs `target`). `kv_heads`: the KV heads its layer is
    served with (0: the checkpoint's; `recipe.serving_draft_heads`): zero heads appended to its
    q/k/v projections and zero rows to its output projection (`weights.pad_heads`), as a
    target's for lane-dense TPU pages. ValueError naming what is missing or mismatched
    otherwise."""
    ckpt = load_checkpoint(path)
    config = Eagle3Config.from_hf(ckpt.config).with_kv_heads(kv_heads)
    target_ckpt = load_checkpoint(target) if target is not None else None
    if target_ckpt is not None:
        config.target_layer_ids(ArchConfig.from_hf(target_ckpt.config))
    names = set(ckpt.tensor_names())
    tensors = checkpoint_tensors(config)
    missing = sorted(t.name for key, t in tensors.items() if t.name not in names and key != "embed")
    if missing:
        raise ValueError(f"the EAGLE-3 checkpoint {ckpt.path} ({config.layout} layout) lacks "
                         f"{', '.join(missing)}")
    wrong = [f"{t.name} {ckpt.tensor_info(t.name)[0]} (expected {t.shape})"
             for t in tensors.values()
             if t.name in names and tuple(ckpt.tensor_info(t.name)[0]) != t.shape]
    if wrong:
        raise ValueError(f"the EAGLE-3 checkpoint {ckpt.path} does not match its config.json: "
                         f"{'; '.join(wrong)}")
    host: dict[str, Callable[[], np.ndarray]] = {
        key: (lambda t=t: t.convert(ckpt.get_tensor(t.name))) for key, t in tensors.items()}
    if "embed_tokens.weight" not in names:
        if target_ckpt is None:
            raise ValueError(f"the EAGLE-3 checkpoint {ckpt.path} ships no embed_tokens.weight; "
                             "pass the target model (its embedding table is the drafter's)")
        from jaxserve.models.registry import get_model_class

        tcfg = ArchConfig.from_hf(target_ckpt.config)
        target_embed = get_model_class(tcfg.architecture).hf_weight_map(tcfg)["embed"]
        host["embed"] = lambda: target_embed(target_ckpt.get_tensor)
    d2t, t2d = vocab_maps(config, ckpt)
    host.update(d2t=lambda: d2t, t2d=lambda: t2d)

    graphdef, abs_state, flat_shardings = sharded_abstract(config, dtype, mesh, rules, attention_impl)

    def load(p, var):
        key = _path_key(p)
        value = pad_heads(host[key](), var.get_metadata().get("logical_axes"), config.layer)
        if tuple(value.shape) != tuple(var.get_value().shape):  # the target's table
            raise ValueError(f"the target's embedding table has shape {tuple(value.shape)}; the "
                             f"drafter expects {tuple(var.get_value().shape)}")
        return var.replace(put_sharded(value, flat_shardings[key], var.get_value().dtype))

    is_var = lambda x: isinstance(x, nnx.Variable)
    state = jax.tree_util.tree_map_with_path(load, abs_state, is_leaf=is_var)
    return nnx.merge(graphdef, state)

