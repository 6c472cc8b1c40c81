"""Native CPU kernels called through the XLA FFI: paged attention, products on packed weights
(AMX bfloat16, AVX-512 or AVX2 float32) and the sampler's random draws.

Pallas has no CPU code generator (only its interpreter), so the CPU serving path's hot ops
are C++ (`attention.cc` with its `simd.h`, `matmul.cc`, `sample.cc`; all use `parallel.h`),
compiled on first use with the host's C++ compiler (`$CXX`, default `g++`, `-O3
-march=<target>`) against the FFI headers shipped in jaxlib, into one library per build
target under `<user cache>/jaxserve/kernels` (the user cache is `$XDG_CACHE_HOME` or
`~/.cache`, as for models and compiled executables), keyed by the sources, the flags (the
target's among them), jaxlib's version and the CPU. Later processes load the cached library
once its checksum (an XXH3 digest and size beside it, `<library>.xxh3`, written before the
library is installed) agrees: a damaged or unchecked library is logged by name and rebuilt, never
loaded (a truncated one used to fail to load, and the engine fell back to slower products for
good). Without a compiler, `ensure_loaded()` raises `KernelUnavailable` and callers fall back to XLA
(the pure-JAX reference attention, XLA's dot, the JAX sampler).

Build targets (`BUILD_TARGETS`; the instruction sets follow from the compiler's macros, each
kernel keeping a portable path):
- "native" (the default): `-march=native`, every instruction set of this CPU (AMX, AVX-512
  where present).
- "haswell": `-march=haswell`, AVX2 + FMA and no AVX-512: the code an AVX2-only CPU (many
  laptops and cloud CPUs) runs, here on any CPU that has those instructions.
- "x86-64": `-march=x86-64`, the baseline (SSE2): the kernels' portable loops; no float32
  product kernel.
A process chooses its target with `select_target(target)` before the kernels' first use; the
wrappers (`packed_matmul`, `sample_rows`, the attention ops) then call that target's library.
Each loaded library registers its FFI handlers under names of its own (`ffi_target`: the base
name for "native", `<name>_<target>` otherwise, `-` as `_`), so the default names stay stable
and tests or benchmarks may call another target's kernels in the same process by passing
`target=` to the wrappers.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import json
import logging
import os
import pathlib
import platform
import shutil
import subprocess
import tempfile

import jax

from jaxserve.models.checksum import damaged_files, manifest

logger = logging.getLogger(__name__)

_DIR = pathlib.Path(__file__).parent
SOURCES = (_DIR / "attention.cc", _DIR / "matmul.cc", _DIR / "sample.cc")
_HEADERS = (_DIR / "parallel.h", _DIR / "simd.h")
_FLAGS = ("-O3", "-fopenmp-simd", "-fno-math-errno", "-std=c++17", "-fPIC", "-shared")
# Build target -> (its -march, the /proc/cpuinfo flags its code needs besides the x86-64
# baseline). "native" needs nothing by definition.
BUILD_TARGETS = {
    "native": ("native", ()),
    "haswell": ("haswell", ("avx", "avx2", "fma", "f16c", "bmi1", "bmi2", "movbe")),
    "x86-64": ("x86-64", ()),
}
DEFAULT_TARGET = "native"
# FFI target name -> exported handler symbol.
TARGETS = {
    "jaxserve_ragged_paged_attention": "JaxserveRaggedPagedAttention",
    "jaxserve_ragged_paged_attention_lse": "JaxserveRaggedPagedAttentionLse",
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


def _check_target(target: str) -> None:
    if target not in BUILD_TARGETS:
        raise ValueError(f"unknown CPU kernel build target {target!r}; one of {list(BUILD_TARGETS)}")


def _flags(target: str) -> tuple[str, ...]:
    _check_target(target)
    return (f"-march={BUILD_TARGETS[target][0]}", *_FLAGS)


def missing_isa(target: str) -> list[str]:
    """The instruction sets `target`'s code needs that this CPU lacks (by /proc/cpuinfo)."""
    _check_target(target)
    needs = BUILD_TARGETS[target][1]
    if needs and platform.machine() not in ("x86_64", "AMD64"):
        return list(needs)
    have = set(cpu_flags().split())
    return [f for f in needs if f not in have]


