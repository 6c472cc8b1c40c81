"""Quantized checkpoints written by the tools against their tool's own dequantization, through
the engine (`jaxserve.LLM`, float32, weight-only on the CPU): prompt log-probs and greedy tokens.

Each DIR is a checkpoint with `reference.safetensors` beside it (scripts/make_quant_fixtures.py:
the tiny fixtures in tests/data/quant/, or the default model quantized with `--default-model`).
The reference is a float checkpoint made here from the same directory: its float tensors, the
decoder weights as the tool dequantized them, no quantization_config. Both are scored by
teacher forcing over the same texts (prompt log-probs of every token) and generate greedily:
the default model's golden cases (tests/data/smollm2_public.json: prompt + completion), or for
the tiny fixtures a few ASCII sentences. One JSON line per checkpoint and mesh goes to
benchmarks/results/quant_parity.jsonl.

    python benchmarks/quant_parity.py DIR [DIR ...] [--tp 1 2] [--cases 8] [--serve]

--tp 2 splits both models over two devices (on the CPU: two host devices, set here).
--serve runs each model under `jaxserve serve` and asks /v1/completions instead (the token
ids as the prompt; echo + logprobs for the prompt log-probs; greedy completions).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import shutil
import sys
import tempfile

import numpy as np

from results_log import append_results

HERE = pathlib.Path(__file__).resolve().parent
RESULTS = HERE / "results" / "quant_parity.jsonl"
TEXTS = ["Quantization keeps the model small.", "jaxserve serves models",
         "The quick brown fox jumps over the lazy dog.", "Rain fell on the old stone bridge."]
QUANT_SUFFIXES = ("_scale", "_zero_point", "weight_shape", "g_idx", "qweight", "qzeros", "scales")


def reference_checkpoint(path: pathlib.Path, out: pathlib.Path) -> pathlib.Path:
    """A float checkpoint in `out`: `path`'s float tensors with reference.safetensors' weights."""
    from jaxserve.models.loader import load_checkpoint
    from jaxserve.models.safetensors_io import PlannedTensor, write_streaming
    from safetensors.numpy import load_file

    ckpt = load_checkpoint(path)
    reference = load_file(str(path / "reference.safetensors"))
    tensors = {}
    for name in ckpt.tensor_names():
        _, dtype = ckpt.tensor_info(name)
        if name.endswith(".weight") and dtype in (np.float32, np.float16) and name not in reference:
            tensors[name] = lambda name=name: np.asarray(ckpt.get_tensor(name), np.float32)
    tensors.update({k: (lambda v=v: v) for k, v in reference.items()})
    out.mkdir(parents=True, exist_ok=True)
    config = dict(ckpt.config)
    config.pop("quantization_config", None)
    (out / "config.json").write_text(json.dumps(config))
    for f in path.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "chat_template", "generation_config")):
            shutil.copy(f, out / f.name)
    planned = [PlannedTensor(k, np.dtype(np.float32), _shape(ckpt, reference, k), fn)
               for k, fn in sorted(tensors.items())]
    write_streaming(out / "model.safetensors", planned)
    return out


def _shape(ckpt, reference, name):
    return reference[name].shape if name in reference else ckpt.tensor_info(name)[0]


def cases_for(path: pathlib.Path, n: int) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, completion ids) to score and generate."""
    config = json.loads((path / "config.json").read_text())
    if config["vocab_size"] > 1000:
        golden = json.loads((HERE.parent / "tests" / "data" / "smollm2_public.json").read_text())
        return [(c["prompt_token_ids"], c["completion_token_ids"]) for c in golden["cases"][:n]]
    return [(list(t.encode("ascii"))[:8], list(t.encode("ascii"))[8:]) for t in TEXTS[:n]]


def run(path: pathlib.Path, cases, tp: int) -> tuple[list[float], list[list[int]], str]:
    """Prompt log-probs of every scored token and the greedy completions, one engine."""
    from jaxserve import LLM, SamplingParams

    llm = LLM(str(path), dtype="float32", tensor_parallel_size=tp, max_num_seqs=8,
              max_num_batched_tokens=512, token_buckets=(16, 512), request_buckets=(8,),
              show_progress=False)
    scored = [p + c for p, c in cases]
    outs = llm.generate(scored, SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0),
                        use_tqdm=False)
    logprobs = [out.prompt_logprobs[j][ids[j]].logprob
                for out, ids in zip(outs, scored) for j in range(1, len(ids))]
    gen = llm.generate([p for p, _ in cases],
                       [SamplingParams(temperature=0.0, max_tokens=len(c), ignore_eos=True)
                        for _, c in cases], use_tqdm=False)
    del llm
    from jaxserve.models.arch_config import ArchConfig

    fmt = ArchConfig.from_hf(json.loads((path / "config.json").read_text())).weight_format
    return logprobs, [list(o.outputs[0].token_ids) for o in gen], fmt.describe() if fmt else "float"


