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
import os
import platform
from collections.abc import Callable

import jax
import numpy as np
from jax.sharding import Mesh

from jaxserve.compiled_step.buckets import geometric
from jaxserve.compiled_step.memory import StepMemory
from jaxserve.config import CacheConfig, ModelConfig, jax_dtype
from jaxserve.models.layers.linear import (
    activation_products,
    prepare_fp8_products,
    prepare_int8_products,
    prepare_quantized_products,
)
from jaxserve.pallas_kernels.ragged_paged_attention.ops import (
    auto_for_dtypes as auto_attention_for_dtypes,
    gpu_capability,
    resolve_impl as resolve_attention_impl,
)

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
    # W8A8 int8 checkpoints' weights multiplied int8 x int8 into int32 (activations quantized
    # per token or by the checkpoint's static scale): chips with int8 products (TPU v4, v5e,
    # v5p, v6e; GPUs of compute capability >= 7.5). False: weight-only (the CPU).
    int8_products: bool = False
    # FP8 and int4 weights' products (models/layers/linear.py): "xla" (dequantized in the step,
    # then XLA's dot) or a quantized product kernel (pallas_kernels/quant_matmul: "tpu", or
    # "tpu-interpret" where attention runs the TPU kernel in the interpreter). The TPU kernels
    # go together: the product kernel runs where attention resolves to the TPU kernel.
    quant_matmul_impl: str = "xla"


# What a TPU's `device_kind` reports -> the chip's name in libtpu's topology names ("v6e:2x4").
TPU_CHIP_NAMES = {"TPU v4": "v4", "TPU v5 lite": "v5e", "TPU v5": "v5p", "TPU v5p": "v5p", "TPU v6 lite": "v6e"}


def log_activation_products(model, plan: DevicePlan) -> str | None:
    """Say at start-up how a checkpoint that quantizes its activations (W8A8 int8 or FP8)
    multiplies here: with quantized activations where the chip has the products, else
    weight-only (activations in the compute dtype, as vLLM runs such checkpoints on chips
    without them). Returns the line (None for other models)."""
    fmt = getattr(getattr(model, "config", None), "weight_format", None)
    counts = activation_products(model)
    if fmt is None or fmt.activations is None or not counts:
        return None
    kind, how = fmt.activations.split("-")
    scales = ("the checkpoint's static input_scale" if how == "static"
              else "a scale per token (amax / 127)" if kind == "int8" else "a scale per token (amax / 448)")
    done = counts.get("int8" if kind == "int8" else "float8_e4m3fn", 0)
    has = plan.int8_products if kind == "int8" else plan.fp8_products
    if done:
        line = (f"{fmt.describe()}: {done} weights multiply {kind} x {kind} with the activations "
                f"quantized to {kind} by {scales}")
        if counts.get("weight-only"):
            line += f"; {counts['weight-only']} stay weight-only (their scales or zeros)"
    else:
        why = "this chip has no int8 products" if kind == "int8" and not has else (
            "this chip has no FP8 products" if not has else "no weight's scales allow it")
        line = (f"{fmt.describe()}: weight-only, the activations stay {plan.dtype} ({why}; as "
                f"vLLM runs such checkpoints on chips without them)")
    logger.info("%s", line)
    return line


class InsufficientMemoryError(ValueError):
    """The configuration cannot fit the device: refused at start, with the figures."""


