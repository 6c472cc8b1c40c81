"""The CPU backend (`backend.py`: CpuBackend) and everything it alone decides: the dtype
measurement (`dtype.py`), the fused decoder layer (`layer.py`), huge pages (`huge_pages.py`),
and the native kernels (`kernels/`: C++ through the XLA FFI, their build and their Python
bindings)."""

from jaxserve.backends.cpu.backend import CpuBackend

__all__ = ["CpuBackend"]
