"""Building an engine from an EngineConfig: the plan (engine/plan.py), then the model, the KV
cache, the compiled runner, the scheduler and the core, each read from the plan.

`build_engine` opens the model's files, plans the engine (every "auto" resolved once, logged as
"engine plan: ..."), then builds -> sizes the KV cache -> compiles -> assembles. It returns the
parts (`EngineParts`); the offline `LLMEngine` and the server's `AsyncEngineClient` are put
together from them, and tests can put them together from fakes.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import gc
import logging
import pathlib
import time
from collections.abc import Callable
from typing import Any

from jaxserve.backends import Backend, DevicePlan, select_backend
from jaxserve.backends.devices import DeviceSet
from jaxserve.config import EngineConfig, jax_dtype
from jaxserve.speculative_config import STEP_DRAFTERS
from jaxserve.core.adapter_slots import AdapterSlots
from jaxserve.core.dp_scheduler import DataParallelScheduler
from jaxserve.core.kv_cache_manager import KVCacheManager
from jaxserve.core.scheduler import Scheduler
from jaxserve.engine.core import EngineCore
from jaxserve.engine.generation_config import load_generation_config
from jaxserve.engine.input_processor import ModelInfo
from jaxserve.engine.model_weights import prepared_model
from jaxserve.engine.kv_sizing import (KVSize, confirm_memory, fit_max_model_len, kv_budget_from_programs,
                                       size_kv_cache)
from jaxserve.engine.plan import DEFAULT_MODEL_NAME, EnginePlan, ModelFiles, plan_engine, with_device_plan
from jaxserve.engine.pooling_core import PoolingCore
from jaxserve.engine.tokenizer import Tokenizer
from jaxserve.leader import step_channel
from jaxserve.models.arch_config import ArchConfig
from jaxserve.models.loader import load_checkpoint, resolve_model
from jaxserve.models.pooling_config import as_causal_lm, check_decoder, load_pooling_config
from jaxserve.models.sharding import check_servable, load_rules, serving_rules
from jaxserve.parallel import multihost
from jaxserve.parallel.mesh import bytes_per_device, make_mesh, replicated_axes
from jaxserve.runner.compile import executable_cache
from jaxserve.reasoning import get_reasoning_parser
from jaxserve.runner.executable_cache import ExecutableScope, canonical, executable_scope
from jaxserve.runner.kv_scales import CALIBRATION_TEXT, prepare_kv_scales
from jaxserve.runner.model_runner import ModelRunner
from jaxserve.runner.pooling_runner import PoolingRunner, pooling_num_pages
from jaxserve.runner.prebuilt import prebuilt_scope, target_material
from jaxserve.runner.recipe import StepRecipe
from jaxserve.runner.protocol import StepRunner
from jaxserve.spec_decode import NgramProposer
from jaxserve.startup_timer import StartupTimer

# The KV cache's sizing lives in engine/kv_sizing.py; its public functions stay importable here.
__all__ = ["DEFAULT_MODEL_NAME", "EngineParts", "build_engine", "confirm_memory", "fit_max_model_len",
           "kv_budget_from_programs"]

logger = logging.getLogger(__name__)
SPECULATION_NAMES = {"ngram": "n-gram", "eagle3": "EAGLE-3", "deepseek_mtp": "DeepSeek MTP",
                     "draft_model": "draft-model"}


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
    engine_plan: EnginePlan | None = None  # every "auto" resolved, with the reasons

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
                 on_model_path: Callable[[pathlib.Path], None] | None = None,
                 engine_core: tuple[str, str] | None = None) -> EngineParts:
    """The engine's parts from `config`. `timer` (optional) collects the wall time of each
    start-up phase; the summary is logged when the engine is ready. `on_model_path(path)` is
    called as soon as the model's directory is known (a frontend elsewhere loads its tokenizer).
    `engine_core`: where the serving core runs and why (engine/client.py; None: offline, on the
    caller's thread), for the plan. Several processes: a build that fails after they joined
    tells the others why (they would otherwise wait for this one in a compile or a collective;
    see parallel/multihost.py)."""
    joined: list[step_channel.Leader | step_channel.Follower] = []
    try:
        return _build_engine(config, timer or StartupTimer(), timer is None, on_model_path, engine_core, joined)
    except BaseException as e:
        for link in joined:
            link.abort(f"{type(e).__name__}: {e}")
        raise


def _build_engine(config: EngineConfig, timer: StartupTimer, own_timer: bool,
                  on_model_path: Callable[[pathlib.Path], None] | None, engine_core, joined: list) -> EngineParts:
    """Open the model's files, plan (engine/plan.py), then from the plan alone: build the model
    -> size the KV cache -> compile the steps -> assemble the engine."""
    pc = config.parallel
    check_servable(serving_rules(load_rules(pc.sharding_rules), pc.data_parallel_size))  # before anything slow
    start = _open(config, timer, on_model_path)
    plan = _plan(config, start, timer, engine_core, joined)
    model = _build(plan, start, timer)
    if plan.pooling:
        pooling = load_pooling_config(start.model_path)
        recipe = plan.recipe(num_pages=pooling_num_pages(plan.grid, plan.config.cache.page_size),
                             max_model_len=plan.scheduler.max_model_len)
        scope = _startup_scope(plan, start, recipe, pooling)
        _kv_scales(plan, start, model, timer, scope)
        return _pooling_engine(plan, start, model, pooling, scope.prebuilt, timer, own_timer)
    kv = size_kv_cache(plan, start.backend, start.mesh, timer)
    scope = _startup_scope(plan, start, kv.recipe(plan))
    _kv_scales(plan, start, model, timer, scope)
    runner = _compile(plan, start, model, kv, timer, scope.prebuilt)
    return _assemble(plan, start, runner, kv, timer, own_timer)


@dataclasses.dataclass
class _Start:
    """What the build reads besides the plan: the run's processes, the model's files, the
    backend and the mesh (the devices themselves), the tokenizer loading on its thread."""

    topo: multihost.Topology | None
    model_path: pathlib.Path
    ckpt: Any  # the checkpoint (a pooling checkpoint saved from a base model: as its causal LM)
    architectures: list[str] | None  # as the checkpoint names them
    gen: Any  # the generation config
    tokenizer: concurrent.futures.Future
    t0: float
    backend: Backend | None = None
    mesh: Any = None
    link: step_channel.Leader | step_channel.Follower | None = None
    load_seconds: float = 0.0


def _open(config: EngineConfig, timer: StartupTimer, on_model_path) -> _Start:
    """Join the run's processes, find the model's files, read the checkpoint's index."""
    t0, mc = time.perf_counter(), config.model
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
    pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="jaxserve-tokenizer")
    tokenizer = pool.submit(Tokenizer.from_pretrained, model_path)
    pool.shutdown(wait=False)
    with timer.phase("checkpoint"):
        ckpt = load_checkpoint(model_path)
        architectures = ckpt.config.get("architectures")
        if mc.is_pooling(architectures):
            check_decoder(architectures)
            ckpt = as_causal_lm(ckpt)
        gen = load_generation_config(model_path, mc.generation_config, ckpt.config)
    return _Start(topo, model_path, ckpt, architectures, gen, tokenizer, t0)


