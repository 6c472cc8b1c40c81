"""One configuration of `jaxserve shard-plan`: the real step compiled on abstract inputs.

For a mesh, a rules table and a (T, R) bucket, this writes the step's recipe (runner/recipe.py:
what `serve` would compile there) and builds from it, as the runner and its compile workers do,
the model abstractly (no weights are read or allocated), its parameters, KV cache and sampling
state laid over the mesh as the engine would, lowers the runner's own step (model, sampler and
all) and compiles it for the devices at hand: simulated CPU devices, a
compile-only TPU topology, GPU hosts, or the real devices. It then reads back what XLA
decided: memory, cost (XLA's cost analysis; for GPUs compiled without one, which it leaves
empty, the flops of the HLO's dots), the collectives and the kernels in the HLO. `--measure`
runs the same executable on random weights.

This module runs inside a worker process (`plan_worker.py`) whose JAX backend was set up for
its devices.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from jaxserve.backends import select_backend
from jaxserve.config import CacheConfig, EngineConfig, LoRAConfig, ModelConfig, jax_dtype
from jaxserve.models import sharding as ax
from jaxserve.models.arch_config import ArchConfig
from jaxserve.models.interface import KV_CACHE_AXES
from jaxserve.runner.compile_pool import abstract_step
from jaxserve.runner.kv_cache import abstract_kv_cache, bytes_per_page
from jaxserve.runner.lora_weights import LoRAWeights
from jaxserve.runner.recipe import (
    StepRecipe,
    program_fingerprint,
    serving_arch,
    serving_draft_heads,
    target_attention,
)
from jaxserve.sampling.config import SamplerConfig
from jaxserve.tools import hlo_ops
from jaxserve.tools.hlo_collectives import parse_collectives, summarize

logger = logging.getLogger(__name__)

_ATTENTION = ("wq", "wk", "wv", "wo", "bq", "bk", "bv", "bo", "q_norm", "k_norm", "sinks",
              "wq_a", "wq_b", "wkv_a", "w_uk", "w_uv")  # the last five: MLA's
_MLP = ("w_gate", "w_up", "w_down", "b_gate", "b_up", "b_down",
        "s_gate", "s_up", "s_down")  # s_*: DeepSeek's shared experts, an always-on MLP
_ROUTER = ("router", "router_bias", "e_bias")


@dataclasses.dataclass(frozen=True)
class PlanSettings:
    """What every configuration of one run shares."""

    arch: dict  # the HF config.json of the model
    platform: str  # the target's JAX platform: "cpu", "tpu", "gpu"
    max_model_len: int
    max_num_seqs: int
    page_size: int = CacheConfig.page_size
    kv_cache_memory: int | None = None  # per device; None: R x max_model_len tokens
    dtype: str = ModelConfig.dtype
    kv_cache_dtype: str = CacheConfig.kv_cache_dtype
    attention_impl: str = ModelConfig.attention_impl
    quantization: str | None = None
    device_memory: int | None = None  # per device, for the verdict
    measure: bool = False
    steps: int = 5
    context: int | None = None  # decode context for --measure (default: min(max_model_len, 1024))
    max_logprobs: int = EngineConfig.max_logprobs  # the sampler's top-logprobs width
    max_loras: int = 0  # LoRA adapters' device slots (0: LoRA off)
    max_lora_rank: int = 0
    # Speculative decoding (--speculative-config): drafts per request and step; the method of a
    # drafter run in the step ("": none) and its directory (an EAGLE-3 head's, a draft model's),
    # whose weights and KV pages the step holds too.
    num_speculative_tokens: int = 0
    draft_model: str = ""
    draft_method: str = ""
    # The FP8 / int4 weights' products: None, what the target's backend resolves (the TPU
    # product kernel where attention runs the TPU kernel); "xla" or a kernel's name to choose.
    quant_matmul_impl: str | None = None
    # --measure --profile: trace one decode step of each bucket (or of these [T, R]) here.
    profile_dir: str | None = None
    profile_buckets: list | None = None


def param_group(path: str, ndim: int) -> str:
    """The report's group of a parameter ("layers.3.wq" -> "attention"; stacked experts -> "moe")."""
    leaf = path.split(".")[-1].removesuffix("_qscale")
    if path.startswith("embed"):
        return "embed"
    if path.startswith("lm_head"):
        return "lm_head"
    if path.startswith("mtp"):  # multi-token prediction layers (kept for speculative decoding)
        return "mtp"
    if leaf in _ATTENTION:
        return "attention"
    stacked_experts = leaf.startswith(("x_", "b_x_")) or (leaf in _MLP[:6] and ndim == 3)
    if leaf in _ROUTER or stacked_experts:
        return "moe"
    if leaf in _MLP:
        return "mlp"
    if "norm" in leaf:
        return "norms"
    return "other"


