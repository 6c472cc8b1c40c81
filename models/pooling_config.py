"""How an embedding model pools: read from its sentence-transformers files, as vLLM does.

A sentence-transformers checkpoint lists its modules in `modules.json` (types named
`sentence_transformers.models.Pooling`, or since v5.4 `...modules.pooling.Pooling`); the
Pooling module's folder (usually `1_Pooling/`) holds `config.json` with `pooling_mode_*`
flags, and a `Normalize` module asks for L2-normalized embeddings. Without `modules.json` a
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

_MODES = {"pooling_mode_lasttoken": "last", "pooling_mode_mean_tokens": "mean"}
_UNSUPPORTED_MODES = ("pooling_mode_cls_token", "pooling_mode_max_tokens",
                      "pooling_mode_mean_sqrt_len_tokens", "pooling_mode_weightedmean_tokens")


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
    modes = [mode for key, mode in _MODES.items() if cfg.get(key)]
    other = [key for key in _UNSUPPORTED_MODES if cfg.get(key)]
    if other or len(modes) > 1:
        asked = ", ".join(other + [k for k in _MODES if cfg.get(k)])
        raise ValueError(f"{cfg_file}: pooling {asked} is not supported; jaxserve pools the last "
                         "token or the mean of the tokens")
    pooling = modes[0] if modes else "last"
    if pooling == "mean" and cfg.get("include_prompt") is False:
        raise ValueError(f"{cfg_file}: mean pooling without the prompt's instruction tokens "
                         "(include_prompt false) is not supported")
    return PoolingConfig(pooling, normalize, f"{cfg_file.relative_to(root)}")


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
