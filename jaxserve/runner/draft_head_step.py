"""Drafting inside the target's compiled step (the engine's side: spec_decode/draft_head.py),
for three drafters: an EAGLE-3 head (models/eagle3.py, `Eagle3Head`), DeepSeek's multi-token
prediction layer (models/deepseek_v3.py, `MtpHead`) and a draft model (runner/draft_model.py,
`DraftModelHead`).

The step does what the plain step does (runner/step_fn.py), with the target's forward also
returning what a head reads, and then drafts the next k tokens of every request that sampled,
on the device:

1. Acceptance: a request fed d drafts samples on d + 1 rows; it keeps the samples while each
   equals the draft fed after it (as `accept_drafts` does on the host). Its last kept row is
   at position P, and the token sampled there (the bonus, or the correction) is the next token.
2. Pass 1 over the step's T tokens, writing the drafter's KV at every position (the rejected
   ones are overwritten later, as the target's are). A head (`shifted`): its hidden state at
   position p is made from the target's outputs there (`DraftHead.hidden_input`), its input
   token is the token at p + 1 (the next fed token; at a prefill chunk's end that samples
   nothing, the next prompt token, from the host; at P, the token sampled there), and draft 1
   is its greedy token at P. A draft model (not `shifted`): it reads the step's own tokens at
   their own positions and proposes nothing.
3. The chained passes, one token per request, each feeding the previous pass's token (and a
   head's hidden state) one position on and writing its KV there (only inside the request's
   pages: a write past them goes to the null page, and the chain only reads its own): a head's
   k - 1 at P + 1, P + 2, ... from draft 1; a draft model's k at P + 1, ..., P + k from the
   kept token. So the chain writes `lookahead_tokens` positions past the step's.

A drafter is a `DraftHead`: what it asks of the target's forward, how it turns the forward's
outputs into its hidden input, its paged layer(s) (over its own paged cache, a `KVCache`: the
target's page size and page count, indexed by the same block tables; EAGLE-3's one layer of K
and V pages, MTP's one layer of latent rows, a draft model's all layers) and how an output
becomes a draft and the chain's next hidden state. With a quantized (fp8, int8) cache the
drafter's pages stay in the model's dtype (`draft_cache_dtype`). The step returns the [R, k]
drafts of each request row (the request's index among the step's rows) with its samples; the
engine feeds them in the next step as draft tokens (jaxserve/engine/core.py,
spec_decode/draft_head.py), verified as n-gram drafts are: greedy drafts are point masses, so
keeping a draft while the request's own sample equals it is exact at any temperature.
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

# The speculative methods that draft inside the step (speculative_config.STEP_DRAFTERS).
EAGLE3, MTP, DRAFT_MODEL = "eagle3", "deepseek_mtp", "draft_model"


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
    """The target's KV cache and the drafter's own `KVCache` (EAGLE-3: one layer of K and V
    pages; MTP: one layer of latent rows, no V; a draft model: all its layers)."""

    target: Any  # the target's KVCache
    draft: Any  # the drafter's KVCache

    @property
    def k(self) -> tuple:
        """Every K array of both caches (what the KV budget's checks count)."""
        return (*self.target.k, *self.draft.k)

    @property
    def v(self) -> tuple:
        return (*self.target.v, *self.draft.v)


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
    """What the drafting step needs of a drafter (static: part of the step function).

    - `shifted`: pass 1 feeds each position the token after it and proposes draft 1 there
      (a head); False: pass 1 feeds the step's own tokens at their own positions, proposing
      nothing, and the chain has k passes from the kept token (a draft model);
    - `forward_kwargs`: what the target's forward is asked for besides its hidden states (the
      forward then returns a third item, passed to `hidden_input`);
    - `module(model, params)`: the head, given the target (merged) and the head's own flat
      weights (they follow the target's in the step's parameter list; none for a head that
      lives in the target);
    - `hidden_input(head, hidden, extra)`: the [T, H] hidden state pass 1 takes, from the
      target's final hidden states (what its LM head reads) and the forward's extra output
      (None: the drafter reads no hidden state);
    - `layer(head, tokens, positions, hidden, cache, md)`: the drafter's layer(s) over a flat
      ragged batch, attending over its own paged `KVCache` -> (output [T, H], cache);
    - `propose(head, out)`: greedy draft ids (target vocabulary) and the next chained pass's
      hidden state (None without one) from outputs [N, H];
    - `key()`: what the drafter changes in the step's program (the executable cache's key)."""

    forward_kwargs = {}
    shifted = True

    def module(self, model, params: list):
        raise NotImplementedError

    def hidden_input(self, head, hidden: jax.Array, extra) -> jax.Array:
        raise NotImplementedError

    def layer(self, head, tokens, positions, hidden, cache: KVCache, md: AttentionMetadata):
        raise NotImplementedError

    def propose(self, head, out: jax.Array) -> tuple[jax.Array, jax.Array]:
        raise NotImplementedError

    def chain_inputs(self, head):
        """What the chained passes read besides the drafter's weights, computed once before
        them (None: nothing)."""
        return None

    def chain_layer(self, head, inputs, tokens, positions, hidden, cache: KVCache,
                    md: AttentionMetadata):
        """`layer` for a chained pass, whose `tokens` are the drafter's own proposals, with
        `chain_inputs`' `inputs`."""
        return self.layer(head, tokens, positions, hidden, cache, md)

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

    def chain_inputs(self, head):
        """The draft vocabulary's embedding rows: a chained pass feeds a token the head drafted,
        so it reads them and not the whole table. (A loop that reads the table carries it in
        its state; where the chip lays the table out other than a row lookup wants (TPU: the
        vocabulary minor), the compiled step copies the whole table into that state.)"""
        return head.draft_vocab_embeddings()

    def chain_layer(self, head, inputs, tokens, positions, hidden, cache, md):
        embeds = head.draft_embeddings(inputs, tokens)
        out, k, v = head.paged_layer(tokens, positions, hidden, cache.k[0], cache.v[0], md,
                                     embeds=embeds)
        return out, KVCache(k=(k,), v=(v,))

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
class DraftModelHead(DraftHead):
    """A draft model (runner/draft_model.py): a whole causal LM over the target's vocabulary,
    with its own weights (`graphdef`, `treedef`) and its own paged cache of all its layers. It
    reads nothing of the target's forward; pass 1 gives it the step's tokens at their own
    positions (its KV of them) and the chain starts from the kept token (not `shifted`)."""

    graphdef: Any
    treedef: Any
    shifted = False

    def module(self, model, params):
        return nnx.merge(self.graphdef, jax.tree.unflatten(self.treedef, params))

    def hidden_input(self, head, hidden, extra):
        return None

    def layer(self, head, tokens, positions, hidden, cache, md):
        return head(tokens, positions, cache, md)

    def propose(self, head, out):
        return jnp.argmax(head.compute_logits(out), axis=-1).astype(jnp.int32), None

    def key(self) -> str:
        from jaxserve.runner.executable_cache import canonical

        return f"{DRAFT_MODEL} {canonical(self.graphdef)}"


@dataclasses.dataclass(frozen=True, eq=False)
class DraftingStepFunction(StepFunction):
    """The step with a drafter (see the module docstring): `params` is the target's flat
    weights, then the drafter's own (if any); `kv` a `DraftKV`; the inputs end with `DraftInputs`.
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
        drafts, draft_kv = self.draft(head, first_hidden, input_ids, out.token_ids, inputs, draft, kv.draft)
        return DraftKV(target_kv, draft_kv), sstate, out, (plp, drafts)

    def draft(self, head, first_hidden, input_ids, sampled, inputs: ModelInputs, d: DraftInputs, cache: KVCache):
        """The k drafts of each request row that sampled ([R, k] target ids) and the drafter's
        updated pages."""
        T = inputs.input_ids.shape[0]
        md, k, h = inputs.md, self.num_speculative_tokens, self.head
        last = accepted_rows(sampled, inputs, d, k)
        live = d.num_rows > 0
        at = inputs.logits_indices[last]  # [R] the flat token of each request's last kept row
        token = sampled[last].astype(jnp.int32)  # the kept token, at P + 1
        drafts = jnp.zeros((sampled.shape[0], k), jnp.int32)
        if h.shifted:  # pass 1 reads the token after each position: draft 1 comes from P
            tokens = d.next_tokens.at[jnp.where(live, at, T)].set(token, mode="drop")
            out, cache = h.layer(head, tokens, inputs.positions, first_hidden, cache, md)
            token, hidden = h.propose(head, out[at])  # only the rows that draft read the head
            drafts, first, pos = drafts.at[:, 0].set(token), 1, inputs.positions[at]
        else:  # pass 1 writes the drafter's KV of the step's tokens; the chain starts at P + 1
            _, cache = h.layer(head, input_ids, inputs.positions, first_hidden, cache, md)
            hidden, first, pos = None, 0, inputs.positions[at] + 1

        chain_inputs = h.chain_inputs(head)

        def chain(j, carry):
            cache, drafts, token, hidden = carry
            cmd = chain_metadata(md, pos + j, live, d.num_pages, self.page_size)
            out, cache = h.chain_layer(head, chain_inputs, token, pos + j, hidden, cache, cmd)
            ids, hidden = h.propose(head, out)
            return cache, drafts.at[:, j].set(ids), ids, _float32(hidden)

        cache, drafts, _, _ = jax.lax.fori_loop(first, k, chain, (cache, drafts, token, _float32(hidden)))
        return drafts, cache


def _float32(hidden):
    """The chain's hidden state as it is carried (float32; None for a drafter without one)."""
    return None if hidden is None else hidden.astype(jnp.float32)


def drafting_step(recipe, model, mesh, drafter, graphdef, treedef, layer_impl):
    """The drafting step of `recipe.draft_method` over `model` (the one place mapping a method
    to its drafter): (DraftingStepFunction, the drafter's own flat weights, the config of its
    own KV pages). `drafter`: the loaded EAGLE-3 head or draft model, or None for abstract
    weights read from `recipe.draft_model` (MTP's layer is the target's own)."""
    method = recipe.draft_method
    if method == MTP:
        if not getattr(model, "mtp", None):
            raise ValueError(f"{model.config.architecture} has no MTP layers to draft with")
        head, dparams, cache_cfg = MtpHead(), [], mtp_layer_config(model.config)
    elif method in (EAGLE3, DRAFT_MODEL):
        if drafter is None:  # abstract: its pages' heads as served (`recipe.draft_kv_heads`)
            heads = recipe.draft_kv_heads
            attention = recipe.model_attention(
                draft_cache_config(method, model.config, recipe.draft_model, heads), mesh,
                draft_cache_dtype(recipe.dtype, recipe.kv_dtype))
        if drafter is None and method == EAGLE3:
            from jaxserve.models.eagle3_checkpoint import abstract_eagle3

            drafter = abstract_eagle3(recipe.draft_model, model.config, recipe.dtype, mesh, recipe.rules,
                                      attention_impl=attention, kv_heads=heads)
        elif drafter is None:
            from jaxserve.runner.draft_model import abstract_draft_model

            drafter = abstract_draft_model(recipe.draft_model, recipe.dtype, mesh, recipe.rules, attention,
                                           kv_heads=heads)
        dgraph, dstate = nnx.split(drafter)
        dparams, dtreedef = jax.tree.flatten(dstate)
        if method == EAGLE3:
            head = Eagle3Head(dgraph, dtreedef, drafter.config.target_layer_ids(model.config))
            cache_cfg = drafter.config.layer
        else:
            head, cache_cfg = DraftModelHead(dgraph, dtreedef), drafter.config
    else:
        raise ValueError(f"draft method {method!r}: not one that drafts inside the step")
    function = DraftingStepFunction(graphdef, treedef, layer_impl, recipe.sampler_config, None, head=head,
                                    num_speculative_tokens=recipe.num_speculative_tokens,
                                    page_size=recipe.page_size)
    return function, dparams, cache_cfg


def lookahead_tokens(method: str, k: int) -> int:
    """KV positions past a request's scheduled tokens that the chained passes write (the
    scheduler reserves them): a head's k - 1 (draft 1 comes from pass 1), a draft model's k."""
    return k if method == DRAFT_MODEL else k - 1


def draft_cache_dtype(model_dtype, kv_dtype):
    """The dtype of a drafter's own pages: the cache's when it is a float dtype, the model's for
    a quantized (fp8, int8) cache. A quantized cache's scales are measured over a forward of
    the target's layers only (the drafter's activations are not in it), one-byte pages at the
    default scale 1.0 lose small values, and a head's one layer costs 1/L of the target's
    float bytes, a draft model's few small layers little more; so the drafter keeps float pages
    (and its drafts do not depend on the cache's quantization)."""
    return jnp.dtype(model_dtype) if is_quantized(kv_dtype) else jnp.dtype(kv_dtype)


def draft_layer_config(path: str, kv_heads: int = 0):
    """The ArchConfig of the decoder layer of the EAGLE-3 head in `path` (its KV pages), served
    with `kv_heads` KV heads (0: its checkpoint's; `recipe.serving_draft_heads`)."""
    from jaxserve.models.eagle3 import Eagle3Config
    from jaxserve.models.loader import load_checkpoint

    return Eagle3Config.from_hf(load_checkpoint(path).config).with_kv_heads(kv_heads).layer


def mtp_layer_config(target):
    """The ArchConfig of a DeepSeek target's MTP layer's pages: the target's, one layer."""
    return dataclasses.replace(target, num_layers=1)


def draft_cache_config(method: str, target, draft_model: str = "", kv_heads: int = 0):
    """The ArchConfig of the drafter's own pages for `method` ("eagle3": the layer of the head
    in `draft_model`; "deepseek_mtp": the target's, ArchConfig `target` as served, one layer;
    "draft_model": the draft model's in `draft_model`, all its layers), a head's or a draft
    model's served with `kv_heads` KV heads (0: its checkpoint's; `recipe.serving_draft_heads`
    decides them: zero heads appended for lane-dense TPU pages)."""
    if method == MTP:
        return mtp_layer_config(target)
    if method == DRAFT_MODEL:
        from jaxserve.runner.draft_model import draft_model_config

        return draft_model_config(draft_model, kv_heads)
    return draft_layer_config(draft_model, kv_heads)
