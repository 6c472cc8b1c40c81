"""The backends' "auto" resolution: dtype per backend and per CPU, the matmul kernel choice."""

from __future__ import annotations

import types

import pytest

from jaxserve.backends import Backend, cpu_dtype, select_backend
from jaxserve.backends.cpu import CpuBackend
from jaxserve.pallas_kernels.cpu.matmul import amx_available, avx2_available, avx512_available

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
    for dtype, mesh in (("bfloat16", ONE), ("float32", EIGHT)):
        if dtype == "float32":
            assert b.resolve_matmul_impl("auto", dtype, mesh) == "xla"
        with pytest.raises(ValueError, match="matmul_impl='avx512' cannot run here"):
            b.resolve_matmul_impl("avx512", dtype, mesh)
        with pytest.raises(ValueError, match="matmul_impl='avx2' cannot run here"):
            b.resolve_matmul_impl("avx2", dtype, mesh)
    with pytest.raises(ValueError, match="'auto', 'xla', 'amx', 'avx512' or 'avx2'"):
        b.resolve_matmul_impl("onednn", "bfloat16", ONE)
    assert b.resolve_matmul_impl("auto", "bfloat16", ONE) == ("amx" if amx_available() else "xla")
    # float32: AVX-512 where the process's kernel build has it, else AVX2 (a build without
    # AVX-512 on a CPU with AVX2 and FMA), else XLA.
    assert b.resolve_matmul_impl("auto", "float32", ONE) == (
        "avx512" if avx512_available() else "avx2" if avx2_available() else "xla")
    for name, ok in (("avx512", avx512_available()), ("avx2", avx2_available())):
        if ok:
            assert b.resolve_matmul_impl(name, "float32", ONE) == name
        else:
            with pytest.raises(ValueError, match=f"matmul_impl='{name}' cannot run here"):
                b.resolve_matmul_impl(name, "float32", ONE)


def test_buckets_without_limits_set_the_limits():
    from jaxserve.config import EngineConfig

    c = EngineConfig.from_kwargs(token_buckets=[64, 16], request_buckets=[8])
    assert c.compile.token_buckets == (16, 64) and c.scheduler.max_num_batched_tokens == 64
    assert c.scheduler.max_num_seqs == 8
    c = EngineConfig.from_kwargs(token_buckets=[16, 64, 256], max_num_batched_tokens=128, max_num_seqs=4)
    assert (c.scheduler.max_num_batched_tokens, c.scheduler.max_num_seqs) == (128, 4)
