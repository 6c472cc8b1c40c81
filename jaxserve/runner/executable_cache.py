"""Compiled step executables kept on disk, so that a restart loads them instead of tracing.

JAX's persistent compilation cache skips XLA's compilation, but finds its entry by the lowered
program: every start still traces and lowers each bucket's step (the model, the sampler:
~0.4 s a bucket on a 2-core CPU, most of a warm start). This cache stores the compiled
executables themselves (`jax.experimental.serialize_executable`) under a key computed without
tracing, from everything the program is a function of:

- the code that is traced: every source file of the `jaxserve` packages (models, kernels,
  runner, sampler), hashed (`code_fingerprint`);
- the library versions (jax, jaxlib, flax, numpy, ml_dtypes), the backend (platform and its
  version), the devices of the mesh (ids, kinds, processes), the XLA/TPU environment variables
  and JAX's configuration (`environment_fingerprint`);
- what the engine's backend adds (`Backend.fingerprint`): the host's architecture; on the CPU,
  its instruction sets and the native kernels (the build target and its library, named by the
  hash of its sources, flags, compiler, jaxlib version and CPU, or their absence);
- what the runner passes (`ExecutableCache.scope`): the model's graph definition (its
  architecture config and every static attribute), the weights', KV cache's and sampling
  state's shapes, dtypes and shardings, the fused layer, the sampler's sizes and the bucket.

A change of any of these is another key: a wrong executable is never loaded. An entry carries
a checksum of its bytes: a damaged one (truncated, overwritten, a zero-length file) is removed
with a warning naming it and the step compiled again. As a last line, a loaded executable must
take exactly the argument structure, shapes, dtypes and shardings of the call it replaces, or it
is discarded and the step compiled. Entries are one file each (atomic writes), touched when
used; past `max_bytes` the least recently used go.
Loading an entry deserializes machine code: the directory must be as trusted as the
persistent compilation cache's (it is the user's own cache directory).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import importlib
import logging
import os
import pathlib
import pickle
import threading
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import jax

from jaxserve.models import checksum

logger = logging.getLogger(__name__)

# JAX's own persistent cache, where something enabled it: an executable it returns was loaded,
# not compiled, and XLA:CPU serializes such an executable incompletely (see runner/compile.py).
_JAX_CACHE_HIT = "/jax/compilation_cache/cache_hits"
_jax_cache_hits = threading.local()
_listener_lock = threading.Lock()
_listening = False


def _on_event(event: str, **kwargs) -> None:
    if event == _JAX_CACHE_HIT:
        _jax_cache_hits.count = getattr(_jax_cache_hits, "count", 0) + 1


def _listen() -> None:
    global _listening
    with _listener_lock:
        if not _listening:
            jax.monitoring.register_event_listener(_on_event)
            _listening = True

FORMAT = 2  # bump when the file layout changes. 2: a checksum of the pickled entry first
_MAGIC = b"JXSEXE02"
_DIGEST_BYTES = 32
_SUFFIX = ".jexe"
DEFAULT_MAX_BYTES = 4 << 30
# Packages whose source is traced into the step (their folders: jaxserve includes runner,
# sampling, backends; models and pallas_kernels are installed into the jaxserve namespace from
# folders of their own).
_PACKAGES = ("jaxserve", "jaxserve.models", "jaxserve.pallas_kernels")
_SOURCE_SUFFIXES = (".py", ".cc", ".h")
# JAX options that do not change a compiled program (caches, logging, debugging output).
_CONFIG_IGNORED = ("cache", "log", "explain", "dump", "traceback", "pprint", "source_url", "timeout",
                   "transfer_guard", "thread_guard", "tracer_error")
_ENV_PREFIXES = ("XLA_", "LIBTPU_", "TPU_", "JAX_", "JAXSERVE_MLA_")


@functools.cache
def code_fingerprint() -> str:
    """SHA-256 of the jaxserve packages' sources (relative path and contents of every file)."""
    h = hashlib.sha256()
    for package in _PACKAGES:
        root = pathlib.Path(importlib.import_module(package).__file__).parent
        for path in sorted(root.rglob("*")):
            if path.suffix in _SOURCE_SUFFIXES and "__pycache__" not in path.parts and path.is_file():
                h.update(f"{package}:{path.relative_to(root).as_posix()}\0".encode())
                h.update(path.read_bytes())
                h.update(b"\0")
    return h.hexdigest()


def _version(module: str) -> str:
    try:
        return str(importlib.import_module(module).__version__)
    except (ImportError, AttributeError):
        return "-"


def environment_fingerprint(devices: Iterable[jax.Device]) -> dict[str, str]:
    """What besides the program decides the executable: versions, devices, flags (the backend
    adds its own: `Backend.fingerprint`)."""
    devices = list(devices)
    client = devices[0].client
    config = {k: v for k, v in sorted(jax.config.values.items())
              if not any(word in k for word in _CONFIG_IGNORED)}
    return {
        "format": str(FORMAT),
        "code": code_fingerprint(),
        "versions": " ".join(f"{m}={_version(m)}" for m in ("jax", "jaxlib", "flax", "numpy", "ml_dtypes")),
        "backend": f"{client.platform} {client.platform_version}",
        "devices": repr([(d.id, d.process_index, d.device_kind, d.platform) for d in devices]),
        "processes": f"{jax.process_index()}/{jax.process_count()}",
        "env": repr(sorted((k, v) for k, v in os.environ.items() if k.startswith(_ENV_PREFIXES))),
        "config": repr(config),
    }


