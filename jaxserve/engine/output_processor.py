"""Output processing: incremental detokenization, stop strings, log-probs, RequestOutputs.

The scheduler owns the token-level stop rules (EOS, stop_token_ids, max_tokens); stop *strings*
are matched here on the detokenized text, across token boundaries, and the finished request is
handed back to the scheduler. For n > 1 a parent gathers its children's CompletionOutputs.
"""

from __future__ import annotations

import dataclasses
import time

from jaxserve.engine.tokenizer import IncrementalDetokenizer, Tokenizer
from jaxserve.outputs import (
    CompletionOutput,
    Logprob,
    LogprobsDict,
    OutputKind,
    RequestMetrics,
    RequestOutput,
)
from jaxserve.request import Request
from jaxserve.runner.model_runner import RunnerOutput, SampleLogprobs
from jaxserve.sampling_params import SamplingParams


@dataclasses.dataclass(slots=True)
class _Seq:
    """One generated sequence (a request, or one of the n samples of a parent)."""

    request_id: str
    index: int
    params: SamplingParams
    detok: IncrementalDetokenizer
    token_ids: list[int] = dataclasses.field(default_factory=list)
    text: str = ""
    logprobs: list[LogprobsDict] | None = None
    cumulative_logprob: float | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    sent_tokens: int = 0  # for DELTA outputs
    sent_text: int = 0
    finish_sent: bool = False

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
    prompt_logprobs: list[LogprobsDict | None] | None = None
    num_cached_tokens: int = 0

    @property
    def finished(self) -> bool:
        return all(s.finished for s in self.seqs)


def _logprob_dict(tok: int, lp: SampleLogprobs, tokenizer: Tokenizer) -> LogprobsDict:
    out: LogprobsDict = {}
    for rank, (tid, val) in enumerate(zip(lp.top_ids, lp.top_logprobs), start=1):
        out[int(tid)] = Logprob(float(val), rank, tokenizer.decode([int(tid)]))
    if tok not in out:
        out[tok] = Logprob(lp.logprob, lp.rank, tokenizer.decode([tok]))
    else:
        out[tok].rank = lp.rank
    # the chosen token first, as vLLM orders it
    return {tok: out[tok], **{k: v for k, v in out.items() if k != tok}}


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self.parents: dict[str, _Parent] = {}
        self.seq_parent: dict[str, str] = {}  # child request id -> parent id
        self.seqs: dict[str, _Seq] = {}

    def add(
        self,
        parent_id: str,
        children: list[Request],
        prompt: str | None,
        kind: OutputKind,
        arrival_time: float,
    ) -> None:
        seqs = []
        for i, req in enumerate(children):
            p = req.sampling_params
            detok = self.tokenizer.detokenizer(skip_special_tokens=p.skip_special_tokens, prompt_token_ids=req.prompt_token_ids)
            seq = _Seq(req.request_id, i, p, detok, logprobs=[] if p.logprobs is not None else None,
                       cumulative_logprob=0.0 if p.logprobs is not None else None)
            seqs.append(seq)
            self.seqs[req.request_id] = seq
            self.seq_parent[req.request_id] = parent_id
        first = children[0]
        wants_plp = first.sampling_params.prompt_logprobs is not None
        self.parents[parent_id] = _Parent(
            parent_id, prompt, list(first.prompt_token_ids), kind, seqs, RequestMetrics(arrival_time),
            prompt_logprobs=[None] + [None] * (len(first.prompt_token_ids) - 1) if wants_plp else None,
        )

    def has(self, parent_id: str) -> bool:
        return parent_id in self.parents

    def child_ids(self, parent_id: str) -> list[str]:
        p = self.parents.get(parent_id)
        return [s.request_id for s in p.seqs] if p else []

    def abort(self, parent_id: str) -> RequestOutput | None:
        """Mark every unfinished sample aborted and return the final output."""
        p = self.parents.get(parent_id)
        if p is None:
            return None
        for s in p.seqs:
            if not s.finished:
                s.finish_reason = "abort"
        return self._emit(p, force=True)

    # ------------------------------------------------------------------ per step
    def process(
        self,
        ro: RunnerOutput,
        finished: list[Request],
        requests: dict[str, Request],
    ) -> tuple[list[RequestOutput], list[str]]:
        """Fold one step in. Returns the outputs to deliver and the ids of requests that a
        stop string finished (the engine tells the scheduler)."""
        now = time.time()
        touched: dict[str, _Parent] = {}
        stopped: list[str] = []
        for rid, (start, rows) in ro.prompt_logprobs.items():
            parent = self.parents.get(self.seq_parent.get(rid, ""))
            if parent is None or parent.prompt_logprobs is None or parent.seqs[0].request_id != rid:
                continue
            for j, lp in enumerate(rows):
                pos = start + j
                parent.prompt_logprobs[pos] = _logprob_dict(parent.prompt_token_ids[pos], lp, self.tokenizer)
        for rid, toks in ro.sampled.items():
            seq = self.seqs.get(rid)
            if seq is None or seq.finished:
                continue
            parent = self.parents[self.seq_parent[rid]]
            if parent.metrics.first_token_time is None:
                parent.metrics.first_token_time = now
            parent.metrics.last_token_time = now
            if rid in requests:
                parent.num_cached_tokens = max(parent.num_cached_tokens, requests[rid].num_cached_tokens)
            for tok in toks:
                seq.token_ids.append(tok)
                if seq.logprobs is not None and rid in ro.logprobs:
                    lp = ro.logprobs[rid]
                    seq.logprobs.append(_logprob_dict(tok, lp, self.tokenizer))
                    seq.cumulative_logprob += lp.logprob
                before = len(seq.text)
                seq.text += seq.detok.add_tokens([tok])
                if self._check_stop_strings(seq, before):
                    stopped.append(rid)
                    break
            touched[parent.request_id] = parent
        for req in finished:
            seq = self.seqs.get(req.request_id)
            if seq is None or seq.finished:
                continue
            seq.finish_reason = req.get_finished_reason()
            seq.stop_reason = req.stop_reason
            seq.text += seq.detok.flush()
            touched[self.seq_parent[req.request_id]] = self.parents[self.seq_parent[req.request_id]]
        outputs = [o for p in touched.values() if (o := self._emit(p)) is not None]
        return outputs, stopped

    def _check_stop_strings(self, seq: _Seq, before: int) -> bool:
        stops = seq.params.stop
        if not stops or len(seq.token_ids) < seq.params.min_tokens:
            return False
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
        finished = p.finished
        if finished:
            p.metrics.finished_time = time.time()
        if p.kind == OutputKind.FINAL_ONLY and not finished and not force:
            return None
        outs = []
        for s in p.seqs:
            if p.kind == OutputKind.DELTA:
                hold = 0
                if not s.finished and s.params.stop and not s.params.include_stop_str_in_output:
                    hold = max(len(x) for x in s.params.stop) - 1  # never emit half a stop string
                end = max(s.sent_text, len(s.text) - hold)
                text, toks = s.text[s.sent_text : end], s.token_ids[s.sent_tokens :]
                lps = s.logprobs[s.sent_tokens :] if s.logprobs is not None else None
                if not text and not toks and not (s.finished and not s.finish_sent):
                    continue
                s.sent_text, s.sent_tokens = end, len(s.token_ids)
                s.finish_sent = s.finished
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
        if finished:
            for s in p.seqs:
                self.seqs.pop(s.request_id, None)
                self.seq_parent.pop(s.request_id, None)
            self.parents.pop(p.request_id, None)
        return out
