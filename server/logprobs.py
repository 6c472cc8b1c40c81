"""Log-probs as the API writes them: the completions format (tokens, text offsets, top
log-probs by token text), the chat format (each token with its bytes and ranked alternatives)
and vLLM's prompt_logprobs. A log-prob of -inf goes out as NEG_INF_LOGPROB (JSON has no
infinity)."""

from __future__ import annotations

from typing import Any

from jaxserve.outputs import LogprobsDict
from jaxserve.server.protocol import CompletionLogProbs
from jaxserve.server.protocol_chat import ChatLogProb, ChatLogProbsContent

NEG_INF_LOGPROB = -9999.0


def _lp(x: float) -> float:
    return max(x, NEG_INF_LOGPROB)


def _token_str(tokenizer: Any, tid: int, d: LogprobsDict | None) -> str:
    if d is not None and tid in d and d[tid].decoded_token is not None:
        return d[tid].decoded_token  # type: ignore[return-value]
    return tokenizer.decode([tid])


def append_completion_logprobs(
    acc: CompletionLogProbs,
    token_ids: list[int],
    dicts: list[LogprobsDict | None],
    tokenizer: Any,
    offset: int,
) -> int:
    """Append tokens in the completions format; returns the next text offset."""
    for tid, d in zip(token_ids, dicts):
        tok = _token_str(tokenizer, tid, d)
        acc.tokens.append(tok)
        acc.text_offset.append(offset)
        offset += len(tok)
        if d is None or tid not in d:
            acc.token_logprobs.append(None)
            acc.top_logprobs.append(None)
            continue
        acc.token_logprobs.append(_lp(d[tid].logprob))
        top: dict[str, float] = {}
        for k, v in d.items():
            s = v.decoded_token if v.decoded_token is not None else tokenizer.decode([k])
            top.setdefault(s, _lp(v.logprob))
        acc.top_logprobs.append(top)
    return offset


def chat_logprobs(token_ids: list[int], dicts: list[LogprobsDict], tokenizer: Any,
                  top_k: int) -> list[ChatLogProbsContent]:
    """The chat format: each token, its bytes and its `top_k` alternatives by rank."""
    out = []
    for tid, d in zip(token_ids, dicts):
        tok = _token_str(tokenizer, tid, d)
        lp = d[tid].logprob if tid in d else NEG_INF_LOGPROB
        ranked = sorted(d.items(), key=lambda kv: (
            kv[1].rank if kv[1].rank is not None else 1 << 30, -kv[1].logprob))
        top = []
        for k, v in ranked[:top_k]:
            s = v.decoded_token if v.decoded_token is not None else tokenizer.decode([k])
            top.append(ChatLogProb(token=s, logprob=_lp(v.logprob), bytes=list(s.encode("utf-8"))))
        out.append(ChatLogProbsContent(token=tok, logprob=_lp(lp), bytes=list(tok.encode("utf-8")),
                                       top_logprobs=top))
    return out


def prompt_logprobs_json(plp: list[LogprobsDict | None] | None
                         ) -> list[dict[str, Any] | None] | None:
    """vLLM's prompt_logprobs: per prompt position {token_id: {logprob, rank, decoded_token}},
    the first None."""
    if plp is None:
        return None
    return [None if d is None else {str(k): {"logprob": _lp(v.logprob), "rank": v.rank,
                                             "decoded_token": v.decoded_token}
                                    for k, v in d.items()}
            for d in plp]
