"""One real server per test session: the default model with small buckets, served by uvicorn on a
free loopback port in a background thread, protected by an API key that the clients send, with
the Hermes tool-call parser and auto tool choice on."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from jaxserve.server.config import ServerConfig
from tests.live_server import LiveServer, free_port

API_KEY = "test-key"
MODEL = "SmolLM2-135M-Instruct"
# The load tests run 8 requests of a few hundred tokens at once (and 8 more waiting, the
# server's limit): the CPU's full 1 GiB of KV cache, not the suite's smaller default.
ENGINE_OPTIONS = dict(dtype="float32", max_num_seqs=8, max_num_batched_tokens=128, token_buckets=(16, 128),
                      request_buckets=(1, 8), show_progress=False, kv_cache_memory_bytes=1 << 30)


def app_config(**fields: Any) -> ServerConfig:
    """The front end's options for a test's app (build_app): ServerConfig's defaults, but a
    1-second shutdown grace (a test's server stops with nothing in flight), and `fields`."""
    return ServerConfig(**{"shutdown_grace": 1.0, **fields})


@pytest.fixture(scope="session")
def live_server() -> Iterator[LiveServer]:
    from jaxserve.config import EngineConfig
    from jaxserve.engine.setup import build_engine
    from jaxserve.server.app import build_app
    from jaxserve.engine.async_client import AsyncEngineClient

    engine = AsyncEngineClient.in_thread(build_engine(EngineConfig.from_kwargs(model=None, **ENGINE_OPTIONS)))
    app = build_app(engine, app_config(served_model_name=(MODEL, "alias"), api_key=(API_KEY,),
                                       max_request_body=1 << 20, shutdown_grace=5, enable_sleep_mode=True,
                                       tool_call_parser="hermes", enable_auto_tool_choice=True))
    srv = LiveServer(app, free_port())
    srv.start()
    yield srv
    srv.stop()


@pytest.fixture(scope="session")
def client(live_server):
    import openai

    return openai.OpenAI(base_url=live_server.base_url + "/v1", api_key=API_KEY, max_retries=0, timeout=300)


@pytest.fixture(scope="session")
def http(live_server):
    import httpx

    with httpx.Client(base_url=live_server.base_url, headers={"Authorization": f"Bearer {API_KEY}"},
                      timeout=300) as c:
        yield c