def _plan(config: EngineConfig, start: _Start, timer: StartupTimer, engine_core, joined: list) -> EnginePlan:
    """The engine's plan (every "auto" resolved, engine/plan.py) on this run's devices; in a
    multi-host run every follower takes the leader's device plan."""
    if config.speculative_config is not None:
        from jaxserve.engine.draft_check import detect_eagle3_head

        config = detect_eagle3_head(config)  # vLLM's: a draft model that is an EAGLE-3 head
    with timer.phase("backend"):
        start.backend = backend = select_backend()
        start.mesh = make_mesh(config.parallel.data_parallel_size, config.parallel.tensor_parallel_size)
        files = ModelFiles(start.model_path, start.ckpt.config, start.architectures)
        plan = plan_engine(config, files, backend, DeviceSet.of_mesh(start.mesh, backend.platform),
                           engine_core=engine_core)
    spec = config.speculative_config
    if spec is not None and spec.method in STEP_DRAFTERS:
        plan = plan.with_drafter(spec.method, drafter_dir(config, start.ckpt.config, start.tokenizer),
                                 devices=list(start.mesh.devices.flat))
    if plan.max_model_len > plan.arch.max_position_embeddings:
        logger.warning("max_model_len %d exceeds the model's max_position_embeddings %d",
                       plan.max_model_len, plan.arch.max_position_embeddings)
    if start.topo is not None:  # the leader resolves the "auto"s; every follower takes them
        with timer.phase("distributed"):
            start.link, device = _join(start.topo, config, start.model_path, plan.device)
            joined.append(start.link)
            start.link.watch_startup()
        if not start.topo.is_leader:
            plan = with_device_plan(plan, device, "the leader's")
    logger.info("engine plan: %s", plan.describe())
    if plan.arch.kv_padding_note():
        logger.info("%s", plan.arch.kv_padding_note())
    return plan


