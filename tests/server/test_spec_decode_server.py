"""Speculative decoding over HTTP (a tiny model, the app in-process): `--speculative-config`'s
engine streams several tokens per step where drafts are accepted, with the same text, tokens
and log-probs as without streaming, and /metrics counts drafts and accepted tokens."""

from __future__ import annotations

import json
import re

from starlette.testclient import TestClient

from tests.model_dirs import write_model_dir
from tests.server.conftest import app_config

PROMPT = "w9 w10 w11 w9 w10 w11 w9 w50 w50 w53 w18 w91 w18 w91 w18"


def _metric(text: str, name: str) -> float:
    return float(re.search(rf"^vllm:{name}\{{[^}}]*\}} (\S+)$", text, re.MULTILINE).group(1))


def test_speculative_decoding_over_http(tmp_path, compile_cache_dir):
    from jaxserve.config import EngineConfig
    from jaxserve.engine.setup import build_engine
    from jaxserve.server.app import build_app
    from jaxserve.engine.async_client import AsyncEngineClient

    parts = build_engine(EngineConfig.from_kwargs(
        model=str(write_model_dir(tmp_path / "m")), dtype="float32", max_num_seqs=8, max_num_batched_tokens=64,
        token_buckets=(16, 64), request_buckets=(8,), compilation_cache_dir=compile_cache_dir, show_progress=False,
        speculative_config='{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1}'))
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
        metrics = client.get("/metrics").text
        accepted = _metric(metrics, "spec_decode_num_accepted_tokens_total")
        assert 0 < accepted < _metric(metrics, "spec_decode_num_draft_tokens_total")
        assert _metric(metrics, "spec_decode_num_drafts_total") > 0
