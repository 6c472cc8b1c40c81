"""The engine's plan: every "auto" of an EngineConfig resolved once, each with its reason.

`plan_engine(config, model files, backend, devices)` is pure: it reads the model's config.json
(`ModelFiles`), the backend's policy and the devices as facts (`DeviceSet`: JAX's, or described
for a TPU slice or GPU hosts this host does not have) and opens no device. It resolves the
weights' and the KV cache's dtypes, the attention implementation (the kernel's shape check on
one device's heads, as "auto" decides when serving), the product kernels, max_model_len, the
token budget, the bucket grid, how the KV cache is sized, the sampler's sizes, where the engine
core runs and how many processes compile the steps. Building the engine then reads only the
plan (engine/setup.py: build -> size the KV cache -> compile -> assemble), and the step's recipe
(runner/recipe.py) is written from it. The plan is logged at start ("engine plan: ...") and
`jaxserve serve --help` lists what each entry is resolved from (`PLAN_HELP`).

This module loads without JAX (the server's --help reads `PLAN_HELP` through the engine client);
`plan_engine` imports what it needs when called.
"""

from __future__ import annotations

import dataclasses
import pathlib
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from jaxserve.config import EngineConfig, LoRAConfig, SchedulerConfig
from jaxserve.speculative_config import STEP_DRAFTERS, SpeculativeConfig

if TYPE_CHECKING:
    from jaxserve.backends.base import Backend, DevicePlan
    from jaxserve.backends.devices import DeviceSet
    from jaxserve.compiled_step.buckets import BucketGrid
    from jaxserve.models.arch_config import ArchConfig
    from jaxserve.runner.recipe import StepRecipe
    from jaxserve.sampling.config import SamplerConfig

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"  # the bundled model's (models/loader.py)

# What each entry of the plan is resolved from: `jaxserve serve --help` shows it, the start-up
# log shows the values and their reasons.
PLAN_HELP = """\
the engine plan: every "auto" is resolved once at start (jaxserve/engine/plan.py) and logged as
"engine plan: ...", each value with the reason it was chosen:
  runner          generate; pooling for a base model's checkpoint (architectures *Model)
  dtype           bfloat16 on TPU/GPU; on a CPU the faster of bfloat16 and float32 (measured once)
  kv dtype        the model's; float32 on a CPU without the native attention kernel
  attention       the platform's kernel when it takes one device's heads, else the reference; for
                  the TPU kernel, zero KV heads appended where Hkv x head dim is not a multiple
                  of 128 lanes (SmolLM2: 3 -> 4 heads, +33 % KV bytes; a drafter's pages alike)
  matmul          a native CPU product kernel for the weights' dtype (one device), else XLA's dot
  quant products  the TPU product kernel where attention runs the TPU kernel, else XLA's
  fp8 products    on GPUs of compute capability >= 8.9
  max model len   the model's context (on a CPU at most 2048); on TPU/GPU lowered to what the KV
                  cache holds when it cannot hold one sequence that long
  token budget    the largest token bucket, else 8192 per data-parallel rank on TPU/GPU, 512 on
                  a CPU (at least max_model_len without chunked prefill)
  buckets         tokens x2 from 16 to the budget (x4 above 1024 on TPU/GPU); requests x4 from 8
  kv cache        TPU/GPU: what the largest compiled step leaves of each device; a CPU: 1 GiB
                  (JAXSERVE_CPU_KVCACHE_SPACE); --kv-cache-memory: that
  decode steps    multi-step decode: 4 decode steps per device call on TPU/GPU, 1 on a CPU; 1
                  with data parallelism, several processes or the pooling runner
  engine core     serve: a thread on a CPU, a process of its own on TPU/GPU; offline: the caller's
  compile workers TPU: one per 4 host cores, at most 8; elsewhere 1 (in the engine's process)"""


@dataclasses.dataclass(frozen=True)
class ModelFiles:
    """What the plan reads of the model's files: its directory and config.json (a pooling
    checkpoint saved from a base model already read as its causal LM)."""

    path: pathlib.Path | None
    config: Mapping[str, Any]
    # The architectures as the checkpoint names them (a base model's: *Model), before it is
    # read as its causal LM; default: config.json's.
    saved_architectures: list[str] | None = None

    @property
    def architectures(self) -> list[str] | None:
        return self.saved_architectures if self.saved_architectures is not None else self.config.get("architectures")


