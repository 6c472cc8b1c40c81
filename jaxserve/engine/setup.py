"""Building an engine from an EngineConfig: the model, its tokenizer, the backend's plan, the KV
cache, the scheduler and the compiled runner.

`build_engine` returns the parts (`EngineParts`); the offline `LLMEngine` and the server's
`AsyncEngineClient` are put together from them, and tests can put them together from fakes.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import gc
import logging
import pathlib
import time
from collections.abc import Callable

from jaxserve.backends import Backend, DevicePlan, select_backend
from jaxserve.backends.base import InsufficientMemoryError, MemoryBudget, log_activation_products, min_over_processes
from jaxserve.config import EngineConfig, jax_dtype
from jaxserve.core.kv_cache_manager import KVCacheManager
from jaxserve.core.lora_slots import LoRASlotTable
from jaxserve.core.dp_scheduler import DataParallelScheduler, rank_config
from jaxserve.core.scheduler import Scheduler
from jaxserve.engine.core import EngineCore
from jaxserve.engine.pooling_core import PoolingCore
from jaxserve.engine.generation_config import load_generation_config
from jaxserve.engine.input_processor import ModelInfo
from jaxserve.engine.tokenizer import Tokenizer
from jaxserve.models.arch_config import ArchConfig
from jaxserve.models.loader import load_checkpoint, resolve_model
from jaxserve.models.pooling_config import as_causal_lm, check_decoder, load_pooling_config
from jaxserve.models.sharding import check_servable, load_rules, serving_rules
from jaxserve.models.weights import create_model, sharded_abstract_model
from jaxserve.parallel import multihost, step_channel
from jaxserve.parallel.mesh import bytes_per_device, make_mesh, replicated_axes
from jaxserve.runner.buckets import BucketGrid
from jaxserve.runner.compile import executable_cache, weight_cache
from jaxserve.runner.compile_pool import StepRecipe, step_memory
from jaxserve.runner.executable_cache import canonical, executable_scope
from jaxserve.runner.kv_cache import bytes_per_page, num_pages_for_budget
from jaxserve.pallas_kernels.kv_quant import is_quantized
from jaxserve.runner.kv_scales import CALIBRATION_TEXT, prepare_kv_scales
from jaxserve.runner.step_memory import StepMemory, bytes_on_device
from jaxserve.runner.model_runner import ModelRunner
from jaxserve.runner.pooling_runner import PoolingRunner
from jaxserve.runner.protocol import StepRunner
from jaxserve.sampling.config import SamplerConfig
from jaxserve.spec_decode import NgramProposer
from jaxserve.startup_timer import StartupTimer

logger = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


@dataclasses.dataclass
class EngineParts:
    tokenizer: Tokenizer
    info: ModelInfo
    core: EngineCore | PoolingCore
    model_path: pathlib.Path | None = None  # the (converted) checkpoint directory
    arch: ArchConfig | None = None
    backend: Backend | None = None
    plan: DevicePlan | None = None
    load_seconds: float = 0.0
    topology: multihost.Topology | None = None  # several processes: this one's place
    link: step_channel.Leader | step_channel.Follower | None = None  # the step channel
    model_runner: ModelRunner | None = None  # this process's devices (core.runner may wrap it)

    @property
    def is_follower(self) -> bool:
        return self.topology is not None and not self.topology.is_leader

    def run_follower(self) -> None:
        """A follower's whole life after start-up: launch the leader's steps until it says to
        shut down (raises LeaderLostError when it goes away)."""
        import jax

        self.link.run(self.model_runner, self.link.settings["step_timeout_seconds"])
        jax.distributed.shutdown()

    def close(self) -> None:
        """The leader's clean exit: the followers shut down with it."""
        if self.topology is not None and self.topology.is_leader:
            import jax

            self.link.close()
            jax.distributed.shutdown()


