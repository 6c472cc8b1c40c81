"""Multi-step decode: K decode steps of every running request in one dispatch.

A decode block is a step of R rows that each feed one token (T = R) run K times on the device
(vLLM's former `--num-scheduler-steps`, tpu-inference's decode steps per host call). Each
iteration is the compiled step's own forward and draw (`StepFunction.sample_step`); between
iterations the device advances what the host would have packed for the next step:

- the input token: the row's last sampled token, through the pending-token mechanism (the
  iteration feeds PENDING; `resolve_pending_tokens` reads the slot's `last_tokens`, which the
  previous iteration's `record_sampled_tokens` wrote);
- the position and `kv_lens` (+1), and the token's KV slot, read from the row's block table
  (the scheduler allocated the pages of all K tokens before the block);
- the sampling rows: the random number of the output position (`uniforms[j]`, hashed on the
  host from the seed and the position as for any step, so a seeded request draws the same
  numbers as with single steps), min_tokens' suppressed ids while the output count is below
  it, and no slot reset after the first iteration. The state's penalty counts and recent
  outputs fold each fed token as a single step does: penalties stay exact.

A row stops on the device when it has decoded `steps` tokens (the host's length limits:
max_tokens, max_model_len) or sampled one of its stop tokens (EOS unless ignore_eos, then its
stop_token_ids, at most `SamplerConfig.max_stop_ids` of them) once min_tokens allow: its
later iterations write their KV into the null page, fold nothing, record nothing, and its
position stops advancing. The device's stops are a subset of the host's (the scheduler's
`_check_stop` decides, and trims the tokens after a stop): a stop token beyond the table only
costs the row's later, discarded iterations. The loop ends when every row has stopped.

The block returns [K, R] tokens (and the draws' log-probs, [K, R, ...]); no prompt log-probs
(a decode row has no prompt token left to score).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.runner.step_buffers import BufferLayout
from jaxserve.runner.step_fn import StepFunction, step_layout
from jaxserve.runner.step_inputs import ModelInputs, TokenInfo
from jaxserve.sampling.config import SamplerConfig
from jaxserve.sampling.metadata import SamplingMetadata
from jaxserve.sampling.sampler import SamplerOutput


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class BlockInputs:
    """What a decode block reads besides one step's inputs (numpy on the host)."""

    steps: np.ndarray  # [R] int32 tokens the row may decode in the block (0: padding)
    stop_tokens: np.ndarray  # [R, M] int32 the ids that stop the row on the device (-1: none)
    min_tokens: np.ndarray  # [R] int32 no stop before the row has this many outputs
    output_pos: np.ndarray  # [R] int32 the output position of the row's first token
    uniforms: np.ndarray  # [K, R] float32 the random number of each iteration's draw


def block_layout(R: int, K: int, *, pages_per_req: int, page_size: int, sampler_config: SamplerConfig,
                 lora: bool = False) -> BufferLayout:
    """How a decode block's inputs (ModelInputs, SamplingMetadata, TokenInfo of an (R, R) step,
    then BlockInputs) are packed."""
    step = step_layout(R, R, pages_per_req=pages_per_req, page_size=page_size, sampler_config=sampler_config,
                       lora=lora)
    inputs, meta, tok = step.unpack_host(tuple(np.zeros(n, dt) for n, dt in zip(step.sizes, step.dtypes)))
    M = sampler_config.max_stop_ids
    block = BlockInputs(steps=np.zeros(R, np.int32), stop_tokens=np.zeros((R, M), np.int32),
                        min_tokens=np.zeros(R, np.int32), output_pos=np.zeros(R, np.int32),
                        uniforms=np.zeros((K, R), np.float32))
    return BufferLayout.of((inputs, meta, tok, block))


