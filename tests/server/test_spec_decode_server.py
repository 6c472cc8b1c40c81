"""Speculative decoding over HTTP (a tiny model, the app in-process): `--speculative-config`'s
engine streams several tokens per step where drafts are accepted, with the same text, tokens
and log-probs as without streaming, and /metrics serves vLLM's speculative-decoding series as
`vllm bench serve` reads them (names, labels, a `position` per draft position), equal to the
drafts and acceptances the runner's steps had."""

from __future__ import annotations

import json

from starlette.testclient import TestClient

from tests.model_dirs import write_model_dir
from tests.server.conftest import app_config

K = 4
PROMPT = "w9 w10 w11 w9 w10 w11 w9 w50 w50 w53 w18 w91 w18 w91 w18"


def _families(text: str) -> dict:
    from prometheus_client.parser import text_string_to_metric_families

    return {f.name: f for f in text_string_to_metric_families(text) if f.name.startswith("vllm:spec_decode")}


def _values(family) -> dict[str, float]:
    """{position or "": value} of a counter family's _total samples, each labelled as vLLM does."""
    out = {}
    for sample in family.samples:
        if sample.name.endswith("_total"):
            assert sample.labels.pop("model_name") == "tiny" and sample.labels.pop("engine") == "0", sample
            out[sample.labels.pop("position", "")] = sample.value
            assert not sample.labels, sample  # no other label
    return out


def test_speculative_decoding_over_http(tmp_path, compile_cache_dir):
    from jaxserve.config import EngineConfig
    from jaxserve.engine.setup import build_engine
    from jaxserve.server.app import build_app
    from jaxserve.engine.async_client import AsyncEngineClient

    parts = build_engine(EngineConfig.from_kwargs(
        model=str(write_model_dir(tmp_path / "m")), dtype="float32", max_num_seqs=8, max_num_batched_tokens=64,
        token_buckets=(16, 64), request_buckets=(8,), compilation_cache_dir=compile_cache_dir, show_progress=False,
        speculative_config={"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_min": 1}))
    # The engine's own count of each step's drafts and acceptances, at the runner.
    runner, counted = parts.model_runner, {"drafts": 0, "draft_tokens": 0, "accepted": 0, "per_pos": [0] * K}
    collect = runner.collect

    def counting_collect(step):
        out = collect(step)
        for rid, drafts in step.plan.drafts.items():
            accepted = len(out.sampled[rid]) - 1
            counted["drafts"] += 1
            counted["draft_tokens"] += len(drafts)
            counted["accepted"] += accepted
            for j in range(accepted):
                counted["per_pos"][j] += 1
        return out

    runner.collect = counting_collect
    app = build_app(AsyncEngineClient.in_thread(parts), app_config(served_model_name=("tiny",)))
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 24, "temperature": 0, "logprobs": 2,
            "ignore_eos": True, "return_token_ids": True}
    with TestClient(app) as client:
        full = client.post("/v1/completions", json=body)
        assert full.status_code == 200, full.text
        whole = full.json()["choices"][0]
        chunks = []
        with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    chunks.append(json.loads(line[6:])["choices"][0])
        streamed = [c for c in chunks if c.get("token_ids")]
        assert "".join(c["text"] for c in chunks) == whole["text"]
        assert [t for c in streamed for t in c["token_ids"]] == whole["token_ids"] and len(whole["token_ids"]) == 24
        assert [t for c in streamed for t in c["logprobs"]["tokens"]] == whole["logprobs"]["tokens"]
        assert max(len(c["token_ids"]) for c in streamed) > 1  # accepted drafts arrive together
        families = _families(client.get("/metrics").text)
    assert sorted(families) == [f"vllm:spec_decode_{n}" for n in ("num_accepted_tokens", "num_accepted_tokens_per_pos",
                                                                  "num_draft_tokens", "num_drafts")]
    assert all(f.type == "counter" for f in families.values())
    served = {name.removeprefix("vllm:spec_decode_"): _values(f) for name, f in families.items()}
    assert served["num_drafts"] == {"": counted["drafts"]}
    assert served["num_draft_tokens"] == {"": counted["draft_tokens"]}
    assert served["num_accepted_tokens"] == {"": counted["accepted"]}
    assert served["num_accepted_tokens_per_pos"] == {str(j): n for j, n in enumerate(counted["per_pos"])}
    assert 0 < counted["accepted"] < counted["draft_tokens"] and counted["per_pos"][1] > 0