def _path(p) -> str:
    return ".".join(str(getattr(k, "key", getattr(k, "name", k))) for k in p)


def _nbytes(shape, dtype) -> int:
    return int(math.prod(shape) * jnp.dtype(dtype).itemsize)


def _local_bytes(s: jax.ShapeDtypeStruct) -> int:
    return _nbytes(s.sharding.shard_shape(s.shape), s.dtype)


def _requested_split(axes, shape, mesh: Mesh, rules) -> tuple[int, int, list[str]]:
    """(requested split, granted split, notes on dims the rules asked to split but were not)."""
    asked_n = granted_n = 1
    notes = []
    used: set[str] = set()
    for name, size, (asked, granted) in zip(axes, shape, ax.spec_entries(axes, shape, mesh, rules)):
        present = tuple(a for a in asked if a in mesh.shape and a not in used)
        used.update(present)
        n = ax.mesh_axes_size(mesh, present)
        asked_n *= n
        granted_n *= ax.mesh_axes_size(mesh, granted)
        if n > 1 and not granted:
            notes.append(f"{name} ({size}) over {'x'.join(present)}={n}")
    return asked_n, granted_n, notes


def resolve_plan(settings: PlanSettings, cfg: ArchConfig, mesh: Mesh, rules) -> dict[str, Any]:
    """dtype, KV dtype, attention, MoE and quantized product implementations as the target's
    backend resolves them, the attention kernel checked on the per-device shapes (as
    `impl="auto"` does when serving), and the backend's whole plan (`device_plan`)."""
    backend = select_backend(settings.platform)
    mc = ModelConfig(dtype=settings.dtype, attention_impl=settings.attention_impl, matmul_impl="xla")
    cc = CacheConfig(kv_cache_dtype=settings.kv_cache_dtype, page_size=settings.page_size)
    plan = backend.plan(mc, cc, mesh)
    cfg = serving_arch(settings.attention_impl, settings.platform, cfg, mesh, rules,
                       settings.page_size, jax_dtype(plan.kv_dtype), jax_dtype(plan.dtype),
                       lora=settings.max_loras > 0)
    impl, note = target_attention(settings.attention_impl, settings.platform, cfg, mesh, rules, settings.page_size,
                                  jax_dtype(plan.kv_dtype), jax_dtype(plan.dtype))
    draft_heads = serving_draft_heads(settings.draft_method, settings.draft_model, cfg, settings.attention_impl,
                                      settings.platform, mesh, rules, settings.page_size, jax_dtype(plan.kv_dtype),
                                      jax_dtype(plan.dtype))
    quant = settings.quant_matmul_impl or plan.quant_matmul_impl
    return {"dtype": plan.dtype, "kv_dtype": plan.kv_dtype, "attention_impl": impl, "attention_note": note,
            "kv_heads": cfg.num_kv_heads if cfg.checkpoint_heads else 0,
            "kv_heads_note": cfg.kv_padding_note(), "draft_kv_heads": draft_heads,
            "native_sampling": plan.native_sampling, "moe_impl": plan.moe_impl, "quant_matmul_impl": quant,
            "device_plan": {**dataclasses.asdict(plan), "quant_matmul_impl": quant}}