def serve_run(path: pathlib.Path, cases, tp: int) -> tuple[list[float], list[list[int]], str]:
    """`run` through `jaxserve serve` (a subprocess on a loopback port): /v1/completions with
    the token ids as the prompt, echo and logprobs for the prompt log-probs, then greedy."""
    import socket
    import subprocess
    import time
    import urllib.request

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    base = f"http://127.0.0.1:{port}"
    cmd = [str(pathlib.Path(sys.executable).parent / "jaxserve"), "serve", str(path), "--dtype",
           "float32", "--port", str(port), "--tensor-parallel-size", str(tp), "--max-model-len",
           "1024", "--max-num-seqs", "8", "--served-model-name", "m"]
    log = tempfile.NamedTemporaryFile("w+", prefix="quant-parity-serve-", suffix=".log", delete=False)
    server = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ))

    def post(body):
        req = urllib.request.Request(base + "/v1/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
        return json.load(urllib.request.urlopen(req, timeout=600))["choices"][0]

    try:
        deadline = time.monotonic() + 1800
        while True:
            try:
                urllib.request.urlopen(base + "/health", timeout=2)
                break
            except OSError:
                if server.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"jaxserve serve did not start: {pathlib.Path(log.name).read_text()[-2000:]}")
                time.sleep(1)
        logprobs, completions = [], []
        for prompt, completion in cases:
            scored = post({"model": "m", "prompt": prompt + completion, "max_tokens": 1,
                           "temperature": 0, "echo": True, "logprobs": 0})
            logprobs += [lp for lp in scored["logprobs"]["token_logprobs"][1:len(prompt + completion)]]
            gen = post({"model": "m", "prompt": prompt, "max_tokens": len(completion),
                        "temperature": 0, "ignore_eos": True, "return_token_ids": True})
            completions.append(list(gen.get("token_ids") or []) or [gen["text"]])
    finally:
        server.terminate()
        server.wait(120)
    print(f"  {path.name}: {pathlib.Path(log.name).read_text().count('weight-only')} start-up "
          f"lines saying weight-only (log {log.name})", flush=True)
    from jaxserve.models.arch_config import ArchConfig

    fmt = ArchConfig.from_hf(json.loads((path / "config.json").read_text())).weight_format
    return logprobs, completions, fmt.describe() if fmt else "float"


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("dirs", nargs="+", type=pathlib.Path)
    p.add_argument("--tp", nargs="+", type=int, default=[1])
    p.add_argument("--cases", type=int, default=8)
    p.add_argument("--serve", action="store_true",
                   help="through `jaxserve serve` (HTTP, one server at a time) instead of LLM")
    p.add_argument("--results", default=str(RESULTS))
    args = p.parse_args(argv)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    if max(args.tp) > 1:
        flags = os.environ.get("XLA_FLAGS", "")
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={max(args.tp)}"
    rows = []
    for d in args.dirs:
        cases = cases_for(d, args.cases)
        with tempfile.TemporaryDirectory(prefix="quant-reference-") as tmp:
            ref_dir = reference_checkpoint(d, pathlib.Path(tmp) / "reference")
            for tp in args.tp:
                runner = serve_run if args.serve else run
                want, want_gen, _ = runner(ref_dir, cases, tp)
                got, got_gen, fmt = runner(d, cases, tp)
                diff = np.abs(np.asarray(got) - np.asarray(want))
                rows.append({"checkpoint": d.name, "format": fmt, "tp": tp,
                             "path": "jaxserve serve" if args.serve else "LLM",
                             "scored_tokens": len(diff),
                             "max_abs_dlogprob": float(diff.max()),
                             "mean_abs_dlogprob": float(diff.mean()),
                             "greedy_identical": f"{sum(a == b for a, b in zip(got_gen, want_gen))}"
                                                 f"/{len(cases)}"})
                print(json.dumps(rows[-1]), flush=True)
    stamp = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    if args.results:
        append_results(args.results, [{"benchmark": "quant_parity", **r, "timestamp": stamp}
                                      for r in rows])
    print(f"\n{'checkpoint':28} {'tp':>3} {'tokens':>7} {'max |dlp|':>10} {'mean |dlp|':>11} {'greedy':>7}")
    for r in rows:
        print(f"{r['checkpoint']:28} {r['tp']:3d} {r['scored_tokens']:7d} {r['max_abs_dlogprob']:10.2e} "
              f"{r['mean_abs_dlogprob']:11.2e} {r['greedy_identical']:>7}")


if __name__ == "__main__":
    sys.exit(main())