def build_engine(config: EngineConfig, timer: StartupTimer | None = None, *,
                 on_model_path: Callable[[pathlib.Path], None] | None = None) -> EngineParts:
    """The engine's parts from `config`. `timer` (optional) collects the wall time of each
    start-up phase; the summary is logged when the engine is ready. `on_model_path(path)` is
    called as soon as the model's directory is known (a frontend elsewhere loads its tokenizer).
    Several processes: a build that fails after they joined tells the others why (they would
    otherwise wait for this one in a compile or a collective; see parallel/multihost.py)."""
    joined: list[step_channel.Leader | step_channel.Follower] = []
    try:
        return _build_engine(config, timer, on_model_path, joined)
    except BaseException as e:
        for link in joined:
            link.abort(f"{type(e).__name__}: {e}")
        raise


def _build_engine(config: EngineConfig, timer: StartupTimer | None,
                  on_model_path: Callable[[pathlib.Path], None] | None, joined: list) -> EngineParts:
    own_timer = timer is None
    timer = timer or StartupTimer()
    t0 = time.perf_counter()
    mc, cc = config.model, config.cache
    D = config.parallel.data_parallel_size
    rules = serving_rules(load_rules(config.parallel.sharding_rules), D)
    check_servable(rules)  # before anything slow: a bad preset or file fails at once
    with timer.phase("distributed"):
        topo = multihost.initialize(config.parallel)  # first: before anything touches a JAX backend
    with timer.phase("model files"):
        model_path = resolve_model(mc.model, cache_dir=mc.model_cache_dir, revision=mc.revision,
                                   download_dir=mc.download_dir, gguf_file=mc.gguf_file)
    if on_model_path is not None:
        on_model_path(model_path)
    # The tokenizer (transformers' import and its files: ~1 s) loads on a thread of its own while
    # this one reads and lays out the weights and loads the steps (numpy, XLA, deserialization:
    # most of it without the GIL).
    tokenizer_pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="jaxserve-tokenizer")
    tokenizer_future = tokenizer_pool.submit(Tokenizer.from_pretrained, model_path)
    tokenizer_pool.shutdown(wait=False)
    with timer.phase("checkpoint"):
        ckpt = load_checkpoint(model_path)
        pooling = mc.is_pooling(ckpt.config.get("architectures"))
        if pooling:
            check_decoder(ckpt.config.get("architectures"))
            ckpt = as_causal_lm(ckpt)
        arch = ArchConfig.from_hf(ckpt.config)
        gen = load_generation_config(model_path, mc.generation_config, ckpt.config)
    with timer.phase("backend"):
        backend = select_backend()
        mesh = make_mesh(D, config.parallel.tensor_parallel_size)
        plan = backend.plan(mc, cc, mesh)
    max_model_len = mc.resolve_max_model_len(arch.max_position_embeddings, backend.default_max_model_len)
    if max_model_len > arch.max_position_embeddings:
        logger.warning("max_model_len %d exceeds the model's max_position_embeddings %d",
                       max_model_len, arch.max_position_embeddings)
    # The token budget: the user's, else the largest of their token buckets, else the backend's.
    budget = backend.resolve_max_num_batched_tokens(
        config.scheduler.max_num_batched_tokens, config.compile.token_buckets, D,
        at_least=1 if config.scheduler.enable_chunked_prefill else max_model_len)
    sc = dataclasses.replace(config.scheduler, max_model_len=max_model_len, max_num_batched_tokens=budget)
    link = None
    if topo is not None:  # the leader resolves the "auto"s; every follower takes them
        with timer.phase("distributed"):
            link, plan = _join(topo, config, model_path, plan)
            joined.append(link)
            link.watch_startup()
    kv_dtype = jax_dtype(plan.kv_dtype)
    if pooling and (D > 1 or topo is not None):
        raise ValueError("--runner pooling runs on one process without data parallelism")
    if config.lora.enable_lora and (pooling or topo is not None):
        raise ValueError("--enable-lora serves generation on one process (not with --runner pooling, "
                         "nor across hosts)")
    model = _prepared_model(config, ckpt, arch, backend, plan, mesh, rules, timer)
    with timer.phase("kv scales"):  # a quantized cache's, before the steps are compiled
        prepare_kv_scales(model, kv_dtype, ckpt,
                          lambda: tokenizer_future.result().encode(CALIBRATION_TEXT))
    load_seconds = time.perf_counter() - t0
    if pooling:
        return _pooling_engine(config, model, model_path, arch, backend, plan, mesh, rules, gen,
                               timer, tokenizer_future, sc, load_seconds, own_timer)
    sampler_config = SamplerConfig(max_num_seqs=sc.max_num_seqs, vocab_size=arch.vocab_size,
                                   max_logprobs=config.max_logprobs, native=plan.native_sampling)
    share = rank_config(sc, D)  # the buckets are one rank's
    grid = BucketGrid.build(share.max_num_batched_tokens, share.max_num_seqs,
                            config.compile.token_buckets or backend.default_token_buckets(share.max_num_batched_tokens),
                            config.compile.request_buckets)
    exe_cache = executable_cache(config.compile)
    recipe = functools.partial(StepRecipe, arch=ckpt.config, platform=backend.platform,
                               plan=dataclasses.asdict(plan), attention_impl=mc.attention_impl, rules=rules,
                               mesh_shape=(D, config.parallel.tensor_parallel_size),
                               target=backend.compile_target(mesh.devices.flat) or {}, page_size=cc.page_size,
                               sampler_config=sampler_config)
    # The recipe rebuilds the step from the checkpoint's float model: a model whose weights or
    # KV cache are quantized, or that carries LoRA slots, is not that program, so neither the
    # memory probe nor the compile workers take it (the free-memory policy and one process).
    recipe_applies = (mc.quantization is None and arch.weight_format is None
                      and not is_quantized(kv_dtype) and not config.lora.enable_lora)
    # Pages per data-parallel rank (each rank's devices hold its own; `num_pages` counts them all).
    memory = None
    if cc.num_pages:
        rank_pages = cc.num_pages // D
    elif backend.sizes_kv_from_programs and cc.kv_cache_memory_bytes is None and recipe_applies:
        with timer.phase("memory"):
            memory = _memory_from_programs(backend, cc, recipe, grid, max_model_len, mesh, exe_cache, arch,
                                           kv_dtype, rules)
        rank_pages = num_pages_for_budget(arch, cc.page_size, kv_dtype, memory.kv, mesh, rules)
    else:
        rank_pages = num_pages_for_budget(arch, cc.page_size, kv_dtype, backend.kv_cache_budget(cc), mesh, rules)
    # One sequence of max_model_len must fit the cache (a page count given for tests is taken as is).
    fitted = (max_model_len if cc.num_pages else
              fit_max_model_len(max_model_len, rank_pages, cc.page_size, given=mc.max_model_len is not None))
    if fitted != max_model_len:
        max_model_len = fitted
        sc = dataclasses.replace(sc, max_model_len=max_model_len)
    num_pages = rank_pages * D
    kv_managers = [KVCacheManager(cc.page_size, rank_pages, enable_caching=cc.enable_prefix_caching,
                                  max_model_len=max_model_len) for _ in range(D)]
    workers = config.compile.compile_workers or backend.default_compile_workers(len(grid.shapes()))
    runner = ModelRunner(
        model, backend=backend, mesh=mesh, num_pages=num_pages, page_size=cc.page_size,
        max_model_len=max_model_len, max_num_seqs=sc.max_num_seqs, grid=grid, sampler_config=sampler_config,
        kv_dtype=kv_dtype, seed=mc.seed, show_progress=config.compile.show_progress, rules=rules, timer=timer,
        executable_cache=exe_cache, lora=config.lora,
        compile_workers=workers if backend.compile_target(mesh.devices.flat) else 1,
        recipe=recipe(num_pages=num_pages, max_model_len=max_model_len) if recipe_applies else None,
    )
    timer.note("executables", f"{runner.executables_loaded} loaded, {runner.executables_compiled} compiled")
    if memory is not None:
        confirm_memory(memory, runner)
    if mesh.size > 1:
        _log_placement(model, runner, mesh, rules)
    step_runner: StepRunner = runner  # what the core drives: a leader wraps this process's runner
    if topo is not None:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices("jaxserve-ready")  # every process compiled the same steps
        if topo.is_leader:
            link.start()
            step_runner = step_channel.LeaderRunner(runner, link)
    max_loras = config.lora.max_loras if config.lora.enable_lora else 0
    lora_slots = LoRASlotTable(max_loras) if max_loras else None
    scheduler = (DataParallelScheduler(sc, kv_managers, lora_slots) if D > 1 else
                 Scheduler(sc, kv_managers[0], lora_slots))
    spec = config.speculative_config
    proposer = (NgramProposer(spec.num_speculative_tokens, spec.prompt_lookup_min, spec.prompt_lookup_max)
                if spec is not None else None)
    core = EngineCore(scheduler, step_runner, async_scheduling=sc.async_scheduling, proposer=proposer)
    with timer.phase("tokenizer"):  # what is left of it
        tokenizer = tokenizer_future.result()
    eos = tokenizer.eos_token_id
    if eos is None and gen.eos_token_ids:
        eos = gen.eos_token_ids[0]
    info = ModelInfo(
        name=mc.served_model_name or (mc.model or DEFAULT_MODEL_NAME),
        vocab_size=arch.vocab_size, max_model_len=max_model_len, eos_token_id=eos,
        extra_eos_token_ids=tuple(t for t in gen.eos_token_ids if t != eos),
        sampler_config=sampler_config, sampling_defaults=gen.sampling_defaults,
        default_max_tokens=gen.max_new_tokens, scheduling_policy=sc.policy, max_num_seqs=sc.max_num_seqs,
        kv_cache_tokens=scheduler.cache_tokens,
        max_lora_rank=config.lora.max_lora_rank if config.lora.enable_lora else 0,
        max_loras=max_loras,
    )
    # Everything built so far lives as long as the engine: move it out of the garbage
    # collector's generations, so that the collections the steps' short-lived objects trigger do
    # not walk it (at 1,024 running requests full collections cost milliseconds per step).
    with timer.phase("gc"):
        gc.collect()
        gc.freeze()
    logger.info("engine ready: %s, %s, %d KV pages of %d%s, %d buckets in %.1fs (%d executables loaded, %d "
                "compiled; load %.1fs)%s", info.name, plan.dtype, num_pages, cc.page_size,
                f" ({D} data-parallel ranks)" if D > 1 else "", runner.num_buckets, runner.compile_seconds,
                runner.executables_loaded, runner.executables_compiled, load_seconds,
                (", overlapped steps" if core.async_scheduling else "") +
                (f", n-gram speculation ({spec.num_speculative_tokens} tokens)" if spec is not None else ""))
    if own_timer:  # else the caller logs it when it is ready (the server: once it listens)
        logger.info("%s", timer.summary())
    return EngineParts(tokenizer, info, core, model_path, arch, backend, plan, load_seconds, topo, link,
                       runner)


