"""InputProcessor: a client's prompt and SamplingParams -> validated, tokenized EngineRequests.

It runs on the frontend side (the caller's thread, or a worker thread in the server), once per
request, before anything is queued: tokenizes the prompt and the bad words, checks the prompt
against the vocabulary and the context length, resolves `max_tokens`, adds the model's extra
end-of-sequence ids (generation_config.json, config.json) to the stop token ids as vLLM does,
checks the sampler's limits, compiles a structured-output constraint (cached by schema; see
jaxserve/structured/compiler.py), and splits `n > 1` into n sequences. Anything wrong raises
ValueError with a message for the user (HTTP 400).
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Sequence
from typing import Any

from jaxserve.engine.tokenizer import Tokenizer
from jaxserve.inputs import Prompt, PromptType, parse_prompt
from jaxserve.lora_request import LoRARequest
from jaxserve.models.lora import read_config
from jaxserve.request import EngineRequest
from jaxserve.sampling.config import SamplerConfig
from jaxserve.sampling_params import SamplingParams
from jaxserve.structured.compiler import GrammarCompiler


@dataclasses.dataclass(frozen=True)
class ModelInfo:
    """What the frontend knows of the served model."""

    name: str  # the name clients use
    vocab_size: int
    max_model_len: int
    eos_token_id: int | None  # the primary EOS (stop_reason None when it stops a request)
    extra_eos_token_ids: tuple[int, ...]  # other ids that end generation (as stop token ids)
    sampler_config: SamplerConfig  # the sampler's static limits (logprobs, stop ids, bad words)
    sampling_defaults: dict[str, Any]  # from generation_config.json (SamplingParams names)
    default_max_tokens: int | None = None  # generation_config.json's max_new_tokens
    scheduling_policy: str = "fcfs"  # "priority": requests may carry a priority
    max_num_seqs: int = 1  # sequences a step runs at most
    kv_cache_tokens: int = 0  # tokens the KV cache holds (all data-parallel ranks)
    runner: str = "generate"  # "pooling": the engine embeds (engine/embedding.py), nothing else
    hidden_size: int = 0  # the embeddings' size (pooling)
    normalize_embeddings: bool = False  # whether the pooled vectors are L2-normalized (pooling)
    max_lora_rank: int = 0  # LoRA adapters' largest rank (0: LoRA is off)
    max_loras: int = 0  # LoRA adapters' device slots (0: LoRA is off)
    reasoning_parser: str | None = None  # the model's reasoning format (--reasoning-parser)
    num_speculative_tokens: int = 0  # drafts per request and step (0: speculative decoding is off)


def check_lora(info: ModelInfo, lora: LoRARequest) -> None:
    """ValueError unless LoRA is on and the adapter's config is one the engine can serve (its
    weights are checked against the model when it is loaded)."""
    if not isinstance(lora, LoRARequest):
        raise ValueError(f"lora_request must be a LoRARequest, got {type(lora).__name__}")
    if not info.max_lora_rank:
        raise ValueError(f"LoRA adapter {lora.lora_name!r} was requested, but LoRA is not "
                         "enabled (--enable-lora; LLM(enable_lora=True)).")
    read_config(lora.lora_path, info.max_lora_rank, lora.lora_name)


@dataclasses.dataclass(frozen=True)
class ProcessedRequest:
    """One client request, ready for the engine: its sequences (n of them) and what the output
    processor needs to assemble their outputs."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams  # max_tokens resolved
    sequences: tuple[EngineRequest, ...]


def tokenize_bad_words(bad_words: Sequence[str], encode) -> list[list[int]]:
    """Token id sequences for `SamplingParams.bad_words`, as vLLM does it: each word encoded
    as-is and with a leading space (the spaced form is kept when it is a different token
    sequence of the same length). `encode(text) -> list[int]` must not add special tokens."""
    out: list[list[int]] = []
    for word in bad_words:
        plain = list(encode(word.lstrip()))
        if plain:
            out.append(plain)
        spaced = list(encode(" " + word.lstrip()))
        if spaced and (not plain or (spaced[0] != plain[0] and len(spaced) == len(plain))):
            out.append(spaced)
    return out


