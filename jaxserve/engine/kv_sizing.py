"""Sizing the KV cache: a page count given, a budget in bytes per device, or what the largest
compiled step leaves of each device on an accelerator (`kv_budget_from_programs`: the step's
memory analysis, compiled from the engine's StepRecipe on abstract weights); then max_model_len
fitted to the pages, and the served step checked against the budget once it is compiled.
See docs/DESIGN.md §4b ("The KV budget on accelerators comes from the compiled programs")."""

from __future__ import annotations

import dataclasses
import functools
import logging
from typing import TYPE_CHECKING

from jaxserve.backends import Backend
from jaxserve.backends.base import InsufficientMemoryError, MemoryBudget, min_over_processes
from jaxserve.compiled_step.memory import StepMemory, bytes_on_device
from jaxserve.config import jax_dtype
from jaxserve.engine.plan import EnginePlan
from jaxserve.runner.compile import executable_cache
from jaxserve.runner.compile_pool import step_memory
from jaxserve.runner.executable_cache import canonical, executable_scope
from jaxserve.runner.kv_cache import bytes_per_page, num_pages_for_budget
from jaxserve.runner.recipe import StepRecipe
from jaxserve.startup_timer import StartupTimer

if TYPE_CHECKING:
    from jaxserve.models.arch_config import ArchConfig
    from jaxserve.runner.model_runner import ModelRunner

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class KVSize:
    """The KV cache as sized: its pages, the context they hold, the step's recipe with them."""

    rank_pages: int  # pages per data-parallel rank (each rank's devices hold its own)
    max_model_len: int  # the plan's, or what one sequence can hold of those pages
    memory: MemoryBudget | None  # the budget from the compiled programs (accelerators)

    def recipe(self, plan: EnginePlan) -> StepRecipe:
        D = plan.mesh_shape[0]
        return plan.recipe(num_pages=self.rank_pages * D, max_model_len=self.max_model_len)


