"""Drafting inside the target's compiled step with a draft head (the engine's side:
spec_decode/draft_head.py), for the heads of two methods: EAGLE-3 (models/eagle3.py,
`Eagle3Head`) and DeepSeek's multi-token prediction (models/deepseek_v3.py, `MtpHead`).

The step does what the plain step does (runner/step_fn.py), with the target's forward also
returning what the head reads, and then drafts the next k tokens of every request that sampled,
on the device:

1. Acceptance: a request fed d drafts samples on d + 1 rows; it keeps the samples while each
   equals the draft fed after it (as `accept_drafts` does on the host). Its last kept row is
   at position P, and the token sampled there (the bonus, or the correction) is the next token.
2. Pass 1 over the step's T tokens: the head's hidden state at position p is made from the
   target's outputs there (`DraftHead.hidden_input`), its input token is the token at p + 1
   (the next fed token; at a prefill chunk's end that samples nothing, the next prompt token,
   from the host; at P, the token sampled there). It writes the head's KV at every position
   (the rejected ones are overwritten later, as the target's are). Draft 1 is the head's
   greedy token at P.
3. k - 1 chained passes, one token per request at P + 1, P + 2, ...: the previous pass's
   hidden state and draft as input, each writing its KV (only inside the request's pages: a
   write past them goes to the null page, and the chain only reads its own).

A head is a `DraftHead`: what it asks of the target's forward, how it turns the forward's
outputs into its hidden input, its paged layer (over its own one-layer paged cache: the
target's page size and page count, indexed by the same block tables, a `KVCache` of one layer:
EAGLE-3's K and V pages, MTP's latent rows) and how a layer output becomes a draft and the
chain's next hidden state. With a quantized (fp8, int8) cache the head's pages stay in the
model's dtype (`draft_cache_dtype`). The step returns the [R, k] drafts of each request row (the
request's index among the step's rows) with its samples; the engine feeds them in the next step
as draft tokens (jaxserve/engine/core.py, spec_decode/draft_head.py), verified as n-gram drafts
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

from jaxserve.models.interface import KVCache
from jaxserve.pallas_kernels.kv_quant import is_quantized
from jaxserve.pallas_kernels.ragged_paged_attention.metadata import AttentionMetadata
from jaxserve.runner.step_fn import StepFunction
from jaxserve.runner.step_inputs import ModelInputs, TokenInfo
from jaxserve.sampling.metadata import SamplingMetadata

# The speculative methods whose head drafts inside the step, and what vLLM also calls them.
EAGLE3, MTP = "eagle3", "deepseek_mtp"


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
    """The target's KV cache and the head's own: a one-layer `KVCache` (EAGLE-3: K and V
    pages; MTP: latent rows, no V)."""

    target: Any  # the target's KVCache
    draft: Any  # the head's KVCache


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


class DraftHead:
    """What the drafting step needs of a draft head (static: part of the step function).

    - `forward_kwargs`: what the target's forward is asked for besides its hidden states (the
      forward then returns a third item, passed to `hidden_input`);
    - `module(model, params)`: the head, given the target (merged) and the head's own flat
      weights (they follow the target's in the step's parameter list; none for a head that
      lives in the target);
    - `hidden_input(head, hidden, extra)`: the [T, H] hidden state pass 1 takes, from the
      target's final hidden states (what its LM head reads) and the forward's extra output;
    - `layer(head, tokens, positions, hidden, cache, md)`: the head's layer over a flat ragged
      batch, attending over its own paged `KVCache` -> (layer output [T, H], cache);
    - `propose(head, out)`: greedy draft ids (target vocabulary) and the next chained pass's
      hidden state from layer outputs [N, H];
    - `key()`: what the head changes in the step's program (the executable cache's key)."""

    forward_kwargs = {}

    def module(self, model, params: list):
        raise NotImplementedError

    def hidden_input(self, head, hidden: jax.Array, extra) -> jax.Array:
        raise NotImplementedError

    def layer(self, head, tokens, positions, hidden, cache: KVCache, md: AttentionMetadata):
        raise NotImplementedError

    def propose(self, head, out: jax.Array) -> tuple[jax.Array, jax.Array]:
        raise NotImplementedError

    def key(self) -> str:
        raise NotImplementedError


@dataclasses.dataclass(frozen=True, eq=False)
class Eagle3Head(DraftHead):
    """An EAGLE-3 head (models/eagle3.py): its own weights (`graphdef`, `treedef`), reading the
    target's taps (`taps`: the residual streams entering those layers), `fc` of them its hidden
    input; K and V pages."""

    graphdef: Any
    treedef: Any
    taps: tuple[int, ...]

    @property
    def forward_kwargs(self) -> dict:
        return {"taps": self.taps}

    def module(self, model, params):
        return nnx.merge(self.graphdef, jax.tree.unflatten(self.treedef, params))

    def hidden_input(self, head, hidden, extra):
        return head.combine_hidden(extra)

    def layer(self, head, tokens, positions, hidden, cache, md):
        out, k, v = head.paged_layer(tokens, positions, hidden, cache.k[0], cache.v[0], md)
        return out, KVCache(k=(k,), v=(v,))

    def propose(self, head, out):
        step = head.head(out)
        return step.target_ids, step.hidden

    def key(self) -> str:
        from jaxserve.runner.executable_cache import canonical

        return f"eagle3 {self.taps} {canonical(self.graphdef)}"


@dataclasses.dataclass(frozen=True, eq=False)
class MtpHead(DraftHead):
    """DeepSeek V3's first multi-token prediction layer (models/deepseek_v3.py
    `DeepseekV3MtpLayer`), part of the target's weights: its hidden input is the target's
    final hidden state (after the final norm: what the LM head reads, as vLLM passes it);
    one latent-row page array. With one MTP layer and k > 1 it is reused for every chained
    pass, its own output feeding the next (vLLM's)."""

    def module(self, model, params):
        return model

    def hidden_input(self, head, hidden, extra):
        return hidden

    def layer(self, head, tokens, positions, hidden, cache, md):
        out, latent = head.mtp[0].paged_step(head, tokens, positions, hidden, cache.k[0], md)
        return out, KVCache(k=(latent,), v=())

    def propose(self, head, out):
        logits = head.mtp[0].logits(head, out)
        return jnp.argmax(logits, axis=-1).astype(jnp.int32), out

    def key(self) -> str:
        return MTP


@dataclasses.dataclass(frozen=True, eq=False)
class DraftingStepFunction(StepFunction):
    """The step with a draft head (see the module docstring): `params` is the target's flat
    weights, then the head's own (if any); `kv` a `DraftKV`; the inputs end with `DraftInputs`.
    Returns (kv, sstate, SamplerOutput, (PromptLogprobs, drafts [R, k] int32))."""

    head: DraftHead = None
    num_speculative_tokens: int = 1
    page_size: int = 16

    def model_of(self, params, tok: TokenInfo):
        n = self.params_treedef.num_leaves
        return nnx.merge(self.graphdef, jax.tree.unflatten(self.params_treedef, params[:n])), None

    def __call__(self, params, kv: DraftKV, sstate, inputs: ModelInputs, meta: SamplingMetadata, tok: TokenInfo,
                 draft: DraftInputs):
        model, _ = self.model_of(params, tok)
        input_ids, sstate = self.fold_inputs(sstate, inputs, meta, tok)
        hidden, target_kv, *extra = model(input_ids, inputs.positions, kv.target, inputs.md, self.layer_impl,
                                          **self.head.forward_kwargs)
        logits = model.compute_logits(hidden[inputs.logits_indices])
        sstate, out, plp = self.sample_and_keep(model, hidden, logits, sstate, meta, tok)
        head = self.head.module(model, params[self.params_treedef.num_leaves:])
        first_hidden = self.head.hidden_input(head, hidden, extra[0] if extra else None)
        drafts, draft_kv = self.draft(head, first_hidden, out.token_ids, inputs, draft, kv.draft)
        return DraftKV(target_kv, draft_kv), sstate, out, (plp, drafts)

    def draft(self, head, first_hidden, sampled, inputs: ModelInputs, d: DraftInputs, cache: KVCache):
        """The k drafts of each request row that sampled ([R, k] target ids) and the head's
        updated pages."""
        T = inputs.input_ids.shape[0]
        md, k, h = inputs.md, self.num_speculative_tokens, self.head
        last = accepted_rows(sampled, inputs, d, k)
        live = d.num_rows > 0
        at = inputs.logits_indices[last]  # [R] the flat token of each request's last kept row
        tokens = d.next_tokens.at[jnp.where(live, at, T)].set(sampled[last], mode="drop")
        out, cache = h.layer(head, tokens, inputs.positions, first_hidden, cache, md)
        first, hidden = h.propose(head, out[at])  # only the rows that draft read the head
        pos = inputs.positions[at]
        drafts = jnp.zeros((sampled.shape[0], k), jnp.int32).at[:, 0].set(first)
        hidden = hidden.astype(jnp.float32)

        def chain(j, carry):
            cache, drafts, hidden = carry
            cmd = chain_metadata(md, pos + j, live, d.num_pages, self.page_size)
            out, cache = h.layer(head, drafts[:, j - 1], pos + j, hidden, cache, cmd)
            ids, hidden = h.propose(head, out)
            return cache, drafts.at[:, j].set(ids), hidden.astype(jnp.float32)

        cache, drafts, _ = jax.lax.fori_loop(1, k, chain, (cache, drafts, hidden))
        return drafts, cache


def draft_cache_dtype(model_dtype, kv_dtype):
    """The dtype of a draft head's pages: the cache's when it is a float dtype, the model's for
    a quantized (fp8, int8) cache. A quantized cache's scales are measured over a forward of
    the target's layers only (the head's activations are not in it), one-byte pages at the
    default scale 1.0 lose small values, and the head's one layer costs 1/L of the target's
    float bytes; so the head keeps float pages (and its drafts do not depend on the cache's
    quantization)."""
    return jnp.dtype(model_dtype) if is_quantized(kv_dtype) else jnp.dtype(kv_dtype)


def draft_layer_config(path: str):
    """The ArchConfig of the decoder layer of the EAGLE-3 head in `path` (its KV pages)."""
    from jaxserve.models.eagle3 import Eagle3Config
    from jaxserve.models.loader import load_checkpoint

    return Eagle3Config.from_hf(load_checkpoint(path).config).layer


def mtp_layer_config(target):
    """The ArchConfig of a DeepSeek target's MTP layer's pages: the target's, one layer."""
    return dataclasses.replace(target, num_layers=1)


def draft_cache_config(method: str, target, draft_model: str = ""):
    """The ArchConfig of the draft head's one layer of pages for `method` ("eagle3": the
    head in `draft_model`'s; "deepseek_mtp": the target's, ArchConfig `target`)."""
    return mtp_layer_config(target) if method == MTP else draft_layer_config(draft_model)