def canonical(x: Any) -> str:
    """A description of `x` that is the same in every process and for equal values: like repr,
    with sets sorted (a set's repr follows string hashes, which differ from process to
    process), dicts sorted by key (flax orders a variable's metadata by how it was made), and
    dataclasses written field by field (so what they hold is sorted too)."""
    if isinstance(x, (set, frozenset)):
        return "{" + ",".join(sorted(canonical(e) for e in x)) + "}"
    if isinstance(x, Mapping):
        return "{" + ",".join(sorted(f"{canonical(k)}:{canonical(v)}" for k, v in x.items())) + "}"
    if isinstance(x, (list, tuple)):
        return f"{type(x).__name__}(" + ",".join(map(canonical, x)) + ")"
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return f"{type(x).__qualname__}(" + ",".join(
            f"{f.name}={canonical(getattr(x, f.name))}" for f in dataclasses.fields(x)) + ")"
    return repr(x)


def signature(tree: Any) -> str:
    """Shapes, dtypes and shardings of a pytree's leaves, with its structure."""
    leaves, treedef = jax.tree.flatten(tree)
    return repr((str(treedef), [(tuple(x.shape), str(x.dtype), repr(getattr(x, "sharding", None)))
                                for x in leaves]))


class ExecutableCache:
    """A directory of serialized executables; `scope(...)` gives the keyed view one runner uses."""

    def __init__(self, directory: str | os.PathLike[str], max_bytes: int = DEFAULT_MAX_BYTES,
                 read_only: bool = False):
        self.directory = pathlib.Path(directory)
        self.max_bytes = max_bytes
        # A directory of executables compiled ahead (runner/prebuilt.py): loaded from, never
        # written to or pruned (an entry that fails its checks is skipped, not removed).
        self.read_only = read_only
        self.hits = 0
        self.misses = 0

    def scope(self, devices: Iterable[jax.Device], **parts: str) -> ExecutableScope:
        """Keys for the executables of one runner: the environment of `devices` plus `parts`
        (descriptions of everything else the programs depend on)."""
        devices = list(devices)
        material = {**environment_fingerprint(devices), **parts}
        h = hashlib.sha256()
        for name in sorted(material):
            h.update(f"{name}\0{material[name]}\0".encode())
        if logger.isEnabledFor(logging.DEBUG):  # which part changed, when a restart misses
            logger.debug("executable cache key %s: %s", h.hexdigest()[:16], ", ".join(
                f"{name} {hashlib.sha256(material[name].encode()).hexdigest()[:8]}" for name in sorted(material)))
        return ExecutableScope(self, h.hexdigest(), devices)

    # ------------------------------------------------------------------ files
    def _path(self, key: str, name: str) -> pathlib.Path:
        safe = "".join(c if c.isalnum() or c in "-_" else "_" for c in name)[:40]
        return self.directory / f"{safe}-{key[:40]}{_SUFFIX}"

    def has(self, key: str, name: str) -> bool:
        """Whether an entry is stored under `key` (it may still fail its checks when loaded)."""
        return self._path(key, name).is_file()

    def load(self, key: str, name: str, args: tuple, devices: list[jax.Device] | None = None
             ) -> jax.stages.Compiled | None:
        """The executable stored under `key`, if any and if it takes `args` (abstract) exactly;
        loaded onto `devices` (its device assignment, in order; default: the first device)."""
        from jax.experimental.serialize_executable import deserialize_and_load

        path = self._path(key, name)
        try:
            blob = path.read_bytes()
        except FileNotFoundError:
            self.misses += 1
            return None
        except OSError as e:
            logger.warning("cannot read the cached executable %s (%s); compiling", path, e)
            self.misses += 1
            return None
        head = len(_MAGIC) + _DIGEST_BYTES
        stored_digest = blob[len(_MAGIC):head].decode("ascii", "replace")
        if blob[:len(_MAGIC)] != _MAGIC or checksum.digest(blob[head:]) != stored_digest:
            logger.warning("the cached executable %s is damaged (it fails its checksum): %s; compiling",
                           path, "skipping it" if self.read_only else "removing it")
            self._discard(path)
            self.misses += 1
            return None
        try:
            fmt, stored_key, payload, in_tree, out_tree = pickle.loads(blob[head:])
            if fmt != FORMAT or stored_key != key:
                raise ValueError("another format or key")
            compiled = deserialize_and_load(payload, in_tree, out_tree,
                                            execution_devices=devices or jax.devices()[:1])
            if not _same_arguments(compiled, args):
                raise ValueError("it takes other arguments")
        except Exception as e:  # noqa: BLE001 - any unreadable entry: compile instead
            logger.warning("discarding the cached executable %s (%s: %s); compiling", path.name,
                           type(e).__name__, e)
            self._discard(path)
            self.misses += 1
            return None
        if not self.read_only:
            try:
                os.utime(path)  # recently used: kept longest
            except OSError:
                pass
        self.hits += 1
        return compiled

    def _discard(self, path: pathlib.Path) -> None:
        if not self.read_only:
            _unlink(path)

    def store(self, key: str, name: str, compiled: jax.stages.Compiled) -> None:
        """Keep `compiled` under `key` (best effort: a failure is logged, serving goes on)."""
        from jax.experimental.serialize_executable import serialize

        if self.read_only:
            return
        path = self._path(key, name)
        try:
            payload, in_tree, out_tree = serialize(compiled)
            blob = pickle.dumps((FORMAT, key, payload, in_tree, out_tree), protocol=pickle.HIGHEST_PROTOCOL)
            self.directory.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
            tmp.write_bytes(_MAGIC + checksum.digest(blob).encode("ascii") + blob)
            os.replace(tmp, path)  # atomic: concurrent writers each install a whole file
        except Exception as e:  # noqa: BLE001 - e.g. an executable that cannot be serialized
            logger.warning("cannot cache the executable %s (%s: %s)", name, type(e).__name__, e)
            return
        evict_least_recently_used(self.directory, _SUFFIX, self.max_bytes)


