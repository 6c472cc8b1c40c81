"""Shared test setup: JAX on the CPU with 8 simulated devices, float32 matmuls at full precision."""

from __future__ import annotations

import os

# Must happen before jax is imported anywhere.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
import sys  # noqa: E402

# `pytest --kernel-device`: the Pallas kernel tests run on the real accelerator (no interpret
# mode), so JAX keeps its default platform (see benchmarks/device_check.sh).
if "--kernel-device" not in sys.argv:
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import pathlib  # noqa: E402

import pytest  # noqa: E402

DATA = pathlib.Path(__file__).parent / "data"


def pytest_addoption(parser):
    parser.addoption(
        "--kernel-device", action="store_true", default=False,
        help="run the Pallas kernel tests on the device backend instead of interpret mode",
    )


@pytest.fixture(scope="session")
def kernel_device(request) -> bool:
    """True under `pytest --kernel-device`: kernels run compiled on the accelerator."""
    return bool(request.config.getoption("--kernel-device"))


@pytest.fixture(scope="session")
def data_dir() -> pathlib.Path:
    return DATA


@pytest.fixture(scope="session")
def golden() -> dict:
    import json

    return json.loads((DATA / "smollm2_public.json").read_text())


@pytest.fixture(scope="session")
def default_model_dir(tmp_path_factory) -> pathlib.Path:
    """The bundled default model (SmolLM2-135M-Instruct GGUF), converted once per test session."""
    from jaxserve.models.loader import resolve_model

    return resolve_model(None, cache_dir=str(tmp_path_factory.mktemp("jaxserve-cache")))


@pytest.fixture(scope="session")
def compile_cache_dir(tmp_path_factory) -> str:
    """One persistent XLA cache for every engine of the test session (identical buckets compile once)."""
    return str(tmp_path_factory.mktemp("xla-cache"))


@pytest.fixture(scope="session")
def small_engine_options(default_model_dir, compile_cache_dir) -> dict:
    """Engine options with few compiled buckets, for tests on the real default model."""
    return dict(
        model=str(default_model_dir),
        dtype="float32",  # compared against the float32 golden data
        max_num_seqs=8,
        max_num_batched_tokens=512,
        token_buckets=(16, 512),
        request_buckets=(1, 8),
        compilation_cache_dir=compile_cache_dir,
        show_progress=False,
    )
