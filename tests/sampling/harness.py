"""Builds sampler inputs (state + metadata) from plain request descriptions, as the runner will."""

from __future__ import annotations

import dataclasses
import functools

import jax
import numpy as np

from jaxserve.sampling import (
    SamplerConfig,
    SamplingMetadataBuilder,
    init_sampling_state,
    penalty_slots,
    sample,
    update_state_from_tokens,
    write_slot_rows,
)
from jaxserve.sampling_params import SamplingParams


@dataclasses.dataclass
class Req:
    params: SamplingParams
    slot: int
    prompt: list[int] = dataclasses.field(default_factory=list)
    outputs: list[int] = dataclasses.field(default_factory=list)
    eos: tuple[int, ...] = ()
    bad_words: list[list[int]] | None = None


@functools.cache
def jitted(config: SamplerConfig):
    """One set of jitted functions per config, shared by the tests (their compile caches are
    then checked). Fresh wrappers, so that jit caches are not shared across configs."""
    return (
        jax.jit(lambda logits, meta, state: sample(logits, meta, state, config)),
        jax.jit(lambda *args: update_state_from_tokens(*args), donate_argnums=0),
        jax.jit(lambda state, rows: write_slot_rows(state, rows), donate_argnums=0),
    )


def feed(config, state, reqs, reset_slots, num_tokens: int, count_slots):
    """One step that feeds every request's prompt then outputs (contiguous per request).
    `count_slots`: the slots whose counts to keep (the step's `penalty_slots(meta)`)."""
    _, update, _ = jitted(config)
    slots, toks, is_prompt = [], [], []
    for r in reqs:
        slots += [r.slot] * (len(r.prompt) + len(r.outputs))
        toks += list(r.prompt) + list(r.outputs)
        is_prompt += [True] * len(r.prompt) + [False] * len(r.outputs)
    n = len(toks)
    assert n <= num_tokens
    pad = num_tokens - n
    return update(
        state,
        np.asarray(slots + [0] * pad, np.int32),
        np.asarray(toks + [0] * pad, np.int32),
        np.asarray(is_prompt + [False] * pad),
        np.asarray([True] * n + [False] * pad),
        np.asarray(reset_slots, np.int32),
        np.asarray(count_slots, np.int32),
    )


def build(config: SamplerConfig, reqs: list[Req], num_rows: int, seed: int = 0,
          num_tokens: int = 512, builder: SamplingMetadataBuilder | None = None, state=None):
    """Admit `reqs`, write their slot rows, feed their history; -> (state, meta, builder)."""
    _, _, write = jitted(config)
    state = init_sampling_state(config) if state is None else state
    b = builder or SamplingMetadataBuilder(config, seed=seed)
    for r in reqs:
        b.admit(r.slot, r.params, r.eos, r.bad_words)
    for w in b.take_slot_writes():
        state = write(state, w)
    meta = b.build([r.slot for r in reqs], [len(r.outputs) for r in reqs], num_rows)
    state = feed(config, state, reqs, meta.reset_slots, num_tokens, penalty_slots(meta))
    return state, meta, b
