"""The CPU backend's KV budget: the explicit one, else JAXSERVE_CPU_KVCACHE_SPACE GiB from the
environment (vLLM's VLLM_CPU_KVCACHE_SPACE alike), else 1 GiB; a bad value is refused by name."""

from __future__ import annotations

import pytest

from jaxserve.backends.cpu.backend import KV_SPACE_ENV, CpuBackend
from jaxserve.config import CacheConfig


def test_the_default_budget_comes_from_the_environment(monkeypatch):
    backend = CpuBackend()
    monkeypatch.delenv(KV_SPACE_ENV, raising=False)
    assert backend.kv_cache_budget(CacheConfig()) == 1 << 30
    monkeypatch.setenv(KV_SPACE_ENV, "0.25")
    assert backend.kv_cache_budget(CacheConfig()) == 1 << 28
    monkeypatch.setenv(KV_SPACE_ENV, "3")
    assert backend.kv_cache_budget(CacheConfig()) == 3 << 30
    # the engine's own option wins over the environment
    assert backend.kv_cache_budget(CacheConfig(kv_cache_memory_bytes=12345)) == 12345


@pytest.mark.parametrize("bad", ["0", "-1", "lots", "nan"])
def test_a_bad_value_is_refused_by_name(monkeypatch, bad):
    monkeypatch.setenv(KV_SPACE_ENV, bad)
    with pytest.raises(ValueError, match=KV_SPACE_ENV):
        CpuBackend().kv_cache_budget(CacheConfig())
