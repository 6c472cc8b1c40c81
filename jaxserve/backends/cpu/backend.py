"""The CPU backend: native kernels (`kernels/`) where the host can build them.

What differs from the accelerators (see docs/DESIGN.md §9 for the measurements):
- dtype "auto": whichever of bfloat16 and float32 runs the products faster here (measured);
- KV dtype "auto": the model dtype when the native attention kernel writes the cache, else
  float32 (XLA:CPU's bfloat16 scatter is orders of magnitude slower);
- the KV budget: 1 GiB unless given (host memory has no useful "free" figure), or
  JAXSERVE_CPU_KVCACHE_SPACE GiB (the counterpart of vLLM's VLLM_CPU_KVCACHE_SPACE);
- the token budget per step: 512 unless given (larger steps delay first tokens here);
- products on weights packed once at load time (AMX bfloat16, AVX-512 or AVX2 float32), one
  device, on the kernel build `ModelConfig.cpu_kernel_target` selects;
- a fused decoder layer (`layer.py`) when the model's layer features are all covered;
- MoE layers' grouped products as tiles, or dense for small steps ("tiled-or-dense");
- weights in a huge-page arena and the KV cache advised onto huge pages;
- the sampler's random draws and logprobs in a native kernel (one device).
Without a C++ compiler every native path is off and the engine runs XLA's ops (same results).
"""

from __future__ import annotations

import logging
import os
import platform
import types

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from jaxserve.backends.base import Backend, DevicePlan, LayerImpl, layer_features_covered
from jaxserve.backends.cpu import dtype as cpu_dtype
from jaxserve.backends.cpu import huge_pages
from jaxserve.backends.cpu import kernels
from jaxserve.backends.cpu import layer as cpu_layer
# (registering attention's "cpu" and the sampler's native "cpu")
from jaxserve.backends.cpu.kernels import attention, sample  # noqa: F401
from jaxserve.backends.cpu.kernels.matmul import (
    amx_available, avx2_available, avx512_available, strips_kernel,
)
from jaxserve.config import DEFAULT_MAX_MODEL_LEN, CacheConfig, ModelConfig
from jaxserve.backends.cpu.packing import pack_linear_weights
from jaxserve.models.layers.linear import PackedParam

logger = logging.getLogger(__name__)

CPU_KV_BYTES = 1 << 30
# The default KV budget in GiB, in the environment (vLLM's CPU backend reads
# VLLM_CPU_KVCACHE_SPACE alike): the whole budget is zeroed at start, on every device of a
# simulated mesh, so small runs (the test suite) start faster with less.
KV_SPACE_ENV = "JAXSERVE_CPU_KVCACHE_SPACE"
_ONE_DEVICE = types.SimpleNamespace(size=1)  # a mesh of one device, for resolving the kernels
MATMUL_IMPLS = ("auto", "xla", "amx", "avx512", "avx2")


