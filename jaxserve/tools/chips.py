"""The accelerator chips `jaxserve shard-plan` compiles for, and the figures the step-time
prediction uses: one table, so that the memory verdict and the prediction read the same numbers.

A compile target is `CHIP:SHAPE`: a TPU slice (`v5e:2x4`, the chips' ICI topology as libtpu
names it) or GPU hosts (`h100:1x8`, `h200:2x8`: hosts x GPUs per host). TPU chips come from
libtpu's compile-only topologies; GPUs from XLA's target description of the chip
(`gpu_targets/*.txtpb`, package data) through JAX's CUDA plugin, which compiles without a GPU.

Figures are the vendors' published ones (Google Cloud's TPU pages, NVIDIA's H100/H200 data
sheets): HBM per chip, HBM bandwidth, dense bfloat16 peak, and the interconnect bandwidth one
chip sends at (ICI: half the published bidirectional figure; NVLink 4: 450 GB/s each way).
"""

from __future__ import annotations

import dataclasses
import pathlib
import re

GPU_TARGET_DIR = pathlib.Path(__file__).parent / "gpu_targets"


@dataclasses.dataclass(frozen=True)
class Chip:
    name: str  # as written in --topology ("v5e", "h100")
    platform: str  # "tpu" or "gpu"
    device_kind: str  # what `device.device_kind` reports
    hbm_bytes: int  # per chip
    hbm_bandwidth: float  # bytes/s per chip
    peak_flops: float  # dense bfloat16 flop/s per chip
    link_bandwidth: float  # bytes/s one chip sends to its peers (one direction)
    target_config: str | None = None  # GPUs: the file in gpu_targets/

    def target_text(self) -> str:
        """XLA's target description of a GPU (the text `get_topology_desc` takes)."""
        assert self.target_config is not None, self.name
        return (GPU_TARGET_DIR / self.target_config).read_text()


def _gpu_memory(config: str) -> int:
    m = re.search(r"device_memory_size:\s*(\d+)", (GPU_TARGET_DIR / config).read_text())
    assert m, config
    return int(m.group(1))


GiB = 1 << 30
CHIPS: dict[str, Chip] = {
    c.name: c
    for c in (
        Chip("v4", "tpu", "TPU v4", 32 * GiB, 1228e9, 275e12, 150e9),
        Chip("v5e", "tpu", "TPU v5 lite", 16 * GiB, 819e9, 197e12, 200e9),
        Chip("v5p", "tpu", "TPU v5", 95 * GiB, 2765e9, 459e12, 300e9),
        Chip("v6e", "tpu", "TPU v6 lite", 32 * GiB, 1638e9, 918e12, 400e9),
        Chip(
            "h100",
            "gpu",
            "NVIDIA H100 80GB HBM3",
            _gpu_memory("h100_sxm.txtpb"),
            3.35e12,
            989e12,
            450e9,
            "h100_sxm.txtpb",
        ),
        Chip(
            "h200",
            "gpu",
            "NVIDIA H200 141GB HBM3e",
            _gpu_memory("h200.txtpb"),
            4.8e12,
            989e12,
            450e9,
            "h200.txtpb",
        ),
    )
}
# What `device_kind` reports -> HBM per chip, for the memory verdict ("TPU v5" is v5p's kind).
HBM_BY_DEVICE_KIND = {c.device_kind: c.hbm_bytes for c in CHIPS.values()} | {
    "TPU v4 lite": 8 * GiB,
    "TPU v5p": 95 * GiB,
}


def chip_of_device_kind(kind: str) -> Chip | None:
    """The chip of a device that reports `kind` (`device.device_kind`): the table's entry of
    that kind, else the GPU whose name the kind holds as a word ("NVIDIA H200" is the h200),
    except boards of other memory and figures under the same name (H100 PCIe, H100 NVL);
    None for any other device."""
    for chip in CHIPS.values():
        if chip.device_kind == kind:
            return chip
    words = set(re.split(r"[^a-z0-9]+", kind.lower()))
    if words & {"pcie", "nvl"}:
        return None
    return next((c for c in CHIPS.values() if c.platform == "gpu" and c.name in words), None)


def parse_target(text: str) -> dict:
    """`v5e:2x4` -> {"kind": "tpu", "topology": "v5e:2x4"}; `h100:1x8` -> {"kind": "gpu",
    "chip": "h100", "hosts": 1, "gpus_per_host": 8, "topology": "h100:1x8"}; else ValueError."""
    name, _, shape = text.partition(":")
    chip = CHIPS.get(name.lower())
    if chip is None or not shape:
        raise ValueError(
            f"topology {text!r}: write CHIP:SHAPE with CHIP one of {', '.join(CHIPS)} "
            "(TPU slices as v5e:2x4, GPU hosts as h100:1x8 = hosts x GPUs per host)"
        )
    dims = shape.split("x")
    if not all(d.isdigit() and int(d) > 0 for d in dims):
        raise ValueError(f"topology {text!r}: the shape must be positive integers joined by x")
    if chip.platform == "tpu":
        return {"kind": "tpu", "topology": f"{chip.name}:{shape}"}
    if len(dims) != 2:
        raise ValueError(f"topology {text!r}: a GPU topology is HOSTSxGPUS, e.g. {chip.name}:1x8")
    return {
        "kind": "gpu",
        "chip": chip.name,
        "hosts": int(dims[0]),
        "gpus_per_host": int(dims[1]),
        "topology": f"{chip.name}:{shape}",
    }


def target_chip_count(target: dict) -> int:
    if target["kind"] == "gpu":
        return target["hosts"] * target["gpus_per_host"]
    n = 1
    for d in target["topology"].split(":")[-1].split("x"):
        n *= int(d)
    return n


def tpu_devices(target: dict):
    """The devices of a compile-only TPU slice (`backends/devices.py`'s `tpu_slice_devices`)."""
    from jaxserve.backends.devices import tpu_slice_devices

    return tpu_slice_devices(target["topology"])


def gpu_devices(target: dict):
    """The devices of GPU hosts for a compile-only target (needs jax's CUDA plugin: the
    `gpu-compile` extra; JAX_PLATFORMS=cpu must be set before jax starts)."""
    import importlib.util

    from jax.experimental import topologies

    spec = importlib.util.find_spec
    needed = ("jax_cuda12_plugin", "nvidia", "nvidia.cuda_nvcc")  # the plugin, ptxas's wheel
    if any(spec(name) is None for name in needed):
        raise ValueError(
            "compiling for GPUs needs JAX's CUDA plugin and ptxas: make install-gpu-compile "
            "(or pip install 'jaxserve[gpu-compile]')"
        )
    chip = CHIPS[target["chip"]]
    # partitions x hosts x GPUs per host
    topology = f"1x{target['hosts']}x{target['gpus_per_host']}"
    desc = topologies.get_topology_desc(
        platform="cuda", topology=topology, target_config=chip.target_text()
    )
    return list(desc.devices)
