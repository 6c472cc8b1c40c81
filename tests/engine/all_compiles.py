"""Every XLA compilation in the process, whoever makes it: the engine's counters
(`CompileCounter`) count what their runner compiles inside its own blocks; a start from a
directory of executables compiled ahead must compile nothing at all (the calibration forward,
the pooling runner, the eager ops of the start included). JAX's in-process caches are cleared
first, so that what an earlier engine of the test process compiled is compiled again, as in a
fresh server process."""

from __future__ import annotations

import contextlib
import threading

import jax

_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
_lock = threading.Lock()
_recording: list[list[str]] = []
_installed = False


def _on_event(event: str, duration: float, **kwargs) -> None:
    if event == _COMPILE_EVENT:
        with _lock:
            for names in _recording:
                names.append(kwargs.get("fun_name", "?"))


@contextlib.contextmanager
def all_compiles():
    """Yields the list of the names of the programs compiled in the block (any thread)."""
    global _installed
    with _lock:
        if not _installed:
            jax.monitoring.register_event_duration_secs_listener(_on_event)
            _installed = True
    jax.clear_caches()
    names: list[str] = []
    with _lock:
        _recording.append(names)
    try:
        yield names
    finally:
        with _lock:
            _recording.remove(names)
