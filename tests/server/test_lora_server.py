"""LoRA adapters over HTTP: --lora-modules adapters are models (parent = the base) that a request
picks by "model", an unknown model is a 404 as in vLLM, adapters are loaded and unloaded at
runtime (--allow-runtime-lora-updating), and vllm:lora_requests_info names them."""

from __future__ import annotations

import pytest
from safetensors.numpy import load_file
from starlette.testclient import TestClient

from tests.engine.test_lora import LORA_OPTIONS
from tests.model_dirs import write_model_dir
from tests.server.conftest import app_config


@pytest.fixture(scope="module")
def client(data_dir, tmp_path_factory, compile_cache_dir):
    from jaxserve.config import EngineConfig
    from jaxserve.engine.async_client import AsyncEngineClient
    from jaxserve.engine.setup import build_engine
    from jaxserve.server.app import build_app

    model = write_model_dir(tmp_path_factory.mktemp("lora") / "llama", "llama")
    parts = build_engine(
        EngineConfig.from_kwargs(
            model=str(model), compilation_cache_dir=compile_cache_dir, **LORA_OPTIONS)
    )
    app = build_app(
        AsyncEngineClient.in_thread(parts),
        app_config(
            served_model_name=("base",),
            lora_modules=(f"a={data_dir / 'lora' / 'llama' / 'a'}",),
            allow_runtime_lora_updating=True,
        ),
    )
    with TestClient(app) as c:
        yield c


def _greedy(client, model):
    r = client.post(
        "/v1/completions",
        json={"model": model, "prompt": PROMPT, "max_tokens": 8, "min_tokens": 8, "temperature": 0},
    )
    return r


def _expected(data_dir, name, client) -> str:
    ids = load_file(str(data_dir / "lora" / "llama" / name / "expected.safetensors"))[
        "greedy"
    ].tolist()
    return client.app.state.engine.tokenizer.decode(ids)


PROMPT = [1, 17, 45, 3, 99, 100, 7, 7, 64, 12, 120, 5]


def test_adapters_are_models_picked_by_name(client, data_dir):
    models = {m["id"]: m for m in client.get("/v1/models").json()["data"]}
    assert set(models) == {"base", "a"} and models["a"]["parent"] == "base"
    r = _greedy(client, "a")
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"].strip() == _expected(data_dir, "a", client)
    assert _greedy(client, "base").json()["choices"][0]["text"] != r.json()["choices"][0]["text"]
    r = _greedy(client, "nope")
    assert (
        r.status_code == 404 and "The model 'nope' does not exist" in r.json()["error"]["message"]
    )
    metrics = client.get("/metrics").text
    assert (
        'vllm:lora_requests_info{max_lora="2",running_lora_adapters="",waiting_lora_adapters=""}'
        in metrics
    )


def test_load_and_unload_at_runtime(client, data_dir):
    path = str(data_dir / "lora" / "llama" / "b")
    r = client.post("/v1/load_lora_adapter", json={"lora_name": "b", "lora_path": path})
    assert r.status_code == 200 and "added successfully" in r.text
    assert (
        client.post("/v1/load_lora_adapter", json={"lora_name": "b", "lora_path": path}).status_code
        == 400
    )
    bad = client.post("/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "/nowhere"})
    assert bad.status_code == 400 and "adapter_config.json" in bad.json()["error"]["message"]
    # (the engine of tests/engine/test_lora.py: its executables come from the cache)
    for name in ("b", "a", "b"):
        r = _greedy(client, name)
        assert r.status_code == 200 and r.json()["choices"][0]["text"].strip() == _expected(
            data_dir, name, client
        )
    assert client.post("/v1/unload_lora_adapter", json={"lora_name": "b"}).status_code == 200
    assert _greedy(client, "b").status_code == 404
    assert client.post("/v1/unload_lora_adapter", json={"lora_name": "b"}).status_code == 404
    assert client.app.state.engine.stats.recompiles == 0