def drafter_dir(config: EngineConfig, target_config: dict, target_tokenizer=None) -> str:
    """The directory of the drafter that `config`'s speculative method runs inside the step,
    checked against the target (`target_config` its config.json, `target_tokenizer` its
    Tokenizer or a future of it, read for a draft model only): an EAGLE-3 head's, a draft
    model's, "" for DeepSeek MTP (the target's own layer). ValueError naming what does not
    fit. `jaxserve compile` resolves it the same way."""
    method = config.speculative_config.method
    if method == "eagle3":
        return draft_model_dir(config, target_config)
    if method == "draft_model":
        from jaxserve.engine.draft_check import checked_draft_model

        return checked_draft_model(config, dict(target_config), target_tokenizer)
    _check_mtp_target(target_config)
    return ""


def draft_model_dir(config: EngineConfig, target_config: dict) -> str:
    """The EAGLE-3 head's directory (a Hub name resolved as the model's is), checked against
    the target of config.json `target_config` (hidden size, vocabulary, the layers it reads):
    ValueError naming what is wrong. `jaxserve compile` resolves it the same way."""
    import inspect

    from jaxserve.models.eagle3 import Eagle3Config
    from jaxserve.models.registry import get_model_class

    mc, target = config.model, ArchConfig.from_hf(dict(target_config))
    if "taps" not in inspect.signature(get_model_class(target.architecture).__call__).parameters:
        raise ValueError(f"speculative_config method 'eagle3' serves Llama-family targets; the "
                         f"{target.architecture} forward gives a draft head no hidden states")
    try:
        path = resolve_model(config.speculative_config.model, cache_dir=mc.model_cache_dir,
                             download_dir=mc.download_dir)
        Eagle3Config.from_hf(load_checkpoint(path).config).target_layer_ids(target)
    except ValueError as e:
        raise ValueError(f"speculative_config model {config.speculative_config.model!r}: {e}") from None
    return str(path)


def _check_mtp_target(target_config: dict) -> None:
    """The target (config.json `target_config`) of method "deepseek_mtp": a DeepSeek V3
    checkpoint with MTP layers (ValueError naming what is not)."""
    target = ArchConfig.from_hf(dict(target_config))
    if target.architecture != "DeepseekV3ForCausalLM":
        qwen3_next = "qwen3_next" in str(target_config.get("model_type", ""))
        raise ValueError(
            "speculative_config method 'deepseek_mtp' drafts with a DeepSeek V3 checkpoint's MTP "
            f"layers; the target is {target.architecture}"
            + (" (Qwen3-Next's mtp.* layers: jaxserve does not serve Qwen3-Next)" if qwen3_next else ""))
    if not target.num_mtp_layers:
        raise ValueError("speculative_config method 'deepseek_mtp': the checkpoint has no MTP layers "
                         "(num_nextn_predict_layers is 0)")


def _build(plan: EnginePlan, start: _Start, timer: StartupTimer):
    """The model: weights placed and laid out by the backend (a quantized KV cache's scales are
    set next, `_kv_scales`)."""
    model = prepared_model(plan, start.ckpt, start.mesh, start.backend, timer)
    start.load_seconds = time.perf_counter() - start.t0
    return model


def _startup_scope(plan: EnginePlan, start: _Start, recipe: StepRecipe,
                   pooling=None) -> ExecutableScope:
    """Where the start's programs outside the runner (a quantized cache's calibration forward)
    are loaded from or compiled into: the executable cache, keyed by the recipe (as the memory
    probes are), and first the executables compiled ahead (`--executables DIR`), opened here
    once for the runner too (a mismatch is named in one log line). `pooling`: the pooling
    runner's PoolingConfig (its directory is keyed by it), None for generation."""
    devices = list(start.mesh.devices.flat)
    scope = executable_scope(executable_cache(plan.config.compile), devices,
                             **start.backend.fingerprint(), recipe=canonical(recipe.program_key()))
    executables = plan.config.compile.executables
    if executables is not None:
        material = target_material(recipe, devices, start.backend, pooling)
        scope.prebuilt = prebuilt_scope(executables, material, devices)
    return scope


def _kv_scales(plan: EnginePlan, start: _Start, model, timer: StartupTimer,
               scope: ExecutableScope | None) -> None:
    """A quantized cache's scales set on the model (inputs of the steps, beside the weights):
    the checkpoint's, or measured by the calibration forward, loaded through `scope` or
    compiled."""
    t0 = time.perf_counter()
    with timer.phase("kv scales"):
        prepare_kv_scales(model, jax_dtype(plan.device.kv_dtype), start.ckpt,
                          lambda: start.tokenizer.result().encode(CALIBRATION_TEXT), scope)
    start.load_seconds += time.perf_counter() - t0