@dataclasses.dataclass(frozen=True, eq=False)
class DecodeBlock:
    """The decode block of a step function: K iterations of its forward and draw (see the
    module's doc). `page_size` locates each new token's KV slot in its row's block table."""

    step: StepFunction
    num_steps: int  # K
    page_size: int

    def __call__(self, params, kv, sstate, inputs: ModelInputs, meta: SamplingMetadata, tok: TokenInfo,
                 block: BlockInputs):
        K, ps = self.num_steps, self.page_size
        model, lora = self.step.model_of(params, tok)
        S = sstate.last_tokens.shape[0]
        R = block.steps.shape[0]
        t = jnp.arange(R, dtype=jnp.int32)  # row r feeds token r (T = R)
        tables = inputs.md.block_tables
        last_page = tables.shape[1] - 1
        live = inputs.md.kv_lens > 0
        no_reset = jnp.full_like(meta.reset_slots, S)

        def iteration(carry):
            j, kv, sstate, pos, done, outs = carry
            first = j == 0
            page = tables[t, jnp.minimum(pos // ps, last_page)]
            md = dataclasses.replace(inputs.md, kv_lens=jnp.where(live, pos + 1, 0),
                                     slot_mapping=jnp.where(done, t % ps, page * ps + pos % ps))
            ids = jnp.where(first, inputs.input_ids, -1)  # later iterations feed the token just drawn
            step_inputs = dataclasses.replace(inputs, input_ids=ids, positions=pos, md=md)
            min_active = (block.output_pos + j < block.min_tokens)[:, None]
            step_meta = dataclasses.replace(meta, uniform=block.uniforms[j],
                                            stop_ids=jnp.where(min_active, meta.stop_ids, -1),
                                            reset_slots=jnp.where(first, meta.reset_slots, no_reset))
            step_tok = dataclasses.replace(tok, valid=tok.valid & ~done, is_prompt=tok.is_prompt & first,
                                           sample_slots=jnp.where(done, S, tok.sample_slots))
            kv, sstate, out, _ = self.step.sample_step(model, lora, kv, sstate, step_inputs, step_meta, step_tok)
            outs = jax.tree.map(lambda acc, x: jax.lax.dynamic_update_index_in_dim(acc, x, j, 0), outs, out)
            stopped = (jnp.any(out.token_ids[:, None] == block.stop_tokens, axis=1)
                       & (block.output_pos + j + 1 >= block.min_tokens))
            finished = done | (j + 1 >= block.steps) | stopped
            pos = jnp.where(finished, pos, pos + 1)
            return j + 1, kv, sstate, pos, finished, outs

        def more(carry):
            j, _, _, _, done, _ = carry
            return (j < K) & ~jnp.all(done)

        k = self.step.sampler_config.max_logprobs
        outs = SamplerOutput(token_ids=jnp.zeros((K, R), jnp.int32), logprobs=jnp.zeros((K, R), jnp.float32),
                             topk_ids=jnp.zeros((K, R, k), jnp.int32), topk_logprobs=jnp.zeros((K, R, k), jnp.float32),
                             rank=jnp.zeros((K, R), jnp.int32))
        carry = (jnp.int32(0), kv, sstate, inputs.positions, block.steps <= 0, outs)
        _, kv, sstate, _, _, outs = jax.lax.while_loop(more, iteration, carry)
        return kv, sstate, outs

    def packed(self, layout: BufferLayout, params, kv, sstate, *buffers):
        return self(params, kv, sstate, *layout.unpack(buffers))

    def lower(self, layout: BufferLayout, params, kv, sstate, input_sharding) -> jax.stages.Lowered:
        """The block lowered on (abstract or real) weights, KV cache and sampling state (donated,
        returned in their shardings, as `StepFunction.lower`); the tokens and log-probs come back
        with `input_sharding` (replicated)."""
        keep = lambda tree: jax.tree.map(lambda x: x.sharding, tree)  # noqa: E731
        jitted = jax.jit(functools.partial(self.packed, layout), donate_argnums=(1, 2),
                         out_shardings=(keep(kv), keep(sstate), input_sharding))
        return jitted.lower(params, kv, sstate, *layout.abstract(input_sharding))
