"""The compiled step as a function of (weights, KV cache, sampling state, packed inputs).

`StepFunction` is what the runner compiles per (T, R) bucket, and all it needs is the model's
graph definition, the structure of its weights, the backend's layer replacement and the
sampler's static sizes: so the same code path lowers a step on real arrays (`ModelRunner`) or
on abstract ones that were never allocated (`jaxserve shard-plan`, which compiles it for
meshes and devices it does not have).

One step does: replace pending input tokens by the tokens their slots sampled last -> fold the
input tokens into the sampling state (penalty counts) -> model forward over the flat token
batch (KV cache updated in place, donated) -> logits at each request's last scheduled token ->
sampling (+ raw logprobs, and prompt logprobs when some row asks) -> keep each row's sampled
token in its slot.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxserve.models.layers.lora import LoRABatch
from jaxserve.runner.step_buffers import BufferLayout
from jaxserve.runner.step_inputs import ModelInputs, TokenInfo, pack_rows
from jaxserve.sampling.config import SamplerConfig
from jaxserve.sampling.metadata import SamplingMetadata, SamplingMetadataBuilder, penalty_slots
from jaxserve.sampling.sampler import prompt_logprobs, sample, sample_with_extra
from jaxserve.sampling.state import (
    init_sampling_state,
    record_sampled_tokens,
    resolve_pending_tokens,
    update_state_from_tokens,
)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PromptLogprobs:
    logprob: jax.Array  # [T] f32
    topk_ids: jax.Array  # [T, K] int32
    topk_logprobs: jax.Array  # [T, K] f32
    rank: jax.Array  # [T] int32


@dataclasses.dataclass(frozen=True, eq=False)
class StepFunction:
    graphdef: Any  # the model's nnx GraphDef
    params_treedef: Any  # how the flat weight list unflattens into the model's State
    layer_impl: Any  # a backend's fused decoder layer, or None
    sampler_config: SamplerConfig
    # The LoRA slots' structure (runner/lora_slots.py): their arrays follow the weights in
    # `params`; None: LoRA is off
    lora_treedef: Any = None

    def __call__(self, params, kv, sstate, inputs: ModelInputs, meta: SamplingMetadata, tok: TokenInfo):
        model, lora = self.model_of(params, tok)
        kv, sstate, logits, hidden = self.forward(model, lora, kv, sstate, inputs, meta, tok)
        sstate, out, plp = self.sample_and_keep(model, hidden, logits, sstate, meta, tok)
        return kv, sstate, out, plp

    def sample_and_keep(self, model, hidden, logits, sstate, meta: SamplingMetadata, tok: TokenInfo):
        """Sample each row (+ prompt log-probs when some token asks) and keep each row's token
        in its slot: (sstate, SamplerOutput, PromptLogprobs)."""
        k = self.sampler_config.max_logprobs
        T = hidden.shape[0]
        wants = tok.next_prompt_token >= 0

        def with_prompt_lp():
            lp, ids, top, rank = prompt_logprobs(model.compute_logits(hidden), jnp.maximum(tok.next_prompt_token, 0), k,
                                                 self.sampler_config.native)
            return PromptLogprobs(lp, ids, top, rank)

        def without():
            return PromptLogprobs(jnp.zeros((T,), jnp.float32), jnp.zeros((T, k), jnp.int32),
                                  jnp.zeros((T, k), jnp.float32), jnp.zeros((T,), jnp.int32))

        # The prompt logprobs ride in the sampler's conditional of optional work (a GPU reads
        # each conditional's predicate back: a plain step reads one).
        out, plp = sample_with_extra(logits, meta, sstate, self.sampler_config,
                                     (jnp.any(wants), with_prompt_lp, without))
        sstate = record_sampled_tokens(sstate, out.token_ids, tok.sample_slots)
        return sstate, out, plp

    def model_of(self, params, tok: TokenInfo):
        """(the model over the flat weight list, the step's LoRA batch or None)."""
        lora = None
        if self.lora_treedef is not None:
            n = len(params) - self.lora_treedef.num_leaves
            lora = LoRABatch.of(jax.tree.unflatten(self.lora_treedef, params[n:]), tok.lora_slots)
            params = params[:n]
        return nnx.merge(self.graphdef, jax.tree.unflatten(self.params_treedef, params)), lora

    def forward(self, model, lora, kv, sstate, inputs: ModelInputs, meta: SamplingMetadata, tok: TokenInfo):
        """Resolve pending tokens -> fold the inputs into the sampling state -> model (KV
        written) -> logits at each row's token. Returns (kv, sstate, logits [R, V], hidden
        [T, E])."""
        input_ids, sstate = self.fold_inputs(sstate, inputs, meta, tok)
        hidden, kv = model(input_ids, inputs.positions, kv, inputs.md, self.layer_impl, lora=lora)  # [T, E]
        return kv, sstate, model.compute_logits(hidden[inputs.logits_indices]), hidden

    def fold_inputs(self, sstate, inputs: ModelInputs, meta: SamplingMetadata, tok: TokenInfo):
        """Resolve pending input tokens and fold the inputs into the sampling state:
        (input_ids [T], sstate)."""
        input_ids = resolve_pending_tokens(sstate, inputs.input_ids, tok.slots)
        sstate = update_state_from_tokens(sstate, tok.slots, input_ids, tok.is_prompt, tok.valid,
                                          meta.reset_slots, penalty_slots(meta))
        return input_ids, sstate

    def sample_step(self, model, lora, kv, sstate, inputs: ModelInputs, meta: SamplingMetadata, tok: TokenInfo):
        """One forward and draw (a decode block's iteration): `forward` -> sample -> keep each
        row's token in its slot. Returns (kv, sstate, SamplerOutput, hidden [T, E])."""
        kv, sstate, logits, hidden = self.forward(model, lora, kv, sstate, inputs, meta, tok)
        out = sample(logits, meta, sstate, self.sampler_config)
        sstate = record_sampled_tokens(sstate, out.token_ids, tok.sample_slots)
        return kv, sstate, out, hidden

    def packed(self, layout: BufferLayout, params, kv, sstate, *buffers):
        return self(params, kv, sstate, *layout.unpack(buffers))

    def lower(self, layout: BufferLayout, params, kv, sstate, input_sharding) -> jax.stages.Lowered:
        """The step of one bucket lowered on (abstract or real) weights, KV cache and sampling
        state; the packed inputs are abstract with `input_sharding`. The KV cache and the
        sampling state are donated, and come back in the shardings they went in with (left to
        itself XLA may return the sampling state split like the vocab-sharded logits, which the
        next step would refuse); the sampled tokens and logprobs come back with
        `input_sharding` (replicated: every process can read them)."""
        keep = lambda tree: jax.tree.map(lambda x: x.sharding, tree)  # noqa: E731
        jitted = jax.jit(functools.partial(self.packed, layout), donate_argnums=(1, 2),
                         out_shardings=(keep(kv), keep(sstate), input_sharding, input_sharding))
        return jitted.lower(params, kv, sstate, *layout.abstract(input_sharding))


    def lower_data_parallel(self, layout: BufferLayout, mesh, params, kv, sstate, input_sharding) -> jax.stages.Lowered:
        """The step of one bucket for data parallelism: `shard_map` manual over "data" runs
        `packed` once per rank on its own pages and slot range (the KV cache and the sampling
        state are split over "data"), with the weights as they are over the other axes (XLA
        partitions them there). The packed inputs are [D, n] per dtype, replicated (they are
        small; replicated numpy inputs work across processes too), and each rank takes its row;
        the sampled tokens and logprobs come back rank after rank ([D * R] rows, [D * T]
        tokens), replicated."""
        data = jax.sharding.PartitionSpec("data")
        kv_spec, state_spec = jax.tree.map(lambda _: data, kv), jax.tree.map(lambda _: data, sstate)

        def per_rank(params, kv, sstate, *buffers):
            r = jax.lax.axis_index("data")
            mine = [jax.lax.dynamic_index_in_dim(b, r, keepdims=False) for b in buffers]
            return self.packed(layout, params, kv, sstate, *mine)

        body = jax.shard_map(per_rank, mesh=mesh, axis_names={"data"}, check_vma=False,
                             in_specs=(jax.sharding.PartitionSpec(), kv_spec, state_spec,
                                       *(jax.sharding.PartitionSpec(),) * len(layout.sizes)),
                             out_specs=(kv_spec, state_spec, data, data))
        keep = lambda tree: jax.tree.map(lambda x: x.sharding, tree)  # noqa: E731
        jitted = jax.jit(body, donate_argnums=(1, 2),
                         out_shardings=(keep(kv), keep(sstate), input_sharding, input_sharding))
        D = mesh.shape["data"]
        buffers = [jax.ShapeDtypeStruct((D, n), dt, sharding=input_sharding)
                   for n, dt in zip(layout.sizes, layout.dtypes)]
        return jitted.lower(params, kv, sstate, *buffers)


def step_program(step: StepFunction, layout: BufferLayout, mesh, params, kv, sstate, input_sharding):
    """(lower, abstract packed inputs) of one bucket's step as the runner compiles it: per
    data-parallel rank inside a shard_map when the mesh has a "data" axis over 1, else plain.
    `lower()` returns the Lowered program; the inputs are the abstract arguments after the
    weights, KV cache and sampling state."""
    if mesh.shape.get("data", 1) > 1:
        D = mesh.shape["data"]
        buffers = [jax.ShapeDtypeStruct((D, n), dt, sharding=input_sharding)
                   for n, dt in zip(layout.sizes, layout.dtypes)]
        return (functools.partial(step.lower_data_parallel, layout, mesh, params, kv, sstate, input_sharding),
                buffers)
    return functools.partial(step.lower, layout, params, kv, sstate, input_sharding), layout.abstract(input_sharding)


def step_layout(T: int, R: int, *, pages_per_req: int, page_size: int,
                sampler_config: SamplerConfig, lora: bool = False, draft: bool = False) -> BufferLayout:
    """How a (T, R) step's inputs (ModelInputs, SamplingMetadata, TokenInfo) are packed (with
    `lora`, each token's adapter slot too; with `draft`, the EAGLE-3 drafting's inputs after
    them: jaxserve/runner/draft_head_step.py)."""
    empty = np.zeros(0, np.int32)
    dummy = pack_rows(empty, empty, empty, np.zeros((0, pages_per_req), np.int32),
                      num_tokens=T, num_reqs=R, page_size=page_size)
    tok = TokenInfo(slots=np.zeros(T, np.int32), is_prompt=np.zeros(T, np.bool_), valid=np.zeros(T, np.bool_),
                    next_prompt_token=np.zeros(T, np.int32), sample_slots=np.zeros(R, np.int32),
                    lora_slots=np.zeros(T, np.int32) if lora else None)
    meta = SamplingMetadataBuilder(sampler_config).build([], [], R)
    if draft:
        from jaxserve.runner.draft_head_step import DraftInputs

        return BufferLayout.of((dummy, meta, tok, DraftInputs.empty(T, R)))
    return BufferLayout.of((dummy, meta, tok))


def abstract_sampling_state(sampler_config: SamplerConfig, shardings):
    """The sampling state's ShapeDtypeStructs (no memory), with `shardings` (a SamplingState of
    them: state.sampling_state_shardings)."""
    shapes = jax.eval_shape(functools.partial(init_sampling_state, sampler_config))
    return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), shapes, shardings)