@dataclasses.dataclass(frozen=True)
class EnginePlan:
    """One engine, resolved. `reasons` says why each entry holds its value (by the entry's
    name: the fields below, and the DevicePlan's fields under their own names)."""

    config: EngineConfig  # what was asked
    model: ModelFiles
    arch: ArchConfig
    name: str  # the served model's name
    pooling: bool  # embeddings (the pooling runner) instead of generation
    platform: str
    mesh_shape: tuple[int, int]  # (data, model)
    multi_process: bool  # a multi-host run (the leader's plan reaches every follower)
    rules: Mapping[str, Any]  # the serving rules
    device: DevicePlan  # the backend's: dtypes, kernels, products
    attention_impl: str  # what attention "auto" runs here (the kernel's shape check included)
    scheduler: SchedulerConfig  # max_model_len and the token budget resolved
    grid: BucketGrid  # the runner's buckets (generation: one data-parallel rank's)
    kv_sizing: str  # "pages" (a count given), "budget" (bytes per device), "programs" (measured)
    kv_budget: int | None  # bytes per device, for "budget"
    sampler: SamplerConfig
    compile_target: Mapping[str, Any]  # the compile workers' devices ({}: none)
    compile_workers: int
    engine_core: str  # "thread", "process" (serve) or "caller" (offline: the caller's thread)
    reasons: Mapping[str, str]
    num_decode_steps: int = 1  # multi-step decode's K (runner/decode_block.py)
    # Drafting inside the step: the method ("eagle3", "deepseek_mtp", "draft_model"; "": none)
    # and the drafter's directory (an EAGLE-3 head's or a draft model's; "" for MTP, the
    # target's own layer), set at build once checked against the target
    draft_model: str = ""
    draft_method: str = ""
    # The KV heads the drafter's own pages are served with (0: its checkpoint's): zero heads
    # appended where the TPU kernel needs lane-dense pages, as for the target (`with_drafter`)
    draft_kv_heads: int = 0

    def with_drafter(self, method: str, directory: str, devices=None) -> EnginePlan:
        """This plan with the drafter `method` runs inside the step (its directory checked
        against the target: `setup.drafter_dir`) and the KV heads its own pages are served with
        (`recipe.serving_draft_heads`, the target's decision applied to the drafter's pages;
        `devices` the mesh's, as `plan_engine`'s); the attention reason says when they grow."""
        from jaxserve.config import jax_dtype
        from jaxserve.runner.recipe import serving_draft_heads

        heads = serving_draft_heads(method, directory, self.arch, self.config.model.attention_impl, self.platform,
                                    _MeshShape(*self.mesh_shape), self.rules, self.config.cache.page_size,
                                    jax_dtype(self.device.kv_dtype), jax_dtype(self.device.dtype), devices)
        reasons = dict(self.reasons)
        if heads:
            from jaxserve.runner.draft_head_step import draft_cache_config

            note = draft_cache_config(method, self.arch, directory, heads).kv_padding_note()
            reasons["attention"] += f"; the drafter's {note}"
        return dataclasses.replace(self, draft_method=method, draft_model=directory, draft_kv_heads=heads,
                                   reasons=reasons)

    @property
    def max_model_len(self) -> int:
        """The context before the KV cache is sized (on TPU/GPU a defaulted one may be lowered
        to what the cache holds)."""
        return self.scheduler.max_model_len

    @property
    def lora(self) -> LoRAConfig | None:
        return self.config.lora if self.config.lora.enable_lora else None

    @property
    def speculative(self) -> SpeculativeConfig | None:
        return self.config.speculative_config

    def entries(self) -> list[tuple[str, Any]]:
        """(name, value) of every resolved entry, in the order the log shows them."""
        d, sc = self.device, self.scheduler
        kv = {"pages": f"{self.config.cache.num_pages} pages", "programs": "from the compiled programs",
              "budget": f"{(self.kv_budget or 0) / 2**30:.3g} GiB per device"}[self.kv_sizing]
        return [("runner", "pooling" if self.pooling else "generate"), ("dtype", d.dtype),
                ("kv_dtype", d.kv_dtype), ("attention", self.attention_impl), ("matmul_impl", d.matmul_impl),
                ("native_sampling", d.native_sampling or "none"), ("moe_impl", d.moe_impl),
                ("quant_matmul_impl", d.quant_matmul_impl), ("fp8_products", d.fp8_products),
                ("weights", self.weights), ("max_model_len", sc.max_model_len),
                ("max_num_batched_tokens", sc.max_num_batched_tokens),
                ("token_buckets", ",".join(map(str, self.grid.token_buckets))),
                ("request_buckets", ",".join(map(str, self.grid.request_buckets))),
                ("num_decode_steps", self.num_decode_steps), ("kv_cache", kv),
                ("engine_core", self.engine_core), ("compile_workers", self.compile_workers)]

    @property
    def weights(self) -> str:
        fmt = self.arch.weight_format
        return (f"{fmt.describe()} (the checkpoint's)" if fmt is not None else
                self.config.model.quantization or self.device.dtype)

    def describe(self) -> str:
        """The plan as the start-up log shows it: each entry with its reason."""
        D, M = self.mesh_shape
        head = f"{self.name} on {self.platform} ({D}x{M} mesh{', several processes' if self.multi_process else ''})"
        return head + "; " + "; ".join(f"{k} {v} ({self.reasons[k]})" for k, v in self.entries())

    def recipe(self, *, num_pages: int, max_model_len: int) -> StepRecipe:
        """The step recipe of this plan (runner/recipe.py) with its KV cache's pages."""
        from jaxserve.runner.recipe import StepRecipe

        lora, spec = self.lora, self.speculative
        return StepRecipe(
            arch=dict(self.model.config), platform=self.platform, plan=dataclasses.asdict(self.device),
            attention_impl=self.config.model.attention_impl, rules=dict(self.rules), mesh_shape=self.mesh_shape,
            target=dict(self.compile_target), num_pages=num_pages, page_size=self.config.cache.page_size,
            max_model_len=max_model_len, sampler_config=self.sampler, quantization=self.config.model.quantization,
            max_loras=lora.max_loras if lora else 0, max_lora_rank=lora.max_lora_rank if lora else 0,
            num_speculative_tokens=spec.num_speculative_tokens if spec else 0, draft_model=self.draft_model,
            draft_method=self.draft_method, draft_kv_heads=self.draft_kv_heads,
            token_buckets=self.grid.token_buckets, request_buckets=self.grid.request_buckets,
            num_decode_steps=self.num_decode_steps,
            kv_heads=self.arch.num_kv_heads if self.arch.checkpoint_heads else 0)


