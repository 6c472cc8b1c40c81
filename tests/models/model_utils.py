"""Helpers for model tests: run a model over ragged token sequences through the paged path."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxserve.runner.kv_cache import allocate_kv_cache
from jaxserve.runner.step_inputs import StepRequest, pack_step


def make_forward(model, layer_impl=None):
    """A jitted (state, kv_cache, inputs) -> (logits at every token [T, V], kv_cache);
    `layer_impl`: a backend's replacement decoder layer (jaxserve/backends)."""
    graphdef, state = nnx.split(model)

    @jax.jit
    def fwd(state, kv, inputs):
        m = nnx.merge(graphdef, state)
        h, kv = m(inputs.input_ids, inputs.positions, kv, inputs.md, layer_impl=layer_impl)
        return m.compute_logits(h), kv

    return lambda kv, inputs: fwd(state, kv, inputs)


class PagedRunner:
    """Feeds chunks of several sequences through a model with shuffled block tables."""

    def __init__(self, model, *, page_size: int, num_pages: int, seed: int = 0, dtype=jnp.float32, mesh=None,
                 layer_impl=None):
        from jaxserve.models.sharding import single_device_mesh

        self.cfg = model.config
        self.page_size = page_size
        self.num_pages = num_pages
        self.kv = allocate_kv_cache(self.cfg, num_pages, page_size, dtype, mesh or single_device_mesh())
        self.fwd = make_forward(model, layer_impl)
        rng = np.random.default_rng(seed)
        self.free = list(rng.permutation(np.arange(1, num_pages)))  # page 0 is the null page
        self.blocks: dict[int, list[int]] = {}

    def ensure(self, seq: int, length: int) -> list[int]:
        blocks = self.blocks.setdefault(seq, [])
        while len(blocks) * self.page_size < length:
            blocks.append(int(self.free.pop()))
        return blocks

    def step(self, chunks: list[tuple[int, list[int], int]], *, num_tokens: int, num_reqs: int, pages_per_req: int):
        """chunks: (seq id, token ids, start position). Returns per-chunk logits [n_i, V]."""
        reqs = [
            StepRequest(token_ids=toks, start_pos=start, block_ids=self.ensure(seq, start + len(toks)))
            for seq, toks, start in chunks
        ]
        inputs = pack_step(reqs, num_tokens=num_tokens, num_reqs=num_reqs,
                           pages_per_req=pages_per_req, page_size=self.page_size)
        logits, self.kv = self.fwd(self.kv, jax.tree.map(jnp.asarray, inputs))
        logits = np.asarray(logits)
        out, lo = [], 0
        for _, toks, _ in chunks:
            out.append(logits[lo : lo + len(toks)])
            lo += len(toks)
        return out
