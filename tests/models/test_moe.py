"""Mixture of experts: the grouped implementations equal every-expert-on-every-token, under
uneven routing; expert parallelism on 8 simulated devices equals the unsharded model."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P
from jaxserve.models.arch_config import ArchConfig
from jaxserve.models.layers.linear import QuantizedWeight, quantize_int8
from jaxserve.models.layers.moe import (
    EXPERT_SPECS,
    experts_dense,
    experts_grouped,
    route,
    tile_rows,
)
from jaxserve.models.sharding import EXPERT_PARALLEL_RULES, single_device_mesh
from jaxserve.models.weights import create_model

from jaxserve.parallel.mesh import make_mesh
from tests.models.model_utils import PagedRunner

TINY_MOE = dict(
    architectures=["MixtralForCausalLM"], vocab_size=128, hidden_size=64, intermediate_size=32,
    num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=8, num_local_experts=8,
    num_experts_per_tok=2, rope_theta=10000.0, tie_word_embeddings=False,
)


def _problem(seed, T=37, E=32, F=48, X=8, k=2, skew=3.0):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((T, E)), jnp.float32)
    # skewed router: experts 0-1 popular, the last ones rarely chosen
    logits = jnp.asarray(rng.standard_normal((T, X)) + skew * np.linspace(1, -1, X), jnp.float32)
    weights, ids = route(logits, k, normalize=True)
    w = [jnp.asarray(0.1 * rng.standard_normal(s), jnp.float32) for s in ((X, E, F), (X, E, F), (X, F, E))]
    return x, weights, ids, w


@pytest.mark.parametrize("tile", [None, 8, 16])
@pytest.mark.parametrize("seed", [0, 1])
def test_grouped_equals_dense(seed, tile):
    x, weights, ids, (wg, wu, wd) = _problem(seed)
    counts = np.bincount(np.asarray(ids).ravel(), minlength=8)
    assert counts.max() > 3 * max(counts.min(), 1)  # routing really is uneven
    want = experts_dense(x, weights, ids, wg, wu, wd)
    for impl in ("ragged", "tiled"):
        got = jax.jit(lambda *a, impl=impl: experts_grouped(*a, impl=impl, tile=tile))(x, weights, ids, wg, wu, wd)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5, rtol=1e-5)


def test_grouped_bfloat16():
    """bfloat16 experts: every implementation runs (XLA:CPU has no bfloat16 dot in a loop) and
    agrees within bfloat16 rounding."""
    x, weights, ids, ws = _problem(4)
    wb = [w.astype(jnp.bfloat16) for w in ws]
    want = experts_dense(x, weights, ids, *wb)
    for impl in ("ragged", "tiled"):
        got = jax.jit(lambda *a, impl=impl: experts_grouped(*a, impl=impl))(x, weights, ids, *wb)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-2, rtol=2e-2)


def test_grouped_local_experts_only():
    """With an expert offset (a device's share of the experts), only those experts count."""
    x, weights, ids, (wg, wu, wd) = _problem(2)
    full = experts_dense(x, weights, ids, wg, wu, wd)
    parts = [experts_grouped(x, weights, ids, wg[o:o + 2], wu[o:o + 2], wd[o:o + 2], impl="tiled", expert_offset=o)
             for o in range(0, 8, 2)]
    np.testing.assert_allclose(np.asarray(sum(parts)), np.asarray(full), atol=2e-5, rtol=1e-5)


def test_grouped_int8_experts():
    x, weights, ids, ws = _problem(3)
    qs = [QuantizedWeight(*quantize_int8(w, EXPERT_SPECS[n]), "float32") for w, n in zip(ws, ("w_gate", "w_up", "w_down"))]
    deq = [q.dequantize() for q in qs]
    assert qs[0].scale.shape == (8, 1, 48) and qs[2].scale.shape == (8, 1, 32)
    want = experts_dense(x, weights, ids, *deq)
    for impl in ("ragged", "tiled"):
        got = experts_grouped(x, weights, ids, *qs, impl=impl)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5, rtol=1e-5)


def test_tile_rows():
    assert tile_rows(64, 8) == 8 and tile_rows(1024, 8) == 128 and tile_rows(4, 8) == 8


