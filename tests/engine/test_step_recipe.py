"""One StepRecipe, one program: the runner (real weights), the compile workers' path (abstract
weights, `compile_pool.abstract_step`) and shard-plan (`plan_compile.plan_one`) lower the same
step program from the same recipe, with quantized weights, a quantized KV cache (its scales are
inputs of the program, not part of it), LoRA slots and a max_logprobs that is not the default:
the lowered programs' fingerprints are equal (runner/recipe.py). Lowering only, except
shard-plan's one compile of a tiny model."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import pytest

from jaxserve.backends import select_backend
from jaxserve.models.arch_config import ArchConfig
from jaxserve.models.loader import load_checkpoint
from jaxserve.models.sharding import load_rules, serving_rules
from jaxserve.models.weights import create_model
from jaxserve.parallel.mesh import make_mesh
from jaxserve.runner.compile_pool import abstract_step, lower_bucket
from jaxserve.runner.kv_scales import kv_scales_of, set_kv_scales
from jaxserve.runner.model_runner import ModelRunner
from jaxserve.runner.recipe import program_fingerprint, step_program
from jaxserve.tools.plan_compile import PlanSettings, plan_one, plan_recipe, resolve_plan
from tests.model_dirs import DATA

BUCKET = (16, 8)


@pytest.fixture(scope="module")
def planned():
    """shard-plan's record and the recipe it compiled: int8 weights, an fp8 KV cache, two LoRA
    slots of rank 8, max_logprobs 7."""
    ckpt = load_checkpoint(DATA / "llama")
    settings = PlanSettings(arch=dict(ckpt.config), platform="cpu", max_model_len=64, max_num_seqs=8,
                            dtype="float32", kv_cache_dtype="fp8", quantization="int8", max_logprobs=7,
                            max_loras=2, max_lora_rank=8)
    mesh = make_mesh(1, 1)
    rec = plan_one(settings, mesh, "tp", BUCKET, "cpu")
    cfg, rules = ArchConfig.from_hf(settings.arch), serving_rules(load_rules("tp"), 1)
    recipe = plan_recipe(settings, cfg, mesh, rules, resolve_plan(settings, cfg, mesh, rules), rec["kv"]["num_pages"])
    return ckpt, cfg, mesh, recipe, rec


def _model(ckpt, cfg, mesh, recipe):
    """The model a runner of `recipe` serves, from the checkpoint's weights."""
    backend = select_backend("cpu")
    model = create_model(cfg, dtype=jnp.float32, mesh=mesh, get_tensor=ckpt.get_tensor,
                         quantization=recipe.quantization, rules=recipe.rules, moe_impl=recipe.plan["moe_impl"])
    backend.prepare_model(model, recipe.device_plan())
    return backend, model


def test_the_runner_the_compile_workers_and_shard_plan_lower_one_program(planned):
    ckpt, cfg, mesh, recipe, rec = planned
    assert recipe.quantization == "int8" and recipe.max_loras == 2 and recipe.sampler_config.max_logprobs == 7
    assert recipe.plan["kv_dtype"] == "fp8"
    workers = program_fingerprint(lower_bucket(recipe, abstract_step(recipe), BUCKET))
    assert workers == rec["program_fingerprint"]
    backend, model = _model(ckpt, cfg, mesh, recipe)
    runner = ModelRunner(model, recipe, backend=backend, mesh=mesh, show_progress=False)  # no buckets: no step compiled
    assert runner.lora is not None and runner.program.function.layer_impl is None
    assert program_fingerprint(runner.lower(BUCKET)) == workers
    # What shard-plan used to leave out changes the program: the recipe carries it.
    narrower = dataclasses.replace(recipe, sampler_config=dataclasses.replace(recipe.sampler_config, max_logprobs=3))
    assert program_fingerprint(lower_bucket(narrower, abstract_step(narrower), BUCKET)) != workers


def test_a_quantized_caches_scales_are_inputs_of_its_program_not_part_of_it(planned):
    """The recipe names the fp8 cache, not its scales: a model whose scales were never set
    (ones), one with others and the abstract model of the recipe lower one program, whose
    arguments include each layer's [2, Hkv] scales."""
    ckpt, cfg, mesh, recipe, _ = planned
    assert "kv_scales" not in {f.name for f in dataclasses.fields(recipe)}
    abstract = program_fingerprint(lower_bucket(recipe, abstract_step(recipe), BUCKET))
    for scales in (None, [((0.5,), (0.25,)), ((0.5, 2.0), (1.0, 0.125))]):
        backend, model = _model(ckpt, cfg, mesh, recipe)
        if scales is not None:
            set_kv_scales(model, scales)
        program, params, _ = step_program(recipe, model, backend, mesh)  # the runner's own builder
        assert kv_scales_of(model) == tuple(scales or [((1.0,), (1.0,))] * cfg.num_layers)
        shaped = [jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding) for x in params]
        assert sum(x.shape == (2, cfg.num_kv_heads) for x in shaped) == cfg.num_layers
        shaped += program.lora_arrays(abstract=True)
        lowered = program.lower(BUCKET, shaped, program.abstract_kv(), program.abstract_state())[0]()
        assert program_fingerprint(lowered) == abstract