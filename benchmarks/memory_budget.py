"""The KV budget a TPU topology gets for a model, from the compiled programs (no chip needed:
libtpu's compile-only topologies), and the served step's own memory analysis with that cache.

What the engine does at start on an accelerator (`engine/setup.py: kv_budget_from_programs`):
compile the largest bucket's step on abstract weights with 2 pages and with an eighth of what
that leaves, take the weights, temporaries, outputs and code from XLA's `memory_analysis()`,
give the KV cache the rest of HBM x utilization, then compile the step with the pages of that
budget (what `serve` would run) and take what it needs beyond the budget off the cache. The
script records the figures of that served step (compiled again if the budget shrank): its peak
must stay within the allowed bytes. One JSON line per topology in
benchmarks/results/memory_budget.jsonl.

    ALLOW_MULTIPLE_LIBTPU_LOAD=1 .venv/bin/python benchmarks/memory_budget.py \\
        --preset llama3-8b --topology v5e:2x2,v6e:2x4 --bucket 512x8
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import subprocess
import sys
import time

from results_log import append_results

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
GiB = 2**30


def measure(preset: str, topology: str, bucket: tuple[int, int], layers: int | None, utilization: float,
            max_model_len: int, max_num_seqs: int) -> dict:
    import jax.numpy as jnp

    from jaxserve.backends.base import Backend
    from jaxserve.config import CacheConfig
    from jaxserve.engine.setup import kv_budget_from_programs
    from jaxserve.parallel.mesh import make_mesh
    from jaxserve.runner.compile_pool import recipe_devices, step_memory
    from jaxserve.runner.kv_cache import bytes_per_page, num_pages_for_budget
    from jaxserve.tools.chips import CHIPS
    from parallel_compile import recipe as step_recipe

    chips = 1
    for d in topology.split(":")[1].split("x"):
        chips *= int(d)
    mesh_shape = (1, chips)  # tensor parallel over every chip
    hbm = CHIPS[topology.split(":")[0]].hbm_bytes

    def recipe(num_pages: int):
        return step_recipe(preset, topology, mesh_shape, max_model_len, max_num_seqs, num_pages=num_pages,
                           layers=layers)

    base = recipe(2)
    arch = base.arch_config()  # as served (zero KV heads appended for the TPU kernel, if any)
    mesh = make_mesh(*mesh_shape, devices=recipe_devices(base.target))
    t0 = time.perf_counter()
    budget = kv_budget_from_programs(Backend("tpu"), CacheConfig(device_memory_utilization=utilization), recipe,
                                     bucket, hbm, arch=arch, kv_dtype=jnp.bfloat16, mesh=mesh, rules=base.rules)
    pages = num_pages_for_budget(arch, base.page_size, jnp.bfloat16, budget.kv, mesh, base.rules)
    served = budget.served  # the sizing's last probe, when it is the step of these pages
    if served is None or served.kv != pages * bytes_per_page(arch, base.page_size, jnp.bfloat16, mesh, base.rules):
        served = step_memory(recipe(pages), bucket, devices=list(mesh.devices.flat))
    return {
        "topology": topology,
        "chips": chips,
        "layers": base.arch["num_hidden_layers"],
        "vocab_size": arch.vocab_size,
        "bucket": list(bucket),
        "utilization": utilization,
        "hbm_gib": round(hbm / GiB, 2),
        "weights_gib": round(budget.step.weights / GiB, 3),
        "probe_temp_gib": round(budget.step.temp / GiB, 3),
        "temp_per_kv_byte": round(budget.kv_overhead, 3),
        "served_excess_gib": round(budget.served_excess / GiB, 3),
        "kv_budget_gib": round(budget.kv / GiB, 3),
        "pages": pages,
        "tokens_cached": (pages - 1) * base.page_size,
        "served_peak_gib": round(served.peak / GiB, 3),
        "served_temp_gib": round(served.temp / GiB, 3),
        "served_kv_gib": round(served.kv / GiB, 3),
        "allowed_gib": round(budget.usable / GiB, 3),
        "fits": served.peak <= budget.usable,
        "seconds": round(time.perf_counter() - t0, 1),
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="llama3-8b")
    p.add_argument("--topology", default="v5e:2x2,v6e:2x4", help="comma-separated")
    p.add_argument("--bucket", default="512x8", help="TxR: the largest step's bucket")
    p.add_argument("--layers", type=int, default=None, help="fewer layers than the preset's (faster compiles)")
    p.add_argument("--utilization", type=float, default=0.9)
    p.add_argument("--max-model-len", type=int, default=8192)
    p.add_argument("--max-num-seqs", type=int, default=32)
    p.add_argument("--note", default="")
    p.add_argument("--out", default=str(HERE / "results" / "memory_budget.jsonl"))
    a = p.parse_args()
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # compile-only: another process may hold it
    bucket = tuple(int(x) for x in a.bucket.split("x"))
    sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=HERE.parent, capture_output=True,
                         text=True).stdout.strip()
    for topology in a.topology.split(","):
        rec = {"benchmark": "memory_budget",
               "time": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"), "git_sha": sha,
               "preset": a.preset, **measure(a.preset, topology, bucket, a.layers, a.utilization,
                                             a.max_model_len, a.max_num_seqs), "note": a.note}
        append_results(a.out, rec)
        print(json.dumps(rec), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