def _run(model, mesh):
    rng = np.random.default_rng(0)
    seqs = [rng.integers(0, 128, size=n).tolist() for n in (21, 5, 12)]
    runner = PagedRunner(model, page_size=8, num_pages=16, seed=1, mesh=mesh)
    first = runner.step([(0, seqs[0], 0), (1, seqs[1], 0), (2, seqs[2], 0)], num_tokens=64, num_reqs=4, pages_per_req=4)
    nxt = runner.step([(0, [3], 21), (1, [7], 5), (2, [9], 12)], num_tokens=16, num_reqs=4, pages_per_req=4)
    return np.concatenate(first + nxt)


@pytest.mark.parametrize("rules", ["expert_parallel", "default"])
def test_sharded_moe_equals_unsharded(rules):
    """8 simulated devices: experts split over the model axis (one per device), or each
    expert's intermediate dim split (the default rules); logits equal one device's."""
    assert len(jax.devices()) >= 8
    cfg = ArchConfig.from_hf(TINY_MOE)
    single = create_model(cfg, dtype=jnp.float32, seed=5, mesh=single_device_mesh())
    mesh = make_mesh(1, 8)
    r = EXPERT_PARALLEL_RULES if rules == "expert_parallel" else None
    sharded = create_model(cfg, dtype=jnp.float32, seed=5, mesh=mesh, rules=r)
    for layer in sharded.layers:
        want = P("model", None, None) if rules == "expert_parallel" else P(None, None, "model")
        assert layer.w_gate[...].sharding.spec == want
        assert len({str(s.index) for s in layer.w_gate[...].addressable_shards}) == 8
        assert (layer.expert_axis, layer.mlp_axis) == (("model", None) if r else (None, "model"))
    np.testing.assert_allclose(_run(sharded, mesh), _run(single, None), atol=1e-4, rtol=0)


def test_tiled_or_dense_runs_small_steps_of_converted_experts_dense():
    """"tiled-or-dense" (the CPU backend's plan) runs a step dense while its extra expert-rows
    (tokens x unused experts) stay within DENSE_MAX_EXTRA_ROWS and the experts are converted
    per tile (bfloat16, int8), grouped tiles otherwise; the other forms run as named."""
    from jaxserve.models.layers.moe import DENSE_MAX_EXTRA_ROWS, step_impl

    mixtral = {"num_experts": 8, "top_k": 2}
    assert step_impl("tiled-or-dense", num_tokens=32, **mixtral) == "dense"
    assert step_impl("tiled-or-dense", num_tokens=512, **mixtral) == "dense"
    assert step_impl("tiled-or-dense", num_tokens=1024, **mixtral) == "tiled"
    assert step_impl("tiled-or-dense", num_tokens=DENSE_MAX_EXTRA_ROWS // 30, num_experts=32,
                     top_k=2) == "dense"
    assert step_impl("tiled-or-dense", num_tokens=64, num_experts=128, top_k=8) == "tiled"
    assert step_impl("tiled-or-dense", num_tokens=32, float32_experts=True, **mixtral) == "tiled"
    assert step_impl("ragged", num_tokens=32, **mixtral) == "ragged"
    assert step_impl("tiled", num_tokens=32, **mixtral) == "tiled"
    with pytest.raises(ValueError, match="moe impl"):
        step_impl("grouped", num_tokens=32, **mixtral)
    with pytest.raises(ValueError, match="moe impl"):  # the model checks it at construction
        create_model(ArchConfig.from_hf(TINY_MOE), dtype=jnp.float32, moe_impl="auto")


def test_the_backend_plans_the_moe_implementation():
    """The backend's plan picks the grouped products (the CPU's tiles, the accelerators'
    ragged_dot), and the engine builds the model with that choice."""
    from jaxserve.backends import Backend
    from jaxserve.backends.cpu import CpuBackend
    from jaxserve.config import CacheConfig, ModelConfig

    one = make_mesh(1, 1)
    mc, cc = ModelConfig(dtype="float32", matmul_impl="xla"), CacheConfig()
    assert CpuBackend().plan(mc, cc, one).moe_impl == "tiled-or-dense"
    assert Backend("tpu").plan(mc, cc, one).moe_impl == "ragged"
    cfg = ArchConfig.from_hf(TINY_MOE)
    model = create_model(cfg, dtype=jnp.float32, moe_impl="tiled-or-dense")
    assert model.moe_impl == "tiled-or-dense"
