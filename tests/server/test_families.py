"""`jaxserve serve` on each new family's tiny fixture answers a chat completion: the fixture's
weights with a word-level tokenizer sized to its vocabulary and a plain chat template
(tests/model_dirs.py), an engine with two token buckets, the app in-process."""

from __future__ import annotations

import pytest
from starlette.testclient import TestClient

from tests.model_dirs import write_model_dir
from tests.server.conftest import app_config

FAMILIES = ["gemma2", "gemma3", "phi3", "qwen2_sliding", "mixtral", "qwen3_moe"]


@pytest.mark.parametrize("family", FAMILIES)
def test_family_serves_a_chat_completion(family, data_dir, tmp_path, compile_cache_dir):
    from jaxserve.config import EngineConfig
    from jaxserve.engine.setup import build_engine
    from jaxserve.server.app import build_app
    from jaxserve.engine.async_client import AsyncEngineClient

    model = write_model_dir(tmp_path / family, family)
    parts = build_engine(EngineConfig.from_kwargs(
        model=str(model), dtype="float32", max_num_seqs=8, max_num_batched_tokens=64, token_buckets=(16, 64),
        request_buckets=(8,), max_model_len=32, num_pages=32, page_size=8,
        compilation_cache_dir=compile_cache_dir, show_progress=False))
    app = build_app(AsyncEngineClient.in_thread(parts), app_config(served_model_name=(family,)))
    with TestClient(app) as client:
        r = client.post("/v1/chat/completions", json={
            "model": family, "max_tokens": 5, "temperature": 0,
            "messages": [{"role": "user", "content": "w5 w6 w7 w8 w9 w10"}]})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["choices"][0]["message"]["role"] == "assistant"
        assert body["usage"]["completion_tokens"] >= 1
        assert body["usage"]["prompt_tokens"] >= 4  # (transformers may pick the family's tokenizer class)
