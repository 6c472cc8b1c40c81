"""What a draft model (speculative_config method "draft_model") must be to draft for a target.

The step drafts with it inside the target's program (runner/draft_head_step.py,
`DraftModelHead`) and the target verifies its tokens as its own: so it must be a causal LM the
engine serves, in float weights (the target's dtype), over the target's vocabulary with the
target's tokenizer. Anything else
is refused at start, by name.
"""

from __future__ import annotations

import dataclasses
import logging
import pathlib

from jaxserve.config import EngineConfig
from jaxserve.models.arch_config import ArchConfig
from jaxserve.models.loader import load_checkpoint, resolve_model
from jaxserve.models.registry import get_model_class

logger = logging.getLogger(__name__)

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")


class TargetTokenizer:
    """The target's tokenizer read only when asked for, as a future of it (`checked_draft_model`
    reads it for a draft model with a tokenizer of its own): what the tools that plan without
    starting an engine pass."""

    def __init__(self, model: str):
        self.model = model

    def result(self):
        from jaxserve.engine.tokenizer import Tokenizer

        return Tokenizer.from_pretrained(self.model)


def detect_eagle3_head(config: EngineConfig) -> EngineConfig:
    """`config` with method "eagle3" where "draft_model" (given, or inferred for a "model"
    without a method) names an EAGLE-3 head (a speculators "eagle3" config, or an original
    EAGLE-3 repository's architectures): vLLM detects the method from the draft checkpoint so.
    Unchanged otherwise (a model that cannot be read is refused later, by name)."""
    from jaxserve.models.eagle3 import ORIGINAL_ARCHITECTURES

    spec, mc = config.speculative_config, config.model
    if spec is None or spec.method != "draft_model":
        return config
    try:
        path = resolve_model(spec.model, cache_dir=mc.model_cache_dir, download_dir=mc.download_dir)
        hf = load_checkpoint(path).config
    except ValueError:
        return config
    if hf.get("speculators_model_type") != "eagle3" and not set(hf.get("architectures") or ()) & set(
            ORIGINAL_ARCHITECTURES):
        return config
    logger.info("speculative_config model %r is an EAGLE-3 head: method 'eagle3'", spec.model)
    return dataclasses.replace(config, speculative_config=dataclasses.replace(spec, method="eagle3"))


def checked_draft_model(config: EngineConfig, target_config: dict, target_tokenizer) -> str:
    """The draft model's directory (a Hub name resolved as the target's is), checked against
    the target (`target_config` its config.json, `target_tokenizer` its Tokenizer or a future
    of it): ValueError naming what does not fit."""
    spec, mc = config.speculative_config, config.model
    name = spec.model
    local = pathlib.Path(name).expanduser()
    if (local / "adapter_config.json").is_file() and not (local / "config.json").is_file():
        raise ValueError(f"speculative_config model {name!r}: it is a LoRA adapter, not a model: a draft "
                         "model is a whole causal LM")
    try:
        path = resolve_model(name, cache_dir=mc.model_cache_dir, download_dir=mc.download_dir)
        hf = load_checkpoint(path).config
    except ValueError as e:
        raise ValueError(f"speculative_config model {name!r}: {e}") from None
    what = f"speculative_config model {name!r}"
    architectures = hf.get("architectures") or []
    if hf.get("speculators_model_type") or any("eagle" in a.lower() for a in architectures):
        raise ValueError(f"{what} is a speculator checkpoint ({hf.get('speculators_model_type') or architectures}), "
                         "not a draft model; of those jaxserve serves EAGLE-3 heads (method 'eagle3')")
    if architectures and all(a.endswith("Model") for a in architectures):
        raise ValueError(f"{what} is a base model ({', '.join(architectures)}), not a causal LM: a draft "
                         "model generates tokens (pooling models do not draft)")
    try:
        draft = ArchConfig.from_hf(hf)
        get_model_class(draft.architecture)
    except (ValueError, KeyError) as e:
        raise ValueError(f"{what}: {e}") from None
    if draft.weight_format is not None:
        raise ValueError(f"{what} is quantized ({draft.weight_format.describe()}); a draft model runs in "
                         "float weights, in the target's dtype")
    target = ArchConfig.from_hf(target_config)
    if draft.vocab_size != target.vocab_size:
        raise ValueError(f"{what}: its vocabulary size ({draft.vocab_size}) differs from the target's "
                         f"({target.vocab_size}); a draft model shares the target's vocabulary and tokenizer")
    _check_tokenizer(what, pathlib.Path(path), target_tokenizer)
    if config.model.max_model_len and draft.max_position_embeddings < config.model.max_model_len:
        logger.warning("%s: its context (%d) is shorter than max_model_len (%d): its drafts past it are "
                       "poor (verified all the same)", what, draft.max_position_embeddings, config.model.max_model_len)
    return str(path)


def _check_tokenizer(what: str, path: pathlib.Path, target_tokenizer) -> None:
    """The draft model's tokenizer, where its directory has one, must map the same strings to
    the same ids as the target's."""
    if not any((path / f).is_file() for f in TOKENIZER_FILES):
        return  # the target's tokenizer is the only one: the vocabulary size was checked
    from jaxserve.engine.tokenizer import Tokenizer

    if hasattr(target_tokenizer, "result"):
        target_tokenizer = target_tokenizer.result()
    mine = Tokenizer.from_pretrained(path).hf_tokenizer.get_vocab()
    theirs = target_tokenizer.hf_tokenizer.get_vocab()
    if mine != theirs:
        differ = sorted(set(mine.items()) ^ set(theirs.items()))[:3]
        raise ValueError(f"{what}: its tokenizer differs from the target's ({len(mine)} and {len(theirs)} "
                         f"entries; e.g. {', '.join(repr(t) for t, _ in differ)}); a draft model shares the "
                         "target's tokenizer")