class InvalidParamError(ValueError):
    """Bad input that one request parameter explains (`param`: its name, as the API spells it)."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


def grammar_compiler(tokenizer: Tokenizer, info: ModelInfo) -> GrammarCompiler:
    """The structured-output compiler of a model (its tokenizer tables are built on first use)."""
    eos = [t for t in (info.eos_token_id, *info.extra_eos_token_ids) if t is not None]
    return GrammarCompiler(tokenizer.hf_tokenizer, info.vocab_size, eos)


class InputProcessor:
    def __init__(self, tokenizer: Tokenizer, info: ModelInfo):
        self.tokenizer = tokenizer
        self.info = info
        self._grammars: GrammarCompiler | None = None
        self._grammars_lock = threading.Lock()

    @property
    def grammars(self) -> GrammarCompiler:
        """The structured-output compiler (its tokenizer tables are built on first use)."""
        with self._grammars_lock:
            if self._grammars is None:
                self._grammars = grammar_compiler(self.tokenizer, self.info)
            return self._grammars

    def default_sampling_params(self) -> SamplingParams:
        """vLLM's defaults overridden by the model's generation config (max_tokens: up to the
        context, or the config's max_new_tokens)."""
        return SamplingParams(**self.info.sampling_defaults, max_tokens=None)

    def encode(self, prompt: Prompt, add_special_tokens: bool = True) -> list[int]:
        """The prompt's token ids: the client's ids (checked against the vocabulary), else its
        text tokenized."""
        info = self.info
        if prompt.token_ids is not None:
            ids = list(prompt.token_ids)
            bad = [t for t in ids if not 0 <= t < info.vocab_size]
            if bad:
                raise ValueError(f"prompt token ids must be in [0, {info.vocab_size}); got {bad[:5]}")
        else:
            ids = self.tokenizer.encode(prompt.text, add_special_tokens=add_special_tokens)
        if not ids:
            raise ValueError("the prompt is empty; send at least one token.")
        return ids

    def process(
        self,
        request_id: str,
        prompt: Prompt | PromptType,
        params: SamplingParams | None = None,
        *,
        arrival_time: float = 0.0,
        priority: int = 0,
        add_special_tokens: bool = True,
        cache_salt: str | None = None,
        lora_request: LoRARequest | None = None,
    ) -> ProcessedRequest:
        """Validate and tokenize one request (`prompt` in any of vLLM's forms, read by
        jaxserve.inputs; a salt in the prompt and `cache_salt` must agree)."""
        info = self.info
        prompt = parse_prompt(prompt)
        if prompt.cache_salt is not None:
            if cache_salt is not None and cache_salt != prompt.cache_salt:
                raise ValueError("the prompt's cache_salt and the request's cache_salt differ; send one.")
            cache_salt = prompt.cache_salt
        if lora_request is not None:
            check_lora(info, lora_request)
        if priority != 0 and info.scheduling_policy != "priority":
            raise InvalidParamError("priority", f"priority {priority} was sent, but this engine schedules by arrival "
                             f"({info.scheduling_policy!r}); start it with --scheduling-policy priority "
                             "(policy='priority' offline), or omit priority.")
        params = params if params is not None else self.default_sampling_params()
        prompt_ids = self.encode(prompt, add_special_tokens)
        if params.truncate_prompt_tokens is not None:
            keep = params.truncate_prompt_tokens
            if keep == -1:
                keep = info.max_model_len - 1
            elif keep >= info.max_model_len:
                raise ValueError(
                    f"truncate_prompt_tokens ({keep}) must be below the context length {info.max_model_len}."
                )
            prompt_ids = prompt_ids[-keep:]  # the last tokens, as vLLM keeps them
        n = len(prompt_ids)
        if n >= info.max_model_len:
            raise ValueError(
                f"the prompt has {n} tokens, but the model's context length is {info.max_model_len}; "
                "shorten the prompt so at least one token can be generated."
            )
        if params.max_tokens is None:
            rest = info.max_model_len - n
            params = params.clone(max_tokens=min(rest, info.default_max_tokens or rest))
        elif n + params.max_tokens > info.max_model_len:
            raise ValueError(
                f"the prompt ({n} tokens) plus max_tokens ({params.max_tokens}) exceeds the context "
                f"length {info.max_model_len}; lower max_tokens to at most {info.max_model_len - n}."
            )
        extra = [t for t in info.extra_eos_token_ids if t != info.eos_token_id]
        if extra and not params.ignore_eos:
            stops = list(dict.fromkeys([*extra, *(params.stop_token_ids or [])]))
            params = params.clone(stop_token_ids=stops)
        words = ()
        if params.bad_words:
            words = tuple(tuple(w) for w in tokenize_bad_words(
                params.bad_words, lambda t: self.tokenizer.encode(t, add_special_tokens=False)))
        eos = () if info.eos_token_id is None else (info.eos_token_id,)
        info.sampler_config.check_request(params, eos, [list(w) for w in words])
        grammar = None
        if params.structured_outputs is not None:
            grammar = self.grammars.compile(params.structured_outputs)
        seqs = []
        for i in range(params.n):
            p = params if params.n == 1 else params.clone(n=1, seed=None if params.seed is None else params.seed + i)
            rid = request_id if params.n == 1 else f"{i}_{request_id}"
            seqs.append(EngineRequest(rid, tuple(prompt_ids), p, info.eos_token_id, words, arrival_time, priority,
                                      cache_salt, lora_request, grammar))
        return ProcessedRequest(request_id, prompt.text, prompt_ids, params, tuple(seqs))
