"""The engine core in a process of its own (`jaxserve serve --engine-core process`): the server
over it answers exactly as over the engine thread (greedy tokens, log-probs, prompt log-probs,
streams, n > 1, a constraint compiled on the engine's side, commands), a request's abort frees
its KV in the engine process, an engine that cannot be built says why, and an engine process
that dies fails the requests in flight, /health and new requests, and runs the dead-engine
callbacks. A tiny Qwen3 GGUF with a byte-level BPE vocabulary (structured output needs one)."""

from __future__ import annotations

import json
import os
import signal
import time

import pytest
from starlette.testclient import TestClient

from jaxserve.config import EngineConfig
from jaxserve.engine.client import open_engine
from jaxserve.server.app import build_app
from tests.models.gguf_fixtures import write_fixture_gguf
from tests.server.conftest import app_config

OPTIONS = dict(dtype="float32", max_num_seqs=8, max_num_batched_tokens=32, token_buckets=(16, 32),
               request_buckets=(8,), max_model_len=64, num_pages=64, show_progress=False)
REQUESTS = [
    ("/v1/completions", {"prompt": "a b c d", "max_tokens": 6, "temperature": 0, "ignore_eos": True, "logprobs": 2,
                         "prompt_logprobs": 1}),
    ("/v1/completions", {"prompt": ["a b", "c d e"], "max_tokens": 4, "temperature": 0.8, "seed": 3, "n": 2,
                         "ignore_eos": True}),
    ("/v1/completions", {"prompt": "a b c", "max_tokens": 8, "temperature": 0, "structured_outputs":
                         {"regex": "[a-c]( [a-c]){2}"}}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a b c"}], "max_tokens": 5,
                              "temperature": 0, "ignore_eos": True, "logprobs": True, "top_logprobs": 2}),
]


@pytest.fixture(scope="module")
def config(tmp_path_factory, data_dir, compile_cache_dir) -> EngineConfig:
    gguf = write_fixture_gguf(data_dir, "qwen3", tmp_path_factory.mktemp("engine-process") / "tiny.gguf")
    return EngineConfig.from_kwargs(model=str(gguf), model_cache_dir=str(tmp_path_factory.mktemp("models")),
                                    compilation_cache_dir=compile_cache_dir, **OPTIONS)


def _answers(client: TestClient) -> list:
    out = []
    for path, body in REQUESTS:
        r = client.post(path, json=body)
        assert r.status_code == 200, r.text
        data = r.json()
        out.append([{k: c.get(k) for k in ("text", "message", "logprobs", "prompt_logprobs", "finish_reason")}
                    for c in data["choices"]])
    with client.stream("POST", "/v1/chat/completions", json={**REQUESTS[3][1], "stream": True}) as s:
        events = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
    out.append([{k: v for k, v in e.items() if k not in ("id", "created")} for e in events])
    return out


@pytest.fixture(scope="module")
def thread_answers(config):
    engine = open_engine(config, core="thread")
    with TestClient(build_app(engine, app_config())) as client:
        answers = _answers(client)
    return answers


def test_the_process_engine_serves_as_the_thread_engine(config, thread_answers):
    engine = open_engine(config, core="process")
    assert engine.mode == "process"
    with TestClient(build_app(engine, app_config(enable_sleep_mode=True))) as client:
        answers = _answers(client)
        assert answers == thread_answers
        constrained = answers[2][0]["text"]
        assert constrained.count(" ") == 2 and set(constrained.replace(" ", "")) <= set("abc"), constrained
        # a client that goes away mid-stream: its request is aborted in the engine process
        with client.stream("POST", "/v1/completions", json={"prompt": "a b", "max_tokens": 50, "ignore_eos": True,
                                                             "stream": True}) as s:
            next(s.iter_lines())
        deadline = time.monotonic() + 30
        while engine.stats.scheduler.num_running and time.monotonic() < deadline:
            time.sleep(0.05)
        assert engine.stats.scheduler.num_running == 0 and engine.num_in_flight == 0
        assert client.post("/sleep").status_code == 200 and client.get("/is_sleeping").json()["is_sleeping"]
        assert client.post("/v1/completions", json=REQUESTS[0][1]).status_code == 503
        assert client.post("/wake_up").status_code == 200
        assert client.get("/health").status_code == 200
        metrics = client.get("/metrics").text
        assert 'vllm:request_success_total{engine="0",finished_reason="length"' in metrics
    assert not engine.transport.process.is_alive()


def test_an_engine_that_cannot_be_built_says_why(config, tmp_path):
    with pytest.raises(ValueError, match="not found"):
        open_engine(EngineConfig.from_kwargs(model=str(tmp_path / "missing"), **OPTIONS), core="process")


