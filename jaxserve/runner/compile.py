"""Compilation bookkeeping: the compilation caches (serialized executables,
`executable_cache.py`, and laid-out weights, `weight_cache.py`, in folders of the compilation
cache directory), and a counter of compilations.

JAX's own persistent compilation cache is not used: it finds its entries by the lowered
program, so every start still traced each step, and an XLA:CPU executable that JAX loaded from
it serializes incompletely (jaxlib 0.10.2: a kernel such as `wrapped_broadcast` is left out, and
the executable fails with NOT_FOUND when a fresh process runs it), so the executable cache
could not take it over. Every executable the cache stores is compiled in its process.

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
from jaxserve.runner.weight_cache import WeightCache

if TYPE_CHECKING:
    from jaxserve.config import CompileConfig

logger = logging.getLogger(__name__)

_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
# Folders of the compilation cache's directory.
EXECUTABLES_SUBDIR = "executables"
WEIGHTS_SUBDIR = "weights"
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


def weight_cache(config: CompileConfig) -> WeightCache | None:
    """The cache of weights as the backend laid them out (`weight_cache.py`), in the
    compilation cache's directory; None when the compilation cache is off."""
    if not config.enable_compilation_cache:
        return None
    return WeightCache(os.path.join(config.cache_dir(), WEIGHTS_SUBDIR))