def plan_engine(config: EngineConfig, model: ModelFiles, backend: Backend, devices: DeviceSet, *,
                engine_core: tuple[str, str] | None = None) -> EnginePlan:
    """The plan of the engine `config` describes for `model` on `devices` (data x model of them),
    by `backend`'s policy. `engine_core`: (where the serving core runs, why); None offline.
    Pure: nothing is loaded, compiled or allocated. Raises ValueError for a configuration
    that cannot be served (before anything slow)."""
    from jaxserve.config import jax_dtype
    from jaxserve.models.arch_config import ArchConfig
    from jaxserve.models.sharding import check_servable, load_rules, serving_rules
    from jaxserve.runner.recipe import serving_arch, target_attention

    mc, cc, pc = config.model, config.cache, config.parallel
    D, M = pc.data_parallel_size, pc.tensor_parallel_size
    if devices.size != D * M:
        raise ValueError(f"a {D}x{M} mesh needs {D * M} devices; the plan was given {devices.size}")
    rules = serving_rules(load_rules(pc.sharding_rules), D)
    check_servable(rules)
    arch = ArchConfig.from_hf(dict(model.config))
    pooling = mc.is_pooling(model.architectures)
    multi_process = pc.coordinator_address is not None or devices.processes > 1
    _check_servable(config, pooling, multi_process)
    _check_speculative(config, pooling, multi_process)
    device = backend.plan(mc, cc, devices)
    reasons = dict(backend.plan_reasons(mc, cc, device))
    reasons["runner"] = _runner_reason(mc, pooling)
    mesh, kv_dtype, dtype = _MeshShape(D, M), jax_dtype(device.kv_dtype), jax_dtype(device.dtype)
    if not pooling:  # zero KV heads appended where the kernel needs lane-dense pages
        arch = serving_arch(mc.attention_impl, backend.platform, arch, mesh, rules, cc.page_size,
                            kv_dtype, dtype, devices=list(devices.devices),
                            lora=config.lora.enable_lora)
    attention, why_not = target_attention(mc.attention_impl, backend.platform, arch, mesh, rules,
                                          cc.page_size, kv_dtype, dtype,
                                          devices=list(devices.devices))
    reasons["attention"] = ("given" if mc.attention_impl != "auto" else
                            f"auto: {why_not}" if why_not else f"auto: the {backend.platform} platform's kernel")
    if arch.kv_padding_note():
        reasons["attention"] += f"; {arch.kv_padding_note()}"
    reasons["weights"] = ("the checkpoint's format" if arch.weight_format is not None else
                          "--quantization, at load" if mc.quantization else "the dtype's")
    scheduler, grid = _steps(config, arch, backend, pooling, reasons)
    sampler = _sampler(config, arch, scheduler, device)
    kv_sizing, kv_budget = _kv_sizing(config, backend, reasons)
    if arch.checkpoint_heads is not None:  # the pages are sized with the zero heads
        reasons["kv_cache"] += f"; pages of {arch.num_kv_heads} KV heads ({arch.kv_padding_note()})"
    target = backend.compile_target(devices.flat(), devices.processes) or {}
    workers = _compile_workers(config, backend, devices, target, pooling, len(grid.shapes()), reasons)
    core, reasons["engine_core"] = engine_core or ("caller", "offline: the core runs on the caller's thread")
    decode_steps = _decode_steps(config, backend, pooling, D > 1 or multi_process, reasons)
    return EnginePlan(config, model, arch, mc.served_model_name or (mc.model or DEFAULT_MODEL_NAME), pooling,
                      backend.platform, (D, M), multi_process, rules, device, attention, scheduler, grid, kv_sizing,
                      kv_budget, sampler, target, workers, core, reasons, decode_steps)


