"""Weights as the backend laid them out (packed for the CPU product kernels), kept on disk, so
that a restart reads them instead of reading, converting and packing the checkpoint again.

On the 2-core CPU the default model's weights took ~0.8 s to read from the converted float32
checkpoint and convert to bfloat16, and ~0.6 s more to pack (a third of a warm start by then);
read back from this cache they take the time of one copy. Only backends whose
`prepare_model` does such work use it (`Backend.lays_out_weights`: the CPU with its product
kernels), and only for float weights. `jaxserve compile --weights` writes one entry of this
format for a target, under a key of its own (runner/prebuilt.py), read with `read_only`.

An entry is one file: a magic, the header's length and checksum, a JSON header (the key, and
each leaf's path, shape, dtype, place and checksum) and the leaves' bytes, page-aligned, in the
order of the model's state. Its key covers what the bytes depend on: the checkpoint
(config.json, and the checksums a converted checkpoint recorded of its files, or for any other
directory each weight file's name, size, modification time and first and last MiB), the dtype,
the backend's plan, the sharding rules, and the environment of the executable cache (the
jaxserve sources, library versions, devices, CPU). On a restart the model's structure is
rebuilt without any work (the abstract model, laid out on shapes only) and must match the
header leaf for leaf, and every leaf's bytes their checksum (checked on a thread while the
leaves are copied), or the entry is discarded with a warning naming it and the weights are
prepared from the checkpoint again. Writes are atomic; past `max_bytes` the least recently
used entries go.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import json
import logging
import mmap
import os
import pathlib
import struct
from collections.abc import Iterable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxserve.models import checksum
from jaxserve.models.loader import conversion_identity
from jaxserve.runner.executable_cache import canonical, environment_fingerprint, evict_least_recently_used

logger = logging.getLogger(__name__)

FORMAT = 2  # 2: checksums of the header and of every leaf
MAGIC = b"JXSWGT02"
_DIGEST_BYTES = 32  # the header's checksum, hex
DEFAULT_MAX_BYTES = 8 << 30
_SUFFIX = ".weights"
_ALIGN = 4096
_MIB = 1 << 20


def checkpoint_identity(path: pathlib.Path, config: dict, mtime: bool = True) -> str:
    """config.json, and the converted files' checksums for a checkpoint jaxserve converted (its
    contents); for any other directory each weight file's name, size, modification time and
    first and last MiB (as the GGUF conversion cache identifies its source). mtime=False: without
    the modification time (weights prepared on another host: a copy changes it)."""
    h = hashlib.sha256(json.dumps(config, sort_keys=True).encode())
    converted = conversion_identity(path)
    if converted is not None:
        h.update(converted.encode())
        return h.hexdigest()
    for file in sorted(pathlib.Path(path).glob("*.safetensors")):
        stat = file.stat()
        h.update(f"{file.name}|{stat.st_size}|{stat.st_mtime_ns if mtime else '-'}|".encode())
        with open(file, "rb") as f:
            h.update(f.read(_MIB))
            f.seek(max(0, stat.st_size - _MIB))
            h.update(f.read(_MIB))
    return h.hexdigest()


def _data_start(header_bytes: int) -> int:
    """Where the leaves' bytes begin (their offsets count from there): after the magic, the
    header's length and checksum and the header, aligned."""
    return -(-(len(MAGIC) + 8 + _DIGEST_BYTES + header_bytes) // _ALIGN) * _ALIGN


def _leaves(model) -> tuple[list[tuple[str, object]], object, object]:
    """The model's state leaves with their paths, the state's tree and the graph definition."""
    graphdef, state = nnx.split(model)
    with_paths, treedef = jax.tree_util.tree_flatten_with_path(state)
    return [(jax.tree_util.keystr(p), x) for p, x in with_paths], treedef, graphdef


class DamagedEntryError(ValueError):
    """A cache entry's bytes are not those that were written."""


class WeightCache:
    def __init__(self, directory: str | os.PathLike[str], max_bytes: int = DEFAULT_MAX_BYTES,
                 read_only: bool = False):
        """read_only: entries are never removed or touched (a directory `jaxserve compile` wrote)."""
        self.directory = pathlib.Path(directory)
        self.max_bytes = max_bytes
        self.read_only = read_only

    def key(self, checkpoint: pathlib.Path, config: dict, devices: Iterable[jax.Device], **parts: str) -> str:
        material = {**environment_fingerprint(devices), "checkpoint": checkpoint_identity(checkpoint, config),
                    **parts}
        return hashlib.sha256(canonical(sorted(material.items())).encode()).hexdigest()

    def _path(self, key: str) -> pathlib.Path:
        return self.directory / f"{key[:40]}{_SUFFIX}"

    def load(self, key: str, abstract_model):
        """`abstract_model` (ShapeDtypeStructs with shardings, laid out as the backend lays out
        the weights) with the stored weights, or None when there is no entry that fits. An entry
        whose header or leaves fail their checksums is removed (logged, naming it)."""
        path = self._path(key)
        expected, treedef, graphdef = _leaves(abstract_model)
        try:
            f = open(path, "rb")
        except FileNotFoundError:
            return None
        arrays = []
        try:
            with f:
                if f.read(len(MAGIC)) != MAGIC:
                    raise ValueError("not a weight cache entry of this format")
                (n,) = struct.unpack("<Q", f.read(8))
                want_digest = f.read(_DIGEST_BYTES).decode("ascii", "replace")
                raw = f.read(n)
                if checksum.digest(raw) != want_digest:
                    raise DamagedEntryError("its header fails its checksum")
                header = json.loads(raw)
                leaves = header["leaves"]
                if header.get("format") != FORMAT or header.get("key") != key:
                    raise ValueError("another format or key")
                if [(p, tuple(s), d) for p, s, d, _, _, _ in leaves] != [
                        (p, tuple(x.shape), jnp.dtype(x.dtype).name) for p, x in expected]:
                    raise ValueError("the model's layout differs")
                start = _data_start(n)
                # Copied from the mapping into the device buffers (the mapping closes when the
                # last view of it goes), each leaf's checksum computed on a thread meanwhile.
                mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
                views = [memoryview(mm)[start + offset: start + offset + nbytes]
                         for _, _, _, offset, nbytes, _ in leaves]
                if any(len(v) != nbytes for v, (_, _, _, _, nbytes, _) in zip(views, leaves)):
                    raise DamagedEntryError("it is shorter than its header says")
                with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="jaxserve-checksum") as pool:
                    digests = pool.map(checksum.digest, views)
                    for view, (_, shape, dtype, _, _, _), (_, x) in zip(views, leaves, expected):
                        host = np.frombuffer(view, jnp.dtype(dtype)).reshape(shape)
                        arrays.append(jax.device_put(host, x.sharding, may_alias=False))
                    jax.block_until_ready(arrays)
                    bad = [p for (p, *_, want), got in zip(leaves, digests) if got != want]
                del host, view, views, mm
                if bad:
                    raise DamagedEntryError(f"{len(bad)} of its {len(leaves)} arrays fail their checksums "
                                            f"(first: {bad[0]})")
        except DamagedEntryError as e:
            del arrays
            logger.warning("the cached weights %s are damaged (%s): %sthe weights are prepared from the "
                           "checkpoint again", path, e, "" if self.read_only else "removing them; ")
            if not self.read_only:
                path.unlink(missing_ok=True)
            return None
        except Exception as e:  # noqa: BLE001 - any unreadable entry: prepare the weights instead
            del arrays
            logger.warning("ignoring the cached weights %s (%s: %s)", path, type(e).__name__, e)
            return None
        try:
            if not self.read_only:
                os.utime(path)  # recently used: kept longest
        except OSError:
            pass
        return nnx.merge(graphdef, jax.tree.unflatten(treedef, arrays))

    def store(self, key: str, model) -> None:
        """Keep `model`'s weights under `key` (best effort: a failure is logged)."""
        leaves, _, _ = _leaves(model)
        table, offset = [], 0
        for p, x in leaves:
            offset = -(-offset // _ALIGN) * _ALIGN
            table.append([p, list(x.shape), jnp.dtype(x.dtype).name, offset, int(x.nbytes), None])
            offset += int(x.nbytes)
        if offset > self.max_bytes:
            logger.info("not caching %.1f GiB of weights (more than the cache's %.1f GiB)", offset / 2**30,
                        self.max_bytes / 2**30)
            return
        path = self._path(key)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        try:
            def header() -> bytes:
                return json.dumps({"format": FORMAT, "key": key, "checksum": checksum.ALGORITHM,
                                   "leaves": table}).encode()

            for row in table:
                row[5] = "0" * _DIGEST_BYTES  # the checksums are written once known: same length
            n = len(header())
            start = _data_start(n)
            self.directory.mkdir(parents=True, exist_ok=True)
            with open(tmp, "wb") as f:
                for (_, x), row in zip(leaves, table):
                    host = np.ascontiguousarray(np.asarray(x))
                    row[5] = checksum.digest(host.view(np.uint8).reshape(-1))
                    f.seek(start + row[3])
                    host.tofile(f)
                    del host
                data = header()
                assert len(data) == n, "a checksum changed the header's length"
                f.seek(0)
                f.write(MAGIC + struct.pack("<Q", n) + checksum.digest(data).encode("ascii") + data)
            os.replace(tmp, path)  # atomic: concurrent writers each install a whole file
        except Exception as e:  # noqa: BLE001 - e.g. a full disk: serving goes on
            logger.warning("cannot cache the weights (%s: %s)", type(e).__name__, e)
            tmp.unlink(missing_ok=True)
            return
        evict_least_recently_used(self.directory, _SUFFIX, self.max_bytes)