def _memory_from_programs(backend: Backend, cc, recipe, grid: BucketGrid, max_model_len: int, mesh,
                          exe_cache, arch: ArchConfig, kv_dtype, rules) -> MemoryBudget:
    """The KV budget of this process's accelerators from the largest step's own memory
    analysis (`kv_budget_from_programs`), the least over the processes."""
    stats = backend.device_memory()
    if stats is None:
        raise ValueError("the devices do not report their memory: give the KV cache's size (--kv-cache-memory)")
    limit, in_use = stats
    probe = functools.partial(recipe, max_model_len=max_model_len)
    budget = kv_budget_from_programs(
        backend, cc, probe, max(grid.shapes()), limit, arch=arch, kv_dtype=kv_dtype, mesh=mesh, rules=rules,
        in_use=in_use, num_executables=len(grid.shapes()),
        scope=lambda r: executable_scope(exe_cache, mesh.devices.flat, **backend.fingerprint(), recipe=canonical(r)))
    kv = min_over_processes(budget.kv)
    if kv != budget.kv:  # another process has less room
        budget = dataclasses.replace(budget, other_in_use=budget.other_in_use + int((budget.kv - kv) * (
            1 + budget.kv_overhead)))
    logger.info("memory per device: %s", budget.describe())
    return budget


