"""lm-eval's `local-completions` model against `jaxserve serve`, per item against transformers.

lm-eval scores log-likelihood tasks through an OpenAI-compatible server with one request shape:
the context and continuation token ids, `echo`, `logprobs: 1`, `max_tokens: 1`; it sums the
returned log-probs of the continuation's tokens and calls an item greedy when each of them is
the top one. This script runs exactly that, offline, on a small local task built from the
golden cases (tests/data/smollm2_public.json: the default model's prompts, each split into a
context and a continuation of its last `--continuation-tokens` tokens), and compares every
item's log-likelihood and greediness with transformers' (float32, the same converted
checkpoint, the same token ids lm-eval sent).

It needs a Python with lm-eval, torch (CPU) and transformers (the project venv has no torch):

    python -m venv /tmp/lmeval && /tmp/lmeval/bin/pip install torch==2.13.0 "lm-eval[api]" transformers
    /tmp/lmeval/bin/python benchmarks/lm_eval_parity.py [--jaxserve .venv/bin/jaxserve]

`jaxserve serve` (float32) is started by the script behind a small recording proxy, so the
request bodies lm-eval sent are kept; `--record FILE` writes one of them (with each item's
context length and lm-eval's greedy flag) for tests/server/test_openai_api.py to replay.
One JSON line goes to benchmarks/results/lm_eval_parity.jsonl.
"""

from __future__ import annotations

import argparse
import http.server
import json
import os
import pathlib
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

from results_log import append_results

ROOT = pathlib.Path(__file__).resolve().parent.parent
GOLDEN = ROOT / "tests" / "data" / "smollm2_public.json"
RESULTS = ROOT / "benchmarks" / "results" / "lm_eval_parity.jsonl"
MODEL_NAME = "SmolLM2-135M-Instruct"

TASK_YAML = """\
task: jaxserve_golden_loglikelihood
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: loglikelihood
doc_to_text: "{{{{context}}}}"
doc_to_target: "{{{{continuation}}}}"
target_delimiter: ""
metric_list:
  - metric: perplexity
  - metric: acc
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RecordingProxy(http.server.ThreadingHTTPServer):
    """Forwards every request to `upstream` and keeps (path, request body, response body)."""

    def __init__(self, upstream: str):
        self.upstream = upstream
        self.exchanges: list[tuple[str, dict | None, dict | None]] = []
        super().__init__(("127.0.0.1", free_port()), _ProxyHandler)


class _ProxyHandler(http.server.BaseHTTPRequestHandler):
    def _forward(self, method: str) -> None:
        n = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(n) if n else None
        req = urllib.request.Request(self.server.upstream + self.path, data=body, method=method,
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=600) as r:
                status, payload = r.status, r.read()
        except urllib.error.HTTPError as e:
            status, payload = e.code, e.read()
        try:
            self.server.exchanges.append((self.path, json.loads(body) if body else None, json.loads(payload)))
        except ValueError:
            pass
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def do_GET(self):  # noqa: N802
        self._forward("GET")

    def do_POST(self):  # noqa: N802
        self._forward("POST")

    def log_message(self, *args):
        pass


def start_server(jaxserve: str, port: int, log: pathlib.Path) -> subprocess.Popen:
    proc = subprocess.Popen([jaxserve, "serve", "--port", str(port), "--dtype", "float32",
                             "--max-num-seqs", "8", "--max-model-len", "1024"],
                            stdout=log.open("w"), stderr=subprocess.STDOUT)
    deadline = time.time() + 600
    while time.time() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"jaxserve serve exited ({proc.returncode}); see {log}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if r.status == 200:
                    return proc
        except OSError:
            pass
        time.sleep(1)
    proc.kill()
    raise SystemExit("jaxserve serve did not become healthy in 10 minutes")


def model_dir(jaxserve: str) -> pathlib.Path:
    """The converted default model (the checkpoint jaxserve serves), via jaxserve's own Python."""
    python = pathlib.Path(jaxserve).parent / "python"
    out = subprocess.run([str(python), "-c", "from jaxserve.models.loader import resolve_model;"
                          "print(resolve_model(None))"], check=True, capture_output=True, text=True)
    return pathlib.Path(out.stdout.strip().splitlines()[-1])


def task_docs(tokenizer, continuation_tokens: int) -> list[dict]:
    """Each golden case's prompt text split into a context and its last tokens."""
    docs = []
    for case in json.loads(GOLDEN.read_text())["cases"]:
        ids = case["prompt_token_ids"]
        ctx = tokenizer.decode(ids[: len(ids) - continuation_tokens])
        docs.append({"name": case["name"], "context": ctx, "continuation": case["text"][len(ctx):]})
    return docs


def encode_pair(tokenizer, context: str, continuation: str) -> tuple[list[int], int]:
    """The token ids lm-eval sends for (context, continuation) and the context's length in them
    (its causal-model rule: trailing spaces move to the continuation, the whole text is encoded
    and split after the context's own encoding)."""
    n = len(context) - len(context.rstrip())
    if n:
        context, continuation = context[:-n], context[-n:] + continuation
    whole = tokenizer(context + continuation, add_special_tokens=False).input_ids
    return whole, len(tokenizer(context, add_special_tokens=False).input_ids)


