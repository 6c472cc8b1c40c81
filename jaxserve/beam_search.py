"""Beam search as vLLM does it (`LLM.beam_search`, the server's `use_beam_search`).

Each step extends every live beam by one token: the engine runs each beam as a request of one
token (`max_tokens=1`) that returns its top 2 x beam_width log-probs (Hugging Face's rule); each
candidate (beam + token) scores its cumulative log-prob, and the best beam_width candidates of
a prompt live on. A candidate that ends in the end-of-sequence token (unless `ignore_eos`) is
complete; at `max_tokens`, or at the model's context length, the live beams complete too. The
result is the beam_width best completed beams, by cumulative log-prob over length **
length_penalty (the EOS token not counted), best first.

A beam's request is its whole sequence as a prompt, so the engine's prefix cache serves every
full block a beam shares with its prompt and its parent: a step computes about one block per
beam, not the whole sequence again.

`BeamSearch` holds the search and leaves running the steps to its caller (`pending` -> run ->
`advance`), so that the offline API (entrypoints/llm.py, in a loop) and the server (in a
coroutine) share it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from jaxserve.lora_request import LoRARequest
from jaxserve.outputs import LogprobsDict
from jaxserve.sampling_params import BeamSearchParams, SamplingParams

__all__ = ["BeamSearch", "BeamSearchOutput", "BeamSearchParams", "BeamSearchSequence", "beam_score",
           "beam_step_params", "is_eos_ended"]


@dataclasses.dataclass
class BeamSearchSequence:
    """One beam: `tokens` holds the prompt's tokens and the generated ones (as vLLM's);
    `logprobs` one dict per generated token; `text` is filled in when the search ends."""

    tokens: list[int]
    logprobs: list[LogprobsDict]
    lora_request: LoRARequest | None = None
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None  # "stop" (EOS) or "length"
    stop_reason: int | str | None = None


@dataclasses.dataclass
class BeamSearchOutput:
    """The best sequences of one prompt, best first (at most beam_width)."""

    sequences: list[BeamSearchSequence]


def beam_score(tokens: Sequence[int], cum_logprob: float, eos_token_id: int | None,
               length_penalty: float) -> float:
    """A beam's rank: cumulative log-prob over its length (prompt included, a final EOS not)
    to the power length_penalty (Hugging Face's and vLLM's score)."""
    n = len(tokens)
    if eos_token_id is not None and tokens and tokens[-1] == eos_token_id:
        n -= 1
    return cum_logprob / (max(n, 1) ** length_penalty)


@dataclasses.dataclass
class _Prompt:
    prompt_len: int
    beams: list[BeamSearchSequence]
    completed: list[BeamSearchSequence] = dataclasses.field(default_factory=list)


class BeamSearch:
    """The beam search over a batch of prompts (token ids), one step at a time."""

    def __init__(self, prompts: Sequence[Sequence[int]], params: BeamSearchParams, *,
                 eos_token_id: int | None, max_model_len: int,
                 lora_requests: Sequence[LoRARequest | None] | None = None):
        self.params = params
        self.eos_token_id = eos_token_id
        self.max_model_len = max_model_len
        loras = list(lora_requests) if lora_requests is not None else [None] * len(prompts)
        self._prompts = [_Prompt(len(p), [BeamSearchSequence(list(p), [], lora)])
                         for p, lora in zip(prompts, loras)]
        self._steps = 0
        self._pending: list[tuple[_Prompt, BeamSearchSequence]] = []

    def pending(self) -> list[tuple[int, BeamSearchSequence]]:
        """The beams the next step extends, each with the index of its prompt (their `tokens`
        are the step's prompts); empty when the search is over. Beams at the context length
        complete here ("length")."""
        self._pending = []
        if self._steps >= self.params.max_tokens:
            return []
        for p in self._prompts:
            live = []
            for beam in p.beams:
                if len(beam.tokens) >= self.max_model_len:
                    beam.finish_reason = "length"
                    p.completed.append(beam)
                else:
                    live.append(beam)
                    self._pending.append((p, beam))
            p.beams = live
        index = {id(p): i for i, p in enumerate(self._prompts)}
        return [(index[id(p)], beam) for p, beam in self._pending]

    def advance(self, top_logprobs: Sequence[LogprobsDict | None]) -> None:
        """One step's results, in `pending`'s order: each beam's next-token log-probs (None: the
        beam could not be extended; it completes as it is)."""
        if len(top_logprobs) != len(self._pending):
            raise ValueError(f"{len(top_logprobs)} results for {len(self._pending)} beams")
        params, eos = self.params, self.eos_token_id
        grown: dict[int, list[BeamSearchSequence]] = {id(p): [] for p in self._prompts}
        for (p, beam), top in zip(self._pending, top_logprobs):
            if top is None:
                beam.finish_reason = "length"
                p.completed.append(beam)
                continue
            for token, lp in top.items():
                child = BeamSearchSequence(beam.tokens + [token], beam.logprobs + [top], beam.lora_request,
                                           beam.cum_logprob + lp.logprob)
                if token == eos and not params.ignore_eos:
                    child.finish_reason = "stop"
                    p.completed.append(child)
                else:
                    grown[id(p)].append(child)
        for p in self._prompts:
            p.beams = sorted(grown[id(p)], key=self._score, reverse=True)[: params.beam_width]
        self._pending = []
        self._steps += 1

    def results(self) -> list[BeamSearchOutput]:
        """Each prompt's best beams, best first (live beams complete with "length")."""
        out = []
        for p in self._prompts:
            for beam in p.beams:
                beam.finish_reason = beam.finish_reason or "length"
            best = sorted(p.completed + p.beams, key=self._score, reverse=True)[: self.params.beam_width]
            out.append(BeamSearchOutput(best))
        return out

    def prompt_len(self, i: int) -> int:
        return self._prompts[i].prompt_len

    def _score(self, beam: BeamSearchSequence) -> float:
        return beam_score(beam.tokens, beam.cum_logprob, self.eos_token_id, self.params.length_penalty)


def beam_step_params(params: BeamSearchParams, max_logprobs: int) -> SamplingParams:
    """The sampling parameters of one beam's request in a step: one token, and the log-probs of
    its candidates, 2 x beam_width (Hugging Face's rule); ValueError when the engine returns
    fewer (`max_logprobs`)."""
    k = 2 * params.beam_width
    if k > max_logprobs:
        raise ValueError(f"beam_width {params.beam_width} needs {k} log-probs a step, but this engine returns "
                         f"at most {max_logprobs} (--max-logprobs); use beam_width <= {max_logprobs // 2}.")
    return SamplingParams(max_tokens=1, logprobs=k, temperature=params.temperature)


def is_eos_ended(beam: BeamSearchSequence, eos_token_id: int | None, ignore_eos: bool) -> bool:
    """Whether the beam ends in the end-of-sequence token that ended it."""
    return not ignore_eos and eos_token_id is not None and bool(beam.tokens) and beam.tokens[-1] == eos_token_id