@dataclasses.dataclass(frozen=True)
class MemoryBudget:
    """How a device's memory is shared on an accelerator: the KV cache gets what is left."""

    device_memory: int  # bytes per device (the device's limit, or the chip's HBM)
    utilization: float  # --gpu-memory-utilization
    step: StepMemory  # the largest compiled step's own figures
    other_in_use: int = 0  # what the device held besides the weights before the KV cache
    other_code: int = 0  # the other executables' code
    # Bytes of temporaries per byte of KV cache, where the step's temporaries grow with the
    # cache (on TPU, with the attention kernel, XLA copies a layer's cache arrays): from a
    # second probe with more pages (engine/setup.py). 0: they do not.
    kv_overhead: float = 0.0
    # The step compiled with this budget's cache (the one served), and what it needed beyond the
    # budget: taken off the cache (a growth of the temporaries the smaller probes did not show).
    served: StepMemory | None = None
    served_excess: int = 0

    @property
    def usable(self) -> int:
        return int(self.device_memory * self.utilization)

    @property
    def kv(self) -> int:
        left = self.usable - self.step.besides_kv - self.other_in_use - self.other_code
        return (int(left / (1.0 + self.kv_overhead)) if left > 0 else left) - self.served_excess

    def describe(self) -> str:
        s, G = self.step, 2**30
        T, R = s.bucket
        text = (f"{self.device_memory / G:.2f} GiB per device x {self.utilization:g} = {self.usable / G:.2f} GiB; "
                f"weights {s.weights / G:.2f} GiB, largest step ({T} tokens x {R} requests): temporaries "
                f"{s.temp / G:.2f} GiB, outputs {s.outputs / G:.3f} GiB, code {s.code / G:.3f} GiB, sampling "
                f"state and inputs {s.other_arguments / G:.3f} GiB")
        if self.other_code:
            text += f", the other executables' code {self.other_code / G:.3f} GiB"
        if self.other_in_use:
            text += f", already in use {self.other_in_use / G:.2f} GiB"
        if self.kv_overhead:
            text += f"; the step's temporaries grow by {self.kv_overhead:.2f} bytes per byte of KV cache"
        if self.served_excess:
            text += (f"; with that cache the step needed {self.served_excess / G:.3f} GiB more, taken off "
                     f"the cache")
        return text + f"; left for the KV cache {self.kv / G:.2f} GiB"


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
        devices = mesh_devices(mesh)
        attention = resolve_attention_impl(mc.attention_impl, self.platform, devices=devices)
        kv_dtype = self.resolve_kv_dtype(cc.kv_cache_dtype, dtype, attention)
        if mc.attention_impl == "auto" and self.platform == "gpu":  # by the cache's dtype
            attention = auto_attention_for_dtypes(self.platform, devices, jax_dtype(kv_dtype),
                                                  jax_dtype(dtype))
        return DevicePlan(
            dtype=dtype,
            kv_dtype=kv_dtype,
            attention_impl=attention,
            matmul_impl=self.resolve_matmul_impl(mc.matmul_impl, dtype, mesh),
            native_sampling=self.native_sampling(mesh),
            moe_impl=self.moe_impl,
            fp8_products=self.fp8_products(mesh),
            int8_products=self.int8_products(mesh),
            quant_matmul_impl=self.resolve_quant_matmul_impl(attention),
        )

    def plan_reasons(self, mc: ModelConfig, cc: CacheConfig, plan: DevicePlan) -> dict[str, str]:
        """Why the plan holds each value (the engine plan says it: engine/plan.py)."""
        return {
            "dtype": "given" if mc.dtype != "auto" else self.dtype_reason(plan.dtype),
            "kv_dtype": "given" if cc.kv_cache_dtype != "auto" else self.kv_dtype_reason(plan),
            "matmul_impl": "given" if mc.matmul_impl != "auto" else self.matmul_reason(plan),
            "native_sampling": (f"the {plan.native_sampling} kernels' draws and log-probs (one device)"
                                if plan.native_sampling else "JAX's ops"),
            "moe_impl": self.moe_reason,
            "fp8_products": ("every GPU has FP8 products (compute capability >= 8.9)" if plan.fp8_products
                             else "FP8 weights are upcast in the product (no FP8 products here)"),
            "quant_matmul_impl": ("the TPU product kernel (the attention implementation named is the TPU's)"
                                  if plan.quant_matmul_impl != "xla" else "XLA's dequantize-then-dot"),
        }

    def dtype_reason(self, dtype: str) -> str:
        return "auto: bfloat16, the accelerators' product dtype"

    def kv_dtype_reason(self, plan: DevicePlan) -> str:
        return "auto: the model's dtype"

    def matmul_reason(self, plan: DevicePlan) -> str:
        return "auto: XLA's dot (the native product kernels are the CPU's)"

    moe_reason = "ragged: jax.lax.ragged_dot, a native grouped matmul here"

    def resolve_quant_matmul_impl(self, attention_impl: str) -> str:
        """The quantized weights' product: the Pallas TPU kernel where attention runs the TPU
        kernel (compiled or interpreted), else XLA's dequantize-then-dot."""
        return attention_impl if attention_impl in ("tpu", "tpu-interpret") else "xla"

    def fp8_products(self, mesh: Mesh) -> bool:
        """Whether every device of `mesh` (or of a DeviceSet) multiplies FP8 natively (a CUDA
        compute capability of at least 8.9; TPUs before v7 and CPUs do not)."""
        if self.platform != "gpu":
            return False
        cap = gpu_capability(mesh_devices(mesh))
        return cap is not None and cap >= (8, 9)

    def int8_products(self, mesh: Mesh) -> bool:
        """Whether every device of `mesh` multiplies int8 natively: the TPUs of
        `TPU_CHIP_NAMES` (v4 to v6e), GPUs of compute capability >= 7.5 (int8 tensor cores,
        what vLLM's W8A8 kernels ask for); never the CPU."""
        if self.platform == "tpu":
            return all(d.device_kind in TPU_CHIP_NAMES for d in mesh_devices(mesh))
        if self.platform != "gpu":
            return False
        cap = gpu_capability(mesh_devices(mesh))
        return cap is not None and cap >= (7, 5)

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
    # On accelerators the KV cache gets what the compiled programs leave of each device
    # (`kv_budget_from_step`); the CPU backend keeps a fixed budget (`kv_cache_budget`).
    sizes_kv_from_programs = True
    # The context length when none is given: the model's own (None: no cap). The CPU caps it.
    default_max_model_len: int | None = None
    # Decode steps per device call when --num-decode-steps is not given (multi-step decode;
    # the null model's host overhead per token, docs/performance.md). The CPU's is 1.
    default_num_decode_steps: int = 4

    def kv_cache_budget(self, cc: CacheConfig) -> int:
        """Bytes of KV cache per device before anything is compiled (where the programs do not
        size it): the explicit budget, else the configured fraction of each local device's
        memory minus what it already holds, the least over this process's devices and, in a
        multi-process run, over every process (a remote device's `memory_stats()` cannot be
        read, so each process measures its own)."""
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

    def device_memory(self) -> tuple[int, int] | None:
        """(bytes_limit, bytes_in_use) of the local device with the least room, or None where
        the devices do not say (`memory_stats()` empty)."""
        seen = []
        for device in jax.local_devices():
            stats = device.memory_stats() or {}
            if stats.get("bytes_limit"):
                seen.append((int(stats["bytes_limit"]), int(stats.get("bytes_in_use", 0))))
        return min(seen, key=lambda s: s[0] - s[1]) if seen else None

    def kv_budget_from_step(self, cc: CacheConfig, step: StepMemory, device_memory: int, *,
                            in_use: int = 0, num_executables: int = 1,
                            larger: StepMemory | None = None) -> MemoryBudget:
        """The KV cache's bytes per device from the largest compiled step (`step`, XLA's memory
        analysis): device memory x utilization - weights - the step's own need (temporaries,
        outputs that do not alias the donated cache, its code) - the sampling state and inputs
        - the other executables' code (as much as the largest's each) - whatever else the device
        already holds (`in_use` beyond the weights). `larger`: the same step with a larger KV
        cache, where the temporaries grow with it: the budget leaves room for that growth.
        Raises InsufficientMemoryError, with the figures, when nothing is left."""
        overhead = 0.0
        if larger is not None and larger.temp > step.temp + step.temp // 20 + (1 << 20):
            # All of the larger step's temporaries, per byte of its cache: an upper bound of
            # their growth (measured on v5e: 0.52 estimated where the served step needed 0.50).
            overhead = larger.temp / larger.kv
        budget = MemoryBudget(device_memory=device_memory, utilization=cc.device_memory_utilization,
                              step=step, other_in_use=max(in_use - step.weights, 0),
                              other_code=step.code * max(num_executables - 1, 0), kv_overhead=overhead)
        if budget.kv <= 0:
            raise InsufficientMemoryError(f"the model does not fit: {budget.describe()}; raise "
                                          f"--gpu-memory-utilization, shard over more devices "
                                          f"(--tensor-parallel-size), or lower --max-num-batched-tokens")
        return budget

    @staticmethod
    def check_served_step(budget: MemoryBudget, served: StepMemory) -> MemoryBudget:
        """`budget` with the figures of its step compiled with the budget's cache (`served`):
        whatever that step needs beyond the usable memory comes off the cache (a smaller cache
        needs no more temporaries than a larger one)."""
        over = served.peak + budget.other_in_use + budget.other_code - budget.usable
        return dataclasses.replace(budget, served=served, served_excess=max(over, 0))

    # ------------------------------------------------------------------ compilation
    def compile_target(self, devices, processes: int | None = None) -> dict | None:
        """The devices a compile worker process (runner/compile_pool.py) compiles this mesh's
        steps for: on a TPU, the compile-only topology of the same chips (libtpu; the worker
        never opens them), else None (a GPU's compile-only target is not wired in; several
        processes compile their own steps). `processes`: the run's (default: JAX's count)."""
        if self.platform != "tpu" or (jax.process_count() if processes is None else processes) > 1:
            return None
        devices = list(devices)
        chip = TPU_CHIP_NAMES.get(devices[0].device_kind)
        coords = [getattr(d, "coords", None) for d in devices]
        if chip is None or any(c is None for c in coords):
            return None
        dims = [max(c[i] for c in coords) + 1 for i in range(len(coords[0]))]
        while len(dims) > 2 and dims[-1] == 1:
            dims.pop()
        return {"kind": "tpu", "topology": f"{chip}:{'x'.join(map(str, dims))}"}

    def default_compile_workers(self, num_executables: int, cores: int | None = None) -> int:
        """Compile processes at a cold start: on a TPU one per 4 of the host's `cores` (default:
        this host's), at most 8 (a TPU VM host has ~100-200 cores, and each compile of a big
        step holds gigabytes); elsewhere 1."""
        if self.platform != "tpu":
            return 1
        return max(1, min(8, (cores or os.cpu_count() or 1) // 4, num_executables))

    # ------------------------------------------------------------------ the model
    def prepare_model(self, model, plan: DevicePlan, abstract: bool = False) -> None:
        """Lay the weights out for the product kernel in `plan` (on XLA's dot: only FP8 weights
        marked for FP8 products where the plan has them, and FP8 / int4 weights for the
        quantized product kernel where it names one). abstract: `model` holds
        ShapeDtypeStructs; give it the layout's structure only."""
        if plan.fp8_products:
            prepare_fp8_products(model)
        if plan.int8_products:
            prepare_int8_products(model)
        if not abstract:
            log_activation_products(model, plan)
        if plan.quant_matmul_impl != "xla":
            n = prepare_quantized_products(model, plan.quant_matmul_impl)
            if n and not abstract:
                logger.info("%d quantized weights multiply in the %s product kernel", n,
                            plan.quant_matmul_impl)

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


def mesh_devices(mesh) -> list:
    """The devices of a JAX Mesh or of a DeviceSet (what a plan reads of them), as a list."""
    return list(getattr(mesh.devices, "flat", mesh.devices))
