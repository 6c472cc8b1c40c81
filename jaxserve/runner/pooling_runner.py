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
from jaxserve.runner.executable_cache import (
    ExecutableCache,
    ExecutableScope,
    canonical,
    executable_scope,
    signature,
)
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


@dataclasses.dataclass(frozen=True, eq=False)
class PoolingProgram:
    """The pooling runner's executables over a model's weights (real or abstract): its scratch
    KV cache's maker ("kv-zeros") and one pooling program per bucket ("pool-T-R"), each loaded
    or compiled through an ExecutableScope (the runner's, or `jaxserve compile`'s for a
    directory compiled ahead: runner/prebuilt.py) under the one name both use."""

    fn: PoolFunction
    cfg: object  # the model's ArchConfig
    mesh: Mesh
    rules: dict | None
    grid: BucketGrid
    page_size: int
    pages_per_req: int
    num_pages: int
    kv_dtype: object
    params: list  # the weights' ShapeDtypeStructs, in the runner's order

    @property
    def replicated(self) -> NamedSharding:
        return NamedSharding(self.mesh, P())

    def abstract_kv(self):
        return abstract_kv_cache(self.cfg, self.num_pages, self.page_size, self.kv_dtype, self.mesh,
                                 self.rules)

    def scope_parts(self) -> dict[str, str]:
        """What the executable cache keys these executables by (besides the environment)."""
        impl = self.fn.layer_impl
        layer = impl and f"{impl.__module__}.{impl.__qualname__}"
        return dict(runner="pooling", graphdef=canonical(self.fn.graphdef),
                    params=signature(self.params), params_treedef=str(self.fn.params_treedef),
                    kv=signature(self.abstract_kv()), layer_impl=str(layer),
                    pooling=canonical(self.fn.pooling), mesh=repr(self.mesh),
                    pages=f"{self.page_size} {self.pages_per_req} {self.num_pages}")

    def kv_zeros(self, scope) -> jax.stages.Compiled:
        return scope.get("kv-zeros", (), zeros_compiler(self.abstract_kv().k[0]))

    @staticmethod
    def pool_name(bucket: tuple[int, int]) -> str:
        return f"pool-{bucket[0]}-{bucket[1]}"

    def pool_executable(self, scope, bucket: tuple[int, int]) -> jax.stages.Compiled:
        rep, kv = self.replicated, self.abstract_kv()
        args = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=rep),
                            self.pack([], *bucket))
        keep = jax.tree.map(lambda x: x.sharding, kv)

        def lower():
            jitted = jax.jit(self.fn, donate_argnums=(1,), out_shardings=(keep, rep))
            return jitted.lower(self.params, kv, *args).compile()

        return scope.get(self.pool_name(bucket), (self.params, kv, *args), lower)

    def pack(self, prompts: Sequence[Sequence[int]], T: int,
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


def pooling_num_pages(grid: BucketGrid, page_size: int) -> int:
    """The scratch cache's pages: the largest bucket's prompts, each last page partial, and
    page 0, the null page padding writes into."""
    return 1 + -(-max(grid.token_buckets) // page_size) + max(grid.request_buckets)


def pooling_program(model, *, backend, mesh: Mesh, page_size: int, max_model_len: int,
                    grid: BucketGrid, pooling: PoolingConfig, kv_dtype,
                    rules=None) -> tuple[PoolingProgram, list]:
    """The pooling executables' program over `model` (real or abstract weights, laid out by
    `backend`): (program, the model's flat weights)."""
    graphdef, state = nnx.split(model)
    params, treedef = jax.tree.flatten(state)
    fn = PoolFunction(graphdef, treedef, backend.layer_impl(model), pooling)
    num_pages = pooling_num_pages(grid, page_size)
    shaped = [jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding) for x in params]
    program = PoolingProgram(fn, model.config, mesh, rules, grid, page_size,
                             -(-max_model_len // page_size), num_pages, kv_dtype, shaped)
    return program, params


class PoolingRunner:
    def __init__(self, model, *, backend, mesh: Mesh, page_size: int, max_model_len: int,
                 grid: BucketGrid, pooling: PoolingConfig, kv_dtype, show_progress: bool = True,
                 rules=None, executable_cache: ExecutableCache | None = None,
                 prebuilt: ExecutableScope | None = None):
        """`prebuilt`: the executables compiled ahead for this runner (runner/prebuilt.py's
        scope, opened by engine/setup.py), looked in first."""
        self.mesh, self.rules, self.grid, self.pooling = mesh, rules, grid, pooling
        self.cfg = model.config
        self.page_size = page_size
        self.kv_dtype = kv_dtype
        self.max_model_len = max_model_len
        self.program, self.params = pooling_program(
            model, backend=backend, mesh=mesh, page_size=page_size, max_model_len=max_model_len, grid=grid,
            pooling=pooling, kv_dtype=kv_dtype, rules=rules)
        self.pages_per_req, self.num_pages = self.program.pages_per_req, self.program.num_pages
        self.graphdef, self._params_treedef = self.program.fn.graphdef, self.program.fn.params_treedef
        self.layer_impl = self.program.fn.layer_impl
        backend.place_weights(model, self.params, self._params_treedef)
        self.fn = self.program.fn
        self.replicated = self.program.replicated
        self.counter = CompileCounter()
        t0 = time.perf_counter()
        with self.counter.active():
            self._compile_all(backend, executable_cache, prebuilt, show_progress)
        self.compile_seconds = time.perf_counter() - t0
        self.counter.mark_warm()

    @property
    def hidden_size(self) -> int:
        return self.cfg.hidden_size

    @property
    def num_buckets(self) -> int:
        return len(self._compiled)

    def _compile_all(self, backend, cache: ExecutableCache | None, prebuilt: ExecutableScope | None,
                     show_progress: bool) -> None:
        program = self.program
        scope = executable_scope(cache, self.mesh.devices.flat, **program.scope_parts())
        scope.prebuilt = prebuilt
        zeros = program.kv_zeros(scope)
        self.kv = allocate_kv_cache(self.cfg, self.num_pages, self.page_size, self.kv_dtype,
                                    self.mesh, self.rules, zeros=zeros)
        backend.place_kv_cache([*self.params, *self.kv.k, *self.kv.v])
        self._compiled = {}
        for bucket in tqdm(self.grid.shapes(), desc="compiling pooling buckets",
                           disable=not show_progress, unit="bucket"):
            self._compiled[bucket] = program.pool_executable(scope, bucket)
        self.executables_loaded, self.executables_compiled = scope.loaded, scope.compiled

    def _pack(self, prompts: Sequence[Sequence[int]], T: int,
              R: int) -> tuple[ModelInputs, np.ndarray]:
        return self.program.pack(prompts, T, R)

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
