"""Compiling a runner's step executables in worker processes, several at a time.

A big model's step takes minutes to compile (Llama-3-8B for a TPU: 185-368 s a bucket), and
the accelerator grid has 17. XLA compiles one program on few threads, so the buckets are
compiled side by side, in processes: libtpu's compiler crashed when two compiles ran in
threads of one process, and separate processes share nothing.

Each worker gets a `StepRecipe` (everything the step programs are a function of: the model's
config, the backend's plan, the rules, the mesh, the pages, the sampler) and builds from it,
without weights, the same abstract arguments the runner has (the backend lays the abstract
model out as for real weights: `prepare_model(..., abstract=True)`, the same fused layer),
lowers the runner's step (`step_fn.step_program`) and compiles it for its devices: this
host's (a CPU), or a compile-only TPU topology (libtpu, no chip needed; the workers set
ALLOW_MULTIPLE_LIBTPU_LOAD, since libtpu's lock file admits one process per host otherwise).
The parent hands out one bucket at a time, largest first, to whichever worker is free.

With an executable cache the workers store each executable under the key the parent computed
for it (`ExecutableScope.entry_key`), and the runner then loads them as on a warm start: the
cache checks each entry's checksum and that it takes exactly the runner's arguments (tree,
shapes, dtypes, shardings). Without one, a worker reports the compile's time and memory only
(`benchmarks/parallel_compile.py`).
"""

from __future__ import annotations

import base64
import dataclasses
import json
import logging
import os
import pickle
import queue
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

logger = logging.getLogger(__name__)

_RESULT = "@@compile-pool@@ "