def lora_slots_group(settings: PlanSettings, cfg: ArchConfig, dtype, mesh: Mesh, rules):
    """The LoRA slots as the runner lays them out: (their parameter group's bytes, abstract
    arrays, structure)."""
    slots = LoRAWeights(cfg, LoRAConfig(enable_lora=True, max_loras=settings.max_loras,
                                        max_lora_rank=settings.max_lora_rank), dtype, mesh, rules)
    leaves = slots.abstract()
    local = sum(_local_bytes(s) for s in leaves)
    group = {"per_device": local, "requested_per_device": local, "total": slots.nbytes}
    return group, leaves, slots.treedef


def plan_recipe(settings: PlanSettings, cfg: ArchConfig, mesh: Mesh, rules, plan: dict, num_pages: int) -> StepRecipe:
    """The step recipe of one configuration: the step `serve` would compile with these settings
    on this mesh (the XLA product: packed CPU weights are one device's)."""
    sampler_config = SamplerConfig(max_num_seqs=settings.max_num_seqs, vocab_size=cfg.vocab_size,
                                   max_logprobs=settings.max_logprobs, native=plan["native_sampling"])
    return StepRecipe(arch=settings.arch, platform=settings.platform, plan=plan["device_plan"],
                      attention_impl=settings.attention_impl, rules=dict(rules),
                      mesh_shape=(mesh.shape["data"], mesh.shape["model"]), target={}, num_pages=num_pages,
                      page_size=settings.page_size, max_model_len=settings.max_model_len,
                      sampler_config=sampler_config, quantization=settings.quantization,
                      max_loras=settings.max_loras, max_lora_rank=settings.max_lora_rank if settings.max_loras else 0,
                      num_speculative_tokens=settings.num_speculative_tokens, draft_model=settings.draft_model,
                      kv_heads=plan["kv_heads"], draft_method=settings.draft_method,
                      draft_kv_heads=plan["draft_kv_heads"])


def plan_one(settings: PlanSettings, mesh: Mesh, rules_spec: str, bucket: tuple[int, int],
             device_kind: str) -> dict[str, Any]:
    """Compile and analyse one (mesh, rules, bucket); the report's record."""
    cfg = ArchConfig.from_hf(settings.arch)
    D = mesh.shape["data"]  # data-parallel ranks: as `serve`, each its own pages, slots and rows
    if settings.max_num_seqs % D:
        raise ValueError(f"max_num_seqs ({settings.max_num_seqs}) must be a multiple of the {D} data-parallel ranks")
    if settings.max_loras and settings.measure:
        raise ValueError("--measure does not run LoRA slots; plan --enable-lora without it")
    if settings.draft_method and settings.measure:
        raise ValueError("--measure does not run a drafter; plan --speculative-config without it")
    rules = ax.serving_rules(ax.load_rules(rules_spec), D)
    T, R = bucket
    rec: dict[str, Any] = {"mesh": f"{mesh.shape['data']}x{mesh.shape['model']}", "rules": ax.rules_name(rules_spec),
                           "bucket": [T, R], "device_kind": device_kind, "num_devices": mesh.size,
                           "data_parallel": D}
    plan = resolve_plan(settings, cfg, mesh, rules)
    rec.update({k: v for k, v in plan.items() if k != "device_plan"})
    if plan["kv_heads"]:  # zero KV heads appended: the KV and weight bytes below include them
        cfg = cfg.with_kv_heads(plan["kv_heads"])
    rec["kv"], num_pages, pages_per_req = kv_record(settings, cfg, mesh, rules, plan["kv_dtype"], plan["dtype"],
                                                    draft_kv_heads=plan["draft_kv_heads"])
    recipe = plan_recipe(settings, cfg, mesh, rules, plan, num_pages)
    if mesh.size > 1 or settings.platform != "cpu":
        ax.check_servable(rules)
    # ---- the step as the runner builds it from its recipe: abstract weights, KV cache and
    # sampling state with the engine's shardings (runner/recipe.py)
    abstract = abstract_step(recipe, devices=list(mesh.devices.flat))
    rec["params"] = params_record(abstract, settings, cfg, mesh, rules)
    rec["kv"]["per_device"] = sum(_local_bytes(a) for a in jax.tree.leaves(abstract.kv))  # a head's pages too
    rec["sampling_state_per_device"] = sum(_local_bytes(a) for a in jax.tree.leaves(abstract.sstate))
    t0 = time.perf_counter()
    lowered = abstract.lower(bucket)[0]()
    rec["program_fingerprint"] = program_fingerprint(lowered)
    try:
        compiled = lowered.compile()
    except Exception as e:  # a compiler that refuses for lack of memory is a verdict, not an error
        verdict = does_not_fit_record(e, settings.device_memory)
        if verdict is None:
            raise
        rec["memory"], rec["compile_s"] = verdict, round(time.perf_counter() - t0, 2)
        return rec
    rec["compile_s"] = round(time.perf_counter() - t0, 2)
    rec["memory"] = memory_record(compiled, settings.device_memory)
    text = compiled.as_text()
    dot_flops, kernels = hlo_ops.parse(text)
    rec["cost"] = cost_record(compiled, dot_flops)
    rec["kernels"] = hlo_ops.kernel_counts(kernels)
    rec["collectives"] = summarize(parse_collectives(text, mesh.size), cfg.num_layers)
    if settings.measure:
        from jaxserve.tools.plan_measure import measure_step

        rec["measure"] = measure_step(settings, cfg, mesh, rules, plan, compiled, abstract, recipe.sampler_config,
                                      num_pages, pages_per_req, bucket)
    return rec


