"""Fakes for engine tests without a model: a character tokenizer and a runner that keeps the
runner's contract (prepare / launch / collect, pending tokens read from the request's last
sampled one, a compile counter) and samples a deterministic function of each request's
history. `fake_parts` puts them together with the real scheduler, engine core, input and
output processors."""

from __future__ import annotations

import dataclasses
import threading
import time

import numpy as np

from jaxserve.core.kv_cache_manager import KVCacheManager
from jaxserve.core.sched_output import PENDING, NewRequestData, StepBatch
from jaxserve.core.scheduler import Scheduler, SchedulerConfig
from jaxserve.engine.core import EngineCore
from jaxserve.engine.input_processor import ModelInfo
from jaxserve.engine.setup import EngineParts
from jaxserve.engine.tokenizer import IncrementalDetokenizer
from jaxserve.runner.model_runner import RunnerOutput
from jaxserve.outputs import SampleLogprobs
from jaxserve.request import RequestFailedError
from jaxserve.sampling.config import SamplerConfig

VOCAB = 96
EOS = 0


class CharTokenizer:
    """Token id = 1 + (ord(c) - 32) for printable ASCII (id 0 is EOS, a special token)."""

    eos_token_id = EOS
    bos_token_id = None
    pad_token_id = None
    vocab_size = VOCAB
    special_ids = frozenset({EOS})

    def __init__(self) -> None:
        self.decode_threads: set[str] = set()

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [1 + (ord(c) - 32) % (VOCAB - 1) for c in text]

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        self.decode_threads.add(threading.current_thread().name)
        return "".join("" if i == EOS and skip_special_tokens else ("<eos>" if i == EOS else chr(31 + i))
                       for i in ids)

    def convert_ids_to_tokens(self, ids, skip_special_tokens: bool = False) -> list[str]:
        return [self.decode([i]) for i in ids]

    def apply_chat_template(self, messages, add_generation_prompt: bool = True, **kwargs) -> str:
        return "".join(f"{m['role']}: {m['content']}\n" for m in messages) + ("assistant: " if add_generation_prompt else "")

    def detokenizer(self, *, skip_special_tokens: bool = True, prompt_token_ids=None) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(self, skip_special_tokens=skip_special_tokens, prompt_token_ids=prompt_token_ids)


def next_token(prev: int, pos: int) -> int:
    """The fake model: the token after `prev` at position `pos` (never EOS by itself)."""
    return 1 + (prev * 7 + pos * 3) % (VOCAB - 1)


def prompt_logprob(pos: int) -> float:
    """The fake model's log-prob of the prompt token at position `pos` (>= 1)."""
    return -pos / 100


@dataclasses.dataclass
class _Counter:
    num_compiles: int = 3
    recompiles: int = 0
    compile_seconds: float = 0.0


@dataclasses.dataclass
class _Plan:
    rows: list[tuple[str, list[int], int, bool, int | None]]  # (id, tokens, start, sample, logprobs k)
    bitmask: np.ndarray | None = None  # structured output's rows, in row order
    # (id, first fed position, tokens fed, prompt length) of the rows that want prompt log-probs
    prompt_rows: list[tuple[str, int, int, int]] = dataclasses.field(default_factory=list)


def allowed_ids(row: np.ndarray) -> np.ndarray:
    """The token ids a bitmask row ([W] int32) allows."""
    bits = (row[:, None].astype(np.int64) >> np.arange(32)) & 1
    return np.flatnonzero(bits.reshape(-1))


