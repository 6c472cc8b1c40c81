"""Backing the CPU's large buffers (KV cache, weights) with transparent huge pages.

Decode attention reads K/V rows scattered over pages of the cache, and the products stream
every weight once per step; with 4 KiB pages each few KiB read is a TLB miss (a costly page
walk under virtualization). Measured here in one process, huge pages make decode attention
over a 32-request step 1.16-1.20x faster and a 32-row product 1.06-1.22x (1-row: 1.13x).

XLA allocates the buffers, so they are advised after the fact: MADV_HUGEPAGE, then
MADV_COLLAPSE (Linux 6.1+) to move the already-touched pages now rather than whenever the
kernel's background scanner gets there. Only whole aligned 2 MiB ranges inside a buffer can
be huge pages. Collapsing copies the memory (~0.15 s per 100 MB here), so the engine does it
on a background thread; it never changes contents, so steps may run meanwhile. Where the
system has transparent huge pages off, or is not Linux, this does nothing.
"""

from __future__ import annotations

import ctypes
import logging
import sys
import threading
from typing import Iterable

import jax

logger = logging.getLogger(__name__)

HUGE_PAGE = 2 << 20
MADV_HUGEPAGE = 14
MADV_COLLAPSE = 25


def _madvise():
    if not sys.platform.startswith("linux"):
        return None
    libc = ctypes.CDLL(None, use_errno=True)
    fn = libc.madvise
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


def host_ranges(arrays: Iterable[jax.Array]) -> list[tuple[int, int]]:
    """(start, length) of each whole aligned 2 MiB range inside the arrays' CPU buffers."""
    out = []
    for x in arrays:
        for shard in x.addressable_shards:
            if shard.device.platform != "cpu":
                continue
            ptr, n = shard.data.unsafe_buffer_pointer(), shard.data.nbytes
            lo = -(-ptr // HUGE_PAGE) * HUGE_PAGE
            hi = (ptr + n) // HUGE_PAGE * HUGE_PAGE
            if hi > lo:
                out.append((lo, hi - lo))
    return out


def advise_huge_pages(arrays: Iterable[jax.Array]) -> int:
    """Asks for huge pages under the arrays' CPU buffers; returns the bytes collapsed."""
    madvise = _madvise()
    if madvise is None:
        return 0
    done = 0
    for start, length in host_ranges(arrays):
        if madvise(start, length, MADV_HUGEPAGE) != 0:
            return done  # transparent huge pages are off (or unsupported) here
        if madvise(start, length, MADV_COLLAPSE) == 0:
            done += length
    return done


def advise_in_background(arrays: Iterable[jax.Array]) -> threading.Thread:
    """advise_huge_pages on a daemon thread (it holds the arrays until done)."""
    arrays = list(arrays)

    def work():
        done = advise_huge_pages(arrays)
        logger.debug("huge pages: %.0f MiB collapsed", done / 2**20)

    thread = threading.Thread(target=work, name="jaxserve-huge-pages", daemon=True)
    thread.start()
    return thread
