"""The backends' "auto" resolution: dtype per backend and per CPU, the matmul kernel choice."""

from __future__ import annotations

import types

import pytest

from jaxserve.backends import Backend, select_backend
from jaxserve.backends.cpu import dtype as cpu_dtype
from jaxserve.backends.cpu import CpuBackend
from jaxserve.backends.cpu.kernels.matmul import amx_available, avx2_available, avx512_available

ONE, EIGHT = types.SimpleNamespace(size=1), types.SimpleNamespace(size=8)


@pytest.mark.parametrize("times, expected", [({"bfloat16": 1.0, "float32": 2.0}, "bfloat16"),
                                              ({"bfloat16": 3.0, "float32": 2.0}, "float32")])
def test_auto_dtype_on_cpu_is_the_faster_one_measured_once(monkeypatch, tmp_path, times, expected):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    calls = []
    monkeypatch.setattr(cpu_dtype, "measure", lambda impls: calls.append(impls) or times)
    assert CpuBackend().resolve_dtype("auto") == expected
    assert CpuBackend().resolve_dtype("auto") == expected and len(calls) == 1  # cached per CPU
    assert set(calls[0]) == {"bfloat16", "float32"}


def test_the_dtype_measurement_times_both_paths():
    times = cpu_dtype.measure({"bfloat16": "xla", "float32": "xla"})
    assert set(times) == {"bfloat16", "float32"} and all(0 < t < 1 for t in times.values())


@pytest.mark.parametrize("platform", ["tpu", "gpu", "cuda"])
def test_auto_dtype_on_accelerators_is_bfloat16(platform):
    backend = select_backend(platform)
    assert type(backend) is Backend and backend.resolve_dtype("auto") == "bfloat16"
    assert backend.resolve_kv_dtype("auto", "bfloat16", "tpu") == "bfloat16"
    assert backend.resolve_matmul_impl("auto", "bfloat16", EIGHT) == "xla"
    with pytest.raises(ValueError, match="matmul_impl='amx' cannot run here"):
        backend.resolve_matmul_impl("amx", "bfloat16", ONE)


def test_explicit_dtype_wins():
    assert CpuBackend().resolve_dtype("float32") == "float32"
    assert CpuBackend().resolve_dtype("bfloat16") == "bfloat16"


def test_cpu_kv_dtype_is_float32_without_the_native_attention():
    b = CpuBackend()
    assert b.resolve_kv_dtype("auto", "bfloat16", "reference") == "float32"
    assert b.resolve_kv_dtype("bfloat16", "float32", "reference") == "bfloat16"


def test_resolve_matmul_impl():
    b = CpuBackend()
    assert b.resolve_matmul_impl("xla", "bfloat16", ONE) == "xla"
    for dtype, mesh in (("float32", ONE), ("bfloat16", EIGHT)):
        if dtype == "bfloat16":
            assert b.resolve_matmul_impl("auto", dtype, mesh) == "xla"
        with pytest.raises(ValueError, match="matmul_impl='amx' cannot run here"):
            b.resolve_matmul_impl("amx", dtype, mesh)
    assert b.resolve_matmul_impl("auto", "float32", EIGHT) == "xla"
    for name in ("avx512", "avx2"):
        with pytest.raises(ValueError, match=f"matmul_impl='{name}' cannot run here"):
            b.resolve_matmul_impl(name, "float32", EIGHT)
    with pytest.raises(ValueError, match="'auto', 'xla', 'amx', 'avx512' or 'avx2'"):
        b.resolve_matmul_impl("onednn", "bfloat16", ONE)
    # The strips' products (float32 or bfloat16 weights): AVX-512 where the process's kernel
    # build has it, else AVX2 (a build without AVX-512 on a CPU with AVX2 and FMA), else XLA;
    # bfloat16 takes AMX first.
    strips = "avx512" if avx512_available() else "avx2" if avx2_available() else "xla"
    assert b.resolve_matmul_impl("auto", "float32", ONE) == strips
    assert b.resolve_matmul_impl("auto", "bfloat16", ONE) == ("amx" if amx_available() else strips)
    for name, ok in (("avx512", avx512_available()), ("avx2", avx2_available())):
        for dtype in ("float32", "bfloat16"):
            if ok:
                assert b.resolve_matmul_impl(name, dtype, ONE) == name
            else:
                with pytest.raises(ValueError, match=f"matmul_impl='{name}' cannot run here"):
                    b.resolve_matmul_impl(name, dtype, ONE)