class FakeRunner:
    """Samples next_token(last fed token, its position) for each row that samples; a PENDING
    input is the request's last sampled token, as on the device. `step_seconds` stands for
    device time (spent in collect); `explode` makes collect raise (a device error);
    `reject_token` is a token id the runner cannot take: prepare raises RequestFailedError
    naming each newly admitted request whose prompt holds it, after it has taken state for the
    rows before (as a real runner may); `gate` (set by default) holds collect until set;
    `scheduled` records the request ids of each step. A row with a structured-output bitmask
    takes the model's token if the bitmask allows it, else the allowed token picked by the same
    hash."""

    def __init__(self, step_seconds: float = 0.0, sampler_config: SamplerConfig | None = None) -> None:
        self.sampler_config = sampler_config or SamplerConfig(max_num_seqs=8, vocab_size=VOCAB)
        self.step_seconds = step_seconds
        self.masked_steps = 0
        self.explode = False
        self.reject_token: int | None = None
        self.gate = threading.Event()
        self.gate.set()
        self.num_failed_prepares = 0
        self.last: dict[str, int] = {}
        self.scheduled: list[list[str]] = []
        self.prompts: list[list[int]] = []  # of each request, when it first runs
        self.requests: dict[str, NewRequestData] = {}  # the running requests' snapshots
        self.counter = _Counter()
        self.is_sleeping = False

    def prepare(self, batch: StepBatch, token_bitmask: np.ndarray | None = None) -> _Plan | None:
        for rid in (*batch.finished_request_ids, *batch.preempted_request_ids):
            self.requests.pop(rid, None)
        if batch.is_empty:
            return None
        rows, prompt_rows = [], []
        for s in batch.rows:
            if s.is_new:  # what a runner keeps of a request comes from its admission's snapshot
                if self.reject_token is not None and self.reject_token in s.new.prompt_token_ids:
                    self.num_failed_prepares += 1
                    raise RequestFailedError([s.request_id], ValueError(f"the runner cannot take token {self.reject_token}"))
                if not s.is_resumed:
                    self.prompts.append(list(s.new.prompt_token_ids))
                self.requests[s.request_id] = s.new
            new = self.requests[s.request_id]
            rows.append((s.request_id, list(s.token_ids), s.start_pos, s.sample, new.sampling_params.logprobs))
            if new.sampling_params.prompt_logprobs is not None:
                prompt_rows.append((s.request_id, s.start_pos, s.num_scheduled_tokens, new.num_prompt_tokens))
        self.scheduled.append([s.request_id for s in batch.rows])
        if token_bitmask is not None:
            self.masked_steps += 1
            assert token_bitmask.shape == (len(rows), (self.sampler_config.vocab_size + 31) // 32)
        return _Plan(rows, token_bitmask, prompt_rows)

    def launch(self, plan: _Plan) -> _Plan:
        return plan

    def collect(self, plan: _Plan) -> RunnerOutput:
        self.gate.wait()
        if self.explode:
            raise RuntimeError("boom")
        if self.step_seconds:
            time.sleep(self.step_seconds)
        sampled, logprobs = {}, {}
        for i, (rid, tokens, start, sample, k) in enumerate(plan.rows):
            last = tokens[-1] if tokens[-1] != PENDING else self.last[rid]
            if sample:
                tok = next_token(last, start + len(tokens) - 1)
                if plan.bitmask is not None and not (plan.bitmask[i] == -1).all():
                    allowed = allowed_ids(plan.bitmask[i])
                    if tok not in allowed:
                        tok = int(allowed[(last * 7 + start) % len(allowed)])
                self.last[rid] = tok
                sampled[rid] = [tok]
                if k is not None:
                    logprobs[rid] = [SampleLogprobs(-0.5, 1, [tok, 1][:k], [-0.5, -1.5][:k])]
        prompt_lps = {}
        for rid, start, n, prompt_len in plan.prompt_rows:
            scored = range(start + 1, min(start + n + 1, prompt_len))  # the next prompt token of each
            if scored:
                prompt_lps[rid] = (start + 1, [SampleLogprobs(prompt_logprob(p), 1, [], []) for p in scored])
        return RunnerOutput(sampled, logprobs, prompt_lps)

    def sleep(self) -> None:
        self.is_sleeping = True

    def wake_up(self) -> None:
        self.is_sleeping = False


def fake_parts(*, async_scheduling: bool = True, max_num_seqs: int = 8, budget: int = 64,
               max_model_len: int = 128, num_blocks: int = 256, block_size: int = 4,
               step_seconds: float = 0.0, extra_eos: tuple[int, ...] = (), tokenizer=None,
               vocab_size: int = VOCAB, eos: int = EOS, policy: str = "fcfs") -> EngineParts:
    """The real engine over FakeRunner; `tokenizer` (default CharTokenizer) may be a real one
    (with `vocab_size` its vocabulary and `eos` its end-of-sequence id)."""
    kv = KVCacheManager(block_size, num_blocks, True, max_model_len)
    sc = SchedulerConfig(max_num_seqs, budget, max_model_len, async_scheduling=async_scheduling, policy=policy)
    sampler_config = SamplerConfig(max_num_seqs=max_num_seqs, vocab_size=vocab_size, max_logprobs=min(5, vocab_size),
                                   topk_candidates=min(64, vocab_size))
    scheduler = Scheduler(sc, kv)
    core = EngineCore(scheduler, FakeRunner(step_seconds, sampler_config), async_scheduling=async_scheduling)
    info = ModelInfo(name="fake", vocab_size=vocab_size, max_model_len=max_model_len, eos_token_id=eos,
                     extra_eos_token_ids=extra_eos, sampler_config=sampler_config, sampling_defaults={},
                     scheduling_policy=policy, max_num_seqs=max_num_seqs, kv_cache_tokens=scheduler.cache_tokens)
    return EngineParts(tokenizer or CharTokenizer(), info, core)
