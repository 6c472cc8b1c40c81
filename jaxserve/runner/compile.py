"""Compilation bookkeeping: the persistent XLA cache, the cache of serialized executables
(`executable_cache.py`, in a folder of the same directory), and a counter of compilations.

Every executable the engine needs is compiled at start-up. After warm-up any compilation is a
bug (a shape that escaped the bucket grid, a non-static argument that changed): the counter
records it, logs a warning and exposes it (`recompiles`), and tests assert it stays zero.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from typing import TYPE_CHECKING

import jax

from jaxserve.runner.executable_cache import ExecutableCache

if TYPE_CHECKING:
    from jaxserve.config import CompileConfig

logger = logging.getLogger(__name__)

_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
EXECUTABLES_SUBDIR = "executables"  # in the compilation cache's directory (JAX's cache ignores folders)
_lock = threading.Lock()
_listener_installed = False
# The counter whose engine is working on this thread (compilation runs on the calling thread),
# so that engines sharing a process never count each other's compilations.
_active = threading.local()


def _on_event(event: str, duration: float, **kwargs) -> None:
    if event != _COMPILE_EVENT:
        return
    counter = getattr(_active, "counter", None)
    if counter is not None:
        counter._record(duration, kwargs.get("fun_name", "?"))


class CompileCounter:
    """Counts the XLA compilations that happen inside `with counter.active():` blocks."""

    def __init__(self) -> None:
        global _listener_installed
        self.num_compiles = 0
        self.compile_seconds = 0.0
        self.recompiles = 0  # compilations after mark_warm()
        self._warm = False
        with _lock:
            if not _listener_installed:
                jax.monitoring.register_event_duration_secs_listener(_on_event)
                _listener_installed = True

    @contextlib.contextmanager
    def active(self):
        """Attribute compilations on this thread to this counter for the block's duration."""
        previous = getattr(_active, "counter", None)
        _active.counter = self
        try:
            yield self
        finally:
            _active.counter = previous

    def _record(self, duration: float, fun_name: str) -> None:
        self.num_compiles += 1
        self.compile_seconds += duration
        if self._warm:
            self.recompiles += 1
            logger.warning("compilation after warm-up (%s, %.2fs): a shape escaped the bucket grid", fun_name, duration)

    def mark_warm(self) -> None:
        self._warm = True


def executable_cache(config: CompileConfig) -> ExecutableCache | None:
    """The cache of serialized executables (`executable_cache.py`), in the compilation cache's
    directory; None when it or the compilation cache is off."""
    if not (config.enable_compilation_cache and config.enable_executable_cache):
        return None
    return ExecutableCache(os.path.join(config.cache_dir(), EXECUTABLES_SUBDIR))


def enable_persistent_cache(cache_dir: str) -> None:
    """Turn on JAX's persistent compilation cache in `cache_dir` (idempotent)."""
    jax.config.update("jax_compilation_cache_dir", cache_dir)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
