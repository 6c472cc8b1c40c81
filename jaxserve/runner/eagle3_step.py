"""EAGLE-3 drafting inside the target's compiled step (the engine's side: spec_decode/eagle3.py).

The step of an engine with an EAGLE-3 draft head (models/eagle3.py) does what the plain step
does (runner/step_fn.py), with the target's forward also returning its taps (the hidden states
entering the layers the head reads), and then drafts the next k tokens of every request that
sampled, on the device:

1. Acceptance: a request fed d drafts samples on d + 1 rows; it keeps the samples while each
   equals the draft fed after it (as `accept_drafts` does on the host). Its last kept row is
   at position P, and the token sampled there (the bonus, or the correction) is the next token.
2. Pass 1 over the step's T tokens: the head's hidden state is `fc` of the taps, its input
   token at position p the token at p + 1 (the next fed token; at a prefill chunk's end that
   samples nothing, the next prompt token, from the host; at P, the token sampled there). It
   writes the head's KV at every position (the rejected ones are overwritten later, as the
   target's are). Draft 1 is the head's greedy token at P.
3. k - 1 chained passes, one token per request at P + 1, P + 2, ...: the previous pass's
   hidden state and draft as input, each writing its KV (only inside the request's pages: a
   write past them goes to the null page, and the chain only reads its own).

The head has one paged layer of its own (`DraftKV`): the target's page size and page count,
indexed by the same block tables. The step returns the [R, k] drafts of each request row (the
request's index among the step's rows) with its samples; the engine feeds them in the next step
as draft tokens (jaxserve/engine/core.py, spec_decode/eagle3.py), verified as n-gram drafts
are: greedy drafts are point masses, so keeping a draft while the request's own sample equals
it is exact at any temperature.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxserve.pallas_kernels.ragged_paged_attention.metadata import AttentionMetadata
from jaxserve.runner.step_fn import StepFunction
from jaxserve.runner.step_inputs import ModelInputs, TokenInfo
from jaxserve.sampling.metadata import SamplingMetadata


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DraftInputs:
    """What the drafting part of a step reads besides the step's own inputs."""

    next_tokens: np.ndarray  # [T] int32: the token after each fed token, where the host knows it
    first_row: np.ndarray  # [R] int32: each request row's first sampling row
    num_rows: np.ndarray  # [R] int32: its sampling rows (drafts + 1; 0: samples nothing, padding)
    num_pages: np.ndarray  # [R] int32: the pages it holds (the chain writes inside them only)

    @classmethod
    def empty(cls, T: int, R: int) -> DraftInputs:
        z = lambda n: np.zeros(n, np.int32)  # noqa: E731
        return cls(z(T), z(R), z(R), z(R))


def draft_inputs(rows, tokens: np.ndarray, lens: np.ndarray, samples: np.ndarray, drafts: np.ndarray,
                 num_pages: np.ndarray, T: int, R: int) -> DraftInputs:
    """A rank's `DraftInputs` (host): `rows` its ScheduledRequests, `tokens` their fed tokens one
    after another, `lens`, `samples`, `drafts` per row, `num_pages` the pages each row holds."""
    out = DraftInputs.empty(T, R)
    n, total = len(rows), len(tokens)
    if not n:
        return out
    out.next_tokens[: total - 1] = tokens[1:]
    ends = np.cumsum(lens) - 1  # each row's last token: the next row's first is not its successor
    out.next_tokens[ends] = [s.next_token_id if s.next_token_id >= 0 else 0 for s in rows]
    per_row = np.where(samples, 1 + drafts, 0)
    out.num_rows[:n] = per_row
    out.first_row[:n] = np.cumsum(per_row) - per_row
    out.num_pages[:n] = num_pages
    return out


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DraftKV:
    """The target's KV cache and the head's own layer of K and V pages."""

    target: Any  # the target's KVCache
    k: jax.Array
    v: jax.Array


def accepted_rows(sampled: jax.Array, inputs: ModelInputs, d: DraftInputs, k: int) -> jax.Array:
    """[R] each request row's last kept sampling row: its first row + the drafts its samples
    confirmed (a row's draft is the token fed after the row's token)."""
    R = sampled.shape[0]
    matched = sampled == d.next_tokens[inputs.logits_indices]  # [R] per sampling row
    j = jnp.arange(k + 1)
    rows = jnp.clip(d.first_row[:, None] + j[None], 0, R - 1)
    checks = matched[rows] & (j[None] < d.num_rows[:, None] - 1)
    kept = jnp.cumprod(checks.astype(jnp.int32), axis=1).sum(axis=1)
    return jnp.clip(d.first_row + kept, 0, R - 1)


