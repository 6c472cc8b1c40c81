"""Named implementations of one op, and how `impl="auto"` picks among them."""

from __future__ import annotations

import logging
from collections.abc import Callable

import jax

log = logging.getLogger(__name__)


class ImplRegistry:
    """Implementations of the op `op_name` by name ("reference", "tpu", "gpu", ...).

    `resolve("auto")` picks the implementation registered under the name of JAX's backend and
    falls back to "reference" (logging once on a non-CPU backend). Names in `known_kernels`
    that are not registered get an error saying the kernel is not available yet.
    """

    def __init__(self, op_name: str, impls: dict[str, Callable], known_kernels: tuple[str, ...]):
        self.op_name = op_name
        self.impls = dict(impls)
        self.known_kernels = known_kernels
        self.warned: set[str] = set()

    def register(self, name: str, fn: Callable) -> None:
        if name == "auto":
            raise ValueError("'auto' is a dispatch mode, not an implementation name")
        self.impls[name] = fn

    def available(self) -> tuple[str, ...]:
        return tuple(self.impls)

    def warn_once(self, key: str, message: str, *args) -> None:
        if key not in self.warned:
            self.warned.add(key)
            log.warning(message, *args)

    def resolve(self, impl: str, backend: str | None = None) -> str:
        """The implementation name `impl` dispatches to on `backend` (default: JAX's default)."""
        if impl == "auto":
            backend = backend or jax.default_backend()
            if backend in self.impls:
                return backend
            if backend != "cpu":
                self.warn_once(backend, "%s: no %r kernel registered; using the pure-JAX reference",
                               self.op_name, backend)
            return "reference"
        if impl in self.impls:
            return impl
        if impl in self.known_kernels:
            raise ValueError(
                f"{self.op_name} impl={impl!r}: the {impl} kernel is not available yet "
                f"(not implemented); available: {sorted(self.impls)} or 'auto'"
            )
        raise ValueError(f"{self.op_name}: unknown impl {impl!r}; available: {sorted(self.impls)} or 'auto'")