def test_buckets_without_limits_set_the_limits():
    from jaxserve.config import EngineConfig

    c = EngineConfig.from_kwargs(token_buckets=[64, 16], request_buckets=[8])
    assert c.compile.token_buckets == (16, 64) and c.scheduler.max_num_batched_tokens == 64
    assert c.scheduler.max_num_seqs == 8
    c = EngineConfig.from_kwargs(token_buckets=[16, 64, 256], max_num_batched_tokens=128, max_num_seqs=4)
    assert (c.scheduler.max_num_batched_tokens, c.scheduler.max_num_seqs) == (128, 4)


# ---------------------------------------------------------------------- the token budget and buckets
def test_the_token_budget_defaults_to_the_backends():
    cpu, tpu, gpu = CpuBackend(), select_backend("tpu"), select_backend("cuda")
    assert tpu.resolve_max_num_batched_tokens(None, None) == gpu.resolve_max_num_batched_tokens(None, None) == 8192
    assert cpu.resolve_max_num_batched_tokens(None, None) == CpuBackend.default_max_num_batched_tokens
    assert CpuBackend.default_max_num_batched_tokens < 8192
    assert tpu.resolve_max_num_batched_tokens(None, None, data_parallel_size=2) == 2 * 8192  # per rank
    # Without chunked prefill a whole prompt must fit a step.
    assert cpu.resolve_max_num_batched_tokens(None, None, at_least=4096) == 4096


def test_an_explicit_budget_or_explicit_buckets_win():
    for backend in (CpuBackend(), select_backend("tpu")):
        assert backend.resolve_max_num_batched_tokens(300, None) == 300
        assert backend.resolve_max_num_batched_tokens(300, (16, 512)) == 300
        assert backend.resolve_max_num_batched_tokens(None, (16, 64)) == 64


def test_default_token_buckets_by_backend():
    tpu = select_backend("tpu")
    assert tpu.default_token_buckets(8192) == (16, 32, 64, 128, 256, 512, 1024, 4096, 8192)
    assert tpu.default_token_buckets(512) == (16, 32, 64, 128, 256, 512)
    assert CpuBackend().default_token_buckets(2048) == (16, 32, 64, 128, 256, 512, 1024, 2048)
    assert CpuBackend().default_token_buckets(100) == (16, 32, 64, 100)
    from jaxserve.compiled_step.buckets import BucketGrid

    assert len(BucketGrid.build(8192, 32, tpu.default_token_buckets(8192)).shapes()) == 17  # bounded


def test_engine_config_leaves_the_budget_to_the_backend():
    from jaxserve.config import EngineConfig

    assert EngineConfig.from_kwargs().scheduler.max_num_batched_tokens is None
    assert EngineConfig.from_kwargs(max_num_batched_tokens=1024).scheduler.max_num_batched_tokens == 1024


def test_the_engine_takes_the_backends_budget_unless_told(tmp_path, monkeypatch, compile_cache_dir):
    """Through build_engine on a tiny model: the CPU backend's default budget and its grid, and
    an explicit budget or explicit buckets instead."""
    from jaxserve import LLM
    from tests.model_dirs import write_model_dir

    model = str(write_model_dir(tmp_path / "m"))
    monkeypatch.setattr(CpuBackend, "default_max_num_batched_tokens", 32)  # a small grid, for speed
    opts = dict(dtype="float32", max_num_seqs=8, request_buckets=(8,), compilation_cache_dir=compile_cache_dir,
                show_progress=False)

    def limits(**kw):
        core = LLM(model, **opts, **kw).engine.core
        return core.scheduler.config.max_num_batched_tokens, core.runner.grid.token_buckets

    assert limits() == (32, (16, 32))
    assert limits(max_num_batched_tokens=16) == (16, (16,))
    assert limits(token_buckets=(8, 16)) == (16, (8, 16))
    assert limits(max_num_batched_tokens=24, token_buckets=(8, 32)) == (24, (8, 32))