@dataclasses.dataclass(frozen=True)
class _MeshShape:
    """A mesh's shape without its devices (what the sharding rules read of a mesh)."""

    data: int
    model: int

    @property
    def shape(self) -> dict[str, int]:
        return {"data": self.data, "model": self.model}


def _check_servable(config: EngineConfig, pooling: bool, multi_process: bool) -> None:
    if pooling and (config.parallel.data_parallel_size > 1 or multi_process):
        raise ValueError("--runner pooling runs on one process without data parallelism")
    if config.lora.enable_lora and (pooling or multi_process):
        raise ValueError("--enable-lora serves generation on one process (not with --runner pooling, "
                         "nor across hosts)")


def _check_speculative(config: EngineConfig, pooling: bool, multi_process: bool) -> None:
    """A drafter run inside the step (EAGLE-3, MTP, a draft model) runs inside one device's
    step: refuse what it does not run with."""
    spec, pc = config.speculative_config, config.parallel
    if spec is None or spec.method not in STEP_DRAFTERS:
        return
    refused = [name for name, on in (
        ("--runner pooling", pooling), ("--enable-lora", config.lora.enable_lora),
        ("data parallelism", pc.data_parallel_size > 1), ("tensor parallelism", pc.tensor_parallel_size > 1),
        ("several processes", multi_process),
        ("--num-decode-steps above 1", (config.scheduler.num_decode_steps or 1) > 1)) if on]
    if refused:
        raise ValueError(f"speculative_config method {spec.method!r} runs on one device without "
                         f"{', '.join(refused)}")


def _runner_reason(mc, pooling: bool) -> str:
    if mc.runner != "auto":
        return "given"
    return ("auto: a base model's checkpoint (architectures *Model)" if pooling else
            "auto: a causal LM's checkpoint")


def _steps(config: EngineConfig, arch: ArchConfig, backend: Backend, pooling: bool,
           reasons: dict[str, str]) -> tuple[SchedulerConfig, BucketGrid]:
    """The scheduler's limits (context, token budget) and the runner's bucket grid."""
    from jaxserve.compiled_step.buckets import BucketGrid
    from jaxserve.core.dp_scheduler import rank_config

    mc, comp, D = config.model, config.compile, config.parallel.data_parallel_size
    max_model_len = mc.resolve_max_model_len(arch.max_position_embeddings, backend.default_max_model_len)
    cap, own = backend.default_max_model_len, arch.max_position_embeddings
    reasons["max_model_len"] = (
        "given" if mc.max_model_len else
        f"the model's {own}, capped at {cap} on {backend.platform}" if cap is not None and own > cap else
        "the model's context" + (" (lowered to what the KV cache holds, if less)" if backend.sizes_kv_from_programs
                                 else ""))
    chunked = config.scheduler.enable_chunked_prefill
    budget = backend.resolve_max_num_batched_tokens(config.scheduler.max_num_batched_tokens, comp.token_buckets, D,
                                                    at_least=1 if chunked else max_model_len)
    reasons["max_num_batched_tokens"] = (
        "given" if config.scheduler.max_num_batched_tokens is not None else
        "the largest token bucket" if comp.token_buckets else
        f"{backend.platform}'s default per data-parallel rank" + ("" if chunked else
                                                                  ", at least max_model_len (no chunked prefill)"))
    sc = dataclasses.replace(config.scheduler, max_model_len=max_model_len, max_num_batched_tokens=budget)
    if pooling:  # a prompt is never split: the buckets reach max_model_len
        top = max(sc.max_num_batched_tokens, sc.max_model_len)
        tb = comp.token_buckets or backend.default_token_buckets(top)
        tb = tb if max(tb) >= top else (*tb, top)
        grid = BucketGrid.build(max(tb), sc.max_num_seqs, tb, comp.request_buckets)
    else:
        share = rank_config(sc, D)  # the buckets are one rank's
        grid = BucketGrid.build(share.max_num_batched_tokens, share.max_num_seqs,
                                comp.token_buckets or backend.default_token_buckets(share.max_num_batched_tokens),
                                comp.request_buckets)
    dense = backend.dense_buckets_up_to
    reasons["token_buckets"] = "given" if comp.token_buckets else (
        f"auto: x2 from 16 to the budget{f' (x4 above {dense})' if max(grid.token_buckets) > dense else ''}"
        + (", and max_model_len (a prompt is never split)" if pooling else ""))
    reasons["request_buckets"] = "given" if comp.request_buckets else "auto: x4 from 8 to max_num_seqs"
    return sc, grid