class CpuBackend(Backend):
    name = "cpu"
    fused_layer_features = cpu_layer.FEATURES
    # XLA:CPU lowers ragged_dot to every expert on every row: tiles of the sorted rows instead,
    # and every expert on every token for small steps (models/layers/moe.py).
    moe_impl = "tiled-or-dense"
    # Tokens per step by default. A CPU step's time grows with its tokens (a few hundred already
    # keep the cores busy), so a larger step only makes a burst of requests wait for all of it
    # before any first token: at 32 streams on 2 cores, TTFT p50 was 1.4-3.1x that of 512 with
    # 1024 or 2048 tokens, and 1.07x with 256 (docs/DESIGN.md §4b). Token buckets x2 throughout.
    default_max_num_batched_tokens = 512
    dense_buckets_up_to = 1 << 30

    def __init__(self, platform: str = "cpu"):
        super().__init__(platform)

    def resolve_dtype(self, requested: str, mesh: Mesh | None = None) -> str:
        """The faster of bfloat16 and float32 on this CPU for "auto", measured on the products
        a decode step is made of, through the path each would take (`dtype.py`: once per
        CPU, cached). Set "float32" to match float32 references to the last digits."""
        if requested != "auto":
            return requested
        one = mesh is None or mesh.size == 1
        where = _ONE_DEVICE if one else mesh
        impls = {d: self.resolve_matmul_impl("auto", d, where) for d in ("bfloat16", "float32")}
        key = f"{kernels.cpu_flags()}|{kernels.selected_target()}|{jax.__version__}|{one}"
        return cpu_dtype.fastest_dtype(impls, key)

    def resolve_kv_dtype(self, requested: str, model_dtype: str, attention_impl: str) -> str:
        if requested != "auto":
            return requested
        native = attention_impl == "cpu" and kernels.available()
        return model_dtype if native else "float32"

    def resolve_matmul_impl(self, requested: str, dtype: str, mesh: Mesh) -> str:
        """"amx", "avx512", "avx2" or "xla" for `requested` (one of MATMUL_IMPLS).

        The kernels need a one-device mesh (packed weights are not sharded), and: "amx" bfloat16
        weights and a CPU with AMX; "avx512" float32 or bfloat16 weights (computed in float32)
        and a CPU with AVX-512; "avx2" the same with a kernel build without AVX-512 on a CPU with
        AVX2 and FMA (all on the process's kernel build, `ModelConfig.cpu_kernel_target`).
        "auto" picks AMX for bfloat16 where it runs, else AVX-512 where the build has it, else
        AVX2, else "xla"; an explicit one that cannot run raises ValueError."""
        if requested not in MATMUL_IMPLS:
            raise ValueError(f"matmul_impl must be 'auto', 'xla', 'amx', 'avx512' or 'avx2'; got {requested!r}")
        if requested == "xla":
            return "xla"
        dt = jnp.dtype(dtype)
        name = requested
        if requested == "auto":
            # (neither strips kernel: "avx512", which cannot run, so auto falls back to XLA)
            name = "amx" if dt == jnp.bfloat16 and amx_available() else strips_kernel() or "avx512"
        want = {"amx": (jnp.bfloat16,), "avx512": (jnp.bfloat16, jnp.float32),
                "avx2": (jnp.bfloat16, jnp.float32)}[name]
        reasons = []
        if dt not in want:
            reasons.append(f"the weights are {dt.name}, not " + " or ".join(jnp.dtype(w).name for w in want))
        if mesh.size != 1:
            reasons.append(f"the mesh has {mesh.size} devices")
        if not reasons and not {"amx": amx_available, "avx512": avx512_available, "avx2": avx2_available}[name]():
            reasons.append({"amx": "this CPU has no usable AMX-BF16 (or the kernels cannot be built)",
                            "avx512": "this CPU has no AVX-512 (or the kernels cannot be built with it)",
                            "avx2": "no kernel build without AVX-512 on a CPU with AVX2 and FMA (or the "
                                    "kernels cannot be built)"}[name])
        if not reasons:
            return name
        if requested != "auto":
            raise ValueError(f"matmul_impl={requested!r} cannot run here: " + "; ".join(reasons))
        return "xla"

    def native_sampling(self, mesh: Mesh) -> str | None:
        return "cpu" if mesh.size == 1 and kernels.available() else None

    def dtype_reason(self, dtype: str) -> str:
        return "auto: the faster of bfloat16 and float32 in this CPU's products (measured once per CPU)"

    def kv_dtype_reason(self, plan: DevicePlan) -> str:
        if plan.kv_dtype == plan.dtype:
            return "auto: the model's dtype (the native attention kernel writes the cache)"
        return "auto: float32 (without the native attention kernel XLA writes the cache: its bfloat16 scatter is slow)"

    def matmul_reason(self, plan: DevicePlan) -> str:
        if plan.matmul_impl == "xla":
            return "auto: XLA's dot (no native product kernel for these weights on this mesh and CPU)"
        return f"auto: the native {plan.matmul_impl} kernel on weights packed at load ({plan.dtype}, one device)"

    moe_reason = "tiled-or-dense: XLA:CPU has no grouped matmul (tiles of the sorted rows; dense for small steps)"

    def plan(self, mc: ModelConfig, cc: CacheConfig, mesh: Mesh) -> DevicePlan:
        kernels.select_target(mc.cpu_kernel_target)  # before anything loads the kernels
        return super().plan(mc, cc, mesh)

    # A fixed KV budget, and the context capped (a CPU serves short contexts).
    sizes_kv_from_programs = False
    default_max_model_len = DEFAULT_MAX_MODEL_LEN
    # A CPU step of a real model lasts far longer than its host work: blocks of decode steps
    # would only delay the requests that arrive meanwhile (docs/performance.md).
    default_num_decode_steps = 1

    def compile_target(self, devices, processes: int | None = None) -> dict | None:
        """This host's CPU devices (one process)."""
        return {"kind": "cpu"} if (jax.process_count() if processes is None else processes) == 1 else None

    def kv_cache_budget(self, cc: CacheConfig) -> int:
        return cc.kv_cache_memory_bytes if cc.kv_cache_memory_bytes is not None else default_kv_bytes()

    # ------------------------------------------------------------------ the model
    def prepare_model(self, model, plan: DevicePlan, abstract: bool = False) -> None:
        super().prepare_model(model, plan, abstract)  # quantized products ("tpu-interpret")
        if plan.matmul_impl == "xla":
            return
        n = pack_linear_weights(model, *model.product_specs, tiles=plan.matmul_impl == "amx",
                                abstract=abstract)
        if not abstract:
            logger.info("packed %d weights for the %s matmul kernel", n, plan.matmul_impl)

    def lays_out_weights(self, plan: DevicePlan) -> bool:
        return plan.matmul_impl != "xla"

    def layer_impl(self, model) -> LayerImpl | None:
        """The fused layer when the model's layer features are all covered and every product of
        every layer is packed (`prepare_model` with a native product kernel)."""
        if not layer_features_covered(model, self.fused_layer_features):
            return None
        if any(layer.attn_spec != model.attn_spec for layer in model.layers):
            return None  # the fused layer reads the model-wide spec (its window, its scale)
        for layer in model.layers:
            if not all(isinstance(getattr(layer, n, None), PackedParam) for n in cpu_layer.PACKED):
                return None
        return cpu_layer.fused_layer

    def place_weights(self, model, params: list[jax.Array], treedef) -> None:
        """Copy the weights into one huge-page arena (see huge_pages.py), in place in
        `params`, and point `model`'s variables at them, so that XLA's copies are freed; the
        freed memory goes back to the system."""
        moved_params, moved = huge_pages.place_on_huge_pages(params)
        logger.debug("huge pages: %.0f MiB of weights in the arena", moved / 2**20)
        if moved:
            params[:] = moved_params
            del moved_params
            nnx.update(model, jax.tree.unflatten(treedef, params))
            huge_pages.release_freed_host_memory()

    def fingerprint(self) -> dict[str, str]:
        """The host's instruction sets, and the native kernels the steps call: the build target
        and its library (named by the hash of its sources, flags, compiler, jaxlib and CPU), or
        their absence."""
        target = kernels.selected_target()
        library = kernels.library_path(target).name if kernels.available(target) else "unavailable"
        return {"cpu": f"{platform.machine()} {kernels.cpu_flags().strip()}",
                "kernels": f"{target}:{library}"}

    def place_kv_cache(self, arrays: list[jax.Array]):
        return huge_pages.advise_in_background(arrays)


def default_kv_bytes() -> int:
    """KV-cache bytes per device when none is given: JAXSERVE_CPU_KVCACHE_SPACE GiB, else 1 GiB."""
    raw = os.environ.get(KV_SPACE_ENV, "").strip()
    if not raw:
        return CPU_KV_BYTES
    try:
        gib = float(raw)
    except ValueError:
        gib = 0.0
    if not gib > 0:
        raise ValueError(f"{KV_SPACE_ENV}={raw!r}: give the KV cache's GiB as a positive number (e.g. 4 or 0.25)")
    return int(gib * (1 << 30))
