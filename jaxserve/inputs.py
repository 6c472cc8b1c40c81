"""Prompt inputs as vLLM takes them (`vllm.inputs`), and the one function that reads them.

A prompt is a string, a list of token ids, a `TextPrompt` (`{"prompt": str}`) or a
`TokensPrompt` (`{"prompt_token_ids": [int, ...]}`, with the text it came from as an optional
`"prompt"`); either dict may carry a `cache_salt` (its prefix-cache entries are shared only with
prompts of the same salt) and `multi_modal_data` (refused: every model jaxserve serves takes
text alone). A batch is a list of any mix of them; a flat list of ints is one prompt of token
ids, as in vLLM.

`parse_prompts` (a prompt or a batch) and `parse_prompt` (one) turn all of these into `Prompt`s.
They are the only readers of the client's forms: `LLM.generate`, `LLM.embed`, `LLM.beam_search`,
the engine's input processor and the HTTP routes all go through them, so that the forms cannot
drift apart again (a dict was once iterated as if it were a list of prompts). Anything else is a
TypeError that names the accepted forms; a form vLLM has but no served model takes (prompt
embeddings, encoder-decoder prompts, images) is a ValueError that names it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, NotRequired, TypedDict

__all__ = ["ACCEPTED_FORMS", "Prompt", "PromptType", "TextPrompt", "TokensPrompt", "parse_prompt",
           "parse_prompts"]


class TextPrompt(TypedDict):
    """A prompt as text (tokenized by the engine)."""

    prompt: str
    multi_modal_data: NotRequired[Any]
    mm_processor_kwargs: NotRequired[dict[str, Any]]
    cache_salt: NotRequired[str]


class TokensPrompt(TypedDict):
    """A prompt as token ids (`prompt`: the text they came from, reported back if given)."""

    prompt_token_ids: list[int]
    prompt: NotRequired[str]
    multi_modal_data: NotRequired[Any]
    mm_processor_kwargs: NotRequired[dict[str, Any]]
    cache_salt: NotRequired[str]


PromptType = str | list[int] | TextPrompt | TokensPrompt

ACCEPTED_FORMS = ("a string, a list of token ids, a TextPrompt ({'prompt': str}), a TokensPrompt "
                  "({'prompt_token_ids': [int, ...]}), or a list of these")

_KNOWN_KEYS = frozenset({"prompt", "prompt_token_ids", "multi_modal_data", "mm_processor_kwargs",
                         "cache_salt"})
# vLLM's other prompt forms and fields, which no model served here takes.
_UNSERVED_KEYS = {
    "prompt_embeds": "prompt embeddings (EmbedsPrompt)",
    "encoder_prompt": "encoder-decoder prompts",
    "decoder_prompt": "encoder-decoder prompts",
    "token_type_ids": "token type ids",
    "multi_modal_uuids": "multi-modal data",
}


@dataclasses.dataclass(frozen=True, slots=True)
class Prompt:
    """One prompt, read: its token ids when the client sent ids, its text when the client sent
    text (or both: ids with the text they came from), and its prefix-cache salt."""

    text: str | None = None
    token_ids: tuple[int, ...] | None = None
    cache_salt: str | None = None

    def __post_init__(self) -> None:
        if self.text is None and self.token_ids is None:
            raise ValueError("a prompt needs its text or its token ids")


def _is_token(x: Any) -> bool:
    # bool is an int in Python, but True is not a token id anyone means
    return isinstance(x, int) and not isinstance(x, bool) or _is_numpy_int(x)


def _is_numpy_int(x: Any) -> bool:
    return type(x).__module__ == "numpy" and getattr(x, "dtype", None) is not None and x.dtype.kind in "iu"


def _is_token_list(x: Any) -> bool:
    return isinstance(x, (list, tuple)) and all(_is_token(t) for t in x)


def _refuse(x: Any, where: str = "") -> TypeError:
    shown = repr(x)
    if len(shown) > 80:
        shown = shown[:77] + "..."
    return TypeError(f"{where}unsupported prompt {shown} ({type(x).__name__}); a prompt is {ACCEPTED_FORMS}.")


def _token_ids(value: Any, where: str) -> tuple[int, ...]:
    if hasattr(value, "tolist") and not isinstance(value, (list, tuple)):  # a numpy array
        value = value.tolist()
    if isinstance(value, str) or not _is_token_list(value):
        raise TypeError(f"{where}'prompt_token_ids' must be a list of ints, got {type(value).__name__}.")
    return tuple(int(t) for t in value)


def _from_dict(d: Mapping[str, Any], where: str) -> Prompt:
    for key, what in _UNSERVED_KEYS.items():
        if key in d:
            raise ValueError(f"{where}{what} ({key!r}) are not supported: the models jaxserve serves "
                             "take text or token ids.")
    unknown = sorted(str(k) for k in d if k not in _KNOWN_KEYS)
    if unknown:
        raise TypeError(f"{where}a prompt dict has no key(s) {', '.join(map(repr, unknown))}; a prompt "
                        f"is {ACCEPTED_FORMS}, with optional 'cache_salt'.")
    if d.get("multi_modal_data"):
        raise ValueError(f"{where}multi_modal_data was given, but this model takes text alone.")
    salt = d.get("cache_salt")
    if salt is not None and (not isinstance(salt, str) or not salt):
        raise TypeError(f"{where}'cache_salt' must be a non-empty string.")
    text = d.get("prompt")
    if text is not None and not isinstance(text, str):
        raise TypeError(f"{where}'prompt' must be a string, got {type(text).__name__}.")
    if "prompt_token_ids" in d:
        return Prompt(text, _token_ids(d["prompt_token_ids"], where), salt)
    if text is None:
        raise TypeError(f"{where}a prompt dict needs 'prompt' (text) or 'prompt_token_ids'; a prompt is "
                        f"{ACCEPTED_FORMS}.")
    return Prompt(text, None, salt)


def parse_prompt(x: Any, *, where: str = "") -> Prompt:
    """One prompt in any of vLLM's forms (a `Prompt` passes through). `where` prefixes the
    error messages (e.g. "prompt 3: ")."""
    if isinstance(x, Prompt):
        return x
    if isinstance(x, str):
        return Prompt(text=x)
    if isinstance(x, Mapping):
        return _from_dict(x, where)
    if hasattr(x, "tolist") and not isinstance(x, (list, tuple)) and getattr(x, "ndim", None) == 1:
        x = x.tolist()  # a numpy array of ids
    if _is_token_list(x):
        return Prompt(token_ids=tuple(int(t) for t in x))
    raise _refuse(x, where)


def parse_prompts(x: Any) -> list[Prompt]:
    """A prompt or a batch of them, in vLLM's forms, as a list of `Prompt`s (in order). A flat
    list of ints is one prompt; an empty list is an empty batch."""
    if isinstance(x, (str, Mapping, Prompt)):
        return [parse_prompt(x)]
    if hasattr(x, "tolist") and not isinstance(x, (list, tuple)):
        x = x.tolist()
    if isinstance(x, (list, tuple)):
        if x and _is_token_list(x):
            return [parse_prompt(x)]
        return [parse_prompt(p, where=f"prompt {i}: " if len(x) > 1 else "") for i, p in enumerate(x)]
    raise _refuse(x)  # a number, None, a set or a generator (no order or length), ...
