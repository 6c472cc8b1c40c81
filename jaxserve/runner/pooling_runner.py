"""PoolingRunner: embeddings of whole prompts (`--runner pooling`).

The model's hidden states after the final norm, pooled per prompt (last token or mean of the
tokens) and optionally L2-normalized, by one executable per (T tokens, R prompts) bucket,
compiled at start-up like the generation step (no compilation while serving). A batch is a
plain prefill: each prompt is packed as a row starting at position 0 into pages of a small
scratch KV cache of the runner's own (the attention kernels read K/V from pages; nothing is
kept between batches, so there is no scheduler, no sampling state and no prefix cache).
A separate runner rather than the generation step with a pooled output: the step's sampling,
its per-slot state and its logits are dead weight for embeddings, and a pooling model needs a
KV cache of one batch instead of the whole memory budget.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from tqdm import tqdm

from jaxserve.compiled_step.buckets import BucketGrid
from jaxserve.models.pooling_config import PoolingConfig
from jaxserve.runner.compile import CompileCounter
from jaxserve.runner.executable_cache import ExecutableCache, canonical, executable_scope, signature
from jaxserve.runner.kv_cache import abstract_kv_cache, allocate_kv_cache, zeros_compiler
from jaxserve.runner.step_inputs import ModelInputs, pack_rows


@dataclasses.dataclass(frozen=True, eq=False)
class PoolFunction:
    """(weights, KV cache, packed prompts, token rows) -> (KV cache, pooled [R, E] float32)."""

    graphdef: object
    params_treedef: object
    layer_impl: object
    pooling: PoolingConfig

    def __call__(self, params, kv, inputs: ModelInputs, rows: jax.Array):
        model = nnx.merge(self.graphdef, jax.tree.unflatten(self.params_treedef, params))
        hidden, kv = model(inputs.input_ids, inputs.positions, kv, inputs.md, self.layer_impl)
        hidden = hidden.astype(jnp.float32)  # [T, E]
        R = inputs.logits_indices.shape[0]
        if self.pooling.pooling == "last":
            pooled = hidden[inputs.logits_indices]
        else:  # mean over each prompt's tokens; padding tokens are row R, dropped
            sums = jax.ops.segment_sum(hidden, rows, num_segments=R + 1)[:R]
            ones = jnp.ones_like(rows, jnp.float32)
            counts = jax.ops.segment_sum(ones, rows, num_segments=R + 1)[:R]
            pooled = sums / jnp.maximum(counts, 1.0)[:, None]
        if self.pooling.normalize:  # as torch.nn.functional.normalize (eps 1e-12)
            norm = jnp.linalg.norm(pooled, axis=-1, keepdims=True)
            pooled = pooled / jnp.maximum(norm, 1e-12)
        return kv, pooled


class PoolingRunner:
    def __init__(self, model, *, backend, mesh: Mesh, page_size: int, max_model_len: int,
                 grid: BucketGrid, pooling: PoolingConfig, kv_dtype, show_progress: bool = True,
                 rules=None, executable_cache: ExecutableCache | None = None):
        self.mesh, self.rules, self.grid, self.pooling = mesh, rules, grid, pooling
        self.cfg = model.config
        self.page_size = page_size
        self.kv_dtype = kv_dtype
        self.max_model_len = max_model_len
        self.pages_per_req = -(-max_model_len // page_size)
        # Page 0 is the null page padding writes into; every prompt's last page may be partial.
        self.num_pages = 1 + -(-max(grid.token_buckets) // page_size) + max(grid.request_buckets)
        self.graphdef, state = nnx.split(model)
        self.params, self._params_treedef = jax.tree.flatten(state)
        del state
        self.layer_impl = backend.layer_impl(model)
        backend.place_weights(model, self.params, self._params_treedef)
        self.fn = PoolFunction(self.graphdef, self._params_treedef, self.layer_impl, pooling)
        self.replicated = NamedSharding(mesh, P())
        self.counter = CompileCounter()
        t0 = time.perf_counter()
        with self.counter.active():
            self._compile_all(backend, executable_cache, show_progress)
        self.compile_seconds = time.perf_counter() - t0
        self.counter.mark_warm()

    @property
    def hidden_size(self) -> int:
        return self.cfg.hidden_size

    @property
    def num_buckets(self) -> int:
        return len(self._compiled)

    def _compile_all(self, backend, cache: ExecutableCache | None, show_progress: bool) -> None:
        shaped = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)  # noqa: E731
        abstract_kv = abstract_kv_cache(self.cfg, self.num_pages, self.page_size, self.kv_dtype,
                                        self.mesh, self.rules)
        params = [shaped(x) for x in self.params]
        layer = self.layer_impl and f"{self.layer_impl.__module__}.{self.layer_impl.__qualname__}"
        scope = executable_scope(
            cache, self.mesh.devices.flat, runner="pooling", graphdef=canonical(self.graphdef),
            params=signature(params), params_treedef=str(self._params_treedef),
            kv=signature(abstract_kv),
            layer_impl=str(layer), pooling=canonical(self.pooling), mesh=repr(self.mesh),
            pages=f"{self.page_size} {self.pages_per_req} {self.num_pages}")
        zeros = scope.get("kv-zeros", (), zeros_compiler(abstract_kv.k[0]))
        self.kv = allocate_kv_cache(self.cfg, self.num_pages, self.page_size, self.kv_dtype,
                                    self.mesh, self.rules, zeros=zeros)
        backend.place_kv_cache([*self.params, *self.kv.k, *self.kv.v])
        keep = jax.tree.map(lambda x: x.sharding, self.kv)
        self._compiled = {}
        rep = self.replicated
        for T, R in tqdm(self.grid.shapes(), desc="compiling pooling buckets",
                         disable=not show_progress, unit="bucket"):
            args = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=rep),
                                self._pack([], T, R))

            def lower(args=args):
                jitted = jax.jit(self.fn, donate_argnums=(1,), out_shardings=(keep, rep))
                return jitted.lower(params, abstract_kv, *args).compile()

            self._compiled[(T, R)] = scope.get(f"pool-{T}-{R}", (params, abstract_kv, *args), lower)
        self.executables_loaded, self.executables_compiled = scope.loaded, scope.compiled

    def _pack(self, prompts: Sequence[Sequence[int]], T: int,
              R: int) -> tuple[ModelInputs, np.ndarray]:
        """Prompts as prefill rows from position 0, on consecutive pages from page 1."""
        lens = np.asarray([len(p) for p in prompts], np.int64)
        pages = -(-lens // self.page_size)
        first = 1 + np.cumsum(pages) - pages
        tables = np.zeros((len(prompts), self.pages_per_req), np.int32)
        for i, (f, n) in enumerate(zip(first.tolist(), pages.tolist())):
            tables[i, :n] = np.arange(f, f + n)
        tokens = np.fromiter((t for p in prompts for t in p), np.int32, count=int(lens.sum()))
        inputs = pack_rows(tokens, np.zeros(len(prompts), np.int64), lens, tables, num_tokens=T,
                           num_reqs=R, page_size=self.page_size)
        rows = np.full(T, R, np.int32)
        rows[: len(tokens)] = np.repeat(np.arange(len(prompts)), lens)
        return inputs, rows

    def _batches(self, prompts: Sequence[Sequence[int]]) -> list[list[int]]:
        """Indices of prompts in batches that fit the largest bucket, in order."""
        max_t, max_r = max(self.grid.token_buckets), max(self.grid.request_buckets)
        batches, cur, tokens = [], [], 0
        for i, p in enumerate(prompts):
            if cur and (tokens + len(p) > max_t or len(cur) == max_r):
                batches.append(cur)
                cur, tokens = [], 0
            cur.append(i)
            tokens += len(p)
        if cur:
            batches.append(cur)
        return batches

    def embed(self, prompts: Sequence[Sequence[int]]) -> np.ndarray:
        """[len(prompts), hidden] float32: each prompt's pooled hidden states. Raises ValueError
        for an empty prompt or one longer than max_model_len (nothing runs)."""
        for i, p in enumerate(prompts):
            if not 0 < len(p) <= self.max_model_len:
                raise ValueError(f"prompt {i} has {len(p)} tokens; an embedding input needs 1 to "
                                 f"{self.max_model_len} (max_model_len)")
        out = np.zeros((len(prompts), self.hidden_size), np.float32)
        launched = []
        with self.counter.active():
            for batch in self._batches(prompts):
                chunk = [prompts[i] for i in batch]
                T, R = self.grid.pick(sum(len(p) for p in chunk), len(chunk))
                inputs, rows = self._pack(chunk, T, R)
                self.kv, pooled = self._compiled[(T, R)](self.params, self.kv, inputs, rows)
                launched.append((batch, pooled))
        for batch, pooled in launched:
            out[batch] = np.asarray(pooled)[: len(batch)]
        return out
