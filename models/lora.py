"""LoRA adapters: PEFT adapter directories read into the layout of the model's weights, and the
shapes of the device slots that hold them.

A PEFT LoRA adapter (adapter_config.json + adapter_model.safetensors) stores, per adapted
Linear, `lora_A.weight` [r, in] and `lora_B.weight` [out, r]; the layer computes
`W x + (B A x) * scale` with scale = lora_alpha / r (rsLoRA: lora_alpha / sqrt(r)). Here each
target of each layer becomes A [in..., r] and B [r, out...] shaped like the input and output
dims of our weight (e.g. q_proj's B is [r, Hq, D]), the scale folded into B. Targets are the
decoder layers' seven products (q/k/v/o, gate/up/down); anything else an adapter asks for
(DoRA, other modules, biases, a rank above the maximum, extra embeddings) is refused with an
error naming it.
"""

from __future__ import annotations

import dataclasses
import json
import math
import pathlib
import re

import numpy as np

from jaxserve.models.arch_config import ArchConfig
from jaxserve.models.safetensors_io import memmap, read_header, tensor_view

# Our weight name -> the HF module name PEFT targets.
TARGETS = {
    "wq": "q_proj",
    "wk": "k_proj",
    "wv": "v_proj",
    "wo": "o_proj",
    "w_gate": "gate_proj",
    "w_up": "up_proj",
    "w_down": "down_proj",
}
_BY_MODULE = {v: k for k, v in TARGETS.items()}
_KEY = re.compile(
    r"^(?:base_model\.model\.)?model\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)"
    r"\.lora_([AB])(?:\.[\w-]+)?\.weight$"
)
# Config keys whose non-default values jaxserve cannot serve.
_UNSUPPORTED = {
    "use_dora": False,
    "fan_in_fan_out": False,
    "modules_to_save": None,
    "rank_pattern": {},
    "alpha_pattern": {},
    "bias": "none",
    "layer_replication": None,
    "trainable_token_indices": None,
}


class LoRAAdapterError(ValueError):
    """An adapter jaxserve cannot serve (the message names what and why)."""


def target_shapes(cfg: ArchConfig) -> dict[str, tuple[tuple[int, ...], tuple[int, ...]]]:
    """Each target's (input dims, output dims), as our weights lay them."""
    E, F, Hq, Hkv, D = (
        cfg.hidden_size,
        cfg.intermediate_size,
        cfg.num_heads,
        cfg.num_kv_heads,
        cfg.head_dim,
    )
    q, kv, e, f = (Hq, D), (Hkv, D), (E,), (F,)
    return {
        "wq": (e, q),
        "wk": (e, kv),
        "wv": (e, kv),
        "wo": (q, e),
        "w_gate": (e, f),
        "w_up": (e, f),
        "w_down": (f, e),
    }


@dataclasses.dataclass(frozen=True)
class LoRAAdapter:
    """One adapter on the host: (layer, target) -> (A [in..., r], B [r, out...] * scale)."""

    name: str
    rank: int
    scale: float
    weights: dict[tuple[int, str], tuple[np.ndarray, np.ndarray]]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.weights.values())


def _check_config(conf: dict, name: str, max_rank: int) -> tuple[int, float]:
    if str(conf.get("peft_type", "LORA")).upper() != "LORA":
        raise LoRAAdapterError(
            f"LoRA adapter {name!r}: peft_type {conf.get('peft_type')!r} is not "
            "supported (only LORA)."
        )
    for key, default in _UNSUPPORTED.items():
        value = conf.get(key, default)
        if value is not None and value != default and value not in ({}, [], False, "none"):
            if key == "use_dora":
                raise LoRAAdapterError(f"LoRA adapter {name!r}: DoRA (use_dora) is not supported.")
            raise LoRAAdapterError(f"LoRA adapter {name!r}: {key}={value!r} is not supported.")
    r = conf.get("r")
    if not isinstance(r, int) or r < 1:
        raise LoRAAdapterError(f"LoRA adapter {name!r}: invalid rank r={r!r}.")
    if r > max_rank:
        raise LoRAAdapterError(
            f"LoRA adapter {name!r} has rank {r}, above max_lora_rank {max_rank}."
        )
    targets = conf.get("target_modules")
    if isinstance(targets, (list, tuple)):
        unknown = sorted({t for t in targets if t.split(".")[-1] not in _BY_MODULE})
        if unknown:
            raise LoRAAdapterError(
                f"LoRA adapter {name!r} targets module(s) {', '.join(unknown)}; "
                f"supported: {', '.join(TARGETS.values())}."
            )
    alpha = conf.get("lora_alpha", r)
    scale = alpha / math.sqrt(r) if conf.get("use_rslora") else alpha / r
    return r, float(scale)


