"""Compiling a runner's step executables in worker processes, several at a time.

A big model's step takes minutes to compile (Llama-3-8B for a TPU: 185-368 s a bucket), and
the accelerator grid has 17. XLA compiles one program on few threads, so the buckets are
compiled side by side, in processes: libtpu's compiler crashed when two compiles ran in
threads of one process, and separate processes share nothing.

Each worker gets a `StepRecipe` (runner/recipe.py: everything the step programs are a function
of, quantized weights, the KV cache's dtype and LoRA slots included; a quantized cache's scales
are inputs, abstract like the weights) and builds from it, without weights,
the same program and abstract arguments the runner has (`recipe.step_program`; the backend lays
the abstract model out as for real weights: `prepare_model(..., abstract=True)`, the same fused
layer), lowers one bucket's step and compiles it for its devices: this
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

import jax

from jaxserve.runner.recipe import StepRecipe

logger = logging.getLogger(__name__)

_RESULT = "@@compile-pool@@ "


def recipe_devices(target: dict):
    """The devices a recipe's programs are compiled for."""
    import jax

    if target.get("kind") == "tpu":
        from jaxserve.backends.devices import tpu_slice_devices

        return tpu_slice_devices(target["topology"])
    return jax.devices()


def abstract_step(recipe: StepRecipe, devices=None) -> AbstractStep:
    """The step program of `recipe` with its arguments as a runner built from it holds them,
    without memory (on `devices`, default the recipe's target's)."""
    from jaxserve.backends import select_backend
    from jaxserve.parallel.mesh import make_mesh
    from jaxserve.runner.recipe import abstract_model, step_program

    devices = recipe_devices(recipe.target) if devices is None else devices
    mesh = make_mesh(*recipe.mesh_shape, devices=devices)
    backend = select_backend(recipe.platform)
    model = abstract_model(recipe, mesh, backend)
    program, params, _ = step_program(recipe, model, backend, mesh)
    params = [jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding) for x in params]
    return AbstractStep(program, model, params + (program.drafter_params or []) + program.lora_arrays(abstract=True),
                        program.abstract_kv(),
                        program.abstract_state())


@dataclasses.dataclass
class AbstractStep:
    """A recipe's step program and its abstract arguments (no memory)."""

    program: Any  # runner/recipe.py's StepProgram
    model: Any  # the abstract model (its variables' metadata: shard-plan's report)
    params: list  # the weights' ShapeDtypeStructs, the LoRA slots' after them
    kv: Any
    sstate: Any

    def lower(self, bucket: tuple[int, int]):
        """(lower, abstract packed inputs) of `bucket`'s step."""
        return self.program.lower(bucket, self.params, self.kv, self.sstate)


def lower_bucket(recipe: StepRecipe, abstract: AbstractStep, bucket: tuple[int, int]):
    """The Lowered step of `bucket` over `abstract` (what `abstract_step` returned)."""
    return abstract.lower(bucket)[0]()


def step_memory(recipe: StepRecipe, bucket: tuple[int, int], devices=None, scope=None):
    """The `StepMemory` of `bucket`'s step compiled from `recipe` (abstract weights; on
    `devices`, default the recipe's target), through `scope` (an ExecutableScope: a restart
    loads the executable instead of compiling it) when given."""
    from jaxserve.compiled_step.memory import StepMemory, bytes_on_device

    abstract = abstract_step(recipe, devices)
    lower, buffers = abstract.lower(bucket)
    T, R = bucket
    if scope is None:
        compiled = lower().compile()
    else:
        compiled = scope.get(
            f"memory-{T}x{R}", (abstract.params, abstract.kv, abstract.sstate, *buffers), lambda: lower().compile()
        )
    kv = abstract.kv
    return StepMemory.of(
        compiled, bucket, weights=bytes_on_device(abstract.params), kv=bytes_on_device([*kv.k, *kv.v])
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
