"""Frontend: the request side of an engine, wherever its core runs.

It holds the input processor (validate and tokenize once) and the output processor (token ids ->
RequestOutputs), and owns the policies the offline `LLMEngine` and the server's
`AsyncEngineClient` share:

- what enters: `process` validates a request (its priority against the scheduling policy among
  the rest, see InputProcessor) before anything is queued;
- what a step's outputs do: `take_outputs` delivers them, and returns the sequence ids the core
  must abort (those a stop string finished, and the siblings of a sequence that failed: an n > 1
  request fails whole) and the failures (request id, error);
- what an abort or a refusal does: `abort` and `reject` return the sequence ids to abort.

It never touches the engine core: its callers send what it returns.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from jaxserve.engine.embedding import NOT_GENERATING
from jaxserve.engine.input_processor import InputProcessor, ModelInfo, ProcessedRequest
from jaxserve.engine.output_processor import OutputProcessor, StatsListener
from jaxserve.inputs import Prompt, PromptType
from jaxserve.outputs import OutputKind, RequestOutput
from jaxserve.sampling_params import SamplingParams


class Frontend:
    def __init__(self, tokenizer: Any, info: ModelInfo, listener: StatsListener | None = None):
        self.tokenizer = tokenizer
        self.info = info
        self.input_processor = InputProcessor(tokenizer, info)
        self.output_processor = OutputProcessor(tokenizer, listener)

    def default_sampling_params(self) -> SamplingParams:
        return self.input_processor.default_sampling_params()

    # ------------------------------------------------------------------ requests in
    def process(self, request_id: str, prompt: Prompt | PromptType, params: SamplingParams | None, *,
                arrival_time: float, priority: int = 0, add_special_tokens: bool = True,
                cache_salt: str | None = None, lora_request=None) -> ProcessedRequest:
        """Validate and tokenize (ValueError for bad input; nothing is registered)."""
        if self.info.runner == "pooling":
            raise ValueError(NOT_GENERATING)
        return self.input_processor.process(request_id, prompt, params, arrival_time=arrival_time,
                                            priority=priority, add_special_tokens=add_special_tokens,
                                            cache_salt=cache_salt, lora_request=lora_request)

    def register(self, requests: Sequence[ProcessedRequest], kind: OutputKind, arrival_time: float,
                 queues: Sequence[Any] | None = None) -> None:
        """Start assembling these requests' outputs (all or none: a used id refuses them all)."""
        op = self.output_processor
        ids = [r.request_id for r in requests]
        for rid in ids:
            if op.has(rid) or ids.count(rid) > 1:
                raise ValueError(f"request id {rid!r} is already in use")
        for i, req in enumerate(requests):
            op.add(req, kind, arrival_time, None if queues is None else queues[i])

    # ------------------------------------------------------------------ outputs
    def take_outputs(self, core_outputs) -> tuple[list[RequestOutput], list[str], list[tuple[str, BaseException]]]:
        """Fold one step's core outputs in. Returns the RequestOutputs (also put on the requests'
        queues), the sequence ids to abort in the core, and (request id, error) of each request
        that failed inside the step (its error is on its queue too)."""
        failed = [o for o in core_outputs if o.error is not None]
        if failed:
            core_outputs = [o for o in core_outputs if o.error is None]
        op = self.output_processor
        outputs, to_abort = op.process(core_outputs)
        failures = []
        for o in failed:  # the core has finished these; the request's other samples go too
            seq = op.seqs.get(o.request_id)
            if seq is not None:
                failures.append((seq.parent.request_id, o.error))
                to_abort += op.fail_sequence(o.request_id, o.error)
        return outputs, to_abort, failures

    def abort(self, request_id: str) -> tuple[RequestOutput | None, list[str]]:
        """Finish a request as aborted: its final output (None if unknown) and the sequence ids
        to abort in the core."""
        op = self.output_processor
        ids = op.sequence_ids(request_id)
        return op.abort(request_id), ids

    def reject(self, sequence_id: str, error: BaseException) -> list[str]:
        """The core could not take a sequence: its request fails with `error`; returns its other
        sequence ids, to abort."""
        return self.output_processor.fail_sequence(sequence_id, error)

    def fail_all(self, error: BaseException) -> None:
        """Every request gets `error` (the engine is dead)."""
        self.output_processor.fail(error)

    def unfinished(self) -> list[str]:
        return self.output_processor.unfinished()