def executable_scope(cache: ExecutableCache | None, devices: Iterable[jax.Device], **parts: str) -> ExecutableScope:
    """`cache.scope(devices, **parts)`, or without a cache a scope that always compiles."""
    return ExecutableScope(None, "", []) if cache is None else cache.scope(devices, **parts)


class ExecutableScope:
    """The executables of one runner: `get(name, args, compile)` loads or compiles and stores.
    `prebuilt`: a read-only scope of executables compiled ahead for these devices
    (runner/prebuilt.py), looked in first."""

    def __init__(self, cache: ExecutableCache | None, key: str, devices: list[jax.Device],
                 prebuilt: ExecutableScope | None = None):
        self.cache = cache
        self.key = key
        self.devices = devices  # the executables' device assignment, in order
        self.prebuilt = prebuilt
        self.loaded = 0
        self.compiled = 0

    def entry_key(self, name: str) -> str:
        return hashlib.sha256(f"{self.key}\0{name}".encode()).hexdigest()

    def has(self, name: str) -> bool:
        """Whether an entry for `name` is stored (here or in the executables compiled ahead)."""
        return ((self.cache is not None and self.cache.has(self.entry_key(name), name))
                or (self.prebuilt is not None and self.prebuilt.has(name)))

    def get(self, name: str, args: tuple, compile_fn: Callable[[], jax.stages.Compiled]) -> jax.stages.Compiled:
        """The executable `name` taking `args` (abstract, with shardings): loaded when compiled
        ahead or cached, else `compile_fn()`, then stored."""
        if self.prebuilt is not None and self.prebuilt.has(name):
            compiled = self.prebuilt.cache.load(self.prebuilt.entry_key(name), name, args, self.prebuilt.devices)
            if compiled is not None:
                self.loaded += 1
                return compiled
        if self.cache is None:
            self.compiled += 1
            return compile_fn()
        key = self.entry_key(name)
        compiled = self.cache.load(key, name, args, self.devices)
        if compiled is not None:
            self.loaded += 1
            return compiled
        _listen()
        hits = getattr(_jax_cache_hits, "count", 0)
        compiled = compile_fn()
        self.compiled += 1
        if getattr(_jax_cache_hits, "count", 0) != hits:
            logger.info("not caching the executable %s: JAX's persistent cache gave it (loaded, not compiled)", name)
        else:
            self.cache.store(key, name, compiled)
        return compiled


def _same_arguments(compiled: jax.stages.Compiled, args: tuple) -> bool:
    """Whether `compiled` takes `args`: the same tree, shapes, dtypes and shardings."""
    infos, tree = jax.tree.flatten(compiled.args_info)
    leaves, expected = jax.tree.flatten((args, {}))
    if tree != expected or len(infos) != len(leaves):
        return False
    shardings = jax.tree.leaves(compiled.input_shardings, is_leaf=lambda x: x is None)
    for info, x, have in zip(infos, leaves, shardings):
        if tuple(info.shape) != tuple(x.shape) or info.dtype != x.dtype:
            return False
        want = getattr(x, "sharding", None)
        if want is not None and have is not None and not have.is_equivalent_to(want, len(x.shape)):
            return False
    return True


def evict_least_recently_used(directory: pathlib.Path, suffix: str, max_bytes: int) -> None:
    """Remove a cache directory's least recently used `*suffix` entries (by modification time,
    which loads refresh) while they hold over max_bytes."""
    try:
        entries = [(p.stat().st_mtime, p.stat().st_size, p) for p in directory.glob(f"*{suffix}")]
    except OSError:
        return
    total = sum(size for _, size, _ in entries)
    for _, size, path in sorted(entries, key=lambda e: e[0]):
        if total <= max_bytes:
            break
        _unlink(path)
        total -= size


def _unlink(path: pathlib.Path) -> None:
    try:
        path.unlink()
    except OSError:
        pass
