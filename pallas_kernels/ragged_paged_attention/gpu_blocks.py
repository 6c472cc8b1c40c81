"""Block sizes of the Mosaic GPU attention kernel (`gpu_mosaic.py`), per chip: the one table.

What a block size is here (see `gpu_mosaic.py` for the kernels):

- `chunk_keys`: keys per pipeline step (a chunk: the pages TMA copies for one step; 64 keys of a
  16-bit cache fill the 128-byte swizzle of a wgmma operand). A page larger than a chunk is one
  chunk.
- `decode_slots`, `prefill_slots`: chunks in flight, the pipeline's depth (shared memory holds
  that many K and V chunks; one more chunk is copied while one is computed).
- `programs`: how many programs the decode grid aims for (SMs x programs resident on an SM x
  waves); the decode kernel's KV split count is chosen from it: S = ceil(programs / (R * Hkv)),
  at most `max_splits`, and at most what the longest context allows at `min_split_keys` keys a
  split (a split reads at least that many keys, at run time too: short contexts use fewer
  splits, the others exit at once).

The values are PREDICTED, NOT MEASURED: no GPU was at hand when they were chosen. They come
from the compilers' own figures for the kernel compiled for sm_90a on a host without a GPU
(benchmarks/gpu_kernel_compile.py: ptxas registers and spills, Mosaic GPU's shared memory per
block, hence programs resident per SM), and Little's law for the bytes an SM must keep in
flight (H100 3.35 TB/s, H200 4.8 TB/s, both 132 SMs at ~1.8 GHz and ~1 us of HBM latency:
~25 and ~36 KiB an SM). The device check's kernel benchmark sweeps them
(benchmarks/kernel_benchmark.py --sweep): the next device run measures them, and this table
then takes its winners.
"""

from __future__ import annotations

import contextlib
import dataclasses
import re

import jax


@dataclasses.dataclass(frozen=True)
class MosaicBlocks:
    chunk_keys: int = 64
    decode_slots: int = 3
    prefill_slots: int = 2
    programs: int = 528  # 132 SMs x 2 resident decode programs x 2 waves
    max_splits: int = 16
    min_split_keys: int = 512


# Predicted from the compile figures (benchmarks/results/gpu_kernel_compile.jsonl, --sweep on
# the llama3-8b, llama3-70b-tp8 and smollm2 decode shapes; docs/performance.md, "GPU attention
# kernels"):
# - 16-bit pages, head dim 128: 3 slots, 215-224 registers and 98 KiB of shared memory a decode
#   program: 2 programs an SM (4 slots, 130 KiB, leave room for one; so do chunks of 128 keys,
#   241-243 registers and 130-194 KiB). 2 programs x 2 chunks copied ahead x 32 KiB = 128 KiB
#   in flight an SM, against the ~40-60 KiB Little's law asks of either chip (~25 and ~36 KB/us
#   an SM at ~1.5 us of loaded HBM latency).
# - 16-bit pages, head dim 64: 4 slots (66 KiB, 145 registers): 3 programs an SM.
# - one-byte pages (a chunk is half the bytes; one 16-bit staging chunk for K and V each):
#   head dim 128, 4 slots (98 KiB, 237-247 registers): 2 programs an SM; head dim 64, 4 slots
#   (50 KiB, 165 registers): 3 programs an SM.
# - prefill (query blocks of 64 rows): 2 slots, as before (229-237 registers, 82 KiB: 2 an SM).
# - programs: SMs x programs resident x 2 waves.
# H100 and H200 compile identically (both sm_90a, 132 SMs, 227 KiB of shared memory a block):
# their rows are the same until the device check measures them apart (the H200's 1.4x
# bandwidth may want deeper pipelines or more splits); any other Hopper part takes "sm90".
_HOPPER = {
    (None, 2): MosaicBlocks(decode_slots=3, programs=528),
    (64, 2): MosaicBlocks(decode_slots=4, programs=792),
    (None, 1): MosaicBlocks(decode_slots=4, programs=528),
    (64, 1): MosaicBlocks(decode_slots=4, programs=792),
}
# (chip, head_dim, cache bytes per element) -> blocks; head_dim None: every other head dim.
_TABLE: dict[tuple[str, int | None, int], MosaicBlocks] = {
    (chip, d, size): blocks
    for chip in ("h100", "h200", "sm90")
    for (d, size), blocks in _HOPPER.items()
}
CHIPS = ("h100", "h200", "sm90")

_target: list[str] = []  # set by `target_chip`, innermost last


@contextlib.contextmanager
def target_chip(chip: str):
    """Trace the kernel for `chip` ("h100", "h200", "sm90") whatever JAX's default device is:
    for programs compiled for a GPU on a host without one (benchmarks/gpu_kernel_compile.py)."""
    if chip not in CHIPS:
        raise ValueError(f"unknown chip {chip!r}; one of {CHIPS}")
    _target.append(chip)
    try:
        yield
    finally:
        _target.pop()


def chip_of(device_kind: str) -> str:
    """The table's name for a device kind ("NVIDIA H100 80GB HBM3" -> "h100")."""
    m = re.search(r"\bH(100|200)\b", device_kind.upper().replace("NVIDIA ", " "))
    return f"h{m.group(1)}" if m else "sm90"


def current_chip() -> str:
    if _target:
        return _target[-1]
    if jax.default_backend() == "gpu":
        return chip_of(jax.devices()[0].device_kind)
    return "sm90"


def lookup(head_dim: int, cache_itemsize: int, chip: str | None = None) -> MosaicBlocks:
    """The table's blocks for this chip (default: the device's), head dim and cache element
    size; the chip's own entry, else the default Hopper one."""
    chip = chip or current_chip()
    size = 1 if cache_itemsize == 1 else 2
    for key in ((chip, head_dim, size), (chip, None, size), ("sm90", head_dim, size),
                ("sm90", None, size)):
        if key in _TABLE:
            return _TABLE[key]
    raise AssertionError("the default entries cover every size")


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def decode_splits(blocks: MosaicBlocks, num_reqs: int, num_kv_heads: int, max_keys: int) -> int:
    """KV splits of the decode grid: enough programs for `blocks.programs`, no more than the
    longest context (`max_keys`, the block table's pages) fills at `min_split_keys` a split."""
    want = cdiv(blocks.programs, max(num_reqs * num_kv_heads, 1))
    return max(1, min(want, blocks.max_splits, cdiv(max_keys, blocks.min_split_keys)))
