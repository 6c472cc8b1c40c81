"""Two local processes as one multi-host run (jax.distributed, gloo collectives, N simulated CPU
devices each), `LLM.generate` on a synthetic workload: output tok/s and what the leader's host
channel costs per step (bytes sent to the followers, and the leader's time spent sending).

    .venv/bin/python benchmarks/multihost_throughput.py [--mesh 1x4 2x2] [--num-prompts 8]
        [--output-len 32] [--devices-per-process 2]

One engine per mesh (DATAxTENSOR over all processes' devices). The same workload runs in one
process with the same mesh shape first (`--devices-per-process` x 2 simulated devices), so the
two can be compared side by side; greedy outputs must agree. One JSON line per (mesh, mode) goes
to benchmarks/results/multihost.jsonl. On one CPU host every "device" shares the same cores,
so the figures show the overhead of the multi-process mode, not the speed-up of real hosts.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import subprocess
import sys
import tempfile

from results_log import append_results

HERE = pathlib.Path(__file__).resolve().parent
RESULTS = HERE / "results" / "multihost.jsonl"

WORKER = r"""
import json, os, sys, time
import numpy as np
from jaxserve import LLM, SamplingParams
job = json.loads(sys.argv[1])
llm = LLM(job["model"], **job["options"])  # a follower never returns from here
rng = np.random.default_rng(0)
prompts = [rng.integers(100, 40000, size=int(n)).tolist()
           for n in rng.integers(job["min_input"], job["max_input"] + 1, size=job["num_prompts"])]
params = SamplingParams(max_tokens=job["output_len"], temperature=0.0, ignore_eos=True)
llm.generate(prompts[:1], params.clone(max_tokens=2), use_tqdm=False)  # warm-up
link = getattr(llm.engine.parts, "link", None)
b0, s0, t0 = (link.bytes_sent, link.step_id, link.send_seconds) if link else (0, 0, 0.0)
steps0 = llm.engine.core.num_steps
w0 = time.perf_counter()
outs = llm.generate(prompts, params, use_tqdm=False)
wall = time.perf_counter() - w0
res = {"wall_s": wall, "output_tokens": sum(len(o.outputs[0].token_ids) for o in outs),
       "steps": llm.engine.core.num_steps - steps0,
       "output_ids": [list(o.outputs[0].token_ids) for o in outs]}
if link:
    res.update(channel_bytes=link.bytes_sent - b0, channel_messages=link.step_id - s0,
               channel_send_s=link.send_seconds - t0, followers=job["options"].get("num_processes", 1) - 1)
print("RESULT " + json.dumps(res), flush=True)
"""


def run(job: dict, num_processes: int, devices: int) -> dict:
    env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}", JAX_PLATFORMS="cpu")
    from jaxserve.parallel.multihost import free_coordinator_port

    port = free_coordinator_port()
    procs = []
    for pid in range(num_processes):
        options = dict(job["options"])
        if num_processes > 1:
            options.update(coordinator_address=f"127.0.0.1:{port}", num_processes=num_processes, process_id=pid)
        procs.append(subprocess.Popen([sys.executable, "-c", WORKER, json.dumps({**job, "options": options})],
                                      env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outs = [p.communicate(timeout=3600)[0] for p in procs]
    if any(p.returncode for p in procs):
        sys.exit("a process failed:\n" + "\n".join(o[-3000:] for o in outs))
    line = next(ln for ln in outs[0].splitlines() if ln.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="model path; default: the bundled default model")
    p.add_argument("--mesh", nargs="+", default=["1x4", "2x2"])
    p.add_argument("--devices-per-process", type=int, default=2)
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--min-input", type=int, default=96)
    p.add_argument("--max-input", type=int, default=160)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--results", default=str(RESULTS), help="JSONL file to append to ('' = none)")
    args = p.parse_args(argv)
    from offline_throughput import environment  # same folder

    rows = []
    for mesh in args.mesh:
        dp, tp = (int(x) for x in mesh.split("x"))
        with tempfile.TemporaryDirectory() as cache:
            options = dict(dtype=args.dtype, data_parallel_size=dp, tensor_parallel_size=tp,
                           max_num_seqs=8 * dp, max_num_batched_tokens=256 * dp, enable_prefix_caching=False,
                           compilation_cache_dir=cache, show_progress=False)
            job = {k: getattr(args, k) for k in ("model", "num_prompts", "min_input", "max_input", "output_len")}
            job["options"] = options
            one = run(job, 1, 2 * args.devices_per_process)
            two = run(job, 2, args.devices_per_process)
        same = one.pop("output_ids") == two.pop("output_ids")
        for mode, r in (("one process", one), ("two processes", two)):
            r["output_tok_s"] = r["output_tokens"] / r["wall_s"]
            r["step_ms"] = 1e3 * r["wall_s"] / r["steps"]
            rows.append({"benchmark": "multihost", "mesh": mesh, "mode": mode, "dtype": args.dtype,
                         "options": {k: v for k, v in options.items() if k != "compilation_cache_dir"},
                         "workload": {k: v for k, v in job.items() if k != "options"},
                         "figures": r, "outputs_equal": same, "load_avg": os.getloadavg()})
        msgs = max(two.get("channel_messages", 0), 1)
        print(f"{mesh}: one process {one['output_tok_s']:.1f} tok/s ({one['step_ms']:.0f} ms/step), "
              f"two processes {two['output_tok_s']:.1f} tok/s ({two['step_ms']:.0f} ms/step); channel "
              f"{two['channel_bytes'] / msgs / 1024:.1f} KiB and {1e3 * two['channel_send_s'] / msgs:.3f} ms "
              f"per step message ({msgs} messages); outputs equal: {same}", flush=True)
    env = environment()
    stamp = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    if args.results:
        append_results(args.results, [{**row, **env, "timestamp": stamp} for row in rows])


if __name__ == "__main__":
    sys.path.insert(0, str(HERE))
    main()
