"""The offline API: `LLM(model).generate(prompts, SamplingParams(...))` and `LLM.chat(...)`."""

from __future__ import annotations

import atexit
import itertools
import sys
from collections.abc import Sequence
from typing import Any

from tqdm import tqdm

from jaxserve.config import EngineConfig
from jaxserve.engine.llm_engine import LLMEngine
from jaxserve.engine.setup import build_engine
from jaxserve.lora_request import LoRARequest
from jaxserve.outputs import EmbeddingOutput, EmbeddingRequestOutput, RequestOutput
from jaxserve.sampling_params import SamplingParams

Prompt = str | Sequence[int]
Message = dict[str, Any]


def _is_token_ids(x: Any) -> bool:
    return isinstance(x, Sequence) and not isinstance(x, str) and all(isinstance(t, int) for t in x) and len(x) > 0


class LLM:
    """An engine driven in a plain loop. `model`: an HF directory, a .gguf file or a Hugging
    Face Hub name (`org/name`; `revision=`, `download_dir=`, `gguf_file=` as the CLI's flags);
    None serves the bundled default model; other keyword arguments are engine options (see
    jaxserve.config, e.g. max_num_seqs=8)."""

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
        return self.engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """vLLM's defaults, overridden by the model's generation_config.json (see
        `--generation-config`); what `generate` uses when given no SamplingParams."""
        return self.engine.default_sampling_params()

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        priority: Sequence[int] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Generate for one prompt or a list; outputs come back in input order. `lora_request`:
        the LoRA adapter of every prompt, or one per prompt (None: the base model)."""
        if isinstance(prompts, str) or _is_token_ids(prompts):
            prompts = [prompts]  # type: ignore[list-item]
        prompts = list(prompts)  # type: ignore[arg-type]
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        if isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"got {len(params)} sampling params for {len(prompts)} prompts; pass one or one per prompt.")
        if lora_request is None or isinstance(lora_request, LoRARequest):
            loras = [lora_request] * len(prompts)
        else:
            loras = list(lora_request)
            if len(loras) != len(prompts):
                raise ValueError(f"got {len(loras)} LoRA requests for {len(prompts)} prompts; "
                                 "pass one or one per prompt.")
        return self._run(prompts, params, use_tqdm, priority, loras)

    def chat(
        self,
        messages: Sequence[Message] | Sequence[Sequence[Message]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation or a list of them, then generate."""
        convs = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        tok = self.engine.tokenizer
        texts = [tok.apply_chat_template(list(c), add_generation_prompt=add_generation_prompt) for c in convs]
        # The template already holds any BOS; do not add special tokens again.
        ids = [tok.encode(t, add_special_tokens=False) for t in texts]
        outs = self.generate(ids, sampling_params, use_tqdm=use_tqdm, lora_request=lora_request)
        for o, t in zip(outs, texts):
            o.prompt = t
        return outs

    def embed(self, prompts: Prompt | Sequence[Prompt], *,
              dimensions: int | None = None) -> list[EmbeddingRequestOutput]:
        """Embed one prompt or a list (the model served with runner="pooling"); outputs come
        back in input order. `dimensions`: keep the first values (Matryoshka), re-normalized
        when the model normalizes."""
        if isinstance(prompts, str) or _is_token_ids(prompts):
            prompts = [prompts]  # type: ignore[list-item]
        results = self.engine.embed(list(prompts), dimensions=dimensions)  # type: ignore[arg-type]
        return [EmbeddingRequestOutput(f"embd-{next(self._embed_ids)}",
                                       EmbeddingOutput(r.embedding.tolist()), r.prompt_token_ids)
                for r in results]

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