def _compile(plan: EnginePlan, start: _Start, model, kv: KVSize, timer: StartupTimer,
             prebuilt: ExecutableScope | None) -> ModelRunner:
    """The runner: the steps of the plan's recipe over the model, compiled (or loaded: from
    `prebuilt`, the executables compiled ahead that match, else the executable cache)."""
    config = plan.config
    drafter = None
    if plan.draft_model and plan.speculative.method == "draft_model":
        from jaxserve.runner.draft_model import load_draft_model

        with timer.phase("draft model"):
            drafter = load_draft_model(plan.draft_model, jax_dtype(plan.device.dtype), start.mesh, plan.rules,
                                       config.model.attention_impl, kv_heads=plan.draft_kv_heads)
    elif plan.draft_model:
        from jaxserve.models.eagle3_checkpoint import load_eagle3

        with timer.phase("draft head"):
            drafter = load_eagle3(plan.draft_model, target=start.model_path, dtype=jax_dtype(plan.device.dtype),
                                  mesh=start.mesh, rules=plan.rules, attention_impl=config.model.attention_impl,
                                  kv_heads=plan.draft_kv_heads)
    runner = ModelRunner(model, kv.recipe(plan), backend=start.backend, mesh=start.mesh, seed=config.model.seed,
                         max_cpu_loras=config.lora.max_cpu_loras, compile_workers=plan.compile_workers,
                         executable_cache=executable_cache(config.compile),
                         prebuilt=prebuilt,
                         show_progress=config.compile.show_progress, timer=timer, drafter=drafter)
    timer.note("executables", f"{runner.executables_loaded} loaded, {runner.executables_compiled} compiled")
    if kv.memory is not None:
        confirm_memory(kv.memory, runner)
    if start.mesh.size > 1:
        _log_placement(model, runner, start.mesh, plan.rules)
    return runner


def _assemble(plan: EnginePlan, start: _Start, runner: ModelRunner, kv: KVSize, timer: StartupTimer,
              own_timer: bool) -> EngineParts:
    """The scheduler over the KV cache's pages, the engine core around it and the runner (a
    multi-host leader's wraps it), the model's facts for the frontend."""
    D, cc, sc = plan.mesh_shape[0], plan.config.cache, dataclasses.replace(plan.scheduler,
                                                                          max_model_len=kv.max_model_len)
    step_runner: StepRunner = runner  # what the core drives: a leader wraps this process's runner
    if start.topo is not None:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices("jaxserve-ready")  # every process compiled the same steps
        if start.topo.is_leader:
            start.link.start()
            step_runner = step_channel.LeaderRunner(runner, start.link)
    kv_managers = [KVCacheManager(cc.page_size, kv.rank_pages, enable_caching=cc.enable_prefix_caching,
                                  max_model_len=kv.max_model_len) for _ in range(D)]
    adapters = AdapterSlots(plan.lora.max_loras if plan.lora else 0)
    scheduler = DataParallelScheduler(sc, kv_managers, adapters) if D > 1 else Scheduler(sc, kv_managers[0], adapters)
    spec = plan.speculative
    proposer = None
    if plan.draft_method:
        from jaxserve.runner.draft_head_step import lookahead_tokens
        from jaxserve.spec_decode.draft_head import DraftHeadProposer

        proposer = DraftHeadProposer(spec.num_speculative_tokens)
        # the chained passes' KV past the step's tokens
        scheduler.num_lookahead_tokens = lookahead_tokens(plan.draft_method, spec.num_speculative_tokens)
    elif spec is not None:
        proposer = NgramProposer(spec.num_speculative_tokens, spec.prompt_lookup_min, spec.prompt_lookup_max)
    core = EngineCore(scheduler, step_runner, async_scheduling=sc.async_scheduling, proposer=proposer,
                      num_decode_steps=runner.num_decode_steps)
    tokenizer, info = _model_info(plan, start, timer, sc, scheduler.cache_tokens)
    if info.reasoning_parser is not None:
        # Structured output applies after the reasoning: the manager needs the end marker's id.
        core.structured.reasoning = get_reasoning_parser(info.reasoning_parser)(tokenizer)
    logger.info("engine ready: %s, %s, %d KV pages of %d%s, %d buckets in %.1fs (%d executables loaded, %d "
                "compiled; load %.1fs)%s", info.name, plan.device.dtype, kv.rank_pages * D, cc.page_size,
                f" ({D} data-parallel ranks)" if D > 1 else "", runner.num_buckets, runner.compile_seconds,
                runner.executables_loaded, runner.executables_compiled, start.load_seconds,
                (", overlapped steps" if core.async_scheduling else "") +
                (f", {SPECULATION_NAMES[spec.method]} speculation ({spec.num_speculative_tokens} tokens)"
                 if spec is not None else ""))
    _ready(timer, own_timer)
    return EngineParts(tokenizer, info, core, start.model_path, plan.arch, start.backend, plan.device,
                       start.load_seconds, start.topo, start.link, runner, plan)