def params_record(abstract, settings: PlanSettings, cfg: ArchConfig, mesh: Mesh, rules) -> dict[str, Any]:
    """The weights per device by group (attention, mlp, moe, embed, lm_head, norms, the LoRA
    slots), as placed and as the rules asked, and what stays whole because the mesh does not
    divide it."""
    groups: dict[str, dict[str, float]] = {}
    replicated: list[str] = []
    _, abs_state = nnx.split(abstract.model)
    variables = jax.tree_util.tree_leaves_with_path(abs_state, is_leaf=lambda x: isinstance(x, nnx.Variable))
    for p, var in variables:
        path, s = _path(p), var.get_value()
        g = groups.setdefault(param_group(path, len(s.shape)), {"per_device": 0, "requested_per_device": 0, "total": 0})
        total = _nbytes(s.shape, s.dtype)
        g["per_device"] += _local_bytes(s)
        g["total"] += total
        axes = var.get_metadata().get("logical_axes")
        if axes is None:
            g["requested_per_device"] += total
            continue
        asked, granted, notes = _requested_split(axes, s.shape, mesh, rules)
        g["requested_per_device"] += _local_bytes(s) * granted / asked
        for note in notes:
            text = f"{param_group(path, len(s.shape))}: {note}"
            if text not in replicated:
                replicated.append(text)
    drafter = abstract.program.drafter_params
    if drafter is not None:  # a drafter's own weights follow the target's, as in the runner
        local, total = sum(_local_bytes(x) for x in drafter), sum(_nbytes(x.shape, x.dtype) for x in drafter)
        groups["draft_head"] = {"per_device": local, "requested_per_device": local, "total": total}
    lora = abstract.program.lora
    if lora is not None:  # the adapters' slots travel after the weights, as in the runner
        local = sum(_local_bytes(x) for x in lora.abstract())
        groups["lora_slots"] = {"per_device": local, "requested_per_device": local, "total": lora.nbytes}
    return {"per_device": int(sum(g["per_device"] for g in groups.values())),
            "total": int(sum(g["total"] for g in groups.values())),
            "groups": {k: {kk: int(vv) for kk, vv in v.items()} for k, v in sorted(groups.items())},
            "replicated": replicated}