def kv_budget_from_programs(backend: Backend, cc, recipe, bucket: tuple[int, int], device_memory: int, *,
                            arch: ArchConfig, kv_dtype, mesh, rules, in_use: int = 0, num_executables: int = 1,
                            scope=None) -> MemoryBudget:
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
    page = bytes_per_page(arch, recipe(num_pages=2 * D).page_size, kv_dtype, mesh, rules)  # per device
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
    """Checks the served largest step against the budget, from its own memory analysis (the
    KV cache it takes is the real one): a step that would not fit the device is refused."""
    largest = max(runner.grid.shapes())
    served = StepMemory.of(runner.executable(largest), largest, weights=budget.step.weights,
                           kv=bytes_on_device([*runner.kv.k, *runner.kv.v]))
    need = served.peak + budget.other_code + budget.other_in_use
    logger.info("largest step %dx%d with its KV cache (%.2f GiB): %.2f GiB of the %.2f GiB allowed per device",
                *largest, served.kv / 2**30, need / 2**30, budget.usable / 2**30)
    if need > budget.device_memory:
        raise InsufficientMemoryError(f"the largest step needs {need / 2**30:.2f} GiB per device, more than the "
                                      f"device's {budget.device_memory / 2**30:.2f} GiB ({budget.describe()})")