def _model_info(plan: EnginePlan, start: _Start, timer: StartupTimer, sc, kv_cache_tokens: int):
    """(tokenizer, the model's facts for the frontend: ModelInfo)."""
    gen, lora = start.gen, plan.lora
    with timer.phase("tokenizer"):  # what is left of it
        tokenizer = start.tokenizer.result()
    eos = tokenizer.eos_token_id
    if eos is None and gen.eos_token_ids:
        eos = gen.eos_token_ids[0]
    info = ModelInfo(
        name=plan.name, vocab_size=plan.arch.vocab_size, max_model_len=sc.max_model_len, eos_token_id=eos,
        extra_eos_token_ids=tuple(t for t in gen.eos_token_ids if t != eos),
        sampler_config=plan.sampler, sampling_defaults=gen.sampling_defaults,
        default_max_tokens=gen.max_new_tokens, scheduling_policy=sc.policy, max_num_seqs=sc.max_num_seqs,
        kv_cache_tokens=kv_cache_tokens,
        max_lora_rank=lora.max_lora_rank if lora else 0,
        max_loras=lora.max_loras if lora else 0, reasoning_parser=plan.config.model.reasoning_parser,
        num_speculative_tokens=plan.speculative.num_speculative_tokens if plan.speculative else 0,
    )
    return tokenizer, info


def _ready(timer: StartupTimer, own_timer: bool) -> None:
    # Everything built so far lives as long as the engine: move it out of the garbage
    # collector's generations, so that the collections the steps' short-lived objects trigger do
    # not walk it (at 1,024 running requests full collections cost milliseconds per step).
    with timer.phase("gc"):
        gc.collect()
        gc.freeze()
    if own_timer:  # else the caller logs it when it is ready (the server: once it listens)
        logger.info("%s", timer.summary())


def _pooling_engine(plan: EnginePlan, start: _Start, model, pooling,
                    prebuilt: ExecutableScope | None, timer: StartupTimer,
                    own_timer: bool) -> EngineParts:
    """The engine of --runner pooling: a PoolingRunner (its own small KV cache, one executable
    per bucket of the plan's grid: a prompt is never split, the token buckets reach
    max_model_len; loaded from `prebuilt`, the executables compiled ahead, where they match)
    in a PoolingCore (embeddings, no scheduler, no steps)."""
    config, sc = plan.config, plan.scheduler
    with timer.phase("executables"):
        runner = PoolingRunner(model, backend=start.backend, mesh=start.mesh, page_size=config.cache.page_size,
                               max_model_len=sc.max_model_len, grid=plan.grid, pooling=pooling,
                               kv_dtype=jax_dtype(plan.device.kv_dtype),
                               show_progress=config.compile.show_progress, rules=plan.rules,
                               executable_cache=executable_cache(config.compile), prebuilt=prebuilt)
    timer.note("executables",
               f"{runner.executables_loaded} loaded, {runner.executables_compiled} compiled")
    core = PoolingCore(runner)
    with timer.phase("tokenizer"):
        tokenizer = start.tokenizer.result()
    info = ModelInfo(name=plan.name, vocab_size=plan.arch.vocab_size, max_model_len=sc.max_model_len,
                     eos_token_id=tokenizer.eos_token_id, extra_eos_token_ids=(),
                     sampler_config=plan.sampler, sampling_defaults=start.gen.sampling_defaults,
                     max_num_seqs=sc.max_num_seqs, runner="pooling", hidden_size=plan.arch.hidden_size,
                     normalize_embeddings=pooling.normalize)
    logger.info("engine ready (pooling: %s): %s, %s, %d buckets in %.1fs (%d executables loaded, "
                "%d compiled; load %.1fs)", pooling.source, info.name, plan.device.dtype,
                runner.num_buckets, runner.compile_seconds, runner.executables_loaded,
                runner.executables_compiled, start.load_seconds)
    if own_timer:
        logger.info("%s", timer.summary())
    return EngineParts(tokenizer, info, core, start.model_path, plan.arch, start.backend, plan.device,
                       start.load_seconds, engine_plan=plan)


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
