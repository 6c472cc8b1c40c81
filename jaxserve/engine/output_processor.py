"""OutputProcessor: the engine core's token ids -> RequestOutputs (frontend side).

It owns everything the frontend keeps per request: incremental detokenization, stop strings,
log-prob dictionaries, the gathering of n > 1 samples under their parent, per-request metrics,
and (in the server) the queue the request's outputs go to. It never runs on the engine's
thread: the offline `LLMEngine` calls it after each step, the server's `AsyncEngineClient` on its
event loop.

The scheduler owns the token-level stop rules (EOS, stop_token_ids, max_tokens); stop *strings*
are matched here on the detokenized text, across token boundaries; `process` returns the ids
of the sequences a stop string finished, for the caller to abort in the engine core (tokens it
produces for them meanwhile are dropped).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

from jaxserve.engine.input_processor import ProcessedRequest
from jaxserve.engine.tokenizer import IncrementalDetokenizer, Tokenizer
from jaxserve.outputs import (
    CompletionOutput,
    Logprob,
    LogprobsDict,
    OutputKind,
    RequestMetrics,
    RequestOutput,
    SampleLogprobs,
)
from jaxserve.sampling_params import SamplingParams


class StatsListener:
    """What the output processor reports per request (metrics); called where it runs."""

    def on_scheduled(self, queue_seconds: float) -> None: ...
    def on_first_token(self, ttft_seconds: float) -> None: ...
    def on_tokens(self, itl_seconds: float) -> None: ...
    def on_output(self, out: RequestOutput) -> None: ...
    def on_finished(self, out: RequestOutput, e2e_seconds: float) -> None: ...


@dataclasses.dataclass(slots=True)
class _Seq:
    """One generated sequence (a request, or one of the n samples of a parent)."""

    request_id: str
    index: int
    params: SamplingParams
    detok: IncrementalDetokenizer
    parent: _Parent | None = None
    token_ids: list[int] = dataclasses.field(default_factory=list)
    text: str = ""
    logprobs: list[LogprobsDict] | None = None
    cumulative_logprob: float | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    sent_tokens: int = 0  # for DELTA outputs
    sent_text: int = 0
    finish_sent: bool = False
    # Characters a DELTA output holds back while unfinished: never half a stop string.
    hold: int = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclasses.dataclass(slots=True)
class _Parent:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    kind: OutputKind
    seqs: list[_Seq]
    metrics: RequestMetrics
    queue: Any = None  # where the server delivers this request's outputs (asyncio.Queue)
    prompt_logprobs: list[LogprobsDict | None] | None = None
    num_cached_tokens: int = 0

    @property
    def finished(self) -> bool:
        return all(s.finished for s in self.seqs)


def logprob_dict(tok: int, lp: SampleLogprobs, tokenizer: Tokenizer) -> LogprobsDict:
    """One position's log-probs as clients read them: {token id: Logprob}, the chosen token
    first (as vLLM orders it), then the top-k by rank."""
    out: LogprobsDict = {}
    for rank, (tid, val) in enumerate(zip(lp.top_ids, lp.top_logprobs), start=1):
        out[int(tid)] = Logprob(float(val), rank, tokenizer.decode([int(tid)]))
    if tok not in out:
        out[tok] = Logprob(lp.logprob, lp.rank, tokenizer.decode([tok]))
    else:
        out[tok].rank = lp.rank
    return {tok: out[tok], **{k: v for k, v in out.items() if k != tok}}


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer, listener: StatsListener | None = None):
        self.tokenizer = tokenizer
        self.listener = listener or StatsListener()
        self.parents: dict[str, _Parent] = {}
        self.seqs: dict[str, _Seq] = {}  # sequence (engine request) id -> its state

    def add(self, req: ProcessedRequest, kind: OutputKind, arrival_time: float, queue: Any = None) -> None:
        if req.request_id in self.parents:
            raise ValueError(f"request id {req.request_id!r} is already in use")
        seqs = []
        for i, r in enumerate(req.sequences):
            p = r.sampling_params
            detok = self.tokenizer.detokenizer(skip_special_tokens=p.skip_special_tokens,
                                               prompt_token_ids=req.prompt_token_ids)
            hold = max(map(len, p.stop)) - 1 if p.stop and not p.include_stop_str_in_output else 0
            seqs.append(_Seq(r.request_id, i, p, detok, logprobs=[] if p.logprobs is not None else None,
                             cumulative_logprob=0.0 if p.logprobs is not None else None, hold=hold))
        wants_plp = req.params.prompt_logprobs is not None
        parent = _Parent(
            req.request_id, req.prompt, list(req.prompt_token_ids), kind, seqs, RequestMetrics(arrival_time),
            queue=queue, prompt_logprobs=[None] * len(req.prompt_token_ids) if wants_plp else None,
        )
        for s in seqs:
            s.parent = parent
            self.seqs[s.request_id] = s
        self.parents[req.request_id] = parent

    def has(self, parent_id: str) -> bool:
        return parent_id in self.parents

    def sequence_ids(self, parent_id: str) -> list[str]:
        p = self.parents.get(parent_id)
        return [s.request_id for s in p.seqs] if p else []

    def unfinished(self) -> list[str]:
        return list(self.parents)

    def abort(self, parent_id: str) -> RequestOutput | None:
        """Mark every unfinished sample aborted and return the final output (None if unknown)."""
        p = self.parents.get(parent_id)
        if p is None:
            return None
        for s in p.seqs:
            if not s.finished:
                s.finish_reason = "abort"
        return self._emit(p, force=True)

    def fail_sequence(self, sequence_id: str, error: BaseException) -> list[str]:
        """The engine could not take this sequence: its request gets `error` (on its queue)
        and is forgotten; returns the request's other sequence ids (for the engine to drop)."""
        seq = self.seqs.get(sequence_id)
        if seq is None:
            return []
        self._forget(seq.parent, error)
        return [s.request_id for s in seq.parent.seqs if s.request_id != sequence_id]

    def fail(self, error: BaseException) -> None:
        """Every request gets `error` (on its queue) and is forgotten (the engine is dead)."""
        for p in list(self.parents.values()):
            self._forget(p, error)

    def _forget(self, p: _Parent, error: BaseException) -> None:
        if p.queue is not None:
            p.queue.put_nowait(error)
        for s in p.seqs:
            self.seqs.pop(s.request_id, None)
        self.parents.pop(p.request_id, None)

    # ------------------------------------------------------------------ per step
    def process(self, core_outputs) -> tuple[list[RequestOutput], list[str]]:
        """Fold one step's EngineCoreOutputs in. Returns the outputs to deliver and the
        sequence ids a stop string finished (to abort in the engine core)."""
        now = time.time()
        touched: dict[str, _Parent] = {}
        stopped: list[str] = []
        tokenizer = self.tokenizer
        for o in core_outputs:
            seq = self.seqs.get(o.request_id)
            if seq is None or seq.finish_reason is not None:
                continue
            parent = seq.parent
            m = parent.metrics
            if m.first_scheduled_time is None:
                m.first_scheduled_time = o.first_scheduled_time or now
                self.listener.on_scheduled(max(0.0, m.first_scheduled_time - m.arrival_time))
            if o.prompt_logprobs is not None and parent.prompt_logprobs is not None and parent.seqs[0] is seq:
                start, rows = o.prompt_logprobs
                for j, lp in enumerate(rows):
                    pos = start + j
                    parent.prompt_logprobs[pos] = logprob_dict(parent.prompt_token_ids[pos], lp, tokenizer)
            if o.new_token_ids:
                if m.first_token_time is None:
                    m.first_token_time = now
                    self.listener.on_first_token(max(0.0, now - m.arrival_time))
                else:
                    self.listener.on_tokens(now - m.last_token_time)
                m.last_token_time = now
                parent.num_cached_tokens = max(parent.num_cached_tokens, o.num_cached_tokens)
                for j, tok in enumerate(o.new_token_ids):
                    seq.token_ids.append(tok)
                    if seq.logprobs is not None and o.logprobs:
                        lp = o.logprobs[j]
                        seq.logprobs.append(logprob_dict(tok, lp, tokenizer))
                        seq.cumulative_logprob += lp.logprob
                    if seq.params.detokenize:
                        before = len(seq.text)
                        seq.text += seq.detok.add_tokens((tok,))
                        if seq.params.stop and self._check_stop_strings(seq, before):
                            stopped.append(seq.request_id)
                            break
            if o.finish_reason is not None and seq.finish_reason is None:
                seq.finish_reason, seq.stop_reason = o.finish_reason, o.stop_reason
            if seq.finish_reason is not None and seq.params.detokenize:
                seq.text += seq.detok.flush()
            touched[parent.request_id] = parent
        outputs = [out for p in touched.values() if (out := self._emit(p)) is not None]
        return outputs, stopped

    def _check_stop_strings(self, seq: _Seq, before: int) -> bool:
        if len(seq.token_ids) < seq.params.min_tokens:
            return False
        stops = seq.params.stop
        longest = max(len(s) for s in stops)
        lo = max(0, before - longest + 1)
        best: tuple[int, str] | None = None
        for s in stops:
            i = seq.text.find(s, lo)
            if i >= 0 and (best is None or i < best[0]):
                best = (i, s)
        if best is None:
            return False
        i, s = best
        seq.text = seq.text[: i + len(s)] if seq.params.include_stop_str_in_output else seq.text[:i]
        seq.finish_reason = "stop"
        seq.stop_reason = s
        return True

    def _emit(self, p: _Parent, force: bool = False) -> RequestOutput | None:
        seqs = p.seqs
        if len(seqs) == 1:
            finished = seqs[0].finish_reason is not None
        else:
            finished = all(s.finish_reason is not None for s in seqs)
        if finished:
            p.metrics.finished_time = time.time()
        if p.kind == OutputKind.FINAL_ONLY and not finished and not force:
            return None
        outs = []
        for s in p.seqs:
            if p.kind == OutputKind.DELTA:
                done = s.finish_reason is not None
                end = max(s.sent_text, len(s.text) - (0 if done else s.hold))
                text, toks = s.text[s.sent_text : end], s.token_ids[s.sent_tokens :]
                lps = s.logprobs[s.sent_tokens :] if s.logprobs is not None else None
                if not text and not toks and not (done and not s.finish_sent):
                    continue
                s.sent_text, s.sent_tokens = end, len(s.token_ids)
                s.finish_sent = done
            else:
                text, toks, lps = s.text, list(s.token_ids), (list(s.logprobs) if s.logprobs is not None else None)
            outs.append(CompletionOutput(s.index, text, toks, s.cumulative_logprob, lps, s.finish_reason, s.stop_reason))
        if p.kind == OutputKind.DELTA and not outs:
            return None
        out = RequestOutput(
            request_id=p.request_id,
            prompt=p.prompt,
            prompt_token_ids=p.prompt_token_ids,
            outputs=outs,
            finished=finished,
            prompt_logprobs=p.prompt_logprobs,
            num_cached_tokens=p.num_cached_tokens,
            metrics=p.metrics,
        )
        self.listener.on_output(out)
        if p.queue is not None:
            p.queue.put_nowait(out)
        if finished:
            self.listener.on_finished(out, max(0.0, p.metrics.finished_time - p.metrics.arrival_time))
            for s in p.seqs:
                self.seqs.pop(s.request_id, None)
            self.parents.pop(p.request_id, None)
        return out