def read_config(path: str | pathlib.Path, max_rank: int, name: str | None = None) -> dict:
    """An adapter directory's adapter_config.json, checked (what the front end refuses before
    a request is queued); LoRAAdapterError names what is wrong."""
    path = pathlib.Path(path)
    name = name or path.name
    conf_file, weights_file = path / "adapter_config.json", path / "adapter_model.safetensors"
    for f in (conf_file, weights_file):
        if not f.is_file():
            raise LoRAAdapterError(
                f"LoRA adapter {name!r}: {f} does not exist (a PEFT adapter "
                "directory has adapter_config.json and adapter_model.safetensors)."
            )
    try:
        conf = json.loads(conf_file.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise LoRAAdapterError(f"LoRA adapter {name!r}: cannot read {conf_file}: {e}") from e
    _check_config(conf, name, max_rank)
    return conf


def load_adapter(
    path: str | pathlib.Path, cfg: ArchConfig, max_rank: int, name: str | None = None
) -> LoRAAdapter:
    """The PEFT adapter in directory `path`, checked against the model (`cfg`) and max_rank."""
    path = pathlib.Path(path)
    name = name or path.name
    r, scale = _check_config(read_config(path, max_rank, name), name, max_rank)
    weights_file = path / "adapter_model.safetensors"
    shapes = target_shapes(cfg)
    entries, _ = read_header(weights_file)
    mapped = memmap(weights_file)
    halves: dict[tuple[int, str, str], np.ndarray] = {}
    for key, entry in entries.items():
        m = _KEY.match(key)
        if m is None:
            raise LoRAAdapterError(
                f"LoRA adapter {name!r}: tensor {key!r} is not a LoRA weight of "
                f"a supported module ({', '.join(TARGETS.values())})."
            )
        layer, module, half = int(m.group(1)), m.group(2), m.group(3)
        if module not in _BY_MODULE:
            raise LoRAAdapterError(
                f"LoRA adapter {name!r}: module {module!r} is not supported "
                f"(supported: {', '.join(TARGETS.values())})."
            )
        if layer >= cfg.num_layers:
            raise LoRAAdapterError(
                f"LoRA adapter {name!r}: layer {layer} does not exist (the model "
                f"has {cfg.num_layers})."
            )
        halves[(layer, _BY_MODULE[module], half)] = np.asarray(
            tensor_view(mapped, entry), np.float32
        )
    weights = {}
    for (layer, target, half), value in halves.items():
        if half != "A":
            continue
        b = halves.get((layer, target, "B"))
        if b is None:
            raise LoRAAdapterError(
                f"LoRA adapter {name!r}: layer {layer} {TARGETS[target]} has lora_A without lora_B."
            )
        a = value
        in_dims, out_dims = shapes[target][:2]
        if a.shape != (r, math.prod(in_dims)) or b.shape != (math.prod(out_dims), r):
            raise LoRAAdapterError(
                f"LoRA adapter {name!r}: layer {layer} {TARGETS[target]} has lora_A "
                f"{list(a.shape)} and lora_B {list(b.shape)}; the model needs "
                f"[{r}, {math.prod(in_dims)}] and "
                f"[{math.prod(out_dims)}, {r}]."
            )
        weights[(layer, target)] = (
            np.ascontiguousarray(a.T).reshape(*in_dims, r),
            np.ascontiguousarray(b.T * scale).reshape(r, *out_dims),
        )
    if any(h == "B" and (layer, t) not in weights for layer, t, h in halves):
        raise LoRAAdapterError(f"LoRA adapter {name!r}: a lora_B has no lora_A.")
    if not weights:
        raise LoRAAdapterError(f"LoRA adapter {name!r} holds no LoRA weights.")
    return LoRAAdapter(name, r, scale, weights)