def hf_loglikelihood(model, ids: list[int], ctxlen: int) -> tuple[float, bool]:
    import torch

    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float()
    lps = torch.log_softmax(logits, -1)
    cont = torch.tensor(ids[ctxlen:])
    rows = lps[ctxlen - 1: len(ids) - 1]
    ll = rows.gather(1, cont[:, None]).sum().item()
    greedy = bool((rows.argmax(-1) == cont).all())
    return ll, greedy


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--jaxserve", default=str(ROOT / ".venv" / "bin" / "jaxserve"))
    ap.add_argument("--continuation-tokens", type=int, default=6)
    ap.add_argument("--batch-size", type=int, default=3, help="lm-eval's requests per HTTP call")
    ap.add_argument("--tolerance", type=float, default=2e-3, help="per-item |log-likelihood difference| allowed")
    ap.add_argument("--record", type=pathlib.Path, help="write one recorded request body (tests replay it)")
    args = ap.parse_args()

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    import lm_eval
    import torch
    from lm_eval.tasks import TaskManager
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(2)
    path = model_dir(args.jaxserve)
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    work = pathlib.Path(tempfile.mkdtemp(prefix="lm-eval-parity-"))
    docs = task_docs(tokenizer, args.continuation_tokens)
    (work / "docs.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    (work / "task.yaml").write_text(TASK_YAML.format(data=work / "docs.jsonl"))

    port = free_port()
    server = start_server(args.jaxserve, port, work / "server.log")
    proxy = RecordingProxy(f"http://127.0.0.1:{port}")
    threading.Thread(target=proxy.serve_forever, daemon=True).start()
    try:
        t0 = time.time()
        results = lm_eval.simple_evaluate(
            model="local-completions",
            model_args=(f"model={MODEL_NAME},base_url=http://127.0.0.1:{proxy.server_address[1]}/v1/completions,"
                        f"tokenizer_backend=huggingface,tokenizer={path},num_concurrent=1,max_retries=1"),
            tasks=["jaxserve_golden_loglikelihood"], task_manager=TaskManager(include_path=str(work)),
            log_samples=True, batch_size=args.batch_size)
        seconds = time.time() - t0
    finally:
        proxy.shutdown()
        server.terminate()
        server.wait(timeout=60)

    samples = results["samples"]["jaxserve_golden_loglikelihood"]
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    rows, worst = [], 0.0
    for s in samples:
        context, continuation = s["arguments"][0][0], s["arguments"][0][1]
        ll, greedy = s["resps"][0][0]
        ids, ctxlen = encode_pair(tokenizer, context, continuation)
        ref_ll, ref_greedy = hf_loglikelihood(hf, ids, ctxlen)
        worst = max(worst, abs(ll - ref_ll))
        rows.append({"name": s["doc"]["name"], "tokens": len(ids), "continuation_tokens": len(ids) - ctxlen,
                     "jaxserve": ll, "transformers": ref_ll, "diff": ll - ref_ll,
                     "greedy": [bool(greedy), ref_greedy]})

    print(f"{'item':16} {'tokens':>6} {'cont':>4} {'jaxserve':>12} {'transformers':>12} {'diff':>9} greedy")
    for r in rows:
        print(f"{r['name']:16} {r['tokens']:6d} {r['continuation_tokens']:4d} {r['jaxserve']:12.5f} "
              f"{r['transformers']:12.5f} {r['diff']:9.1e} {r['greedy'][0]}/{r['greedy'][1]}")
    ok = worst <= args.tolerance and all(r["greedy"][0] == r["greedy"][1] for r in rows)
    print(f"max |diff| {worst:.2e} over {len(rows)} items ({'PASS' if ok else 'FAIL'}); lm-eval took {seconds:.1f} s")

    calls = [(b, r) for p, b, r in proxy.exchanges if p.startswith("/v1/completions") and b]
    if args.record:
        body, _ = max(calls, key=lambda c: len(c[0]["prompt"]))
        items = []
        for ids in body["prompt"]:
            row = next(r for r, s in zip(rows, samples) if encode_pair(tokenizer, *s["arguments"][0][:2])[0] == ids)
            items.append({"ctxlen": row["tokens"] - row["continuation_tokens"], "is_greedy": row["greedy"][1]})
        args.record.write_text(json.dumps({"source": f"lm-eval {lm_eval.__version__} local-completions, "
                                                     "loglikelihood request body (model name replaced on replay)",
                                           "body": body, "items": items}, indent=1) + "\n")
        print(f"recorded one request body ({len(body['prompt'])} prompts) in {args.record}")

    sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    shape = {k: v for k, v in calls[0][0].items() if k != "prompt"} if calls else None
    append_results(RESULTS, {"git": sha, "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                             "lm_eval": lm_eval.__version__, "torch": torch.__version__,
                             "request_shape": shape, "items": rows, "max_abs_diff": worst,
                             "pass": ok})
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
