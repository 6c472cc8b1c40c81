"""The engine's tokenizer: a thin wrapper over a Hugging Face fast tokenizer, plus an incremental
detokenizer for streaming.

Decoding never applies `clean_up_tokenization_spaces`, so that streamed deltas always add up to
`Tokenizer.decode` of the same ids.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

# how many prompt tokens seed the detokenizer, so the first generated token decodes in context
INITIAL_CONTEXT_TOKENS = 5
_REPLACEMENT = "\ufffd"  # what byte-level decoding yields for an incomplete UTF-8 sequence


class Tokenizer:
    """Encode/decode and chat templates over an HF fast tokenizer."""

    def __init__(self, hf_tokenizer: PreTrainedTokenizerBase) -> None:
        self._hf = hf_tokenizer
        self._special_ids = frozenset(hf_tokenizer.all_special_ids)

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike[str]) -> Tokenizer:
        """The tokenizer of a local HF model directory (see `jaxserve.models.loader`)."""
        from jaxserve.models.loader import load_tokenizer

        return cls(load_tokenizer(path))

    @property
    def hf_tokenizer(self) -> PreTrainedTokenizerBase:
        return self._hf

    # ---------------------------------------------------------------- encode / decode

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self._hf(text, add_special_tokens=add_special_tokens)["input_ids"])

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return self._hf.decode(
            list(ids), skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False
        )

    def convert_ids_to_tokens(
        self, ids: Sequence[int], skip_special_tokens: bool = False
    ) -> list[str]:
        return list(
            self._hf.convert_ids_to_tokens(list(ids), skip_special_tokens=skip_special_tokens)
        )

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **kwargs: Any
    ) -> str:
        """The prompt text for a conversation (not tokenized)."""
        if self._hf.chat_template is None and "chat_template" not in kwargs:
            raise ValueError(
                "this model's tokenizer has no chat template; send plain completions instead"
            )
        return self._hf.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt, **kwargs
        )

    # ---------------------------------------------------------------- facts

    @property
    def eos_token_id(self) -> int | None:
        return self._hf.eos_token_id

    @property
    def bos_token_id(self) -> int | None:
        return self._hf.bos_token_id

    @property
    def pad_token_id(self) -> int | None:
        return self._hf.pad_token_id

    @property
    def vocab_size(self) -> int:
        """Number of token ids the tokenizer can produce (base vocabulary plus added tokens)."""
        return len(self._hf)

    @property
    def all_special_ids(self) -> list[int]:
        return list(self._hf.all_special_ids)

    @property
    def special_ids(self) -> frozenset[int]:
        return self._special_ids

    def detokenizer(
        self, *, skip_special_tokens: bool = True, prompt_token_ids: Sequence[int] | None = None
    ) -> IncrementalDetokenizer | StreamDetokenizer:
        """A streaming detokenizer for one sequence: the tokenizers library's incremental decoder
        where the tokenizer has one (a fast tokenizer: one native call per token), else the
        window scheme over `decode`."""
        backend = getattr(self._hf, "backend_tokenizer", None)
        if backend is not None:
            return StreamDetokenizer(
                self, backend, skip_special_tokens=skip_special_tokens, prompt_token_ids=prompt_token_ids
            )
        return IncrementalDetokenizer(
            self, skip_special_tokens=skip_special_tokens, prompt_token_ids=prompt_token_ids
        )


class IncrementalDetokenizer:
    """Per-request streaming detokenization: feed token ids, get the new text.

    vLLM's prefix/read-offset scheme over token ids: text is only released once the tokens read so
    far decode to complete characters (no trailing U+FFFD from a multi-byte UTF-8 sequence split
    across byte-level tokens). Decoding a short window (`ids[prefix_offset:]`) rather than the
    whole sequence keeps each step O(1). `flush()` releases whatever is still held back at the end,
    so the deltas always add up to `Tokenizer.decode(all ids)`.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        *,
        skip_special_tokens: bool = True,
        prompt_token_ids: Sequence[int] | None = None,
    ) -> None:
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        context = [t for t in (prompt_token_ids or ()) if not self._skipped(t)]
        self._ids: list[int] = context[-INITIAL_CONTEXT_TOKENS:]
        self._prefix_offset = 0
        self._read_offset = len(self._ids)

    def _skipped(self, token_id: int) -> bool:
        return self._skip and token_id in self._tokenizer.special_ids

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip)

    def add_tokens(self, token_ids: Iterable[int]) -> str:
        """Feed newly generated ids; returns the text they complete (possibly empty)."""
        pieces = []
        for token_id in token_ids:
            token_id = int(token_id)
            if self._skipped(token_id):
                continue
            self._ids.append(token_id)
            prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
            new_text = self._decode(self._ids[self._prefix_offset :])
            if len(new_text) > len(prefix_text) and not new_text.endswith(_REPLACEMENT):
                pieces.append(new_text[len(prefix_text) :])
                self._prefix_offset = self._read_offset
                self._read_offset = len(self._ids)
        return "".join(pieces)

    def flush(self) -> str:
        """Release text held back at the end of the stream (an unfinished UTF-8 sequence decodes
        to U+FFFD, as `decode` would show it)."""
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset :])
        delta = new_text[len(prefix_text) :] if len(new_text) > len(prefix_text) else ""
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        return delta


class StreamDetokenizer:
    """`IncrementalDetokenizer`'s contract over the tokenizers library's `DecodeStream`: one
    native call per token (about 5x cheaper than decoding a window twice), primed with the
    prompt's last tokens so that the first generated token decodes in context. Ids that do not
    complete a character yet are held; `flush()` decodes them as `decode` would (U+FFFD)."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        backend: Any,
        *,
        skip_special_tokens: bool = True,
        prompt_token_ids: Sequence[int] | None = None,
    ) -> None:
        from tokenizers.decoders import DecodeStream

        self._tokenizer = tokenizer
        self._backend = backend
        self._skip = skip_special_tokens
        context = list(prompt_token_ids or ())[-INITIAL_CONTEXT_TOKENS:]
        self._stream = DecodeStream(ids=context, skip_special_tokens=skip_special_tokens)
        self._recent = context  # the last ids whose text was released (flush's context)
        self._held: list[int] = []  # ids since the last released text

    def add_tokens(self, token_ids: Iterable[int]) -> str:
        """Feed newly generated ids; returns the text they complete (possibly empty)."""
        pieces = []
        step, backend, held = self._stream.step, self._backend, self._held
        for token_id in token_ids:
            token_id = int(token_id)
            chunk = step(backend, token_id)
            held.append(token_id)
            if chunk is not None:
                pieces.append(chunk)
                self._recent = (self._recent + held)[-INITIAL_CONTEXT_TOKENS:]
                held.clear()
        return "".join(pieces)

    def flush(self) -> str:
        """Release text held back at the end of the stream."""
        if not self._held:
            return ""
        decode = self._tokenizer.decode
        prefix = decode(self._recent, skip_special_tokens=self._skip)
        full = decode(self._recent + self._held, skip_special_tokens=self._skip)
        self._recent = (self._recent + self._held)[-INITIAL_CONTEXT_TOKENS:]
        self._held.clear()
        return full[len(prefix) :] if len(full) > len(prefix) else ""
