"""How an embedding model pools: read from its sentence-transformers files, as vLLM does.

A sentence-transformers checkpoint lists its modules in `modules.json` (types named
`sentence_transformers.models.Pooling`, or since v5.4 `...modules.pooling.Pooling`); the
Pooling module's folder (usually `1_Pooling/`) holds `config.json` with its mode
(`pooling_mode`, or before v5.4 `pooling_mode_*` flags; neither: mean, sentence-transformers'
default), and a `Normalize` module asks for L2-normalized embeddings. Without `modules.json` a
decoder model pools its last token and normalizes (Qwen3-Embedding's and e5-mistral's recipe).
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
from typing import Literal

Pooling = Literal["last", "mean"]

# Bidirectional encoders: their attention is not causal and they carry no KV cache; jaxserve
# embeds with decoder models only, and says so by name.
ENCODER_ARCHITECTURES = frozenset({
    "BertModel", "BertForMaskedLM", "RobertaModel", "RobertaForMaskedLM", "XLMRobertaModel",
    "XLMRobertaForMaskedLM", "DistilBertModel", "MPNetModel", "NomicBertModel", "ModernBertModel",
    "DebertaV2Model", "ElectraModel", "T5EncoderModel", "GteModel", "NewModel",
})

# sentence-transformers' pooling modes: `pooling_mode` in its config since v5.4 (a name or a
# list), before that one `pooling_mode_<key>` flag per mode; no mode at all is its default, mean.
_SUPPORTED = {"lasttoken": "last", "mean": "mean"}
_LEGACY_KEYS = {"cls_token": "cls", "max_tokens": "max", "mean_tokens": "mean",
                "mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
                "weightedmean_tokens": "weightedmean", "lasttoken": "lasttoken"}


@dataclasses.dataclass(frozen=True)
class PoolingConfig:
    pooling: Pooling = "last"
    normalize: bool = True
    source: str = "default (last token, normalized)"  # where it came from, for the log


def check_decoder(architectures: list[str] | None) -> None:
    """Refuse bidirectional encoders by name (BERT and its kin)."""
    for name in architectures or ():
        if name in ENCODER_ARCHITECTURES:
            raise ValueError(
                f"{name} is a bidirectional encoder; jaxserve's pooling runner embeds with "
                "decoder models only (the Llama, Qwen2 and Qwen3 families, e.g. "
                "Qwen3-Embedding). BERT-style encoders are out of scope.")


def load_pooling_config(model_dir: str | pathlib.Path) -> PoolingConfig:
    """The pooling of the sentence-transformers files in `model_dir`, else the default."""
    root = pathlib.Path(model_dir)
    modules_file = root / "modules.json"
    if not modules_file.is_file():
        return PoolingConfig()
    modules = json.loads(modules_file.read_text())
    normalize = any(str(m.get("type", "")).endswith("Normalize") for m in modules)
    pooling_dirs = [m.get("path", "") for m in modules
                    if str(m.get("type", "")).endswith("Pooling")]
    if not pooling_dirs:
        return PoolingConfig("last", normalize, "modules.json (no Pooling module: last token)")
    cfg_file = root / pooling_dirs[0] / "config.json"
    cfg = json.loads(cfg_file.read_text()) if cfg_file.is_file() else {}
    modes = _pooling_modes(cfg)
    if len(modes) != 1 or modes[0] not in _SUPPORTED:
        raise ValueError(f"{cfg_file}: pooling {', '.join(modes)} is not supported; jaxserve "
                         "pools the last token (lasttoken) or the mean of the tokens (mean)")
    pooling = _SUPPORTED[modes[0]]
    if pooling == "mean" and cfg.get("include_prompt") is False:
        raise ValueError(f"{cfg_file}: mean pooling without the prompt's instruction tokens "
                         "(include_prompt false) is not supported")
    return PoolingConfig(pooling, normalize, f"{cfg_file.relative_to(root)}")


def _pooling_modes(cfg: dict) -> list[str]:
    """The modes a Pooling module's config.json asks for, in sentence-transformers' names."""
    if "pooling_mode" in cfg:
        mode = cfg["pooling_mode"]
        return [mode] if isinstance(mode, str) else list(mode)
    return [mode for key, mode in _LEGACY_KEYS.items() if cfg.get(f"pooling_mode_{key}")] or ["mean"]


def as_causal_lm(ckpt):
    """A pooling checkpoint saved from a decoder's base model (`Qwen3Model`, `MistralModel`,
    ...: tensors without the `model.` prefix, no `lm_head`) as its causal LM: the architecture
    renamed, the tensors prefixed, and without a head the embedding matrix standing in as a
    tied one (the pooling runner never computes logits). Other checkpoints are returned as
    they are."""
    config = dict(ckpt.config)
    config["architectures"] = [a[: -len("Model")] + "ForCausalLM" if a.endswith("Model") else a
                               for a in config.get("architectures") or ()]
    entries = dict(ckpt._entries)
    if entries and not any(name.startswith("model.") for name in entries):
        entries = {(n if n.startswith("lm_head.") else f"model.{n}"): e for n, e in entries.items()}
    if "lm_head.weight" not in entries:
        config["tie_word_embeddings"] = True
    if config == ckpt.config and entries == ckpt._entries:
        return ckpt
    return dataclasses.replace(ckpt, config=config, _entries=entries)
