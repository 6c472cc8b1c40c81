"""A model's `generation_config.json`: its end-of-sequence ids and default sampling settings.

`ModelConfig.generation_config` (`--generation-config`) works as vLLM's:
- "auto": the model directory's generation_config.json (else the ids of config.json);
- "vllm": ignore the file's sampling defaults (vLLM's own defaults apply); EOS ids still come
  from the model;
- a path: the generation_config.json in that folder (or that file).
The sampling defaults apply to requests that leave a field unset (the server) or that pass no
SamplingParams at all (`LLM.generate`), as in vLLM.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import pathlib
from typing import Any

logger = logging.getLogger(__name__)

# The SamplingParams fields a generation_config.json may give defaults for (vLLM's
# `get_diff_sampling_param`, whose max_new_tokens is `max_new_tokens` below).
SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


@dataclasses.dataclass(frozen=True)
class GenerationConfig:
    eos_token_ids: tuple[int, ...] = ()  # every id that ends generation (the primary one too)
    sampling_defaults: dict[str, Any] = dataclasses.field(default_factory=dict)  # SamplingParams names
    # The default of max_tokens where a request leaves it unset (capped by the context).
    max_new_tokens: int | None = None


def _ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def _read(path: pathlib.Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot read the generation config {path}: {e}") from None


def load_generation_config(model_dir: str | pathlib.Path, setting: str = "auto",
                           hf_config: dict[str, Any] | None = None) -> GenerationConfig:
    """The EOS ids and sampling defaults for `setting` ("auto" | "vllm" | a path)."""
    model_dir = pathlib.Path(model_dir)
    if setting in ("auto", "vllm"):
        source = _read(model_dir / "generation_config.json")
    else:
        path = pathlib.Path(setting)
        if path.is_dir():
            path = path / "generation_config.json"
        if not path.is_file():
            raise ValueError(f"--generation-config {setting!r}: no generation_config.json there")
        source = _read(path)
    eos = _ids(source.get("eos_token_id"))
    if not eos and hf_config is not None:
        eos = _ids(hf_config.get("eos_token_id"))
    if setting == "vllm":
        return GenerationConfig(eos_token_ids=eos)
    defaults = {k: source[k] for k in SAMPLING_FIELDS if source.get(k) is not None}
    max_new = source.get("max_new_tokens")
    if defaults or max_new is not None:
        logger.info("default sampling parameters from the model's generation config: %s%s "
                    "(--generation-config vllm ignores them)", defaults,
                    f", max_tokens {max_new}" if max_new is not None else "")
    return GenerationConfig(eos_token_ids=eos, sampling_defaults=defaults,
                            max_new_tokens=int(max_new) if max_new is not None else None)
