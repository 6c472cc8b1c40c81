"""vLLM's `speculative_config`: which drafter, how many drafts, and the forms it is given in
(a dict, its JSON text on the command line). EngineConfig holds one (jaxserve/config.py)."""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Literal

# The speculative methods that draft inside the target's compiled step, and what drafts
# (runner/draft_head_step.py); those that take a "model" of their own.
STEP_DRAFTERS = {"eagle3": "EAGLE-3 draft head", "deepseek_mtp": "DeepSeek MTP layer",
                 "draft_model": "draft model"}
MODEL_DRAFTERS = {m: STEP_DRAFTERS[m] for m in ("eagle3", "draft_model")}


@dataclasses.dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding, vLLM's `speculative_config`. Four methods: "ngram" (prompt lookup:
    the drafts are the tokens that followed the latest earlier occurrence of the longest n-gram,
    prompt_lookup_min <= n <= prompt_lookup_max, ending the request's context), "eagle3" (an
    EAGLE-3 draft head, `model`, run inside the target's compiled step on the target's hidden
    states), "deepseek_mtp" (vLLM's "mtp" too: a DeepSeek V3 checkpoint's own
    multi-token-prediction layer, run the same way) and "draft_model" (a small causal LM with
    the target's vocabulary, `model`, run inside the target's compiled step with its own KV
    cache); the model checks the drafts all in one step (jaxserve/spec_decode/). Without
    "method", as vLLM: "ngram" when `model` is "ngram", else "draft_model"."""

    method: Literal["ngram", "eagle3", "deepseek_mtp", "draft_model"] = "ngram"
    """How drafts are made: ngram (prompt lookup), eagle3 (an EAGLE-3 draft head: `model`),
    deepseek_mtp ("mtp": the target's own MTP layer) or draft_model (a smaller causal LM:
    `model`)."""
    num_speculative_tokens: int = 0
    """Draft tokens per step and request at most (required, >= 1)."""
    prompt_lookup_min: int | None = None
    """ngram: the shortest n-gram matched. Default: prompt_lookup_max if given, else 5 (vLLM's)."""
    prompt_lookup_max: int | None = None
    """ngram: the longest n-gram matched. Default: prompt_lookup_min if given, else 5 (vLLM's)."""
    model: str | None = None
    """eagle3: the draft head; draft_model: the draft model (the target's vocabulary and
    tokenizer); a local HF directory or a Hugging Face Hub name (required for both)."""

    def __post_init__(self) -> None:
        if self.method not in ("ngram", "[ngram]", "mtp", *STEP_DRAFTERS):
            raise ValueError(f"speculative_config: method {self.method!r} is not supported; jaxserve "
                             "drafts with 'ngram' (prompt lookup), 'eagle3' (an EAGLE-3 draft "
                             "head), 'deepseek_mtp' / 'mtp' (a DeepSeek V3 checkpoint's MTP "
                             "layer) or 'draft_model' (a smaller causal LM).")
        aliases = {"[ngram]": "ngram", "mtp": "deepseek_mtp"}
        if self.method in aliases:
            object.__setattr__(self, "method", aliases[self.method])
        if not isinstance(self.num_speculative_tokens, int) or self.num_speculative_tokens < 1:
            raise ValueError("speculative_config: num_speculative_tokens must be a positive integer, "
                             f"got {self.num_speculative_tokens!r}.")
        if self.method == "deepseek_mtp":
            if self.model is not None:
                raise ValueError('speculative_config: method "deepseek_mtp" drafts with the target '
                                 'checkpoint\'s own MTP layers; leave out "model".')
            if self.prompt_lookup_min is not None or self.prompt_lookup_max is not None:
                raise ValueError("speculative_config: prompt_lookup_min / prompt_lookup_max are "
                                 'the "ngram" method\'s.')
            return
        if self.method in MODEL_DRAFTERS:
            if not isinstance(self.model, str) or not self.model:
                raise ValueError(f'speculative_config: method "{self.method}" needs "model", the '
                                 f"{MODEL_DRAFTERS[self.method]}'s directory or Hub name.")
            if self.prompt_lookup_min is not None or self.prompt_lookup_max is not None:
                raise ValueError("speculative_config: prompt_lookup_min / prompt_lookup_max are "
                                 f'the "ngram" method\'s; method "{self.method}" takes "model".')
            return
        if self.model is not None:
            raise ValueError('speculative_config: "model" is for method "eagle3" or "draft_model"; '
                             "the \"ngram\" method drafts from the request's own tokens.")
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        if lo is None and hi is None:
            lo = hi = 5
        lo = hi if lo is None else lo
        hi = lo if hi is None else hi
        for name, v in (("prompt_lookup_min", lo), ("prompt_lookup_max", hi)):
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"speculative_config: {name} must be a positive integer, got {v!r}.")
        if lo > hi:
            raise ValueError(f"speculative_config: prompt_lookup_min ({lo}) exceeds prompt_lookup_max ({hi}).")
        object.__setattr__(self, "prompt_lookup_min", lo)
        object.__setattr__(self, "prompt_lookup_max", hi)

    @classmethod
    def parse(cls, value: SpeculativeConfig | dict[str, Any] | str | None) -> SpeculativeConfig | None:
        """From vLLM's forms: a dict (`LLM(speculative_config={...})`), its JSON text
        (`--speculative-config`), or None (off). Unknown keys are an error naming them."""
        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"speculative_config: not valid JSON ({e})") from None
        if not isinstance(value, dict):
            raise ValueError("speculative_config must be a JSON object, e.g. "
                             '{"method": "ngram", "num_speculative_tokens": 4}.')
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"speculative_config: unsupported key(s) {', '.join(unknown)}; "
                             f"accepted: {', '.join(sorted(known))}.")
        if "method" not in value:  # vLLM's inference: "ngram" named as the model, else a draft model
            model = value.get("model")
            if model in ("ngram", "[ngram]"):
                value = {**{k: v for k, v in value.items() if k != "model"}, "method": "ngram"}
            elif model is not None:
                value = {**value, "method": "draft_model"}
            else:
                raise ValueError('speculative_config: "method" ("ngram", "eagle3", "deepseek_mtp" or '
                                 '"draft_model") or "model" is required.')
        return cls(**value)