def kv_record(settings: PlanSettings, cfg: ArchConfig, mesh: Mesh, rules, kv_dtype_name: str,
              dtype_name: str | None = None, draft_kv_heads: int = 0):
    """(the KV cache's record, its pages for the budget, pages per request at max_model_len).
    `draft_kv_heads`: the drafter's pages' KV heads as served (the plan's; 0: its checkpoint's)."""
    D, kv_dtype = mesh.shape["data"], jax_dtype(kv_dtype_name)
    probe = abstract_kv_cache(cfg, 1, settings.page_size, kv_dtype, mesh, rules).k[0]
    page_split = ax.mesh_axes_size(mesh, ax.logical_to_spec(KV_CACHE_AXES, (1 << 20, 1, 1, 1), mesh, rules)[0])
    per_page = bytes_per_page(cfg, settings.page_size, kv_dtype, mesh, rules)  # on the devices that hold it
    if settings.draft_method:  # the drafter's own pages, as many and indexed alike, in their dtype
        from jaxserve.runner.draft_head_step import draft_cache_config, draft_cache_dtype

        per_page += bytes_per_page(draft_cache_config(settings.draft_method, cfg, settings.draft_model,
                                                      draft_kv_heads),
                                   settings.page_size, draft_cache_dtype(jax_dtype(dtype_name or settings.dtype), kv_dtype),
                                   mesh, rules)
    pages_per_req = -(-settings.max_model_len // settings.page_size)
    wanted = D * (settings.max_num_seqs // D * pages_per_req + 1)  # + each rank's null page
    if settings.kv_cache_memory is not None:
        num_pages = int(settings.kv_cache_memory // per_page) * page_split
    else:
        num_pages = -(-wanted // page_split) * page_split
    num_pages = max(num_pages, 2 * page_split)
    rec = {"dtype": kv_dtype_name, "bytes_per_page_per_device": per_page // page_split if page_split > 1
           else per_page, "page_size": settings.page_size, "num_pages": num_pages,
           "tokens": (num_pages - D) * settings.page_size, "per_device": None,
           "spec": str(probe.sharding.spec), "budget": settings.kv_cache_memory,
           "workload_pages": wanted, "fits_workload": num_pages >= wanted,
           "max_requests_at_max_len": D * ((num_pages // D - 1) // pages_per_req)}
    return rec, num_pages, pages_per_req


def memory_record(compiled, device_memory: int | None) -> dict[str, Any]:
    m = compiled.memory_analysis()
    out = {k: int(getattr(m, f"{k}_size_in_bytes", 0) or 0)
           for k in ("argument", "output", "alias", "temp", "generated_code")}
    # Donated arguments (the KV cache, the sampling state) alias their outputs.
    out["peak"] = out["argument"] + out["output"] - out["alias"] + out["temp"] + out["generated_code"]
    out["device_memory"] = device_memory
    out["fits"] = None if device_memory is None else out["peak"] <= device_memory
    return out


def cost_record(compiled, dot_flops: int) -> dict[str, Any]:
    """XLA's cost analysis per device; where it gives none (GPU programs compiled without a
    GPU), the flops of the HLO's dots (`hlo_ops.py`) and no byte count."""
    cost = compiled.cost_analysis()
    if isinstance(cost, list):
        cost = cost[0] if cost else {}
    cost = cost or {}
    flops, accessed = float(cost.get("flops", 0.0)), float(cost.get("bytes accessed", 0.0))
    source = "xla cost analysis"
    if not flops:
        flops, accessed, source = float(dot_flops), 0.0, "hlo dots"
    return {"flops": flops, "bytes_accessed": accessed, "dot_flops": dot_flops, "source": source,
            "arithmetic_intensity": round(flops / accessed, 2) if accessed else None}


def does_not_fit_record(error: Exception, device_memory: int | None) -> dict[str, Any] | None:
    """A memory verdict from a compiler that refused the program for lack of memory."""
    text = str(error)
    if "RESOURCE_EXHAUSTED" not in text and "out of memory" not in text.lower():
        return None
    if "shared memory" in text.lower():  # a GPU kernel's on-chip memory, not the device's: an error
        return None
    first = next((line for line in text.splitlines() if "memory" in line.lower()), text.splitlines()[0])
    return {"fits": False, "device_memory": device_memory, "compiler": first.strip()[:400]}
