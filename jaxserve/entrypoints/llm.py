"""The offline API: `LLM(model).generate(prompts, SamplingParams(...))`, `LLM.chat(...)`,
`LLM.beam_search(...)`, `LLM.embed(...)`, as vLLM's `LLM`."""

from __future__ import annotations

import atexit
import itertools
import sys
from collections.abc import Mapping, Sequence
from typing import Any

from tqdm import tqdm

from jaxserve.beam_search import BeamSearch, BeamSearchOutput, BeamSearchParams, beam_step_params
from jaxserve.chat.template import render_chat
from jaxserve.chat.turns import turns_from_dicts
from jaxserve.config import EngineConfig
from jaxserve.engine.llm_engine import LLMEngine
from jaxserve.engine.setup import build_engine
from jaxserve.inputs import Prompt, PromptType, parse_prompts
from jaxserve.lora_request import LoRARequest
from jaxserve.outputs import EmbeddingOutput, EmbeddingRequestOutput, RequestOutput
from jaxserve.sampling_params import SamplingParams

Message = dict[str, Any]


class LLM:
    """An engine driven in a plain loop. `model`: an HF directory, a .gguf file or a Hugging
    Face Hub name (`org/name`; `revision=`, `download_dir=`, `gguf_file=` as the CLI's flags);
    None serves the bundled default model; other keyword arguments are engine options (see
    jaxserve.config, e.g. max_num_seqs=8).

    Prompts come in vLLM's forms (jaxserve.inputs): a string, a list of token ids, a
    `TextPrompt` / `TokensPrompt` dict, or a list of any mix of them."""

    def __init__(self, model: str | None = None, **engine_options: Any):
        """With several processes (coordinator_address=...), only process 0 returns: the other
        processes run its steps until it exits, then exit themselves."""
        parts = build_engine(EngineConfig.from_kwargs(model=model, **engine_options))
        if parts.is_follower:
            _follow_and_exit(parts)
        if parts.topology is not None:
            atexit.register(parts.close)  # the followers shut down with this process
        self.engine = LLMEngine(parts)
        self._embed_ids = itertools.count()

    def get_tokenizer(self):
        """The model's tokenizer (jaxserve's wrapper; `.hf_tokenizer` is transformers')."""
        return self.engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """vLLM's defaults, overridden by the model's generation_config.json (see
        `--generation-config`); what `generate` uses when given no SamplingParams."""
        return self.engine.default_sampling_params()

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """Generate for one prompt or a list; outputs come back in input order. `lora_request`:
        the LoRA adapter of every prompt, or one per prompt (None: the base model)."""
        batch = parse_prompts(prompts)
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        params = _per_prompt(sampling_params, SamplingParams, len(batch), "sampling params")
        loras = _per_prompt(lora_request, LoRARequest, len(batch), "LoRA requests")
        if priority is not None and len(priority) != len(batch):
            raise ValueError(f"got {len(priority)} priorities for {len(batch)} prompts; pass one per prompt.")
        return self._run(batch, params, use_tqdm, priority, loras)

    def chat(
        self,
        messages: Sequence[Message] | Sequence[Sequence[Message]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        chat_template: str | None = None,
        chat_template_content_format: str = "auto",
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict[str, Any]] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """Render one conversation or a list of them with the chat template (the model's, or
        `chat_template`), then generate; vLLM's keywords. `chat_template_kwargs` reach the
        template (e.g. {"enable_thinking": False}); `tools` (OpenAI's function specs) are shown
        to it; `continue_final_message` continues the last (assistant) message instead of
        starting a new one; `chat_template_content_format` renders message content as a string
        ("string") or as OpenAI's list of parts ("openai"; "auto" reads the template)."""
        if continue_final_message and add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt cannot both be true; "
                             "pass add_generation_prompt=False to continue the last message.")
        convs = [messages] if not messages or isinstance(messages[0], Mapping) else list(messages)
        tok = self.engine.tokenizer
        batch = []
        for conv in convs:
            text = render_chat(tok, turns_from_dicts(conv), add_generation_prompt=add_generation_prompt,
                               continue_final_message=continue_final_message, chat_template=chat_template,
                               chat_template_kwargs=chat_template_kwargs, tools=tools,
                               content_format=chat_template_content_format)
            # The template already holds any BOS; do not add special tokens again.
            batch.append(Prompt(text, tuple(tok.encode(text, add_special_tokens=False))))
        return self.generate(batch, sampling_params, use_tqdm=use_tqdm, lora_request=lora_request)

    def beam_search(
        self,
        prompts: PromptType | Sequence[PromptType],
        params: BeamSearchParams,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        use_tqdm: bool = False,
    ) -> list[BeamSearchOutput]:
        """Beam search (jaxserve/beam_search.py) for one prompt or a list, as vLLM's: each
        output holds the prompt's best `beam_width` sequences, best first, with their tokens
        (the prompt's included), text (the whole sequence decoded) and cumulative log-prob."""
        batch = parse_prompts(prompts)
        loras = _per_prompt(lora_request, LoRARequest, len(batch), "LoRA requests")
        engine, info = self.engine, self.engine.info
        ids = [engine.frontend.input_processor.encode(p) for p in batch]
        step = beam_step_params(params, info.sampler_config.max_logprobs)
        search = BeamSearch(ids, params, eos_token_id=info.eos_token_id, max_model_len=info.max_model_len,
                            lora_requests=loras)
        while beams := search.pending():
            outs = self._run([Prompt(token_ids=tuple(b.tokens), cache_salt=batch[i].cache_salt) for i, b in beams],
                             [step] * len(beams), use_tqdm, None, [b.lora_request for _, b in beams])
            search.advance([o.outputs[0].logprobs[0] if o.outputs[0].logprobs else None for o in outs])
        results = search.results()
        tok = engine.tokenizer
        for out in results:
            for seq in out.sequences:
                seq.text = tok.decode(seq.tokens, skip_special_tokens=False)
        return results

    def embed(self, prompts: PromptType | Sequence[PromptType], *,
              dimensions: int | None = None) -> list[EmbeddingRequestOutput]:
        """Embed one prompt or a list (the model served with runner="pooling"); outputs come
        back in input order. `dimensions`: keep the first values (Matryoshka), re-normalized
        when the model normalizes."""
        results = self.engine.embed(parse_prompts(prompts), dimensions=dimensions)
        return [EmbeddingRequestOutput(f"embd-{next(self._embed_ids)}",
                                       EmbeddingOutput(r.embedding.tolist()), r.prompt_token_ids)
                for r in results]

    # ------------------------------------------------------------------ engine commands
    def reset_prefix_cache(self) -> bool:
        """Drop every cached prefix block (vLLM's); False while requests hold blocks."""
        return self.engine.core.reset_prefix_cache()

    def sleep(self, level: int = 1) -> None:
        """Free the device memory of the weights (kept on the host) and of the KV cache
        (dropped), as vLLM's sleep level 1; only while no request runs. Level 2 (weights
        dropped too, to be reloaded by the caller) is not supported."""
        if level != 1:
            raise ValueError(f"sleep level {level!r} is not supported; level 1 keeps the weights on the "
                             "host and drops the KV cache.")
        self.engine.core.sleep()

    def wake_up(self, tags: Sequence[str] | None = None) -> None:
        """Put the weights back on the devices and allocate a fresh KV cache (vLLM's tags
        "weights" and "kv_cache" wake together here: both or None)."""
        if tags is not None and set(tags) != {"weights", "kv_cache"}:
            raise ValueError(f"wake_up tags {list(tags)!r}: the weights and the KV cache wake together; "
                             "pass tags=None.")
        self.engine.core.wake_up()

    def _run(self, prompts, params, use_tqdm, priority, loras) -> list[RequestOutput]:
        engine = self.engine
        ids = []
        try:
            for i, (prompt, p) in enumerate(zip(prompts, params)):
                ids.append(engine.add_request(None, prompt, p,
                                              priority=priority[i] if priority else 0,
                                              lora_request=loras[i]))
        except Exception:
            engine.abort_request(ids)
            raise
        order = {rid: i for i, rid in enumerate(ids)}
        results: list[RequestOutput | None] = [None] * len(ids)
        with tqdm(total=len(ids), desc="generating", disable=not use_tqdm, unit="req") as bar:
            while engine.has_unfinished_requests():
                for out in engine.step():
                    if out.finished and out.request_id in order:
                        results[order[out.request_id]] = out
                        bar.update(1)
                if engine.failures:  # a request's input failed in the engine: the batch fails
                    (rid, error), *_ = engine.failures
                    engine.failures.clear()
                    engine.abort_request(ids)
                    raise ValueError(f"prompt {order.get(rid, '?')}: {error}") from error
        missing = [ids[i] for i, r in enumerate(results) if r is None]
        if missing:
            raise RuntimeError(f"requests ended without output: {missing[:5]}")
        return results  # type: ignore[return-value]


def _per_prompt(value: Any, kind: type, n: int, what: str) -> list:
    """One value for every prompt (`value` is a `kind` or None), or a list of one per prompt."""
    if value is None or isinstance(value, kind):
        return [value] * n
    values = list(value)
    if len(values) != n:
        raise ValueError(f"got {len(values)} {what} for {n} prompts; pass one or one per prompt.")
    return values


def _follow_and_exit(parts) -> None:
    """A follower's LLM(...) never returns: it runs the leader's steps, then exits the process."""
    import logging
    import os

    from jaxserve.parallel.multihost import LeaderLostError

    try:
        parts.run_follower()
    except LeaderLostError as e:
        logging.getLogger(__name__).error("exiting: %s", e)
        logging.shutdown()
        os._exit(1)  # JAX's distributed shutdown would wait for the lost leader at its barrier
    sys.exit(0)