@dataclasses.dataclass(frozen=True)
class StepRecipe:
    """What a runner's step programs are a function of, picklable (see the module's doc)."""

    arch: dict  # the HF config.json
    platform: str  # the backend's platform ("cpu", "tpu", "gpu")
    plan: dict  # the backend's DevicePlan, as a dict
    attention_impl: str  # the model config's ("auto" is resolved inside the model)
    rules: dict  # the serving rules
    mesh_shape: tuple[int, int]  # (data, model)
    target: dict  # the workers' devices: {"kind": "cpu"} or {"kind": "tpu", "topology": "v6e:2x4"}
    num_pages: int
    page_size: int
    max_model_len: int
    sampler_config: Any  # SamplerConfig

    def pages_per_req(self) -> int:
        return -(-self.max_model_len // self.page_size)


def recipe_devices(target: dict):
    """The devices a recipe's programs are compiled for."""
    import jax

    if target["kind"] == "tpu":
        from jax.experimental import topologies

        return list(
            topologies.get_topology_desc(topology_name=target["topology"], platform="tpu").devices
        )
    return jax.devices()


def target_attention(
    requested: str, platform: str, cfg, mesh, rules, page_size: int, kv_dtype, dtype
) -> tuple[str, str | None]:
    """(implementation, why not the kernel) that attention `requested` ("auto") takes on
    `platform` for this model on `mesh`, decided as "auto" decides when serving there (the kernel's shape check on
    one device's heads, else the reference): for programs compiled where that platform is not
    JAX's default (compile-only topologies). `dtype`: the model's (a quantized cache's queries
    come in it)."""
    import jax

    from jaxserve.models import sharding as ax
    from jaxserve.models.interface import KV_CACHE_AXES
    from jaxserve.pallas_kernels.kv_quant import attention_dtype
    from jaxserve.pallas_kernels.ragged_paged_attention.ops import (
        auto_candidates,
        resolve_impl,
        supports_check,
    )
    from jaxserve.runner.kv_cache import kv_cache_shape

    candidates = (auto_candidates(platform, list(mesh.devices.flat)) if requested == "auto"
                  else (resolve_impl(requested, platform),))  # "auto": by the GPUs' capability
    spec = ax.logical_to_spec(KV_CACHE_AXES, kv_cache_shape(cfg, 1, page_size), mesh, rules)
    split = ax.mesh_axes_size(mesh, spec[2])
    notes = []
    for impl in candidates:
        check = supports_check(impl)
        if check is None:
            return impl, "; ".join(notes) or None
        try:
            check(
                jax.ShapeDtypeStruct((1, cfg.num_heads // split, cfg.head_dim),
                                     attention_dtype(kv_dtype, dtype)),
                jax.ShapeDtypeStruct((1, page_size, cfg.num_kv_heads // split, cfg.head_dim),
                                     kv_dtype),
            )
        except ValueError as e:
            notes.append(f"{impl} kernel unsupported: {e}")
            continue
        return impl, "; ".join(notes) or None
    return "reference", "; ".join(notes)


def abstract_step(recipe: StepRecipe, devices=None):
    """(step function, mesh, abstract weights, KV cache, sampling state, replicated sharding) as
    a runner built from `recipe` holds them, without memory."""
    import jax
    from flax import nnx
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from jaxserve.backends import DevicePlan, select_backend
    from jaxserve.config import jax_dtype
    from jaxserve.models.arch_config import ArchConfig
    from jaxserve.models.weights import sharded_abstract_model
    from jaxserve.parallel.mesh import make_mesh
    from jaxserve.runner.kv_cache import abstract_kv_cache
    from jaxserve.runner.step_fn import StepFunction, abstract_sampling_state

    devices = recipe_devices(recipe.target) if devices is None else devices
    D, M = recipe.mesh_shape
    mesh = make_mesh(D, M, devices=devices)
    cfg = ArchConfig.from_hf(recipe.arch)
    plan = DevicePlan(**recipe.plan)
    backend = select_backend(recipe.platform)
    attention = recipe.attention_impl
    if (
        attention == "auto" and recipe.platform != jax.default_backend()
    ):  # compile-only: "auto" of the target
        attention = target_attention(
            "auto",
            recipe.platform,
            cfg,
            mesh,
            recipe.rules,
            recipe.page_size,
            jax_dtype(plan.kv_dtype),
            jax_dtype(plan.dtype),
        )[0]
    model = sharded_abstract_model(
        cfg,
        dtype=jax_dtype(plan.dtype),
        mesh=mesh,
        attention_impl=attention,
        rules=recipe.rules,
        moe_impl=plan.moe_impl,
    )
    backend.prepare_model(model, plan, abstract=True)
    layer_impl = backend.layer_impl(model)
    graphdef, state = nnx.split(model)
    params, treedef = jax.tree.flatten(state)
    params = [jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding) for x in params]
    step = StepFunction(graphdef, treedef, layer_impl, recipe.sampler_config)
    kv = abstract_kv_cache(
        cfg, recipe.num_pages, recipe.page_size, jax_dtype(plan.kv_dtype), mesh, recipe.rules
    )
    rep = NamedSharding(mesh, P())
    sstate = abstract_sampling_state(
        recipe.sampler_config, NamedSharding(mesh, P("data")) if D > 1 else rep
    )
    return step, mesh, params, kv, sstate, rep


def lower_bucket(recipe: StepRecipe, abstract, bucket: tuple[int, int]):
    """The Lowered step of `bucket` over `abstract` (what `abstract_step` returned)."""
    from jaxserve.runner.step_fn import step_layout, step_program

    step, mesh, params, kv, sstate, rep = abstract
    T, R = bucket
    layout = step_layout(
        T,
        R,
        pages_per_req=recipe.pages_per_req(),
        page_size=recipe.page_size,
        sampler_config=recipe.sampler_config,
    )
    lower, _ = step_program(step, layout, mesh, params, kv, sstate, rep)
    return lower()


def step_memory(recipe: StepRecipe, bucket: tuple[int, int], devices=None, scope=None):
    """The `StepMemory` of `bucket`'s step compiled from `recipe` (abstract weights; on
    `devices`, default the recipe's target), through `scope` (an ExecutableScope: a restart
    loads the executable instead of compiling it) when given."""
    from jaxserve.runner.step_fn import step_layout, step_program
    from jaxserve.runner.step_memory import StepMemory, bytes_on_device

    step, mesh, params, kv, sstate, rep = abstract = abstract_step(recipe, devices)
    T, R = bucket
    layout = step_layout(
        T,
        R,
        pages_per_req=recipe.pages_per_req(),
        page_size=recipe.page_size,
        sampler_config=recipe.sampler_config,
    )
    lower, buffers = step_program(step, layout, mesh, params, kv, sstate, rep)
    if scope is None:
        compiled = lower().compile()
    else:
        compiled = scope.get(
            f"memory-{T}x{R}", (params, kv, sstate, *buffers), lambda: lower().compile()
        )
    del abstract
    return StepMemory.of(
        compiled, bucket, weights=bytes_on_device(params), kv=bytes_on_device([*kv.k, *kv.v])
    )


# ---------------------------------------------------------------------------------- the worker
def _worker() -> int:
    """A worker process: the job (a pickled dict) on the first line of stdin, then one bucket
    a line ("T R name key"; key "-": do not store); one result line each on stdout."""
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    job = pickle.loads(base64.b64decode(sys.stdin.readline()))
    recipe: StepRecipe = job["recipe"]
    cache = None
    if job.get("cache_dir"):
        from jaxserve.runner.executable_cache import ExecutableCache

        cache = ExecutableCache(job["cache_dir"])
    abstract = abstract_step(recipe)
    out = sys.stdout
    for line in sys.stdin:
        if not line.strip():
            break
        T, R, name, key = line.split()
        t0 = time.perf_counter()
        result: dict[str, Any] = {"bucket": [int(T), int(R)]}
        try:
            compiled = lower_bucket(recipe, abstract, (int(T), int(R))).compile()
            result["seconds"] = round(time.perf_counter() - t0, 2)
            m = compiled.memory_analysis()
            result["temp_bytes"] = int(getattr(m, "temp_size_in_bytes", 0) or 0)
            if cache is not None and key != "-":
                cache.store(key, name, compiled)
        except Exception as e:  # noqa: BLE001 - reported; the parent compiles that bucket itself
            result["error"] = f"{type(e).__name__}: {e}"[:2000]
        out.write(_RESULT + json.dumps(result) + "\n")
        out.flush()
    return 0


# ---------------------------------------------------------------------------------- the parent
@dataclasses.dataclass
class PoolResult:
    results: list[dict]  # one per bucket, in completion order
    seconds: float  # wall time of the whole pool


def compile_in_workers(
    recipe: StepRecipe,
    buckets: Sequence[tuple[int, int]],
    workers: int,
    *,
    cache_dir: str | None = None,
    keys: dict[tuple[int, int], tuple[str, str]] | None = None,
    on_done: Callable[[dict, int, int], None] | None = None,
) -> PoolResult:
    """Compile `buckets` of `recipe` in `workers` processes (one bucket at a time each, the
    largest first). With `cache_dir` and `keys` ({bucket: (name, key)}) each executable is
    stored in the executable cache there. `on_done(result, done, total)` is called as each
    finishes (on the pool's threads)."""
    order = sorted(buckets, key=lambda b: (b[0] * max(b[1], 1), b), reverse=True)
    todo: queue.Queue = queue.Queue()
    for b in order:
        todo.put(b)
    total = len(order)
    job = base64.b64encode(
        pickle.dumps({"recipe": recipe, "cache_dir": cache_dir if keys else None})
    ).decode()
    env = {**os.environ, "ALLOW_MULTIPLE_LIBTPU_LOAD": "1"}
    if recipe.target["kind"] == "tpu":
        env["JAX_PLATFORMS"] = "cpu"  # compile-only: the workers never open a chip
    results: list[dict] = []
    lock = threading.Lock()
    t0 = time.perf_counter()

    def run_one() -> None:
        proc = subprocess.Popen(
            [sys.executable, "-m", "jaxserve.runner.compile_pool"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        stderr: list[str] = []
        drain = threading.Thread(target=lambda: stderr.extend(proc.stderr), daemon=True)
        drain.start()
        try:
            proc.stdin.write(job + "\n")
            while True:
                try:
                    T, R = todo.get_nowait()
                except queue.Empty:
                    break
                name, key = (keys or {}).get((T, R), (f"step-{T}x{R}", "-"))
                proc.stdin.write(f"{T} {R} {name} {key}\n")
                proc.stdin.flush()
                result = _read_result(proc)
                if result is None:
                    result = {
                        "bucket": [T, R],
                        "error": "the worker exited: " + "".join(stderr[-20:])[-2000:],
                    }
                with lock:
                    results.append(result)
                    if on_done is not None:
                        on_done(result, len(results), total)
                if "error" in result and result["error"].startswith("the worker exited"):
                    return
            proc.stdin.write("\n")
            proc.stdin.flush()
        except BrokenPipeError:
            pass
        finally:
            try:
                proc.stdin.close()
            except BrokenPipeError:
                pass
            proc.wait()
            drain.join(timeout=5)

    threads = [
        threading.Thread(target=run_one, name=f"jaxserve-compile-{i}", daemon=True)
        for i in range(max(1, min(workers, total)))
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return PoolResult(results, time.perf_counter() - t0)


def _read_result(proc) -> dict | None:
    for line in proc.stdout:
        if line.startswith(_RESULT):
            return json.loads(line[len(_RESULT) :])
    return None


if __name__ == "__main__":
    sys.exit(_worker())
