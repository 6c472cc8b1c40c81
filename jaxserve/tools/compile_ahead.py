"""`jaxserve compile`: the served steps compiled for a target without its chips, into a directory
that `jaxserve serve --executables DIR` loads on the real devices.

    jaxserve compile [MODEL] --topology v6e:2x4|h100:1x8|cpu [--tensor-parallel-size N]
        [engine flags] [--weights] --out DIR

The engine is planned as `serve` plans it (engine/plan.py) on the target's devices: a
compile-only TPU slice (libtpu), GPU hosts (JAX's CUDA plugin and XLA's description of the
chip: tools/chips.py), or this host's own (`cpu`). The KV cache is sized from the flags (on
TPU/GPU `serve` otherwise sizes it from the memory its devices have free at start, which only
they know: give --kv-cache-memory, the same on both sides). Its StepRecipe (runner/recipe.py)
then gives, without weights, every executable a runner holds (the steps of the bucket grid, the
KV cache's and sampling state's makers, the slot writers), compiled through the same
`StepProgram` methods the runner calls and stored as an executable cache under the key of
runner/prebuilt.py, with `manifest.json` beside them. What the start compiles besides: a
quantized cache's calibration forward (its shape, the calibration's token count, read from the
model's tokenizer) and, for an embedding model (`--runner pooling`), the pooling runner's
executables instead of the steps. No weights are read: only the model's config.json (MODEL may
be that file, or one of shard-plan's presets), its tokenizer and its checkpoint's tensor names
(scales it has need no calibration). With `--weights` the checkpoint is read too, and its
weights prepared as the target's start prepares them (`write_target_weights`: converted,
quantized at load, padded, laid out) are written into DIR/weights, which the server then loads
instead (as large as the served weights: opt-in; DESIGN §4 says where it pays).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import pathlib
import time
from typing import Any

logger = logging.getLogger(__name__)


def add_arguments(p: argparse.ArgumentParser) -> None:
    from jaxserve.config import EngineConfig

    p.add_argument("model", nargs="?", default=None,
                   help="HF model directory, .gguf file, Hugging Face Hub name, a config.json or a shard-plan "
                        "preset (llama3-8b, ...); default: the bundled model. Its config is read, not its weights")
    p.add_argument("--topology", required=True,
                   help="the devices to compile for: a TPU slice (v6e:2x4), GPU hosts (h100:1x8 = hosts x GPUs "
                        "per host) or 'cpu' (this host's CPU devices)")
    p.add_argument("--out", required=True, help="the directory to write (serve it with --executables DIR)")
    p.add_argument("--weights", action="store_true",
                   help="also write the weights as the target's start prepares them (read, converted, quantized at "
                        "load, padded, laid out), which serve --executables DIR then loads instead: as large as "
                        "the served weights; pays for a checkpoint quantized at load or a GGUF file (docs/DESIGN.md)")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error", "critical"])
    EngineConfig.add_cli_args(p)


def parse_topology(text: str) -> dict[str, Any]:
    """`cpu` -> {"kind": "cpu", "topology": "cpu"}; a chip's slice or hosts: tools/chips.py's."""
    if text.strip().lower() == "cpu":
        return {"kind": "cpu", "topology": "cpu"}
    from jaxserve.tools.chips import parse_target

    return parse_target(text)


def target_devices(target: dict) -> list:
    """The devices of `target` (compile-only for a TPU slice or GPU hosts)."""
    import jax

    from jaxserve.tools.chips import gpu_devices, tpu_devices

    if target["kind"] == "tpu":
        return tpu_devices(target)
    if target["kind"] == "gpu":
        return gpu_devices(target)
    return jax.devices()


def model_config(mc) -> tuple[pathlib.Path | None, dict]:
    """(the model's directory, its config.json) as `serve` reads them (models/loader.py); a
    config.json file or a shard-plan preset (llama3-8b, ...) stands for a model without weights
    (its executables serve a checkpoint whose config.json is that one)."""
    from jaxserve.models.loader import load_checkpoint, resolve_model
    from jaxserve.tools.shard_plan import ARCH_PRESETS, PRESET_DIR

    name = mc.model
    if name in ARCH_PRESETS:
        return None, json.loads((PRESET_DIR / f"{name}.json").read_text())
    if name is not None and name.endswith(".json") and pathlib.Path(name).is_file():
        return None, json.loads(pathlib.Path(name).read_text())
    path = resolve_model(name, cache_dir=mc.model_cache_dir, revision=mc.revision, download_dir=mc.download_dir,
                         gguf_file=mc.gguf_file)
    return path, load_checkpoint(path).config


def compile_for_target(config, target: dict, out: str | os.PathLike[str], weights: bool = False) -> dict[str, Any]:
    """Plan the engine of `config` for `target`'s devices, compile every executable a runner of
    its recipe holds into `out`, write the manifest; returns the manifest. weights: also the
    weights prepared as the target's start prepares them (`write_target_weights`)."""
    import jax

    from jaxserve.backends import select_backend
    from jaxserve.backends.devices import DeviceSet
    from jaxserve.engine.kv_sizing import size_kv_cache
    from jaxserve.engine.plan import ModelFiles, plan_engine
    from jaxserve.speculative_config import STEP_DRAFTERS
    from jaxserve.engine.draft_check import TargetTokenizer
    from jaxserve.engine.setup import drafter_dir
    from jaxserve.parallel.mesh import make_mesh
    from jaxserve.runner.prebuilt import compile_scope, target_material, write_manifest
    from jaxserve.startup_timer import StartupTimer

    t_start = time.perf_counter()
    mc, pc = config.model, config.parallel
    model_path, arch = model_config(mc)
    architectures = arch.get("architectures")
    if mc.is_pooling(architectures):  # as serve reads a pooling checkpoint: as its causal LM
        from jaxserve.models.loader import load_checkpoint
        from jaxserve.models.pooling_config import as_causal_lm, check_decoder

        check_decoder(architectures)
        if model_path is None:
            raise ValueError("a pooling model is compiled from its directory (its pooling, its tokenizer)")
        arch = as_causal_lm(load_checkpoint(model_path)).config
    devices = target_devices(target)
    mesh = make_mesh(pc.data_parallel_size, pc.tensor_parallel_size, devices=devices)
    platform = "cpu" if target["kind"] == "cpu" else target["kind"]
    backend = select_backend(platform)
    if config.speculative_config is not None:
        from jaxserve.engine.draft_check import detect_eagle3_head

        config = detect_eagle3_head(config)  # as serve: a draft model that is an EAGLE-3 head
    plan = plan_engine(config, ModelFiles(model_path, arch, architectures), backend,
                       DeviceSet.of_mesh(mesh, platform))
    spec = config.speculative_config
    if spec is not None and spec.method in STEP_DRAFTERS:  # the drafter runs inside the step: part of it
        plan = plan.with_drafter(spec.method, drafter_dir(config, arch, TargetTokenizer(model_path or mc.model)),
                                 devices=list(mesh.devices.flat))
    if plan.kv_sizing == "programs" and not plan.pooling:
        raise ValueError(f"give the KV cache's size (--kv-cache-memory, the same to serve): on {platform} the "
                         "server otherwise sizes it from the memory its devices have free at start, which this "
                         "host cannot know")
    mesh_devices = list(mesh.devices.flat)
    pooling = None
    if plan.pooling:  # the pooling runner's scratch cache: its own pages, no budget
        from jaxserve.models.pooling_config import load_pooling_config
        from jaxserve.runner.pooling_runner import pooling_num_pages

        pooling = load_pooling_config(model_path)
        recipe = plan.recipe(num_pages=pooling_num_pages(plan.grid, config.cache.page_size),
                             max_model_len=plan.scheduler.max_model_len)
    else:
        recipe = size_kv_cache(plan, backend, mesh, StartupTimer()).recipe(plan)
    material = target_material(recipe, mesh_devices, backend, pooling)
    pathlib.Path(out).mkdir(parents=True, exist_ok=True)
    scope = compile_scope(out, material, mesh_devices)
    seconds: dict[str, float] = {}

    def timed(name: str, make) -> None:
        t0 = time.perf_counter()
        make()
        seconds[name] = round(time.perf_counter() - t0, 2)
        logger.info("compiled %s in %.1fs", name, seconds[name])

    if pooling is not None:
        shapes = compile_pooling(recipe, plan, pooling, mesh, backend, scope, timed)
    else:
        shapes = compile_steps(recipe, mesh_devices, scope, timed)
    calibration = calibration_program(recipe, model_path, mesh, backend)
    if calibration is not None:  # a quantized cache's scales measured at start
        name, (compile_fn, args) = calibration
        timed(name, lambda: scope.get(name, args, compile_fn))
    facts = {
        "topology": target["topology"], "platform": platform, "runner": "pooling" if pooling else "generate",
        "devices": [f"{d.device_kind}" for d in mesh_devices], "mesh": list(plan.mesh_shape),
        "model": str(model_path or mc.model), "draft_model": plan.draft_model or None, "jax": jax.__version__,
        "buckets": [list(b) for b in shapes], "num_pages": recipe.num_pages, "max_model_len": recipe.max_model_len,
        "entries": list(seconds), "compile_seconds": seconds,
        "total_seconds": round(time.perf_counter() - t_start, 2),
        "recipe": {f.name: _plain(getattr(recipe, f.name)) for f in dataclasses.fields(recipe)
                   if f.name not in ("arch", "sampler_config")},
    }
    if weights:
        t0 = time.perf_counter()
        facts["weights"] = write_target_weights(plan, model_path, target, mesh, backend, out)
        seconds["weights"] = round(time.perf_counter() - t0, 2)
        logger.info("prepared the weights (%.2f GiB) in %.1fs", facts["weights"]["bytes"] / 2**30, seconds["weights"])
        facts["total_seconds"] = round(time.perf_counter() - t_start, 2)
    write_manifest(out, material, **facts)
    return {**facts, "material": material}


def write_target_weights(plan, model_path: pathlib.Path | None, target: dict, mesh, backend,
                         out: str | os.PathLike[str]) -> dict[str, Any]:
    """The weights of `plan` prepared as a start on `target` prepares them (engine/setup.py's
    `prepare_weights`: read, converted, quantized at load, padded, laid out by the target's
    backend) into `out`/weights, keyed by `prebuilt.weights_material` (the checkpoint, dtype,
    quantization, plan, rules, devices); returns the manifest's "weights" entry. On this host's
    CPU they are placed on its mesh; for a TPU slice or GPU hosts, whose devices this host only
    describes, on one CPU device (the entry holds each weight whole; the serving host places
    it by its own sharding)."""
    import jax

    from jaxserve.engine.model_weights import prepare_weights
    from jaxserve.models.loader import load_checkpoint
    from jaxserve.models.pooling_config import as_causal_lm
    from jaxserve.parallel.mesh import make_mesh
    from jaxserve.runner.prebuilt import weights_material, write_weights

    if model_path is None:
        raise ValueError("--weights needs the model's checkpoint (a directory, a .gguf file or a Hub name), "
                         "not a config.json or a preset")
    ckpt = load_checkpoint(model_path)
    if plan.pooling:
        ckpt = as_causal_lm(ckpt)
    material = weights_material(ckpt, mesh.devices.flat, backend, dtype=plan.device.dtype,
                                quantization=plan.config.model.quantization, plan=plan.device, rules=plan.rules,
                                arch=plan.arch)
    host_mesh = mesh if target["kind"] == "cpu" else make_mesh(1, 1, devices=jax.devices("cpu")[:1])
    model = prepare_weights(plan, ckpt, host_mesh, backend)
    return write_weights(out, material, model)


def compile_steps(recipe, mesh_devices: list, scope, timed) -> list[tuple[int, int]]:
    """Every executable a generation runner of `recipe` holds, through `scope`: the KV cache's
    (and a drafter's) zeros, the sampling state, the grid's steps, the decode blocks, the slot
    writers. Returns the grid's buckets."""
    from jaxserve.runner.compile_pool import abstract_step

    abstract = abstract_step(recipe, devices=mesh_devices)
    program = abstract.program
    timed("kv-zeros", lambda: program.kv_zeros(scope))
    if program.drafter_cfg is not None:  # the drafter's own pages (a head's layer, a draft model's)
        timed("draft-kv-zeros", lambda: program.draft_kv_zeros(scope))
    timed("sampling-state", lambda: program.sampling_state_init(scope))
    shapes = recipe.grid().shapes()
    for bucket in shapes:
        timed(program.step_name(bucket), lambda b=bucket: program.step_executable(
            scope, b, abstract.params, abstract.kv, abstract.sstate))
    for R in recipe.block_buckets():  # multi-step decode's blocks (runner/decode_block.py)
        timed(program.block_name(R, recipe.num_decode_steps), lambda r=R: program.block_executable(
            scope, r, abstract.params, abstract.kv, abstract.sstate))
    timed("write-slot-rows", lambda: program.slot_rows_writer(scope, abstract.sstate))
    if program.lora is not None:
        timed("lora-write-slot", lambda: program.compile_lora_writer(scope))
    return shapes


def compile_pooling(recipe, plan, pooling, mesh, backend, scope, timed) -> list[tuple[int, int]]:
    """Every executable the pooling runner (`--runner pooling`) of `plan` holds, through `scope`:
    its scratch cache's zeros and one pooling program per bucket, over the abstract model as
    the server's holds it (a quantized cache's scales set). Returns the grid's buckets."""
    from jaxserve.runner.kv_scales import kv_scale_inputs
    from jaxserve.runner.pooling_runner import pooling_program
    from jaxserve.runner.recipe import abstract_model

    model = abstract_model(recipe, mesh, backend)
    kv_scale_inputs(model, recipe.kv_dtype)  # the server sets them before the runner splits the model
    program, _ = pooling_program(model, backend=backend, mesh=mesh, page_size=recipe.page_size,
                                 max_model_len=recipe.max_model_len, grid=plan.grid, pooling=pooling,
                                 kv_dtype=recipe.kv_dtype, rules=plan.rules)
    timed("kv-zeros", lambda: program.kv_zeros(scope))
    shapes = plan.grid.shapes()
    for bucket in shapes:
        timed(program.pool_name(bucket), lambda b=bucket: program.pool_executable(scope, b))
    return shapes


def calibration_program(recipe, model_path: pathlib.Path | None, mesh, backend):
    """(name, (compile, abstract arguments)) of the calibration forward a server of `recipe`
    runs at start to measure a quantized KV cache's scales (runner/kv_scales.py), or None when
    it runs none (a float cache, scales in the checkpoint). Its one shape is the calibration's
    token count, which the model's tokenizer decides: without a model directory (a config.json,
    a preset) there is none, and the forward compiles at start (logged)."""
    from jaxserve.engine.tokenizer import Tokenizer
    from jaxserve.models.loader import load_checkpoint
    from jaxserve.pallas_kernels.kv_quant import is_quantized
    from jaxserve.runner.kv_scales import (CALIBRATION_TEXT, calibration_ids, calibration_name,
                                           calibration_program as program, measures_kv_scales)
    from jaxserve.runner.recipe import abstract_model

    if not is_quantized(recipe.kv_dtype):
        return None
    if model_path is None:
        logger.warning("no tokenizer (the model is a config.json or a preset): the KV cache's calibration "
                       "forward, shaped by its token count, is not compiled ahead")
        return None
    model = abstract_model(recipe, mesh, backend)  # as the server's before its scales are set
    if not measures_kv_scales(recipe.kv_dtype, load_checkpoint(model_path), model):
        return None
    tokenizer = Tokenizer.from_pretrained(model_path)
    n = len(calibration_ids(model.config.vocab_size, lambda: tokenizer.encode(CALIBRATION_TEXT)))
    return calibration_name(n), program(model, n)


def _plain(x: Any) -> Any:
    try:
        json.dumps(x)
        return x
    except TypeError:
        return repr(x)


def run(args: argparse.Namespace) -> int:
    """The command: compile, then one summary line (or the reason it could not)."""
    target = parse_topology(args.topology)
    if target["kind"] != "cpu":  # compile-only: never open a chip (before JAX starts its backends)
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
        os.environ["ALLOW_MULTIPLE_LIBTPU_LOAD"] = "1"
    from jaxserve.config import EngineConfig

    opts = EngineConfig.cli_options(args)
    opts.setdefault("show_progress", False)
    config = EngineConfig.from_kwargs(model=args.model, **opts)
    try:
        manifest = compile_for_target(config, target, args.out, weights=args.weights)
    except ValueError as e:
        print(f"jaxserve compile: {e}")
        return 2
    print(f"jaxserve compile: {len(manifest['entries'])} executables for {manifest['topology']} "
          f"({manifest['devices'][0]} x{len(manifest['devices'])}, {len(manifest['buckets'])} steps) in "
          f"{manifest['total_seconds']:.1f}s"
          + (f", weights {manifest['weights']['bytes'] / 2**30:.2f} GiB" if "weights" in manifest else "")
          + f" -> {args.out}")
    return 0
