"""`use_beam_search` on /v1/completions and /v1/chat/completions, as vLLM's server: `n` is the
beam width, and the n best beams are the choices.

The search (jaxserve/beam_search.py, the offline API's) runs as a task on the event loop: each
step adds one engine request per live beam (one token, the candidates' log-probs) and awaits
them. Its result reaches the route as every engine result does: one final `RequestOutput` per
prompt on the prompt's queue (its outputs are the beams, best first), so that the routes'
formatting (echo, logprobs, usage, streaming, return_token_ids) applies unchanged. Closing the
response cancels the search, which aborts the step requests in flight.

Beam search ranks candidates by their log-probs alone: request fields that would change the
sampling (stop strings and ids, penalties, truncation, logit bias, structured output, tools)
are a 400 naming them rather than silently unapplied.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable
from typing import Any

from jaxserve.beam_search import BeamSearch, beam_step_params
from jaxserve.engine.client import EngineClient, RequestStream
from jaxserve.inputs import Prompt
from jaxserve.outputs import CompletionOutput, LogprobsDict, RequestOutput
from jaxserve.sampling_params import BeamSearchParams, SamplingParams
from jaxserve.server.errors import APIError
from jaxserve.server.engine_requests import Deadline, add_all, merge

# Request fields beam search does not apply, with their neutral values.
_NOT_WITH_BEAMS = {
    "stop": (None, []), "stop_token_ids": (None, []), "bad_words": (None, []), "logit_bias": (None, {}),
    "allowed_token_ids": (None,), "min_tokens": (0,), "presence_penalty": (0.0,), "frequency_penalty": (0.0,),
    "repetition_penalty": (None, 1.0), "top_p": (None, 1.0), "top_k": (None, 0, -1), "min_p": (None, 0.0),
    "prompt_logprobs": (None,), "truncate_prompt_tokens": (None,), "seed": (None,),
    "response_format": (None,), "structured_outputs": (None,), "tools": (None, []),
}


def beam_params(body: Any, params: SamplingParams, max_model_len: int) -> BeamSearchParams:
    """The beam search a request asks for (`n` beams; `params`: its sampling parameters with the
    model's defaults; without max_tokens, beams grow to the context length); a 400 naming a
    field it cannot honour."""
    for name, neutral in _NOT_WITH_BEAMS.items():
        if name in body.model_fields_set and getattr(body, name, None) not in neutral:
            raise APIError(400, f"{name} cannot be combined with use_beam_search (beams are ranked by their "
                                "log-probs alone); remove it.", param=name)
    if body.structured_outputs_params() is not None:
        raise APIError(400, "structured output cannot be combined with use_beam_search.", param="use_beam_search")
    try:
        return BeamSearchParams(beam_width=body.n, max_tokens=params.max_tokens or max_model_len,
                                ignore_eos=params.ignore_eos,
                                temperature=params.temperature, length_penalty=body.length_penalty,
                                include_stop_str_in_output=params.include_stop_str_in_output)
    except ValueError as e:
        raise APIError(400, str(e)) from None


async def add_beam_searches(engine: EngineClient, request_ids: list[str],
                            prompts: list[Prompt] | Callable[[], list[Prompt]], params: SamplingParams,
                            beam: BeamSearchParams, *, priority: int, arrival_time: float,
                            add_special_tokens: bool, cache_salt: str | None, lora_request: Any,
                            deadline: Deadline | None) -> tuple[list[RequestStream], Callable[[], None]]:
    """Start the beam search of each prompt; returns a stream per prompt (one final output
    each) and the callable that cancels the searches. The first step's requests are added
    before this returns, so bad input is a 400 (ValueError) here, as `add_all`'s is."""
    info = engine.info
    try:
        step = beam_step_params(beam, info.sampler_config.max_logprobs)
    except ValueError as e:
        raise APIError(400, str(e), param="n") from None
    step_ids = (f"{request_ids[0]}-beam-{i}" for i in itertools.count())

    async def run(batch: list[Prompt] | Callable[[], list[Prompt]], count: int) -> list[RequestOutput]:
        ids = [next(step_ids) for _ in range(count)]
        streams = await add_all(engine, ids, batch, step, priority, arrival_time, add_special_tokens,
                                cache_salt, stream=False, lora_request=lora_request)
        outs: list[RequestOutput | None] = [None] * len(streams)
        try:
            async for i, out in merge([s.queue for s in streams], deadline):
                outs[i] = out
        finally:
            for rid, out in zip(ids, outs):
                if out is None:
                    engine.abort(rid)
        return outs  # type: ignore[return-value]

    # The first step runs the prompts themselves (made, tokenized and validated in the engine
    # client's worker thread, as add_all does).
    first = await run(prompts, len(request_ids))
    prompt_ids = [list(o.prompt_token_ids) for o in first]
    search = BeamSearch(prompt_ids, beam, eos_token_id=info.eos_token_id, max_model_len=info.max_model_len)
    queues = [asyncio.Queue() for _ in request_ids]

    async def search_all() -> None:
        try:
            beams, outs = search.pending(), first  # the first step's beams are the prompts
            while beams:
                search.advance([_top(o) for o in outs])
                beams = search.pending()
                if beams:
                    outs = await run([Prompt(token_ids=tuple(b.tokens), cache_salt=cache_salt) for _, b in beams],
                                     len(beams))
            for i, (rid, q) in enumerate(zip(request_ids, queues)):
                q.put_nowait(_request_output(rid, first[i], search, i, beam, params, engine.tokenizer,
                                             info.eos_token_id))
        except asyncio.CancelledError:
            raise
        except BaseException as e:  # noqa: BLE001 - the routes raise what a queue holds
            for q in queues:
                q.put_nowait(e)

    task = asyncio.get_running_loop().create_task(search_all())
    streams = [RequestStream(rid, ids, q) for rid, ids, q in zip(request_ids, prompt_ids, queues)]
    return streams, task.cancel


def _top(out: RequestOutput) -> LogprobsDict | None:
    o = out.outputs[0] if out.outputs else None
    return o.logprobs[0] if o is not None and o.logprobs else None


def _trim(d: LogprobsDict, chosen: int, k: int) -> LogprobsDict:
    """The chosen token's log-prob and the k best (the step asked for more candidates)."""
    best = sorted(d.items(), key=lambda kv: -kv[1].logprob)[:k]
    return {t: lp for t, lp in d.items() if t == chosen or (t, lp) in best}


def _request_output(request_id: str, first: RequestOutput, search: BeamSearch, i: int, beam: BeamSearchParams,
                    params: SamplingParams, tokenizer: Any, eos: int | None) -> RequestOutput:
    """A prompt's beams as one final RequestOutput (its outputs best first), as the routes
    read the engine's: the generated tokens, their text (a final EOS left out), log-probs
    when the request asked for them."""
    n = search.prompt_len(i)
    outputs = []
    for index, seq in enumerate(search.results()[i].sequences):
        gen = seq.tokens[n:]
        shown = gen[:-1] if seq.finish_reason == "stop" and not beam.include_stop_str_in_output else gen
        text = tokenizer.decode(shown, skip_special_tokens=params.skip_special_tokens)
        logprobs = None
        if params.logprobs is not None:
            logprobs = [_trim(d, t, params.logprobs) for t, d in zip(gen, seq.logprobs)]
        outputs.append(CompletionOutput(index, text, gen, seq.cum_logprob, logprobs, seq.finish_reason,
                                        None))
    return RequestOutput(request_id, first.prompt, list(first.prompt_token_ids), outputs, True,
                         num_cached_tokens=first.num_cached_tokens, metrics=first.metrics)

