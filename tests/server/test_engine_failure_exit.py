"""An unrecoverable engine failure in `jaxserve serve` (a real process on a tiny model): the
request in flight gets a 500 naming its id, and the process exits 1 by itself, for its
supervisor to restart it, with the engine core on a thread and in a process of its own. The
failure is a device error injected from outside the product: a `sitecustomize` module on the
server's PYTHONPATH (so that the engine process has it too) wraps ModelRunner.collect to raise
once a marker file exists (the product has no test hook)."""

from __future__ import annotations

import os

import httpx
import pytest

from tests.model_dirs import write_model_dir
from tests.server.test_shutdown import _start

SITECUSTOMIZE = """
import os
from jaxserve.runner.model_runner import ModelRunner

marker, collect = os.environ["FAIL_MARKER"], ModelRunner.collect

def collect_or_fail(self, step):
    if os.path.exists(marker):
        raise RuntimeError("device lost (injected by the test)")
    return collect(self, step)

ModelRunner.collect = collect_or_fail
"""


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_model_dir(tmp_path_factory.mktemp("tiny"))


@pytest.mark.parametrize("engine_core", ["thread", "process"])
def test_a_device_error_fails_the_request_and_the_process_exits_1(model_dir, compile_cache_dir, tmp_path,
                                                                   engine_core):
    marker = tmp_path / "fail-now"
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(SITECUSTOMIZE)
    path = os.pathsep.join(p for p in (str(tmp_path / "site"), os.environ.get("PYTHONPATH")) if p)
    proc, url = _start(model_dir, compile_cache_dir, 30.0, extra=("--engine-core", engine_core),
                       env={"PYTHONPATH": path, "FAIL_MARKER": str(marker)})
    try:
        body = {"prompt": "w5 w6 w7", "max_tokens": 4, "temperature": 0}
        assert httpx.post(url + "/v1/completions", json=body, timeout=60).status_code == 200
        marker.touch()
        r = httpx.post(url + "/v1/completions", json=body, headers={"X-Request-Id": "req-7"}, timeout=60)
        assert r.status_code == 500 and "req-7" in r.json()["error"]["message"]
        try:  # until the listener closes, health says so
            assert httpx.get(url + "/health", timeout=5).status_code == 503
        except httpx.TransportError:
            pass
        assert proc.wait(60) == 1
    finally:
        if proc.poll() is None:
            proc.kill()
    assert "exiting: the engine failed" in proc.stdout.read()
