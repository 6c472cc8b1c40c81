"""Cold-start compile time of the accelerator grid: one worker process (serial) against several
(`jaxserve/runner/compile_pool.py`), for a TPU topology compiled on this host (libtpu's
compile-only topologies: no chip needed).

The grid is the engine's default for TPU/GPU (token budget 8192, max_num_seqs 32: 9 token
buckets x request buckets 8 and 32 = 17 executables); `--buckets` measures a subset. Each
run appends one JSON line to benchmarks/results/parallel_compile.jsonl: the workers, the
buckets, the wall time, each bucket's compile seconds, the host's cores and load average.

    ALLOW_MULTIPLE_LIBTPU_LOAD=1 nice .venv/bin/python benchmarks/parallel_compile.py \\
        --preset llama3-8b --topology v6e:2x4 --workers 1,2
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import pathlib
import subprocess
import sys

from results_log import append_results

HERE = pathlib.Path(__file__).resolve().parent
REPO = HERE.parent


def default_grid(max_num_seqs: int = 32) -> list[tuple[int, int]]:
    from jaxserve.backends.base import Backend
    from jaxserve.compiled_step.buckets import BucketGrid

    backend = Backend("tpu")
    budget = backend.resolve_max_num_batched_tokens(None, None)
    return BucketGrid.build(budget, max_num_seqs, backend.default_token_buckets(budget)).shapes()


def recipe(
    preset: str, topology: str, mesh: tuple[int, int], max_model_len: int, max_num_seqs: int,
    num_pages: int | None = None, layers: int | None = None,
):
    from jaxserve.models.sharding import load_rules, serving_rules

    from jaxserve.backends.base import Backend
    from jaxserve.config import CacheConfig, ModelConfig
    from jaxserve.runner.recipe import StepRecipe
    from jaxserve.sampling.config import SamplerConfig
    from jaxserve.tools.shard_plan import model_config

    _, arch = model_config(preset)
    if layers is not None:
        arch = {**arch, "num_hidden_layers": layers}
    # The plan as the TPU backend resolves it (the attention kernel: "auto" on a TPU).
    plan = Backend("tpu").plan(ModelConfig(matmul_impl="xla"), CacheConfig(), _FakeMesh())
    pages = mesh[0] * (max_num_seqs // mesh[0] * -(-max_model_len // 16) + 1)
    return StepRecipe(
        arch=arch,
        platform="tpu",
        plan=dataclasses.asdict(plan),
        attention_impl="auto",
        rules=serving_rules(load_rules("tp"), mesh[0]),
        mesh_shape=mesh,
        target={"kind": "tpu", "topology": topology},
        num_pages=pages if num_pages is None else num_pages,
        page_size=16,
        max_model_len=max_model_len,
        sampler_config=SamplerConfig(
            max_num_seqs=max_num_seqs, vocab_size=arch["vocab_size"], max_logprobs=20
        ),
    )


class _FakeMesh:  # Backend.plan reads nothing of the mesh on accelerators
    shape = {"data": 1, "model": 1}


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--preset", default="llama3-8b")
    p.add_argument("--topology", default="v6e:2x4")
    p.add_argument("--mesh", default="1x8", help="data x model")
    p.add_argument("--max-model-len", type=int, default=8192)
    p.add_argument("--max-num-seqs", type=int, default=32)
    p.add_argument(
        "--workers", default="1,2", help="comma-separated worker counts, run in this order"
    )
    p.add_argument("--buckets", default=None, help="TxR,... (default: the whole default grid)")
    p.add_argument("--note", default="", help="what else ran on the host meanwhile")
    p.add_argument("--out", default=str(HERE / "results" / "parallel_compile.jsonl"))
    a = p.parse_args()
    from jaxserve.runner.compile_pool import compile_in_workers

    mesh = tuple(int(x) for x in a.mesh.split("x"))
    buckets = (
        [tuple(int(x) for x in b.split("x")) for b in a.buckets.split(",")]
        if a.buckets
        else default_grid(a.max_num_seqs)
    )
    r = recipe(a.preset, a.topology, mesh, a.max_model_len, a.max_num_seqs)
    sha = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True
    ).stdout.strip()
    for workers in (int(w) for w in a.workers.split(",")):
        load_before = os.getloadavg()
        done = []

        def progress(res, n, total):
            done.append(res)
            print(
                f"  [{workers} workers] {n}/{total} {res['bucket']} {res.get('seconds', res.get('error'))}",
                flush=True,
            )

        pool = compile_in_workers(r, buckets, workers, on_done=progress)
        errors = [x for x in pool.results if "error" in x]
        rec = {
            "benchmark": "parallel_compile",
            "time": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "git_sha": sha,
            "preset": a.preset,
            "topology": a.topology,
            "mesh": a.mesh,
            "max_model_len": a.max_model_len,
            "max_num_seqs": a.max_num_seqs,
            "workers": workers,
            "buckets": [list(b) for b in buckets],
            "full_default_grid": a.buckets is None,
            "wall_s": round(pool.seconds, 1),
            "compile_s": {
                f"{x['bucket'][0]}x{x['bucket'][1]}": x.get("seconds") for x in pool.results
            },
            "errors": [x["error"][:300] for x in errors],
            "cpus": os.cpu_count(),
            "loadavg_before": [round(x, 2) for x in load_before],
            "loadavg_after": [round(x, 2) for x in os.getloadavg()],
            "note": a.note,
        }
        append_results(a.out, rec)
        print(
            json.dumps(
                {
                    k: rec[k]
                    for k in ("workers", "wall_s", "errors", "loadavg_before", "loadavg_after")
                }
            ),
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