def test_a_dead_engine_process_fails_its_requests_and_health(config):
    engine = open_engine(config, core="process")
    died: list[BaseException] = []
    engine.add_dead_callback(died.append)
    with TestClient(build_app(engine, app_config())) as client:
        assert client.get("/health").status_code == 200
        with client.stream("POST", "/v1/completions", json={"prompt": "a b", "max_tokens": 50, "ignore_eos": True,
                                                             "stream": True}) as s:
            lines = s.iter_lines()
            next(lines)
            os.kill(engine.transport.process.pid, signal.SIGKILL)
            events = [line for line in lines if line.startswith("data: ")]
        assert events[-1] == "data: [DONE]" and json.loads(events[-2][6:])["error"]["code"] == 500
        assert client.get("/health").status_code == 503
        assert client.post("/v1/completions", json=REQUESTS[0][1]).status_code == 503
        assert died and "exited" in str(died[0])


@pytest.mark.parametrize("env, files, platform", [
    ({"JAX_PLATFORMS": "cpu"}, ["accel0"], "cpu"),  # the user's choice wins over the devices
    ({"JAX_PLATFORMS": "tpu,cpu"}, [], "tpu"),
    ({"JAX_PLATFORMS": "cuda"}, [], "gpu"),
    ({}, ["accel0"], "tpu"),  # TPU v4 / v5p VMs
    ({}, ["vfio/0", "vfio/vfio"], "tpu"),  # TPU v5e / v6e VMs
    ({}, ["vfio/vfio"], "cpu"),  # the vfio control file alone is no chip
    ({}, ["nvidia0", "nvidiactl", "nvidia-uvm"], "gpu"),
    ({}, ["nvidiactl"], "cpu"),  # a driver without a GPU
    ({}, ["kfd"], "gpu"),  # ROCm
    ({}, [], "cpu"),
])
def test_the_serving_platform_is_told_without_jax(tmp_path, env, files, platform):
    from jaxserve.engine.client import default_engine_core
    from jaxserve.platform import serving_platform

    for name in files:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).touch()
    assert serving_platform(env, dev=str(tmp_path)) == platform
    # the measured defaults (docs/performance.md: the engine core on a thread or in a process of
    # its own)
    assert default_engine_core(platform) == {"cpu": "thread", "tpu": "process", "gpu": "process"}[platform]


@pytest.mark.parametrize("env, files, system, pinned", [
    ({}, [], "linux", True),  # a CPU host: JAX is told to use the CPU
    ({}, ["accel0"], "linux", False),  # a TPU VM: JAX's choice
    ({}, ["nvidia0"], "linux", False),
    ({}, ["dxg"], "linux", False),  # WSL's GPU
    ({"JAX_PLATFORMS": "cuda"}, [], "linux", False),  # the user's choice stands
    ({}, [], "darwin", False),  # no device files to read there
])
def test_a_host_without_accelerators_pins_jax_to_the_cpu(tmp_path, env, files, system, pinned):
    from jaxserve.platform import pin_cpu_without_accelerator

    for name in files:
        (tmp_path / name).touch()
    before = dict(env)
    assert pin_cpu_without_accelerator(env, dev=str(tmp_path), system=system) is pinned
    assert env == ({**before, "JAX_PLATFORMS": "cpu"} if pinned else before)


def test_no_accelerator_plugin_tracebacks_on_a_cpu_host():
    """With the compile-only plugins installed (JAX's CUDA plugin, libtpu: the CI installs both)
    and JAX_PLATFORMS unset, a process that imports jaxserve starts JAX on the CPU without the
    plugins' initialisation errors; a bare `import jax` still prints them (the check can fail)."""
    import importlib.util
    import subprocess
    import sys

    from jaxserve.platform import serving_platform

    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
    if serving_platform(env) != "cpu":
        pytest.skip("this host has accelerator device files")
    code = "import jaxserve, jax; print(jax.default_backend())"
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and run.stdout.strip() == "cpu", run.stderr
    assert "Jax plugin configuration error" not in run.stderr
    assert "TPU_ACCELERATOR_TYPE" not in run.stderr
    # (find_spec of a submodule imports its parent: without any plugin there is no jax_plugins)
    if importlib.util.find_spec("jax_plugins") and importlib.util.find_spec("jax_plugins.xla_cuda12"):
        bare = subprocess.run([sys.executable, "-c", "import jax; jax.devices()"], env=env,
                              capture_output=True, text=True, timeout=120)
        assert "Jax plugin configuration error" in bare.stderr
