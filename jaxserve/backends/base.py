"""Backend: every decision that depends on the kind of device, in one object per engine.

The engine asks its backend (chosen once, from JAX's platform) for the dtype and KV dtype an
"auto" setting means, the KV cache budget per device, the product kernel and how the weights are
laid out for it, the MoE layers' grouped products, where host buffers live, whether the
sampler's draws run in a native kernel, and whether a decoder layer may be replaced by a fused
implementation. The accelerators (TPU, GPU) share this base; the CPU backend (`cpu/`) adds its
native kernels.

A fused decoder layer replaces a model's pure-JAX layer only after a positive capability check:
the backend lists the layer features its implementation covers, the model declares the ones
it uses (`layer_features`, see models/interface.py), and the replacement applies only when the
model's set is a subset of the backend's. A model that declares nothing, or a feature the
backend does not list, runs its own layer.
"""

from __future__ import annotations

import dataclasses
import logging
import platform
from collections.abc import Callable

import jax
import numpy as np
from jax.sharding import Mesh

from jaxserve.config import CacheConfig, ModelConfig
from jaxserve.models.layers.linear import prepare_fp8_products
from jaxserve.pallas_kernels.ragged_paged_attention.ops import resolve_impl as resolve_attention_impl
from jaxserve.runner.buckets import geometric

logger = logging.getLogger(__name__)

# (model, layer params, h, rope, k_cache, v_cache, md) -> (h, k_cache, v_cache)
LayerImpl = Callable


@dataclasses.dataclass(frozen=True)
class DevicePlan:
    """What the backend resolved for one engine: the "auto" settings made concrete."""

    dtype: str  # the weights' dtype
    kv_dtype: str
    attention_impl: str  # the attention implementation "auto" dispatches to
    matmul_impl: str  # "xla", or a native CPU product kernel ("amx", "avx512")
    # The sampler's draws and logprobs in a backend's native kernel (its name in
    # sampling/native.py: "cpu"), or None for JAX's ops.
    native_sampling: str | None
    moe_impl: str  # MoE layers' grouped products (models/layers/moe.py's MOE_IMPLS)
    # FP8 weights with per-channel/per-tensor scales multiplied as FP8 (activations scaled per
    # token into e4m3): chips with FP8 products (GPUs of compute capability >= 8.9: H100,
    # H200). False: FP8 weights are upcast inside the dot (TPU v5e/v6e, the CPU, older GPUs).
    fp8_products: bool = False


