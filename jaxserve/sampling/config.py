"""SamplerConfig: the static sizes of the sampler's arrays (fixed for the life of an engine)."""

from __future__ import annotations

import dataclasses

from jaxserve.config import EngineConfig
from jaxserve.sampling_params import SamplingParams


@dataclasses.dataclass(frozen=True, slots=True)
class SamplerConfig:
    """Static shapes of the sampling arrays. Every field is fixed when the engine starts, so
    nothing a request asks for can change a compiled shape.

    max_num_seqs (S): number of persistent slots (one per running request).
    vocab_size (V): width of the logits.
    max_logprobs: width of the top-logprobs outputs; a request may ask for 0..max_logprobs.
    max_stop_ids: how many token ids (EOS + stop_token_ids) min_tokens can suppress per request.
    max_bad_words / max_bad_word_len: capacity of the per-slot table of multi-token bad words
        (single-token bad words live in the dense bias row and are unlimited).
    topk_candidates (K): width of the exact top-K candidate list used by top-k/top-p. A row with
        top_k > K, or whose top-p nucleus holds more than K tokens, takes an exact but slower
        search over the whole vocabulary (ops.boundary: at most 8 passes over the row; lax.cond
        on a batch-wide flag).
    slot_write_batch (A): rows per call of `write_slot_rows` (admissions with a bias row or bad
        words are written A at a time; padding rows are dropped).
    native: the native implementation (native.py: registered by a backend, e.g. "cpu") that
        runs steps 5-7 (temperature, min_p, top_k, top_p, the draw) and the raw logprobs
        instead of JAX ops, or None. The engine takes it from its backend's plan
        (`DevicePlan.native_sampling`: the CPU backend's kernels, on a one-device mesh).
    """

    max_num_seqs: int
    vocab_size: int
    max_logprobs: int = EngineConfig.max_logprobs
    max_stop_ids: int = 16
    max_bad_words: int = 16
    max_bad_word_len: int = 8
    topk_candidates: int = 64
    slot_write_batch: int = 4
    native: str | None = None

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1 or self.vocab_size < 2:
            raise ValueError("max_num_seqs must be >= 1 and vocab_size >= 2.")
        if not 0 <= self.max_logprobs <= self.vocab_size:
            raise ValueError(f"max_logprobs must be in [0, vocab_size], got {self.max_logprobs}.")
        if self.max_stop_ids < 1 or self.max_bad_words < 1 or self.max_bad_word_len < 1:
            raise ValueError("max_stop_ids, max_bad_words and max_bad_word_len must be >= 1.")
        if not 1 <= self.topk_candidates <= self.vocab_size:
            raise ValueError(f"topk_candidates must be in [1, vocab_size], got {self.topk_candidates}.")
        if self.slot_write_batch < 1:
            raise ValueError("slot_write_batch must be >= 1.")

    def check_request(
        self,
        params: SamplingParams,
        eos_token_ids: tuple[int, ...] | list[int] = (),
        bad_words_token_ids: list[list[int]] | None = None,
    ) -> None:
        """Raise ValueError (a user error: HTTP 400) when a request does not fit these limits.
        Call it when the request arrives, before it is scheduled."""
        params.validate_for_vocab(self.vocab_size)
        for what, k in (("logprobs", params.logprobs), ("prompt_logprobs", params.prompt_logprobs)):
            if k is None:
                continue
            if k == -1 and self.max_logprobs < self.vocab_size:
                raise ValueError(
                    f"{what}=-1 (the whole vocabulary) is not supported: at most "
                    f"{self.max_logprobs} top log-probs can be returned."
                )
            if k > self.max_logprobs:
                raise ValueError(
                    f"Requested {what}={k}, which is more than the maximum allowed "
                    f"({self.max_logprobs}); ask for fewer."
                )
        if params.min_tokens > 0:
            stops = set(params.stop_token_ids or [])
            if not params.ignore_eos:
                stops.update(int(t) for t in eos_token_ids)
            if len(stops) > self.max_stop_ids:
                raise ValueError(
                    f"min_tokens can suppress at most {self.max_stop_ids} stop token ids "
                    f"(EOS included); this request has {len(stops)}."
                )
        multi = [w for w in (bad_words_token_ids or []) if len(w) > 1]
        if len(multi) > self.max_bad_words:
            raise ValueError(
                f"At most {self.max_bad_words} multi-token bad words are supported; "
                f"this request has {len(multi)}."
            )
        for w in bad_words_token_ids or []:
            if len(w) > self.max_bad_word_len:
                raise ValueError(
                    f"A bad word may be at most {self.max_bad_word_len} tokens long; "
                    f"one has {len(w)}."
                )
            if any(not 0 <= int(t) < self.vocab_size for t in w):
                raise ValueError(f"bad word token ids must lie in [0, {self.vocab_size}).")
