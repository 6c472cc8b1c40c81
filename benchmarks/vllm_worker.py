"""vLLM side of benchmarks/offline_throughput.py (run as a subprocess, under a python with vLLM).

    /path/to/vllm-venv/bin/python benchmarks/vllm_worker.py JOB.json

JOB.json holds {"prompts": [[token ids], ...], "concurrency": [c, ...], "max_new_tokens": n,
"dtypes": ["float32" | "bfloat16", ...], "gguf": path, "cache_dir": dir, "threads": k}.
Per dtype it starts one vLLM engine (max_num_seqs = the largest c, prefix caching off, as the
jaxserve side) and, for each c, drives it as the same closed loop as offline_throughput.py: at
most c requests in flight, the next prompt submitted as soon as one finishes, greedy, exactly n
new tokens each (ignore_eos, min_tokens = n). TTFT is the time from submission to the first step
that returns a token of the request. Prints one JSON line on stdout; messages go to stderr.

vLLM runs on the transformers directory that hf_worker.py builds from the GGUF (vLLM's CPU
build ships torch and transformers). On CPU, vLLM binds its OpenMP threads itself; with
VLLM_CPU_OMP_THREADS_BIND unset it keeps one core for its engine process and computes on the
rest, which on a 2-core machine halves it (measured 260-315 against 380-440 output tok/s at
c = 32). So unless the environment says otherwise, the worker binds cores 0..k-1 (k = "threads",
default: all) and reserves none. The result's "isa" says, per dtype, which of vLLM's kernel
libraries its engine processes loaded (_C: AVX-512 + AMX, _C_AVX512, _C_AVX2), the attention
ISA vLLM picks and what torch reports (under `--cpu-class avx2`: benchmarks/cpu_class.py).
"""

from __future__ import annotations

import gc
import json
import os
import pathlib
import statistics
import sys
import time


def log(msg: str) -> None:
    print(f"[vllm_worker] {msg}", file=sys.stderr, flush=True)


def closed_loop(engine, prompts, c: int, params, tag: str, TokensPrompt) -> dict:
    outs, submitted, first = {}, {}, {}
    nxt = in_flight = steps = 0
    t0 = time.perf_counter()
    while nxt < len(prompts) or engine.has_unfinished_requests():
        while nxt < len(prompts) and in_flight < c:
            rid = f"{tag}-{nxt}"
            submitted[rid] = time.perf_counter()
            engine.add_request(rid, TokensPrompt(prompt_token_ids=prompts[nxt]), params)
            nxt, in_flight = nxt + 1, in_flight + 1
        step_outs = engine.step()
        now = time.perf_counter()
        steps += 1
        for out in step_outs:
            if out.outputs and out.outputs[0].token_ids and out.request_id not in first:
                first[out.request_id] = now
            if out.finished:
                outs[int(out.request_id.rsplit("-", 1)[1])] = out
                in_flight -= 1
    wall = time.perf_counter() - t0
    rows = [list(outs[i].outputs[0].token_ids) for i in range(len(prompts))]
    ttft = [1e3 * (first[r] - submitted[r]) for r in submitted]
    n_prompt, n_out = sum(map(len, prompts)), sum(map(len, rows))
    return {"concurrency": c, "wall_s": wall, "steps": steps, "prompt_tokens": n_prompt,
            "output_tokens": n_out, "output_tok_s": n_out / wall,
            "total_tok_s": (n_prompt + n_out) / wall, "ttft_mean_ms": statistics.fmean(ttft),
            "step_mean_ms": 1e3 * wall / steps, "output_ids": rows}


def engine_isa(llm, dtype: str, torch, loaded_libraries) -> dict:
    """Which of vLLM's kernel libraries the engine's processes mapped, and the attention ISA
    vLLM picks for this model here (the same call its CPU attention backend makes)."""
    out = {"libraries": loaded_libraries(os.getpid(), "/vllm/_C")}
    try:
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

        cfg = llm.llm_engine.vllm_config
        block = cfg.cache_config.block_size or 128
        head = cfg.model_config.get_head_size()
        out["attention_isa"] = _get_attn_isa(getattr(torch, dtype), block, head)
        out["block_size"] = block
    except Exception as e:  # noqa: BLE001 - vLLM internals move; a note, not a failure
        out["attention_isa"] = f"unknown ({e!r:.80})"
    return out


def main(job_path: str) -> None:
    job = json.loads(pathlib.Path(job_path).read_text())
    threads = int(job.get("threads") or os.cpu_count() or 1)
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{threads - 1}")
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
    try:
        import vllm
        from vllm import LLM, SamplingParams
        from vllm.inputs import TokensPrompt
    except ImportError as e:
        sys.exit(f"vllm_worker needs vLLM (for CPU: the vllm-cpu package) in this python: {e}. "
                 "Run it with --vllm-python PATH.")
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
    import torch
    from cpu_class import loaded_libraries, torch_isa
    from hf_worker import build_hf_dir

    n, prompts, cs = int(job["max_new_tokens"]), job["prompts"], job["concurrency"]
    hf_dir = build_hf_dir(pathlib.Path(job["gguf"]), pathlib.Path(job["cache_dir"]))
    max_len = max(map(len, prompts)) + n
    params = SamplingParams(temperature=0.0, max_tokens=n, min_tokens=n, ignore_eos=True)
    env_keys = ("VLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_NUM_OF_RESERVED_CPU",
                "VLLM_CPU_KVCACHE_SPACE")
    result = {"hf_dir": str(hf_dir), "versions": {"vllm": vllm.__version__},
              "env": {k: os.environ[k] for k in env_keys}, "runs": [],
              "isa": {"torch": torch_isa(torch), "engines": {}}}
    for dtype in job["dtypes"]:
        t0 = time.perf_counter()
        llm = LLM(model=str(hf_dir), dtype=dtype, max_model_len=max(1024, max_len),
                  max_num_seqs=max(cs), enable_prefix_caching=False)
        engine = llm.llm_engine
        result["isa"]["engines"][dtype] = engine_isa(llm, dtype, torch, loaded_libraries)
        log(f"{dtype}: {result['isa']['engines'][dtype]}")
        warmup = SamplingParams(temperature=0.0, max_tokens=2)
        closed_loop(engine, prompts[:1], 1, warmup, f"warmup-{dtype}", TokensPrompt)
        startup = time.perf_counter() - t0
        for c in cs:
            load0 = os.getloadavg()
            run = closed_loop(engine, prompts, c, params, f"c{c}-{dtype}", TokensPrompt)
            run.update(dtype=dtype, startup_s=startup, load_avg_before=load0, load_avg_after=os.getloadavg())
            result["runs"].append(run)
            log(f"{dtype} c={c}: {run['output_tok_s']:.1f} output tok/s, wall {run['wall_s']:.1f}s")
        del llm, engine
        gc.collect()
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    main(sys.argv[1])
