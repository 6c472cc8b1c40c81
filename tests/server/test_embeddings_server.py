"""POST /v1/embeddings over HTTP (tiny models, the app in-process): OpenAI's input forms, float
and base64 encodings, Matryoshka dimensions, usage, and the errors (4xx in the envelope)."""

from __future__ import annotations

import base64

import httpx
import numpy as np
import openai
import pytest
from starlette.testclient import TestClient

from tests.live_server import LiveServer, free_port
from tests.model_dirs import write_model_dir
from tests.server.conftest import app_config

OPTIONS = dict(dtype="float32", max_model_len=32, max_num_seqs=4, token_buckets=(16, 32),
               request_buckets=(4,), show_progress=False)


def _app(model_dir, compile_cache_dir, **options):
    from jaxserve.config import EngineConfig
    from jaxserve.engine.async_client import AsyncEngineClient
    from jaxserve.engine.setup import build_engine
    from jaxserve.server.app import build_app

    config = EngineConfig.from_kwargs(model=str(model_dir), compilation_cache_dir=compile_cache_dir,
                                      **OPTIONS, **options)
    parts = build_engine(config)
    return build_app(AsyncEngineClient.in_thread(parts), app_config(served_model_name=("tiny",)))


@pytest.fixture(scope="module")
def server(tmp_path_factory, compile_cache_dir):
    model_dir = write_model_dir(tmp_path_factory.mktemp("m"), "qwen3")
    with LiveServer(_app(model_dir, compile_cache_dir, runner="pooling"), free_port()) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    with httpx.Client(base_url=server.base_url, timeout=300) as c:
        yield c


def _vectors(response) -> np.ndarray:
    assert response.status_code == 200, response.text
    return np.asarray([d["embedding"] for d in response.json()["data"]], np.float64)


def test_input_forms_and_usage(client):
    one = client.post("/v1/embeddings", json={"model": "tiny", "input": "w5 w6 w7"})
    body = one.json()
    assert body["object"] == "list" and body["model"] == "tiny"
    assert [(d["object"], d["index"]) for d in body["data"]] == [("embedding", 0)]
    assert len(body["data"][0]["embedding"]) == 64
    ids = client.post("/tokenize", json={"prompt": "w5 w6 w7"}).json()["tokens"]
    assert body["usage"]["prompt_tokens"] == body["usage"]["total_tokens"] == len(ids)
    forms = {"strings": ["w5 w6 w7", "w9 w10"], "ids": ids, "id lists": [ids, [9, 10]]}
    by_form = {name: client.post("/v1/embeddings", json={"input": x}) for name, x in forms.items()}
    vec = _vectors(one)[0]
    np.testing.assert_allclose(_vectors(by_form["ids"])[0], vec, atol=1e-6)
    np.testing.assert_allclose(_vectors(by_form["strings"])[0], vec, atol=1e-6)
    np.testing.assert_allclose(_vectors(by_form["id lists"])[0], vec, atol=1e-6)
    assert by_form["id lists"].json()["usage"]["prompt_tokens"] == len(ids) + 2
    assert [d["index"] for d in by_form["strings"].json()["data"]] == [0, 1]
    np.testing.assert_allclose(np.linalg.norm(vec), 1.0, atol=1e-5)


def test_base64_round_trip(client):
    plain = _vectors(client.post("/v1/embeddings", json={"input": ["w5 w6", "w7"]}))
    body = {"input": ["w5 w6", "w7"], "encoding_format": "base64"}
    b64 = client.post("/v1/embeddings", json=body)
    assert b64.status_code == 200, b64.text
    decoded = [np.frombuffer(base64.b64decode(d["embedding"]), "<f4") for d in b64.json()["data"]]
    np.testing.assert_array_equal(np.asarray(decoded), plain.astype(np.float32))


def test_dimensions_truncate_and_renormalize(client):
    full = _vectors(client.post("/v1/embeddings", json={"input": "w5 w6 w7"}))[0]
    short = _vectors(client.post("/v1/embeddings", json={"input": "w5 w6 w7", "dimensions": 8}))[0]
    assert short.shape == (8,)
    np.testing.assert_allclose(short, full[:8] / np.linalg.norm(full[:8]), rtol=1e-5)


@pytest.mark.parametrize("body, status, words", [
    ({"input": "w5", "dimensions": 65}, 400, "hidden size 64"),
    ({"input": "w5", "dimensions": 0}, 400, "dimensions"),
    ({"input": []}, 400, "empty"),
    ({"input": ""}, 400, "empty"),
    ({"input": [5, 500]}, 400, "vocabulary"),
    ({"input": [[5], [-1]]}, 400, "vocabulary"),
    ({"input": " ".join(["w5"] * 40)}, 400, "context length"),
    ({"input": "w5", "encoding_format": "hex"}, 400, "encoding_format"),
    ({"input": [1.5]}, 400, "input"),
    ({"input": ["w5", [5]]}, 400, "input"),
    ({}, 400, "input"),
    ({"input": "w5", "model": "other"}, 404, "does not exist"),
])
def test_errors_are_4xx_in_the_envelope(client, body, status, words):
    r = client.post("/v1/embeddings", json=body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert words in error["message"] and error["code"] == status


def test_the_openai_sdk(server, client):
    """The SDK asks for base64 by default and decodes it; `dimensions` passes through."""
    sdk = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)
    r = sdk.embeddings.create(model="tiny", input=["w5 w6 w7", "w9"], dimensions=32)
    assert [len(d.embedding) for d in r.data] == [32, 32] and r.usage.prompt_tokens > 0
    plain = _vectors(client.post("/v1/embeddings", json={"input": ["w5 w6 w7", "w9"],
                                                          "dimensions": 32}))
    np.testing.assert_allclose([d.embedding for d in r.data], plain, rtol=1e-6)
    with pytest.raises(openai.BadRequestError, match="hidden size"):
        sdk.embeddings.create(model="tiny", input="w5", dimensions=1000)


def test_a_pooling_model_refuses_generation(client):
    r = client.post("/v1/completions", json={"prompt": "w5", "max_tokens": 2})
    assert r.status_code == 400 and "--runner pooling" in r.json()["error"]["message"]


def test_a_generation_model_refuses_embeddings(tmp_path, compile_cache_dir):
    with TestClient(_app(write_model_dir(tmp_path / "m"), compile_cache_dir)) as c:
        r = c.post("/v1/embeddings", json={"input": "w5"})
        assert r.status_code == 400 and "--runner pooling" in r.json()["error"]["message"]
        assert c.post("/v1/completions", json={"prompt": "w5", "max_tokens": 2}).status_code == 200


def test_the_process_engine_embeds_as_the_thread_engine(client, tmp_path, compile_cache_dir):
    """--engine-core process: the vectors cross the pipe unchanged."""
    from jaxserve.config import EngineConfig
    from jaxserve.engine.client import open_engine
    from jaxserve.server.app import build_app

    model_dir = write_model_dir(tmp_path / "m", "qwen3")
    config = EngineConfig.from_kwargs(model=str(model_dir), runner="pooling",
                                      compilation_cache_dir=compile_cache_dir, **OPTIONS)
    body = {"input": ["w5 w6 w7", "w9 w10"], "dimensions": 16}
    with TestClient(build_app(open_engine(config, core="process"), app_config())) as c:
        r = c.post("/v1/embeddings", json=body)
        thread = client.post("/v1/embeddings", json=body)
        np.testing.assert_array_equal(_vectors(r), _vectors(thread))
        assert c.post("/v1/embeddings", json={"input": "w5", "dimensions": 99}).status_code == 400