def _pooling_engine(config: EngineConfig, model, model_path, arch: ArchConfig, backend: Backend,
                    plan: DevicePlan, mesh, rules, gen, timer: StartupTimer, tokenizer_future, sc,
                    load_seconds: float, own_timer: bool) -> EngineParts:
    """The engine of --runner pooling: a PoolingRunner (its own small KV cache, one executable
    per bucket) in a PoolingCore (embeddings, no scheduler, no steps). A prompt is never split:
    the token buckets reach max_model_len."""
    pooling = load_pooling_config(model_path)
    budget = max(sc.max_num_batched_tokens, sc.max_model_len)
    tb = config.compile.token_buckets or backend.default_token_buckets(budget)
    if max(tb) < budget:
        tb = (*tb, budget)
    grid = BucketGrid.build(max(tb), sc.max_num_seqs, tb, config.compile.request_buckets)
    with timer.phase("executables"):
        runner = PoolingRunner(model, backend=backend, mesh=mesh, page_size=config.cache.page_size,
                               max_model_len=sc.max_model_len, grid=grid, pooling=pooling,
                               kv_dtype=jax_dtype(plan.kv_dtype),
                               show_progress=config.compile.show_progress, rules=rules,
                               executable_cache=executable_cache(config.compile))
    timer.note("executables",
               f"{runner.executables_loaded} loaded, {runner.executables_compiled} compiled")
    core = PoolingCore(runner)
    with timer.phase("tokenizer"):
        tokenizer = tokenizer_future.result()
    mc = config.model
    sampler_config = SamplerConfig(max_num_seqs=sc.max_num_seqs, vocab_size=arch.vocab_size,
                                   max_logprobs=config.max_logprobs, native=plan.native_sampling)
    info = ModelInfo(name=mc.served_model_name or (mc.model or DEFAULT_MODEL_NAME),
                     vocab_size=arch.vocab_size, max_model_len=sc.max_model_len,
                     eos_token_id=tokenizer.eos_token_id, extra_eos_token_ids=(),
                     sampler_config=sampler_config, sampling_defaults=gen.sampling_defaults,
                     max_num_seqs=sc.max_num_seqs, runner="pooling", hidden_size=arch.hidden_size,
                     normalize_embeddings=pooling.normalize)
    logger.info("engine ready (pooling: %s): %s, %s, %d buckets in %.1fs (%d executables loaded, "
                "%d compiled; load %.1fs)", pooling.source, info.name, plan.dtype,
                runner.num_buckets, runner.compile_seconds, runner.executables_loaded,
                runner.executables_compiled, load_seconds)
    if own_timer:
        logger.info("%s", timer.summary())
    return EngineParts(tokenizer, info, core, model_path, arch, backend, plan, load_seconds)


