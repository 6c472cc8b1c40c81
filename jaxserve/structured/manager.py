"""StructuredOutputManager: the engine core's grammar state, one matcher per constrained
sequence, and the token bitmask of each step.

The matchers live with the scheduler on the engine core's side because they need every
accepted token in order. They are advanced lazily, when a step is planned: a matcher catches up
with its request's output tokens (the scheduler appended them in `update_from_output`), then
writes its row of the bitmask. A request preempted by recompute keeps its output tokens, so its
matcher stays valid; nothing is rebuilt unless a matcher finds itself ahead of its request's
outputs (it then starts again from the grammar's initial state and replays them).

The bitmask is one [n, W] int32 array per step (W = ceil(V / 32), one bit per token id, bit
t % 32 of word t // 32), a row per scheduled request: all ones for free requests and for rows
that sample nothing (a prefill chunk), so constrained and free requests share a batch. The
runner packs it into the step's int32 buffer and the sampler applies it before anything else.

The step that needs a bitmask needs the tokens of the step before it on the host: while a
constrained request is unfinished the engine core does not overlap steps (see core.py).

Reasoning models (`reasoning`: the engine's reasoning parser, --reasoning-parser): the
constraint applies to the answer, not the reasoning, as vLLM's. Unless the request's prompt
has already closed reasoning (`ReasoningParser.reasoning_ended`, e.g. Qwen3 with
enable_thinking false), its matcher neither masks nor advances until the end marker's token
(`</think>`) is among its output tokens; from the token after it on it applies as above, fed the
output tokens after the marker. The request still counts as constrained meanwhile (steps do not
overlap), since the step after the marker needs its mask.

A constraint that llguidance stops enforcing part-way (its parser limits, which bound the time a
step's masks may take: e.g. at most 2,000 items in a parser row, which a choice among
thousands of strings passes after its first token) fails its request with that error
(`RequestFailedError`, a 400), never letting it go on unconstrained.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable

import numpy as np

from jaxserve.core.sched_output import SchedulerOutput
from jaxserve.reasoning import ReasoningParser
from jaxserve.request import EngineRequest, RequestFailedError
from jaxserve.structured.compiler import CompiledGrammar, GrammarCompiler, GrammarMatcher, bitmask_words

logger = logging.getLogger(__name__)


class _State:
    __slots__ = ("grammar", "matcher", "scanned", "start")

    def __init__(self, grammar: CompiledGrammar, start: int | None = 0):
        self.grammar = grammar
        self.matcher: GrammarMatcher = grammar.matcher()
        # Output tokens before the answer (the reasoning and its end marker), which the matcher
        # never sees; None while the request is still reasoning.
        self.start = start
        self.scanned = 0  # output tokens searched for the end marker so far


def default_mask_threads() -> int:
    """Threads filling a step's bitmask rows: llguidance's pool (80% of the cores, at most 32)
    on hosts with more than 4 cores; on smaller ones the engine thread alone. On the 2-core
    development host, in the engine loop, one thread filled 32 rows in about half the time of
    the pool (the hand-offs cost more than the second core gives)."""
    return 1 if (os.cpu_count() or 1) <= 4 else 0


class StructuredOutputManager:
    def __init__(self, vocab_size: int, num_threads: int | None = None):
        """`num_threads`: 1 fills the bitmask on the calling thread, 0 uses llguidance's pool at
        its default size, n > 1 a pool of n; None: `default_mask_threads()`."""
        self.words = bitmask_words(vocab_size)
        self._states: dict[str, _State] = {}
        self._num_threads = default_mask_threads() if num_threads is None else num_threads
        self._executor = None  # llguidance's thread pool for the masks of a step, built on first use
        # Compiles the constraints of requests that arrive without their grammar (from another
        # process: engine/core_process.py); None where requests come compiled.
        self.compiler: GrammarCompiler | None = None
        # The engine's reasoning parser (set at engine build): constraints apply after its end
        # marker; None: from the first output token.
        self.reasoning: ReasoningParser | None = None

    @property
    def active(self) -> bool:
        """Some unfinished request is constrained."""
        return bool(self._states)

    def add(self, request: EngineRequest) -> None:
        grammar = request.grammar
        constraint = request.sampling_params.structured_outputs
        if grammar is None and constraint is not None and self.compiler is not None:
            grammar = self.compiler.compile(constraint)  # cached; validated by the frontend already
        if grammar is not None:
            r = self.reasoning
            reasoning_open = r is not None and not r.reasoning_ended(request.prompt_token_ids)
            self._states[request.request_id] = _State(grammar, None if reasoning_open else 0)

    def remove(self, request_ids: Iterable[str]) -> None:
        for rid in request_ids:
            self._states.pop(rid, None)

    def bitmask(self, so: SchedulerOutput) -> np.ndarray | None:
        """The [len(so.scheduled), W] bitmask of a step (None when no row is constrained).
        Drops the matchers of requests finished since the last step. Raises
        RequestFailedError naming the requests whose grammar can no longer be enforced."""
        self.remove(so.finished_request_ids)
        states = self._states
        rows: list[tuple[int, str, GrammarMatcher]] = []
        for i, (s, req) in enumerate(zip(so.scheduled, so.requests)):
            st = states.get(s.request_id) if s.sample else None
            if st is None:
                continue
            out = req.output_token_ids
            if st.start is None and not self._reasoning_ended(st, out):
                continue  # still reasoning: a free row
            m = st.matcher
            if m.num_tokens > len(out) - st.start:  # not with the scheduler's bookkeeping; recover
                m = st.matcher = st.grammar.matcher()
            for tok in out[st.start + m.num_tokens:]:
                m.accept(tok)
            rows.append((i, s.request_id, m))
        if not rows:
            return None
        mask = np.full((len(so.scheduled), self.words), -1, np.int32)
        self._fill([(m.ll, i) for i, _, m in rows if not m.failed], mask)
        failed = {rid: m.error() for _, rid, m in rows if m.failed or m.ll.is_error()}
        if failed:
            rid, error = next(iter(failed.items()))
            raise RequestFailedError(failed, ValueError(
                f"structured output: the constraint cannot be enforced past output token "
                f"{states[rid].matcher.num_tokens} ({error}); simplify the constraint"))
        return mask

    def _reasoning_ended(self, st: _State, out: list[int]) -> bool:
        """Whether the answer has started among the output tokens `out` (the reasoning parser's
        `answer_start`: after its end marker, or gpt-oss's final channel header; then `st.start`
        is set); searched from where the last search stopped."""
        assert self.reasoning is not None
        at = self.reasoning.answer_start(out, st.scanned)
        if at is None:
            st.scanned = len(out)
            return False
        st.start = at
        return True

    def _fill(self, live, mask: np.ndarray) -> None:
        if not live:
            return
        if len(live) == 1 or self._num_threads == 1:
            for m, i in live:
                row = mask[i]
                m.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)
            return
        if self._executor is None:
            import llguidance

            self._executor = llguidance.LLExecutor(num_threads=self._num_threads or None)
        self._executor.unsafe_compute_mask_ptr(live, mask.ctypes.data, mask.shape[1] * 4, mask.shape[0])
