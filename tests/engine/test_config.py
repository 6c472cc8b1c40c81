"""Engine configuration: the dtype "auto" resolves per backend and per CPU."""

from __future__ import annotations

import pytest

from jaxserve import config
from jaxserve.config import ModelConfig


@pytest.mark.parametrize("native_bf16, expected", [(True, "bfloat16"), (False, "float32")])
def test_auto_dtype_on_cpu_follows_native_bfloat16(monkeypatch, native_bf16, expected):
    monkeypatch.setattr(config, "cpu_has_bfloat16_matmul", lambda: native_bf16)
    assert ModelConfig().resolved_dtype("cpu") == expected


@pytest.mark.parametrize("backend", ["tpu", "gpu"])
def test_auto_dtype_on_accelerators_is_bfloat16(monkeypatch, backend):
    monkeypatch.setattr(config, "cpu_has_bfloat16_matmul", lambda: False)
    assert ModelConfig().resolved_dtype(backend) == "bfloat16"


def test_explicit_dtype_wins(monkeypatch):
    monkeypatch.setattr(config, "cpu_has_bfloat16_matmul", lambda: True)
    assert ModelConfig(dtype="float32").resolved_dtype("cpu") == "float32"
    assert ModelConfig(dtype="bfloat16").resolved_dtype("cpu") == "bfloat16"


def test_cpu_flag_detection_reads_cpuinfo(monkeypatch, tmp_path):
    import builtins

    real_open = builtins.open
    for text, want in (("flags : fpu avx512f amx_bf16 amx_tile\n", True),
                       ("flags : fpu avx2 fma\n", False)):
        fake = tmp_path / "cpuinfo"
        fake.write_text(text)
        monkeypatch.setattr(builtins, "open",
                            lambda p, *a, **k: real_open(fake if p == "/proc/cpuinfo" else p, *a, **k))
        config.cpu_has_bfloat16_matmul.cache_clear()
        assert config.cpu_has_bfloat16_matmul() is want
    monkeypatch.setattr(builtins, "open", real_open)
    config.cpu_has_bfloat16_matmul.cache_clear()