def _prepared_model(config: EngineConfig, ckpt, arch: ArchConfig, backend: Backend, plan: DevicePlan, mesh, rules,
                    timer: StartupTimer):
    """The model with its weights placed and laid out by the backend: from the weight cache when
    the backend lays them out (packing for the CPU kernels) and they were kept, else from the
    checkpoint (then kept)."""
    mc, dtype = config.model, jax_dtype(plan.dtype)
    cache = weight_cache(config.compile) if backend.lays_out_weights(plan) and mc.quantization is None else None
    if cache is not None:
        with timer.phase("weights"):
            key = cache.key(ckpt.path, ckpt.config, mesh.devices.flat, **backend.fingerprint(),
                            dtype=plan.dtype, plan=canonical(plan),
                            rules=canonical(rules), arch=canonical(arch))
            abstract = sharded_abstract_model(arch, dtype=dtype, mesh=mesh, attention_impl=mc.attention_impl,
                                              rules=rules, moe_impl=plan.moe_impl)
            backend.prepare_model(abstract, plan, abstract=True)
            model = cache.load(key, abstract)
        if model is not None:
            timer.note("weights", "laid out, from the weight cache")
            log_activation_products(model, plan)  # what prepare_model says when it lays them out
            return model
    with timer.phase("weights"):
        model = create_model(arch, dtype=dtype, mesh=mesh, attention_impl=mc.attention_impl,
                             get_tensor=ckpt.get_tensor, quantization=mc.quantization, rules=rules,
                             moe_impl=plan.moe_impl)
    with timer.phase("packing"):
        backend.prepare_model(model, plan)
    if cache is not None:
        with timer.phase("weight cache"):
            cache.store(key, model)
    return model


def _log_placement(model, runner: ModelRunner, mesh, rules) -> None:
    """What each device holds, and what stays whole because the mesh does not divide it (e.g.
    SmolLM2's 3 KV heads on 2 or 4 devices: the KV cache and the k/v projections replicate)."""
    weights, kv = bytes_per_device(runner.params), bytes_per_device([*runner.kv.k, *runner.kv.v])
    total = sum(x.nbytes for x in runner.params)
    logger.info("mesh %s: weights %.1f MiB per device (of %.1f MiB), KV cache %.1f MiB per device",
                dict(mesh.shape), weights / 2**20, total / 2**20, kv / 2**20)
    for axis, names in replicated_axes(model, mesh, rules).items():
        shown = ", ".join(sorted({n.rsplit(".", 1)[-1] for n in names}))
        logger.info("replicated: %s does not divide, so %s (%d arrays)%s are whole on every device",
                    axis, shown, len(names), " and the KV cache" if axis.startswith("kv_heads") else "")


def _join(topo, config: EngineConfig, model_path, plan: DevicePlan):
    """The leader waits for every follower and checks it was started alike (fingerprint), then
    sends its plan; a follower connects and takes the leader's plan."""
    key = multihost.shared_key(topo)
    mine = multihost.fingerprint(config, model_path)
    timeout = config.parallel.startup_timeout_seconds
    if topo.is_leader:
        leader = step_channel.Leader(topo, key, mine, timeout=timeout)
        leader.send_settings({"plan": dataclasses.asdict(plan),
                              "step_timeout_seconds": config.parallel.step_timeout_seconds})
        return leader, plan
    follower = step_channel.Follower(topo, key, mine, timeout=timeout)
    return follower, DevicePlan(**follower.settings["plan"])
