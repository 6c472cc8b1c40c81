"""Drafting with a small draft model inside the target's compiled step (method "draft_model").

The draft model is a whole causal LM with the target's vocabulary (any architecture the engine
serves), with a paged KV cache of its own: all its layers, the target's page size and page
count, indexed by the same block tables (`DraftModelKV`). The step does what the plain step
does (runner/step_fn.py), then drafts the next k tokens of every request that sampled:

1. Acceptance, as EAGLE-3's step (runner/eagle3_step.py `accepted_rows`): a request fed d
   drafts keeps its samples while each equals the draft fed after it; its last kept row is at
   position P, and the token sampled there (the bonus, or the correction) is at P + 1.
2. The draft model runs over the step's T fed tokens at their positions, writing its KV for
   them (rejected drafts' too: they are overwritten later, as the target's are).
3. k chained one-token passes per request (a `fori_loop`): the first feeds the token sampled
   at P at position P + 1, each next one the previous pass's draft one position on; each
   writes its KV there (only inside the request's pages: the scheduler reserves k lookahead
   positions; a write past them goes to the null page) and the pass's greedy token is the
   next draft. The chain writes P + 1 .. P + k: one position further than the EAGLE-3 head,
   whose first draft comes from the pass over the fed tokens.

The step returns the [R, k] drafts with its samples, as EAGLE-3's does; the engine feeds them
in the next step (spec_decode/draft_model.py), verified as every draft is: greedy drafts are
point masses, so keeping a draft while the request's own sample equals it is exact at any
temperature.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jaxserve.runner.eagle3_step import DraftInputs, accepted_rows, chain_metadata
from jaxserve.runner.step_fn import StepFunction
from jaxserve.runner.step_inputs import ModelInputs, TokenInfo
from jaxserve.sampling.metadata import SamplingMetadata


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DraftModelKV:
    """The target's KV cache and the draft model's: two KVCaches over the same pages."""

    target: Any  # the target's KVCache
    draft: Any  # the draft model's KVCache

    @property
    def k(self) -> tuple:
        """Every K array of both caches (what the KV budget counts)."""
        return (*self.target.k, *self.draft.k)

    @property
    def v(self) -> tuple:
        return (*self.target.v, *self.draft.v)


@dataclasses.dataclass(frozen=True, eq=False)
class DraftModelStepFunction(StepFunction):
    """The step with a draft model drafting (see the module docstring): `params` is the
    target's flat weights, then the draft model's; `kv` a `DraftModelKV`; the inputs end with
    `DraftInputs`. Returns (kv, sstate, SamplerOutput, (PromptLogprobs, drafts [R, k] int32))."""

    drafter_graphdef: Any = None
    drafter_treedef: Any = None
    num_speculative_tokens: int = 1
    page_size: int = 16

    def model_of(self, params, tok: TokenInfo):
        n = self.params_treedef.num_leaves
        return nnx.merge(self.graphdef, jax.tree.unflatten(self.params_treedef, params[:n])), None

    def drafter_of(self, params):
        n = self.params_treedef.num_leaves
        return nnx.merge(self.drafter_graphdef, jax.tree.unflatten(self.drafter_treedef, params[n:]))

    def __call__(self, params, kv: DraftModelKV, sstate, inputs: ModelInputs, meta: SamplingMetadata,
                 tok: TokenInfo, draft: DraftInputs):
        model, _ = self.model_of(params, tok)
        input_ids, sstate = self.fold_inputs(sstate, inputs, meta, tok)
        hidden, target_kv = model(input_ids, inputs.positions, kv.target, inputs.md, self.layer_impl)
        logits = model.compute_logits(hidden[inputs.logits_indices])
        sstate, out, plp = self.sample_and_keep(model, hidden, logits, sstate, meta, tok)
        drafts, draft_kv = self.draft(self.drafter_of(params), input_ids, out.token_ids, inputs, draft, kv.draft)
        return DraftModelKV(target_kv, draft_kv), sstate, out, (plp, drafts)

    def draft(self, drafter, input_ids, sampled, inputs: ModelInputs, d: DraftInputs, draft_kv):
        """The k greedy drafts of each request row that sampled ([R, k] token ids) and the
        draft model's updated cache."""
        md, k = inputs.md, self.num_speculative_tokens
        last = accepted_rows(sampled, inputs, d, k)
        live = d.num_rows > 0
        _, draft_kv = drafter(input_ids, inputs.positions, draft_kv, md)  # its KV of the fed tokens
        pos = inputs.positions[inputs.logits_indices[last]] + 1  # [R] where the kept token goes
        drafts = jnp.zeros((sampled.shape[0], k), jnp.int32)

        def chain(j, carry):
            draft_kv, drafts, token = carry
            cmd = chain_metadata(md, pos + j, live, d.num_pages, self.page_size)
            hidden, draft_kv = drafter(token, pos + j, draft_kv, cmd)
            nxt = jnp.argmax(drafter.compute_logits(hidden), axis=-1).astype(jnp.int32)
            return draft_kv, drafts.at[:, j].set(nxt), nxt

        draft_kv, drafts, _ = jax.lax.fori_loop(0, k, chain, (draft_kv, drafts, sampled[last].astype(jnp.int32)))
        return drafts, draft_kv


def draft_model_config(path: str):
    """The ArchConfig of the draft model in `path` (its KV pages, its abstract weights)."""
    from jaxserve.models.arch_config import ArchConfig
    from jaxserve.models.loader import load_checkpoint

    return ArchConfig.from_hf(load_checkpoint(path).config)


def abstract_draft_model(path: str, dtype, mesh, rules, attention_impl: str = "auto"):
    """The draft model in `path` as `load_draft_model` builds it, with abstract weights (the
    compile workers' and the memory probes')."""
    from jaxserve.models.weights import sharded_abstract_model

    return sharded_abstract_model(draft_model_config(path), dtype=dtype, mesh=mesh, attention_impl=attention_impl,
                                  rules=rules)


def load_draft_model(path: str, dtype, mesh, rules, attention_impl: str = "auto"):
    """The draft model in `path` with its weights, in the target's dtype, on the target's mesh
    (the model's own layers run it: no backend layout)."""
    from jaxserve.models.loader import load_checkpoint
    from jaxserve.models.weights import create_model

    ckpt = load_checkpoint(path)
    return create_model(draft_model_config(path), dtype=dtype, mesh=mesh, attention_impl=attention_impl,
                        get_tensor=ckpt.get_tensor, rules=rules)
