"""Shared test setup: JAX on the CPU with 8 simulated devices, float32 matmuls at full precision."""

from __future__ import annotations

import os
import sys

# `pytest --kernel-device`: the Pallas kernel tests run on the real accelerator (no interpret
# mode), so JAX keeps its default platform (see benchmarks/device_check.sh).
ON_CPU = "--kernel-device" not in sys.argv
# Must happen before jax is imported anywhere. On the CPU, its code generated at LLVM's lowest
# optimisation: the tests' programs (their HLO, what they compute) are the same, most of the
# suite's time is compiling them, and this cuts that by a quarter to a third (tests that run
# long decodes lose a few %). Test processes started from here inherit the flags (those that
# set a device count of their own append it: the last of a repeated flag wins).
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8" + (
    " --xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true" if ON_CPU else ""))
if ON_CPU:
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    # libtpu (compile-only TPU topologies) admits one process per host unless told otherwise:
    # the test workers, the servers they start and the other test runs on the host all load it.
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
# Each engine zeroes its whole KV cache at start, on every simulated device: 1 GiB a device by
# default on a CPU made the suite's hundreds of engines spend minutes in page faults. 128 MiB holds
# ~2,900 tokens of the default model in float32 (tests that need more say so). Test processes
# started from here (servers, followers) inherit it.
os.environ.setdefault("JAXSERVE_CPU_KVCACHE_SPACE", "0.125")
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


def _run_dir(tmp_path_factory, name: str) -> pathlib.Path:
    """A folder of this test run that every pytest-xdist worker shares: under the run's base
    temporary folder (a worker's own is a subfolder of it); without xdist, the session's."""
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent
    path = root / name
    path.mkdir(exist_ok=True)
    return path


@pytest.fixture(scope="session")
def default_model_dir(tmp_path_factory) -> pathlib.Path:
    """The bundled default model (SmolLM2-135M-Instruct GGUF), converted once per test run (the
    conversion is renamed into place: workers that convert at once agree on one copy)."""
    from jaxserve.models.loader import resolve_model

    return resolve_model(None, cache_dir=str(_run_dir(tmp_path_factory, "jaxserve-cache")))


@pytest.fixture(scope="session")
def compile_cache_dir(tmp_path_factory) -> str:
    """One compilation cache (executables, packed weights) for every engine of the test run, the
    xdist workers' included: identical buckets compile once, and each entry is written to a
    temporary file and renamed into place, so concurrent writers each install a whole file.
    Tests of the caches themselves use folders of their own."""
    return str(_run_dir(tmp_path_factory, "xla-cache"))


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


@pytest.fixture(scope="session")
def small_llm(small_engine_options):
    """One engine of `small_engine_options` for the test modules that only generate with it (a
    test that needs other settings builds its own)."""
    from jaxserve import LLM

    return LLM(**small_engine_options)


# The slow modules, longest first (from `--durations=0` of a whole run, 2 workers on a 2-core CPU:
# those of 10 s or more, the ones that build engines and servers or compile for TPU/GPU
# topologies). They are marked `slow`, so that `make test-fast` (`-m "not slow"`) leaves them
# out for the inner loop; `make test` runs them all.
# pytest-xdist (`make test`: `-n 2 --dist loadfile --no-loadscope-reorder`): a module's tests run
# in one worker, so that its module-scoped engines, model directories and per-process caches of
# compiled topologies are built once; each worker takes the next module in collection order.
# The longest modules go first, so that no long module starts last while the other worker idles.
# (Not --dist loadgroup: with pytest 9.2, xdist 3.8's `xdist_group` marks never reach its
# scheduler.)
SLOW_MODULES = (
    "tests/parallel/test_multihost.py",
    "tests/parallel/test_tensor_parallel.py",
    "tests/tools/test_shard_plan.py",
    "tests/engine/test_executable_cache.py",
    "tests/pallas_kernels/test_gpu_mosaic_kernel.py",
    "tests/engine/test_llm_golden.py",
    "tests/tools/test_device_check.py",
    "tests/parallel/test_data_parallel.py",
    "tests/tools/test_tpu_topology.py",
    "tests/models/test_paged_consistency.py",
    "tests/models/test_gemma4.py",
    "tests/tools/test_gpu_topology.py",
    "tests/tools/test_step_anatomy.py",
    "tests/tools/test_compile_targets.py",
    "tests/engine/test_sharding_rules_engine.py",
    "tests/backends/test_accelerator_memory.py",
    "tests/server/test_fuzz.py",
    "tests/server/test_families.py",
    "tests/server/test_2026_models_serve.py",
    "tests/models/test_sharding_rules.py",
    "tests/engine/test_memory_from_programs.py",
    "tests/backends/test_cpu_matmul.py",
    "tests/pallas_kernels/test_tpu_kernel.py",
    "tests/backends/test_cpu_kernel.py",
    "tests/models/test_default_model.py",
    "tests/server/test_structured_tools.py",
    "tests/models/test_gguf_archs.py",
    "tests/models/test_int8.py",
    "tests/server/test_engine_process.py",
    "tests/pallas_kernels/test_gpu_kernel.py",
    "tests/models/test_moe.py",
    "tests/models/test_ct_formats.py",
    "tests/models/test_sharding.py",
    "tests/engine/test_damaged_caches.py",
    "tests/sampling/test_transforms.py",
    "tests/server/test_engine_failure_exit.py",
    "tests/server/test_responses.py",
    "tests/sampling/test_bitmask.py",
    "tests/models/test_arch_parity.py",
    "tests/models/test_quant_formats.py",
    "tests/engine/test_lora.py",
    "tests/server/test_openai_api.py",
    "tests/pallas_kernels/test_quantized_kv.py",
    "tests/tools/test_step_model.py",
    "tests/models/test_gguf_default_model.py",
    "tests/sampling/test_truncation.py",
    "tests/engine/test_weight_cache.py",
    "tests/engine/test_matmul_impl.py",
    "tests/server/test_shutdown.py",
    "tests/server/test_startup_log.py",
    "tests/sampling/test_sample.py",
    "tests/models/test_hub.py",
    "tests/engine/test_offline_api.py",
    "tests/server/test_embeddings_server.py",
    "tests/engine/test_structured_output.py",
    "tests/server/test_cli.py",
    "tests/pallas_kernels/test_mla_attention.py",
    "tests/models/test_deepseek_v3.py",
    "tests/pallas_kernels/test_reference_attention.py",
    "tests/server/test_playground.py",
    "tests/engine/test_kv_cache_dtype.py",
    "tests/pallas_kernels/test_kv_write.py",
    "tests/engine/test_backend_layer.py",
    "tests/engine/test_embeddings.py",
    "tests/engine/test_decode_block.py",
    "tests/engine/test_config.py",
    "tests/engine/test_compile_ahead.py",
)


def pytest_collection_modifyitems(config, items):
    rank = {path: i for i, path in enumerate(SLOW_MODULES)}
    for item in items:
        if item.nodeid.split("::", 1)[0] in rank:
            item.add_marker(pytest.mark.slow)
    if os.environ.get("PYTEST_XDIST_WORKER"):
        items.sort(key=lambda item: rank.get(item.nodeid.split("::", 1)[0], len(rank)))