def library_path(target: str = DEFAULT_TARGET) -> pathlib.Path:
    """Build the kernel library for build target `target` (`BUILD_TARGETS`) if it is not cached
    yet; return its path. Raises KernelUnavailable."""
    import jaxlib

    flags = _flags(target)
    cxx = os.environ.get("CXX", "g++")
    if shutil.which(cxx) is None:
        raise KernelUnavailable(f"no C++ compiler ({cxx!r} not found; set $CXX)")
    key = hashlib.sha256(b"\0".join([
        *(p.read_bytes() for p in SOURCES + _HEADERS), " ".join(flags).encode(), cxx.encode(),
        jaxlib.__version__.encode(), (platform.machine() + cpu_flags()).encode(),
    ])).hexdigest()[:16]
    out_dir = _cache_dir()
    lib = out_dir / f"kernels-{target}-{key}.so"
    if lib.exists():
        if _whole(lib):
            return lib
        logger.warning("the cached CPU kernel library %s does not match its checksum (damaged, or built "
                       "without one); rebuilding it", lib)
    out_dir.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=out_dir, suffix=".so.tmp")
    os.close(fd)
    cmd = [cxx, *flags, f"-I{jax.ffi.include_dir()}", f"-I{_DIR}", *map(str, SOURCES), "-o", tmp]
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        if res.returncode != 0:
            raise KernelUnavailable(f"compiling the CPU kernels failed:\n{res.stderr[-2000:]}")
        # The checksum goes first: a reader that sees the new library sees its checksum too.
        _replace_text(_checksum_file(lib), json.dumps(manifest(out_dir, [os.path.basename(tmp)]).popitem()[1]))
        os.replace(tmp, lib)  # atomic: concurrent builders each install a complete file
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return lib


def _checksum_file(lib: pathlib.Path) -> pathlib.Path:
    return lib.with_name(lib.name + ".xxh3")


def _whole(lib: pathlib.Path) -> bool:
    """Whether the cached library matches the checksum recorded beside it."""
    try:
        return not damaged_files(lib.parent, {lib.name: json.loads(_checksum_file(lib).read_text())})
    except (OSError, ValueError, KeyError, TypeError):  # no checksum, or not one
        return False


def _replace_text(path: pathlib.Path, text: str) -> None:
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


_selected = DEFAULT_TARGET
_selection_used = False  # set once a default (target=None) call has resolved the target


def select_target(target: str) -> None:
    """Make `target` (a key of `BUILD_TARGETS`) this process's kernel build: the library that
    `ensure_loaded()`, `available()` and the wrappers use when given no target. Call it before
    the kernels' first use; choosing another target after that raises ValueError (one build
    serves a process, so that its compiled steps all call the same code)."""
    global _selected
    _check_target(target)
    if _selection_used and target != _selected:
        raise ValueError(f"the CPU kernels of this process already use build target "
                         f"{_selected!r}; select {target!r} before their first use")
    _selected = target


def selected_target() -> str:
    """The build target of this process's kernels ("native" unless `select_target` chose)."""
    return _selected


def resolve_target(target: str | None) -> str:
    """`target`, or the process's selected one for None (which then stays fixed)."""
    global _selection_used
    if target is None:
        _selection_used = True
        return _selected
    _check_target(target)
    return target


def ffi_target(name: str, target: str | None = None) -> str:
    """The FFI target name under which `target`'s library (None: the process's) registers
    handler `name` (a key of `TARGETS`), after loading that library. Raises KernelUnavailable."""
    target = resolve_target(target)
    _load(target)
    return name + _name_suffix(target)


def _name_suffix(target: str) -> str:
    return "" if target == DEFAULT_TARGET else "_" + target.replace("-", "_")


@functools.cache
def _load(target: str) -> ctypes.CDLL:
    try:
        missing = missing_isa(target)
        if missing:
            raise KernelUnavailable(f"this CPU lacks {', '.join(missing)}, which build target "
                                    f"{target!r} needs")
        lib = ctypes.cdll.LoadLibrary(str(library_path(target)))
        for name, symbol in TARGETS.items():
            jax.ffi.register_ffi_target(name + _name_suffix(target),
                                        jax.ffi.pycapsule(getattr(lib, symbol)), platform="cpu")
    except KernelUnavailable:
        raise
    except (OSError, subprocess.SubprocessError, AttributeError) as e:
        raise KernelUnavailable(f"loading the CPU kernels failed: {e}") from e
    return lib


@functools.cache
def _available(target: str) -> bool:
    try:
        _load(target)
    except KernelUnavailable:
        return False
    return True


def available(target: str | None = None) -> bool:
    """True when the kernel library of `target` (None: the process's) builds and loads on this
    host (tried once per process and target)."""
    return _available(resolve_target(target))


def ensure_loaded(target: str | None = None) -> ctypes.CDLL:
    """Build (once) and register the kernels of build target `target` (None: the process's,
    `select_target`); raises KernelUnavailable when they cannot be."""
    return _load(resolve_target(target))