def chain_metadata(md: AttentionMetadata, positions: jax.Array, live: jax.Array, num_pages: jax.Array,
                   page_size: int) -> AttentionMetadata:
    """The attention metadata of one chained pass: request row i feeds one token at
    `positions[i]` (a `live` row writes its KV there when its pages reach it, else the null
    page; it reads its keys up to there, within its pages)."""
    R, P = md.block_tables.shape
    page = positions // page_size
    inside = live & (page < num_pages) & (page < P)
    slots = md.block_tables[jnp.arange(R), jnp.clip(page, 0, P - 1)] * page_size + positions % page_size
    slot_mapping = jnp.where(inside, slots, jnp.arange(R) % page_size).astype(jnp.int32)
    kv_lens = jnp.where(live, jnp.minimum(positions + 1, num_pages * page_size), 1)
    qsl = jnp.minimum(jnp.arange(R + 1), md.num_seqs).astype(jnp.int32)
    return AttentionMetadata(block_tables=md.block_tables, kv_lens=kv_lens.astype(jnp.int32),
                             query_start_loc=qsl, num_seqs=md.num_seqs, slot_mapping=slot_mapping)


@dataclasses.dataclass(frozen=True, eq=False)
class Eagle3StepFunction(StepFunction):
    """The step with EAGLE-3 drafting (see the module docstring): `params` is the target's flat
    weights, then the head's; `kv` a `DraftKV`; the inputs end with `DraftInputs`. Returns
    (kv, sstate, SamplerOutput, (PromptLogprobs, drafts [R, k] int32))."""

    drafter_graphdef: Any = None
    drafter_treedef: Any = None
    taps: tuple[int, ...] = ()
    num_speculative_tokens: int = 1
    page_size: int = 16

    def model_of(self, params, tok: TokenInfo):
        n = self.params_treedef.num_leaves
        return nnx.merge(self.graphdef, jax.tree.unflatten(self.params_treedef, params[:n])), None

    def drafter_of(self, params):
        n = self.params_treedef.num_leaves
        return nnx.merge(self.drafter_graphdef, jax.tree.unflatten(self.drafter_treedef, params[n:]))

    def __call__(self, params, kv: DraftKV, sstate, inputs: ModelInputs, meta: SamplingMetadata, tok: TokenInfo,
                 draft: DraftInputs):
        model, _ = self.model_of(params, tok)
        input_ids, sstate = self.fold_inputs(sstate, inputs, meta, tok)
        hidden, target_kv, tapped = model(input_ids, inputs.positions, kv.target, inputs.md, self.layer_impl,
                                          taps=self.taps)
        logits = model.compute_logits(hidden[inputs.logits_indices])
        sstate, out, plp = self.sample_and_keep(model, hidden, logits, sstate, meta, tok)
        drafts, dk, dv = self.draft(self.drafter_of(params), tapped, out.token_ids, inputs, draft, kv.k, kv.v)
        return DraftKV(target_kv, dk, dv), sstate, out, (plp, drafts)

    def draft(self, drafter, tapped, sampled, inputs: ModelInputs, d: DraftInputs, dk, dv):
        """The k drafts of each request row that sampled ([R, k] target ids) and the head's
        updated pages."""
        T = inputs.input_ids.shape[0]
        md, k = inputs.md, self.num_speculative_tokens
        last = accepted_rows(sampled, inputs, d, k)
        live = d.num_rows > 0
        at = inputs.logits_indices[last]  # [R] the flat token of each request's last kept row
        tokens = d.next_tokens.at[jnp.where(live, at, T)].set(sampled[last], mode="drop")
        first, dk, dv = drafter.paged_step(tokens, inputs.positions, drafter.combine_hidden(tapped), dk, dv, md)
        pos = inputs.positions[at]
        drafts = jnp.zeros((sampled.shape[0], k), jnp.int32).at[:, 0].set(first.target_ids[at])
        hidden = first.hidden[at].astype(jnp.float32)

        def chain(j, carry):
            dk, dv, drafts, hidden = carry
            cmd = chain_metadata(md, pos + j, live, d.num_pages, self.page_size)
            step, dk, dv = drafter.paged_step(drafts[:, j - 1], pos + j, hidden, dk, dv, cmd)
            return dk, dv, drafts.at[:, j].set(step.target_ids), step.hidden.astype(jnp.float32)

        dk, dv, drafts, _ = jax.lax.fori_loop(1, k, chain, (dk, dv, drafts, hidden))
        return drafts, dk, dv


def draft_layer_config(path: str):
    """The ArchConfig of the decoder layer of the EAGLE-3 head in `path` (its KV pages)."""
    from jaxserve.models.eagle3 import Eagle3Config
    from jaxserve.models.loader import load_checkpoint

    return Eagle3Config.from_hf(load_checkpoint(path).config).layer