class Backend:
    """The accelerator policy (TPU, GPU); the CPU backend overrides what differs."""

    name = "accelerator"
    # Layer features a fused decoder layer of this backend implements (none here).
    fused_layer_features: frozenset[str] = frozenset()
    # MoE layers' grouped products: jax.lax.ragged_dot, a native grouped matmul here.
    moe_impl = "ragged"

    def __init__(self, platform: str):
        self.platform = platform

    # ------------------------------------------------------------------ resolution
    def resolve_dtype(self, requested: str, mesh: Mesh | None = None) -> str:
        """bfloat16 for "auto" (the accelerators' native product dtype)."""
        return "bfloat16" if requested == "auto" else requested

    def resolve_kv_dtype(self, requested: str, model_dtype: str, attention_impl: str) -> str:
        return model_dtype if requested == "auto" else requested

    def resolve_matmul_impl(self, requested: str, dtype: str, mesh: Mesh) -> str:
        if requested not in ("auto", "xla"):
            raise ValueError(f"matmul_impl={requested!r} cannot run here: the backend is "
                             f"{self.platform}, not cpu")
        return "xla"

    def native_sampling(self, mesh: Mesh) -> str | None:
        return None

    def plan(self, mc: ModelConfig, cc: CacheConfig, mesh: Mesh) -> DevicePlan:
        dtype = self.resolve_dtype(mc.dtype, mesh)
        attention = resolve_attention_impl(mc.attention_impl, self.platform)
        return DevicePlan(
            dtype=dtype,
            kv_dtype=self.resolve_kv_dtype(cc.kv_cache_dtype, dtype, attention),
            attention_impl=attention,
            matmul_impl=self.resolve_matmul_impl(mc.matmul_impl, dtype, mesh),
            native_sampling=self.native_sampling(mesh),
            moe_impl=self.moe_impl,
            fp8_products=self.fp8_products(mesh),
        )

    def fp8_products(self, mesh: Mesh) -> bool:
        """Whether every device of `mesh` multiplies FP8 natively (a CUDA compute capability of
        at least 8.9; TPUs before v7 and CPUs do not)."""
        if self.platform != "gpu":
            return False
        caps = [getattr(d, "compute_capability", None) for d in mesh.devices.flat]
        return all(c is not None and tuple(int(x) for x in str(c).split(".")[:2]) >= (8, 9)
                   for c in caps)

    # ------------------------------------------------------------------ step sizes
    # Tokens per step when none is given: vLLM's default. A chip computes a step of thousands of
    # tokens in about the time of a few hundred, so large prefill chunks reach the first tokens
    # of many requests sooner (TTFT under load) at no cost in throughput.
    default_max_num_batched_tokens = 8192
    # Token buckets: x2 from 16 up to this size, then x4 (the last one is the budget itself).
    # Small steps (decode) get close buckets; the large prefill steps, which a busy server fills
    # to the budget anyway, share a few: at 8192, 9 token buckets (17 executables with request
    # buckets 8 and 32) instead of 10 x2 steps.
    dense_buckets_up_to = 1024

    def resolve_max_num_batched_tokens(self, requested: int | None, token_buckets: tuple[int, ...] | None,
                                       data_parallel_size: int = 1, at_least: int = 1) -> int:
        """The token budget per step of the whole mesh: `requested` when given, else the largest
        explicit token bucket, else this backend's default for each data-parallel rank, raised
        to `at_least` per rank (a whole prompt per step, without chunked prefill)."""
        if requested is not None:
            return requested
        if token_buckets:
            return max(token_buckets)
        return max(self.default_max_num_batched_tokens, at_least) * data_parallel_size

    def default_token_buckets(self, max_num_batched_tokens: int) -> tuple[int, ...]:
        """The padded token counts compiled when none are given, for one rank's budget."""
        budget = max_num_batched_tokens
        dense = geometric(min(16, budget), min(budget, self.dense_buckets_up_to))
        return tuple(sorted({*dense, *geometric(dense[-1], budget, factor=4)}))

    # ------------------------------------------------------------------ memory
    def kv_cache_budget(self, cc: CacheConfig) -> int:
        """Bytes of KV cache per device: the explicit budget, else the configured fraction of
        each local device's memory minus what it already holds, the least over this process's
        devices and, in a multi-process run, over every process (a remote device's
        `memory_stats()` cannot be read, so each process measures its own)."""
        if cc.kv_cache_memory_bytes is not None:
            return cc.kv_cache_memory_bytes
        return min_over_processes(self.local_kv_budget(cc))

    def local_kv_budget(self, cc: CacheConfig) -> int:
        budgets = []
        for device in jax.local_devices():
            stats = device.memory_stats() or {}
            limit, used = stats.get("bytes_limit", 0), stats.get("bytes_in_use", 0)
            budgets.append(max(int(limit * cc.device_memory_utilization) - used, 0))
        return min(budgets)

    # ------------------------------------------------------------------ the model
    def prepare_model(self, model, plan: DevicePlan, abstract: bool = False) -> None:
        """Lay the weights out for the product kernel in `plan` (on XLA's dot: only FP8 weights
        marked for FP8 products where the plan has them). abstract: `model` holds
        ShapeDtypeStructs; give it the layout's structure only."""
        if plan.fp8_products:
            prepare_fp8_products(model)

    def lays_out_weights(self, plan: DevicePlan) -> bool:
        """Whether `prepare_model` does work worth keeping (`runner/weight_cache.py`)."""
        return False

    def layer_impl(self, model) -> LayerImpl | None:
        """A fused replacement for `model`'s decoder layer, or None to run the model's own."""
        return None

    def place_weights(self, model, params: list[jax.Array], treedef) -> None:
        """Move the weights (`model`'s flattened state, in place in `params`) to where steps read
        them best; nothing to do on accelerators."""

    def fingerprint(self) -> dict[str, str]:
        """What the engine's compiled steps and laid-out weights depend on through this backend,
        besides the program, the devices and the libraries: parts of the executable and weight
        caches' keys (runner/executable_cache.py). Here the host's architecture."""
        return {"cpu": platform.machine()}

    def place_kv_cache(self, arrays: list[jax.Array]):
        """Advise the memory under the KV cache and the weights; returns the thread doing it,
        if any (nothing on accelerators)."""
        return None


def layer_features_covered(model, supported: frozenset[str]) -> bool:
    """The positive capability check: the model declares its layer features and every one of
    them is in `supported`."""
    declared = getattr(model, "layer_features", None)
    return declared is not None and frozenset(declared) <= supported


def min_over_processes(value: int) -> int:
    """The least of `value` over the processes of a multi-process run (itself in one process)."""
    if jax.process_count() == 1:
        return int(value)
    from jax.experimental import multihost_utils

    return int(np.min(multihost_utils.process_allgather(np.asarray(value, np.int64))))
