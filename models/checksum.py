"""Content digests for what jaxserve keeps on disk (converted checkpoints, laid-out weights,
compiled executables), so that a damaged entry is found and rebuilt instead of served.

XXH3-128 (the `xxhash` package): ~17 GB/s on one core of the 2-core development host against
~1.5 GB/s for SHA-256, so checking a cache entry costs little next to reading it; it releases
the GIL, so it runs beside the copies of a load. It guards against damage (bad disks, truncated
copies, interrupted syncs, a file from elsewhere renamed into place), not against an attacker
who can write the cache directory: such a user can write the executables too.
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Mapping

import xxhash

ALGORITHM = "xxh3_128"


def digest(data) -> str:
    """The hex digest of a bytes-like object (bytes, memoryview, a contiguous numpy array)."""
    return xxhash.xxh3_128_hexdigest(data)


def file_digest(path: str | os.PathLike[str]) -> str:
    """The hex digest of a file's contents, hashed from a memory map (no copy: 513 MiB in
    0.07 s here, against 0.5 s read in chunks)."""
    with open(path, "rb") as f:
        if os.fstat(f.fileno()).st_size == 0:
            return digest(b"")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
            return digest(mm)


def manifest(directory: str | os.PathLike[str], names: list[str]) -> dict[str, dict]:
    """{name: {"size", ALGORITHM}} for files of a directory."""
    return {name: {"size": os.path.getsize(os.path.join(directory, name)),
                   ALGORITHM: file_digest(os.path.join(directory, name))} for name in names}


def damaged_files(directory: str | os.PathLike[str], expected: Mapping[str, Mapping]) -> list[str]:
    """The files of `expected` (a manifest) that are missing or differ from it in size or
    contents, in order."""
    bad = []
    for name, want in expected.items():
        path = os.path.join(directory, name)
        try:
            if os.path.getsize(path) != want["size"] or file_digest(path) != want[ALGORITHM]:
                bad.append(name)
        except OSError:
            bad.append(name)
    return bad
