"""Native CPU kernels called through the XLA FFI: paged attention, products on packed weights
(AMX bfloat16, AVX-512 float32) and the sampler's random draws.

Pallas has no CPU code generator (only its interpreter), so the CPU serving path's hot ops
are C++ (`attention.cc` with its `simd.h`, `matmul.cc`, `sample.cc`; all use `parallel.h`),
compiled on first use with the host's C++ compiler (`$CXX`, default `g++`, `-O3
-march=native`) against the FFI headers shipped in jaxlib, into one library under
`<user cache>/jaxserve/kernels` (the user cache is `$XDG_CACHE_HOME` or `~/.cache`, as for
models and compiled executables), keyed by the sources, the flags, jaxlib's version and the
CPU. Later processes load the cached library. Without a compiler, `ensure_loaded()` raises
`KernelUnavailable` and callers fall back to XLA (the pure-JAX reference attention, XLA's
dot, the JAX sampler).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import pathlib
import platform
import shutil
import subprocess
import tempfile

import jax

_DIR = pathlib.Path(__file__).parent
SOURCES = (_DIR / "attention.cc", _DIR / "matmul.cc", _DIR / "sample.cc")
_HEADERS = (_DIR / "parallel.h", _DIR / "simd.h")
_FLAGS = ("-O3", "-march=native", "-fopenmp-simd", "-fno-math-errno", "-std=c++17", "-fPIC",
          "-shared")
# FFI target name -> exported handler symbol.
TARGETS = {
    "jaxserve_ragged_paged_attention": "JaxserveRaggedPagedAttention",
    "jaxserve_write_kv_and_attend": "JaxserveWriteKvAndAttend",
    "jaxserve_rope_write_kv_and_attend": "JaxserveRopeWriteKvAndAttend",
    "jaxserve_packed_matmul": "JaxservePackedMatmul",
    "jaxserve_sample_rows": "JaxserveSampleRows",
    "jaxserve_raw_logprobs": "JaxserveRawLogprobs",
}


class KernelUnavailable(ValueError):
    """The native CPU kernels cannot be built or loaded on this host."""


def _cache_dir() -> pathlib.Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return pathlib.Path(base) / "jaxserve" / "kernels"


def cpu_flags() -> str:
    """The `flags` line of /proc/cpuinfo ('' when unreadable)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            return next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return ""


def library_path() -> pathlib.Path:
    """Build the kernel library if it is not cached yet; return its path. Raises KernelUnavailable."""
    import jaxlib

    cxx = os.environ.get("CXX", "g++")
    if shutil.which(cxx) is None:
        raise KernelUnavailable(f"no C++ compiler ({cxx!r} not found; set $CXX)")
    key = hashlib.sha256(b"\0".join([
        *(p.read_bytes() for p in SOURCES + _HEADERS), " ".join(_FLAGS).encode(), cxx.encode(),
        jaxlib.__version__.encode(), (platform.machine() + cpu_flags()).encode(),
    ])).hexdigest()[:16]
    out_dir = _cache_dir()
    lib = out_dir / f"kernels-{key}.so"
    if lib.exists():
        return lib
    out_dir.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=out_dir, suffix=".so.tmp")
    os.close(fd)
    cmd = [cxx, *_FLAGS, f"-I{jax.ffi.include_dir()}", f"-I{_DIR}", *map(str, SOURCES), "-o", tmp]
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        if res.returncode != 0:
            raise KernelUnavailable(f"compiling the CPU kernels failed:\n{res.stderr[-2000:]}")
        os.replace(tmp, lib)  # atomic: concurrent builders each install a complete file
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return lib


@functools.cache
def _load() -> ctypes.CDLL:
    lib = ctypes.cdll.LoadLibrary(str(library_path()))
    for target, symbol in TARGETS.items():
        jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(lib, symbol)), platform="cpu")
    return lib


@functools.cache
def available() -> bool:
    """True when the kernel library builds and loads on this host (tried once per process)."""
    try:
        ensure_loaded()
    except KernelUnavailable:
        return False
    return True


def ensure_loaded() -> ctypes.CDLL:
    """Build (once) and register the kernels; raises KernelUnavailable when they cannot be."""
    try:
        return _load()
    except KernelUnavailable:
        raise
    except (OSError, subprocess.SubprocessError, AttributeError) as e:
        raise KernelUnavailable(f"loading the CPU kernels failed: {e}") from e