def _decode_steps(config: EngineConfig, backend: Backend, pooling: bool, several: bool,
                  reasons: dict[str, str]) -> int:
    """Multi-step decode's K: given, else the backend's; 1 where blocks do not run (pooling,
    several data-parallel ranks or processes: a block is one rank's, launched in one process)."""
    given = config.scheduler.num_decode_steps
    spec = config.speculative_config
    if spec is not None and spec.method in STEP_DRAFTERS:
        reasons["num_decode_steps"] = f"the {STEP_DRAFTERS[spec.method]} drafts after each step"
        return 1
    if pooling:
        reasons["num_decode_steps"] = "the pooling runner decodes nothing"
        return 1
    if several:
        if given is not None and given > 1:
            raise ValueError("--num-decode-steps above 1 runs on one process without data parallelism")
        reasons["num_decode_steps"] = "data parallelism or several processes: one step per call"
        return 1
    if given is not None:
        reasons["num_decode_steps"] = "given"
        return given
    reasons["num_decode_steps"] = f"auto: {backend.platform}'s default"
    return backend.default_num_decode_steps


def _sampler(config: EngineConfig, arch: ArchConfig, sc: SchedulerConfig, device: DevicePlan) -> SamplerConfig:
    from jaxserve.sampling.config import SamplerConfig

    return SamplerConfig(max_num_seqs=sc.max_num_seqs, vocab_size=arch.vocab_size,
                         max_logprobs=config.max_logprobs, native=device.native_sampling)


def _kv_sizing(config: EngineConfig, backend: Backend, reasons: dict[str, str]) -> tuple[str, int | None]:
    """How the KV cache is sized: a page count given (tests), the compiled programs' memory
    analysis (accelerators), or a budget in bytes per device."""
    cc = config.cache
    if cc.num_pages:
        reasons["kv_cache"] = "given (a page count)"
        return "pages", None
    if backend.sizes_kv_from_programs and cc.kv_cache_memory_bytes is None:
        reasons["kv_cache"] = (f"auto: --gpu-memory-utilization {cc.device_memory_utilization:g} of each device "
                               "less the weights and what the largest compiled step needs")
        return "programs", None
    reasons["kv_cache"] = ("given (--kv-cache-memory)" if cc.kv_cache_memory_bytes is not None else
                           f"auto: {backend.platform}'s fixed budget (host memory has no useful free figure)")
    return "budget", backend.kv_cache_budget(cc)


def _compile_workers(config: EngineConfig, backend: Backend, devices: DeviceSet, target: Mapping[str, Any],
                     pooling: bool, num_executables: int, reasons: dict[str, str]) -> int:
    given = config.compile.compile_workers
    if pooling:
        reasons["compile_workers"] = "the pooling runner compiles in the engine's process"
        return 1
    n = given or backend.default_compile_workers(num_executables, devices.host_cores)
    if given:
        why = "given"
    elif backend.platform == "tpu":
        why = f"auto: one per 4 of the host's {devices.host_cores} cores, at most 8 and the {num_executables} steps"
    else:
        why = f"auto: the steps compile in the engine's process on {backend.platform}"
    if n > 1 and not target:
        n, why = 1, why + "; no compile-only target for these devices (several processes, or a GPU)"
    reasons["compile_workers"] = why
    return n


def with_device_plan(plan: EnginePlan, device: DevicePlan, why: str) -> EnginePlan:
    """`plan` with another process's DevicePlan (a multi-host follower takes the leader's)."""
    reasons = dict(plan.reasons)
    for field in dataclasses.fields(device):
        reasons[field.name] = why
    return dataclasses.replace(plan, device=device, reasons=reasons)
