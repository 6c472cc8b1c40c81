"""LLMEngine: requests in, RequestOutputs out, one `step()` at a time, on the caller's thread.

The offline API (`LLM.generate`) drives it in a plain loop:

    input processor (validate, tokenize) -> engine core (schedule, run the compiled step) ->
    output processor (detokenize, stop strings, log-prob dicts)

It is put together from its parts (`EngineParts`: tokenizer, model facts, engine core), built
from a config by `from_config`, or injected (tests use a fake runner). The server drives an
engine through `AsyncEngineClient` instead (async_client.py: the core on a thread or in a
process of its own); both share the frontend (frontend.py) and its policies.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence

from jaxserve.config import EngineConfig
from jaxserve.engine.embedding import EmbeddingResult, check_dimensions, embedding_inputs, truncate
from jaxserve.engine.frontend import Frontend
from jaxserve.engine.setup import EngineParts, build_engine
from jaxserve.inputs import Prompt, PromptType
from jaxserve.outputs import OutputKind, RequestOutput
from jaxserve.sampling_params import SamplingParams


class LLMEngine:
    def __init__(self, parts: EngineParts):
        self.parts = parts
        self.tokenizer = parts.tokenizer
        self.info = parts.info
        self.core = parts.core
        self.frontend = Frontend(parts.tokenizer, parts.info)
        self.output_processor = self.frontend.output_processor
        self._ids = itertools.count()
        self.failures: list[tuple[str, BaseException]] = []  # see step()

    @classmethod
    def from_config(cls, config: EngineConfig) -> LLMEngine:
        return cls(build_engine(config))

    # ------------------------------------------------------------------ facts
    @property
    def scheduler(self):
        return self.core.scheduler

    @property
    def runner(self):
        """This process's model runner (the core's, unless a multi-host leader wraps it)."""
        return self.parts.model_runner or self.core.runner

    @property
    def num_compiles_after_warmup(self) -> int:
        return self.core.runner.counter.recompiles

    def default_sampling_params(self) -> SamplingParams:
        return self.frontend.default_sampling_params()

    # ------------------------------------------------------------------ requests
    def add_request(
        self,
        request_id: str | None,
        prompt: Prompt | PromptType,
        params: SamplingParams | None = None,
        *,
        arrival_time: float | None = None,
        priority: int = 0,
        output_kind: OutputKind = OutputKind.FINAL_ONLY,
        add_special_tokens: bool = True,
        lora_request=None,
    ) -> str:
        """Validate and queue a request (`prompt` in any of vLLM's forms: jaxserve.inputs; n > 1
        becomes n sequences sharing the prompt's cached blocks); raises ValueError (TypeError for
        a prompt of no known form) for bad input, before anything is queued."""
        request_id = request_id or f"req-{next(self._ids)}"
        fe = self.frontend
        if fe.output_processor.has(request_id):
            raise ValueError(f"request id {request_id!r} is already in use")
        arrival = arrival_time or time.time()
        req = fe.process(request_id, prompt, params, arrival_time=arrival, priority=priority,
                         add_special_tokens=add_special_tokens, lora_request=lora_request)
        fe.register([req], output_kind, arrival)
        for seq in req.sequences:
            self.core.add_request(seq)
        return request_id

    def embed(self, prompts: Sequence[Prompt], *, dimensions: int | None = None,
              add_special_tokens: bool = True) -> list[EmbeddingResult]:
        """Embeddings of the prompts (--runner pooling); ValueError for bad input."""
        check_dimensions(self.info, dimensions)
        ids = embedding_inputs(self.tokenizer, self.info, prompts,
                               add_special_tokens=add_special_tokens)
        vectors = truncate(self.info, self.core.embed(ids), dimensions)
        return [EmbeddingResult(i, v) for i, v in zip(ids, vectors)]

    def abort_request(self, request_ids: str | Sequence[str]) -> list[RequestOutput]:
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        outs = []
        for rid in ids:
            out, seq_ids = self.frontend.abort(rid)
            self.core.abort_requests(seq_ids)
            if out is not None:
                outs.append(out)
        return outs

    def has_unfinished_requests(self) -> bool:
        return self.core.has_work()

    # ------------------------------------------------------------------ the loop
    def step(self) -> list[RequestOutput]:
        """One engine step. A request whose input failed inside the step (the engine core
        names it) is dropped, and its error is kept in `failures` (request id, exception) for
        the caller; the engine goes on with the others."""
        outputs, to_abort, failures = self.frontend.take_outputs(self.core.step())
        self.failures += failures
        if to_abort:
            self.core.abort_requests(to_abort)
        return outputs
