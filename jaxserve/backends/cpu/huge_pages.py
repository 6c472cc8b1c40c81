"""Backing the CPU's large buffers (weights, KV cache) with transparent huge pages.

With 4 KiB pages, the scattered K/V reads of decode attention and the weight streams of the
products miss the TLB every few KiB (see docs/DESIGN.md §9, "Huge pages on the CPU", for the
measurements). Two ways in:
- The weights (read-only) are copied into one anonymous arena advised MADV_HUGEPAGE before it
  is touched, and handed to XLA without a copy. Most weights alone are smaller than a huge
  page, so in XLA's own buffers only about half of their bytes could be huge pages.
- The KV cache (donated to every step) stays XLA's buffer and is advised after the fact:
  MADV_HUGEPAGE, then MADV_COLLAPSE (Linux 6.1+) on its whole aligned 2 MiB ranges, which
  copies the touched pages into huge ones now, on a background thread. It never changes
  contents, so steps may run meanwhile.
Where transparent huge pages are off, or the system is not Linux, both do nothing.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import mmap
import pathlib
import sys
import threading
import time
from typing import Iterable

import jax
import numpy as np

logger = logging.getLogger(__name__)

HUGE_PAGE = 2 << 20
PAGE = 4096
MADV_HUGEPAGE = 14
MADV_COLLAPSE = 25


def thp_enabled() -> bool:
    """Whether this system gives transparent huge pages to memory advised MADV_HUGEPAGE."""
    path = pathlib.Path("/sys/kernel/mm/transparent_hugepage/enabled")
    try:
        return sys.platform.startswith("linux") and "[never]" not in path.read_text()
    except OSError:
        return False


def _madvise():
    if not thp_enabled():
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


def advise_huge_pages(ranges: Iterable[tuple[int, int]]) -> int:
    """Asks for huge pages under host memory ranges (see host_ranges); returns the bytes
    collapsed.

    MADV_COLLAPSE is best-effort: one huge page at a time, a page the kernel could not isolate
    now (EAGAIN: pages in use, e.g. by a step running meanwhile) is tried again a few times; a
    page it has no free huge page for (ENOMEM: fragmented memory) stays small. Neither advice
    changes contents, and a range no longer mapped fails harmlessly."""
    madvise = _madvise()
    if madvise is None:
        return 0
    done = 0
    for start, length in ranges:
        if madvise(start, length, MADV_HUGEPAGE) != 0:
            return done  # transparent huge pages are off (or unsupported) here
        for page in range(start, start + length, HUGE_PAGE):
            if _collapse(madvise, page):
                done += HUGE_PAGE
    return done


def _collapse(madvise, page: int, tries: int = 5) -> bool:
    for attempt in range(tries):
        if madvise(page, HUGE_PAGE, MADV_COLLAPSE) == 0:
            return True
        if ctypes.get_errno() != errno.EAGAIN:
            return False
        time.sleep(0.01 * (attempt + 1))
    return False


def place_on_huge_pages(arrays: list[jax.Array]) -> tuple[list[jax.Array], int]:
    """The arrays, those on a single CPU device moved into a huge-page arena (see above).

    Returns the new list (the others unchanged) and the bytes now backed by the arena. The
    arena lives as long as any array in it (each holds its host view, which holds the arena).
    """
    madvise = _madvise()
    picked = [i for i, x in enumerate(arrays) if x.nbytes > 0 and _on_one_cpu(x)]
    if madvise is None or not picked:
        return list(arrays), 0
    offsets, total = [], 0
    for i in picked:
        offsets.append(total)
        total += -(-arrays[i].nbytes // PAGE) * PAGE
    total = -(-total // HUGE_PAGE) * HUGE_PAGE
    arena = mmap.mmap(-1, total + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    raw = np.frombuffer(arena, np.uint8)
    shift = -raw.ctypes.data % HUGE_PAGE  # the arena proper starts on a huge page
    if madvise(raw.ctypes.data + shift, total, MADV_HUGEPAGE) != 0:
        return list(arrays), 0
    out, aliased = list(arrays), 0
    for i, off in zip(picked, offsets):
        x = arrays[i]
        view = raw[shift + off : shift + off + x.nbytes].view(x.dtype).reshape(x.shape)
        view[...] = np.asarray(x)
        out[i] = jax.device_put(view, x.sharding, may_alias=True)
        if out[i].unsafe_buffer_pointer() == view.ctypes.data:
            aliased += x.nbytes
    return out, aliased


def release_freed_host_memory() -> None:
    """Returns memory the C allocator keeps after frees to the system (glibc's malloc_trim).

    Moving the weights frees XLA's copies of them, which glibc would otherwise keep mapped
    (~200 MB of resident memory for the default model)."""
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (AttributeError, OSError):
        return
    trim.argtypes = [ctypes.c_size_t]
    trim(0)


def _on_one_cpu(x: jax.Array) -> bool:
    devices = x.sharding.device_set
    return len(devices) == 1 and next(iter(devices)).platform == "cpu"


class HugePageAdvice(threading.Thread):
    """advise_huge_pages on a daemon thread; `collapsed` is the bytes it backed with huge
    pages, once joined.

    The thread is given addresses, never the arrays: a daemon thread that drops the last
    reference to a jax.Array while the interpreter exits aborts the process (the array's
    destructor waits for the GIL, which an exiting interpreter answers by ending the thread
    inside C++). The buffers outlive the advice: the runner holds the weights, and each step
    donates the KV cache back into the same buffers."""

    def __init__(self, ranges: list[tuple[int, int]]):
        super().__init__(name="jaxserve-huge-pages", daemon=True)
        self.ranges = ranges
        self.collapsed = 0

    def run(self):
        self.collapsed = advise_huge_pages(self.ranges)
        logger.debug("huge pages: %.0f MiB collapsed", self.collapsed / 2**20)


def advise_in_background(arrays: Iterable[jax.Array]) -> HugePageAdvice:
    thread = HugePageAdvice(host_ranges(arrays))
    thread.start()
    return thread
