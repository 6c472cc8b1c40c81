"""`shard-plan --measure`'s random weights (jaxserve/tools/plan_measure.py): made on the devices
in the step's own shapes, dtypes and shardings, by one compiled maker per distinct (shape,
dtype, sharding) that a second layer reuses, filled by the module's policy, and kept with the
KV cache from one bucket to the next of the same plan."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from jaxserve.models import sharding as ax
from jaxserve.models.arch_config import ArchConfig
from jaxserve.parallel.mesh import make_mesh
from jaxserve.runner.compile_pool import abstract_step
from jaxserve.tools import plan_measure
from jaxserve.tools.plan_compile import PlanSettings, kv_record, plan_recipe, resolve_plan

TINY = dict(architectures=["LlamaForCausalLM"], vocab_size=256, hidden_size=64,
            intermediate_size=128, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=4, head_dim=16,
            max_position_embeddings=512, tie_word_embeddings=False)


def _plan(quantization=None, layers=2):
    arch = {**TINY, "num_hidden_layers": layers}
    settings = PlanSettings(arch=arch, platform="cpu", max_model_len=128, max_num_seqs=8,
                            dtype="bfloat16", quantization=quantization)
    cfg, mesh = ArchConfig.from_hf(arch), make_mesh(1, 1)
    rules = ax.serving_rules(ax.load_rules("tp"), 1)
    plan = resolve_plan(settings, cfg, mesh, rules)
    _, num_pages, _ = kv_record(settings, cfg, mesh, rules, plan["kv_dtype"])
    recipe = plan_recipe(settings, cfg, mesh, rules, plan, num_pages)
    return abstract_step(recipe, devices=list(mesh.devices.flat)), cfg, mesh, rules, plan, num_pages


def _by_name(abstract, params):
    from flax import nnx

    paths = jax.tree_util.tree_leaves_with_path(nnx.split(abstract.model)[1])
    return {".".join(str(getattr(k, "key", getattr(k, "name", k))) for k in p): a
            for (p, _), a in zip(paths, params)}


def test_the_weights_are_the_steps_own_and_filled_by_the_policy():
    plan_measure._MAKERS.clear()
    abstract = _plan()[0]
    params = plan_measure.random_params(abstract.model, abstract.params)
    assert [(a.shape, a.dtype, a.sharding) for a in params] == [
        (s.shape, s.dtype, s.sharding) for s in abstract.params]
    # 21 weights; the second layer's 9 take the first layer's makers
    assert len(params) == 21 and len(plan_measure._MAKERS) == 8
    named = _by_name(abstract, params)
    assert all(np.all(np.asarray(named[k], np.float32) == 1) for k in named if "norm" in k)
    wq0, wq1 = (np.asarray(named[f"layers.{i}.wq.value"], np.float32) for i in (0, 1))
    assert wq0.std() == pytest.approx(0.02, rel=0.1) and abs(wq0.mean()) < 0.002
    assert not np.array_equal(wq0, wq1)  # one maker, each weight its own draw
    again = plan_measure.random_params(abstract.model, abstract.params)
    assert np.array_equal(np.asarray(again[5], np.float32), np.asarray(params[5], np.float32))


def test_quantized_weights_get_small_integers_and_scales():
    abstract = _plan("int8", layers=1)[0]
    named = _by_name(abstract, plan_measure.random_params(abstract.model, abstract.params))
    q, s = np.asarray(named["layers.0.w_up.value"]), np.asarray(named["layers.0.w_up_qscale.value"])
    assert q.dtype == np.int8 and q.min() >= 0 and q.max() <= 15 and len(np.unique(q)) == 16
    assert s.dtype == np.float32 and np.all(s == np.float32(1e-3))


def test_the_arrays_stay_for_the_next_bucket_of_the_plan():
    abstract, cfg, mesh, rules, plan, num_pages = _plan()
    plan_measure._HELD.clear()
    params, kv, made_s = plan_measure.held_arrays(abstract, cfg, mesh, rules, plan, num_pages, 16)
    assert made_s > 0 and len(kv.k) == cfg.num_layers
    assert kv.k[0].shape[0] == num_pages and not np.any(np.asarray(kv.k[0], np.float32))
    same, same_kv, again = plan_measure.held_arrays(abstract, cfg, mesh, rules, plan, num_pages, 16)
    assert again is None and same is params and same_kv is kv
    _, _, other = plan_measure.held_arrays(abstract, cfg, mesh, rules, plan, num_pages // 2, 16)
    assert other is not None  # another cache: made anew
    assert plan_measure._HELD["kv"] is not kv
    plan_measure._HELD.clear()