def size_kv_cache(plan: EnginePlan, backend: Backend, mesh, timer: StartupTimer) -> KVSize:
    """The KV cache's pages as the plan sizes it: a page count given, a budget in bytes per
    device, or what the largest compiled step leaves of each device; then max_model_len fitted
    to them (one sequence of it must fit; a page count given for tests is taken as is)."""
    cc, D = plan.config.cache, plan.mesh_shape[0]
    if plan.kv_sizing == "pages":
        return KVSize(cc.num_pages // D, plan.max_model_len, None)
    memory = None
    if plan.kv_sizing == "programs":
        with timer.phase("memory"):
            probe = functools.partial(plan.recipe, max_model_len=plan.max_model_len)
            memory = _memory_from_programs(plan, backend, mesh, probe)
    rank_pages = num_pages_for_budget(plan.arch, cc.page_size, jax_dtype(plan.device.kv_dtype),
                                      plan.kv_budget if memory is None else memory.kv, mesh, plan.rules,
                                      extra_bytes_per_page=draft_bytes_per_page(plan, mesh))
    fitted = fit_max_model_len(plan.max_model_len, rank_pages, cc.page_size,
                               given=plan.config.model.max_model_len is not None)
    return KVSize(rank_pages, fitted, memory)


def draft_bytes_per_page(plan: EnginePlan, mesh) -> int:
    """Bytes per page (per device) of the drafter's own pages (an EAGLE-3 head's or MTP's one
    layer, a draft model's whole cache), indexed like the target's, in their own dtype
    (`draft_cache_dtype`); 0 without a drafter in the step."""
    if not plan.draft_method:
        return 0
    from jaxserve.runner.draft_head_step import draft_cache_config, draft_cache_dtype

    cfg = draft_cache_config(plan.draft_method, plan.arch, plan.draft_model, plan.draft_kv_heads)
    dtype = draft_cache_dtype(jax_dtype(plan.device.dtype), jax_dtype(plan.device.kv_dtype))
    return bytes_per_page(cfg, plan.config.cache.page_size, dtype, mesh, plan.rules)


def _memory_from_programs(plan: EnginePlan, backend: Backend, mesh, recipe) -> MemoryBudget:
    """The KV budget of this process's accelerators from the largest step's own memory
    analysis (`kv_budget_from_programs`), the least over the processes. `recipe(num_pages=...)`:
    the step's recipe with that many pages."""
    stats = backend.device_memory()
    if stats is None:
        raise ValueError("the devices do not report their memory: give the KV cache's size (--kv-cache-memory)")
    limit, in_use = stats
    exe_cache = executable_cache(plan.config.compile)
    budget = kv_budget_from_programs(
        backend, plan.config.cache, recipe, max(plan.grid.shapes()), limit, arch=plan.arch,
        kv_dtype=jax_dtype(plan.device.kv_dtype), mesh=mesh, rules=plan.rules, in_use=in_use,
        num_executables=len(plan.grid.shapes()), extra_bytes_per_page=draft_bytes_per_page(plan, mesh),
        scope=lambda r: executable_scope(exe_cache, mesh.devices.flat, **backend.fingerprint(),
                                         recipe=canonical(r.program_key())))
    kv = min_over_processes(budget.kv)
    if kv != budget.kv:  # another process has less room
        budget = dataclasses.replace(budget, other_in_use=budget.other_in_use + int((budget.kv - kv) * (
            1 + budget.kv_overhead)))
    logger.info("memory per device: %s", budget.describe())
    return budget


def kv_budget_from_programs(backend: Backend, cc, recipe, bucket: tuple[int, int], device_memory: int, *,
                            arch: ArchConfig, kv_dtype, mesh, rules, in_use: int = 0, num_executables: int = 1,
                            scope=None, extra_bytes_per_page: int = 0) -> MemoryBudget:
    """The KV budget per device from the step of `bucket` (the largest) compiled from
    `recipe(num_pages=...)` on abstract weights, without running anything: first with the
    fewest pages (the KV cache is a donated argument: what the step needs besides it is XLA's
    buffer assignment, `memory_analysis()`), then with an eighth of the pages that leaves, to
    see whether the step's temporaries grow with the cache (where XLA copies cache arrays,
    e.g. to relayout them for a TPU kernel, they do) and leave room for that. Last, the step
    with the pages of that budget, the step that will be served: a copy that grows with the
    cache can hide under the other temporaries at an eighth of its size and not at all of it
    (the 32-layer Llama-3-8B on v5e: no growth at an eighth, 0.2 GiB more at the full cache),
    so what it needs beyond the budget is taken off the cache. `scope(recipe)`: the executable
    cache's scope of a probe (a restart loads them)."""
    D = mesh.shape.get("data", 1)
    devices = list(mesh.devices.flat)

    def probe(num_pages: int) -> StepMemory:
        r = recipe(num_pages=num_pages)
        return step_memory(r, bucket, devices=devices, scope=None if scope is None else scope(r))

    small = probe(2 * D)
    first = backend.kv_budget_from_step(cc, small, device_memory, in_use=in_use, num_executables=num_executables)
    page = (bytes_per_page(arch, recipe(num_pages=2 * D).page_size, kv_dtype, mesh, rules)  # per device
            + extra_bytes_per_page)  # the drafter's own pages
    pages = D * max(2, first.kv // 8 // page)
    if pages <= 2 * D:
        return first
    budget = backend.kv_budget_from_step(cc, small, device_memory, in_use=in_use, num_executables=num_executables,
                                         larger=probe(pages))
    served_pages = D * (budget.kv // page)
    if served_pages <= pages:
        return budget
    return backend.check_served_step(budget, probe(served_pages))


def fit_max_model_len(max_model_len: int, rank_pages: int, page_size: int, *, given: bool) -> int:
    """`max_model_len`, or what one sequence can hold of a KV cache of `rank_pages` pages (one is
    the null page) when that is less: a context the user gave is refused then, as vLLM does
    (they asked for it); the model's own (the default) is lowered, with a warning saying why."""
    holds = (rank_pages - 1) * page_size
    if max_model_len <= holds:
        return max_model_len
    if given:
        raise InsufficientMemoryError(
            f"max_model_len {max_model_len} is more than the KV cache holds ({holds} tokens in "
            f"{rank_pages - 1} pages of {page_size}): lower --max-model-len, or raise "
            f"--gpu-memory-utilization / --kv-cache-memory")
    logger.warning("max_model_len lowered from the model's %d to %d tokens: the KV cache holds %d pages of %d "
                   "tokens (raise --gpu-memory-utilization or shard over more devices for more)",
                   max_model_len, holds, rank_pages - 1, page_size)
    return holds


def confirm_memory(budget: MemoryBudget, runner: ModelRunner) -> None:
    """Checks the served largest step (and the largest decode block, with multi-step decode)
    against the budget, from its own memory analysis (the KV cache it takes is the real one):
    a step that would not fit the device is refused."""
    largest = max(runner.grid.shapes())
    kv = bytes_on_device([*runner.kv.k, *runner.kv.v])
    served = StepMemory.of(runner.executable(largest), largest, weights=budget.step.weights, kv=kv)
    if runner.block_layouts:
        R = max(runner.block_layouts)
        block = StepMemory.of(runner.decode_block(R), (R, R), weights=budget.step.weights, kv=kv)
        if block.peak > served.peak:
            logger.info("the decode block of %d rows needs more than the largest step: %.2f GiB", R,
                        block.peak / 2**30)
            served = block
    need = served.peak + budget.other_code + budget.other_in_use
    logger.info("largest step %dx%d with its KV cache (%.2f GiB): %.2f GiB of the %.2f GiB allowed per device",
                *served.bucket, served.kv / 2**30, need / 2**30, budget.usable / 2**30)
    if need > budget.device_memory:
        raise InsufficientMemoryError(f"the largest step needs {need / 2**30:.2f} GiB per device, more than the "
                                      f"device's {budget.device_memory / 2**30:.2f} GiB ({budget.describe()})")
