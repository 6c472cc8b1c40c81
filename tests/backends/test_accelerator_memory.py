"""The accelerators' KV budget from the compiled programs (backends/base.py `kv_budget_from_step`,
compiled_step/memory.py, engine/setup.py): the arithmetic and its refusal, max_model_len fitted to
the cache, and, compiled for TPU topologies through libtpu on this host (no TPU), a
Llama-3-8B-shaped model whose budget the served step's own memory analysis confirms.

The topology tests compile Llama-3-8B's layer (hidden 4096, MLP 14336, 32/8 heads) once, with
a 32,000-token vocabulary instead of 128,256: a 32-layer step takes 1-6 minutes to compile
here, one layer and the smaller head ~11 s (18 s with two layers and the full vocabulary), and
the budget's arithmetic does not depend on the depth or the vocabulary (the weights are counted
from the arguments, the temporaries from the buffer assignment of the compiled step, whatever
their size). `benchmarks/memory_budget.py` runs the same check on the whole model
(docs/performance.md)."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import logging

import pytest

from jaxserve.backends.base import Backend, InsufficientMemoryError
from jaxserve.compiled_step.memory import StepMemory
from jaxserve.config import CacheConfig
from jaxserve.engine.setup import fit_max_model_len

GiB = 2**30
needs_libtpu = pytest.mark.skipif(
    importlib.util.find_spec("libtpu") is None,
    reason="libtpu is not installed (pip install 'jaxserve[tpu]'): no TPU compiles",
)


def _step(**kw) -> StepMemory:
    base = dict(
        bucket=(8192, 32),
        weights=4 * GiB,
        arguments=5 * GiB,
        kv=GiB // 2,
        outputs=GiB // 64,
        temp=GiB,
        code=GiB // 32,
    )
    return StepMemory(**{**base, **kw})


def test_the_budget_is_what_the_step_leaves_and_a_step_that_does_not_fit_is_refused_with_figures():
    step = _step()
    budget = Backend("tpu").kv_budget_from_step(
        CacheConfig(device_memory_utilization=0.9), step, 16 * GiB, num_executables=17
    )
    # 14.4 GiB usable - (5 - 0.5 GiB of arguments besides the cache) - 1/64 - 1 - 1/32 - 16 x 1/32 of code
    expect = (
        int(16 * GiB * 0.9) - (step.arguments - step.kv) - step.outputs - step.temp - 17 * step.code
    )
    assert budget.kv == expect
    assert step.peak - step.kv + budget.kv + budget.other_code == budget.usable
    with pytest.raises(InsufficientMemoryError) as e:
        Backend("tpu").kv_budget_from_step(
            CacheConfig(device_memory_utilization=0.3), step, 16 * GiB
        )
    text = str(e.value)
    for figure in (
        "16.00 GiB per device x 0.3 = 4.80 GiB",
        "weights 4.00 GiB",
        "8192 tokens x 32 requests",
        "temporaries 1.00 GiB",
        "left for the KV cache -",
    ):
        assert figure in text, text


def test_what_the_served_step_needs_beyond_the_budget_comes_off_the_cache():
    """The step compiled with the budget's cache can need more temporaries than the probes
    showed (a copy of a layer's cache hidden under other temporaries at a small size): the
    excess comes off the cache, so the served step fits; a step within the budget changes
    nothing."""
    step = _step()
    tpu = Backend("tpu")
    budget = tpu.kv_budget_from_step(CacheConfig(device_memory_utilization=0.9), step, 16 * GiB)
    fits = _step(kv=budget.kv, arguments=step.arguments - step.kv + budget.kv)
    assert tpu.check_served_step(budget, fits).kv == budget.kv
    grown = dataclasses.replace(fits, temp=step.temp + GiB // 4)
    checked = tpu.check_served_step(budget, grown)
    assert checked.served_excess == GiB // 4 and checked.kv == budget.kv - GiB // 4
    assert "0.250 GiB more, taken off the cache" in checked.describe()
    smaller = dataclasses.replace(grown, kv=checked.kv, arguments=grown.arguments - GiB // 4)
    assert smaller.peak + checked.other_code <= checked.usable


def test_max_model_len_is_lowered_to_the_cache_when_defaulted_and_refused_when_given(caplog):
    assert fit_max_model_len(8192, 1 + 512, 16, given=False) == 8192
    with caplog.at_level(logging.WARNING, logger="jaxserve.engine.setup"):
        assert fit_max_model_len(8192, 1 + 100, 16, given=False) == 1600
    assert "lowered from the model's 8192 to 1600" in caplog.text
    with pytest.raises(
        InsufficientMemoryError, match="max_model_len 8192 is more than the KV cache holds"
    ):
        fit_max_model_len(8192, 1 + 100, 16, given=True)


def test_the_cpu_keeps_its_fixed_budget_and_context_cap():
    from jaxserve.backends.cpu import CpuBackend

    cpu = CpuBackend()
    assert not cpu.sizes_kv_from_programs and cpu.default_max_model_len == 2048
    assert Backend("tpu").sizes_kv_from_programs and Backend("tpu").default_max_model_len is None


# ---------------------------------------------------------------------------------- TPU topologies
def _llama8b_layers(n: int, vocab_size: int | None = None) -> dict:
    from jaxserve.tools.shard_plan import model_config

    _, arch = model_config("llama3-8b")
    return {**arch, "num_hidden_layers": n, "vocab_size": vocab_size or arch["vocab_size"]}


def _recipe(topology: str, num_pages: int):
    from jaxserve.models.sharding import load_rules

    from jaxserve.runner.recipe import StepRecipe
    from jaxserve.sampling.config import SamplerConfig

    arch = _llama8b_layers(1, vocab_size=32000)
    plan = dict(
        dtype="bfloat16",
        kv_dtype="bfloat16",
        attention_impl="tpu",
        matmul_impl="xla",
        native_sampling=None,
        moe_impl="ragged",
    )
    n = 1
    for d in topology.split(":")[1].split("x"):
        n *= int(d)
    return StepRecipe(
        arch=arch,
        platform="tpu",
        plan=plan,
        attention_impl="auto",
        rules=dict(load_rules("tp")),
        mesh_shape=(1, n),
        target={"kind": "tpu", "topology": topology},
        num_pages=num_pages,
        page_size=16,
        max_model_len=8192,
        sampler_config=SamplerConfig(
            max_num_seqs=8, vocab_size=arch["vocab_size"], max_logprobs=20
        ),
    )


# The smallest bucket: its temporaries are the step's as at any size, and each of the test's
# three compiles takes ~15 s here instead of ~27 s at 512 tokens.
BUCKET = (16, 8)


@needs_libtpu
# One topology: the sizing is the same mechanism on every chip (v6e:2x4 took 80 s of a 2-core
# suite; test_tpu_topology compiles whole steps for both chips).
@pytest.mark.parametrize("topology", ["v5e:2x2"])
def test_llama8b_shaped_budget_is_confirmed_by_the_served_step_and_an_overfull_one_refused(
    topology,
):
    """The engine's sizing (`kv_budget_from_programs`: the step probed with 2 pages, with an
    eighth of what they leave, and with the pages of that budget, what it needs beyond taken off
    the cache) with the chip's HBM, then the step with the pages of the budget: its own memory
    analysis fits the device x utilization. At a utilization that
    leaves less than the weights and the step, refused with the figures."""
    import jax.numpy as jnp
    from jaxserve.models.arch_config import ArchConfig

    from jaxserve.engine.setup import kv_budget_from_programs
    from jaxserve.parallel.mesh import make_mesh
    from jaxserve.runner.compile_pool import recipe_devices, step_memory
    from jaxserve.runner.kv_cache import bytes_per_page, num_pages_for_budget
    from jaxserve.tools.chips import CHIPS

    hbm = CHIPS[topology.split(":")[0]].hbm_bytes
    base = _recipe(topology, 2)
    arch = ArchConfig.from_hf(base.arch)
    mesh = make_mesh(*base.mesh_shape, devices=recipe_devices(base.target))
    recipe = lambda num_pages: _recipe(topology, num_pages)  # noqa: E731
    sizing = dict(arch=arch, kv_dtype=jnp.bfloat16, mesh=mesh, rules=base.rules)
    budget = kv_budget_from_programs(
        Backend("tpu"), CacheConfig(device_memory_utilization=0.9), recipe, BUCKET, hbm, **sizing
    )
    pages = num_pages_for_budget(arch, 16, jnp.bfloat16, budget.kv, mesh, base.rules)
    served = budget.served  # the sizing's last probe: the step with the budget's pages
    if served is None or served.kv != pages * bytes_per_page(arch, 16, jnp.bfloat16, mesh, base.rules):
        served = step_memory(recipe(pages), BUCKET, devices=list(mesh.devices.flat))
    print(
        json.dumps(
            {
                "topology": topology,
                "hbm": hbm,
                "probe": dataclasses.asdict(budget.step),
                "kv_overhead": budget.kv_overhead,
                "pages": pages,
                "served": dataclasses.asdict(served),
            }
        )
    )
    assert served.weights == budget.step.weights
    assert served.kv >= budget.kv - 2 * (served.kv // pages)  # the pages fill the budget
    assert served.peak <= budget.usable  # XLA's own figures of the served step fit
    with pytest.raises(InsufficientMemoryError) as e:
        Backend("tpu").kv_budget_from_step(
            CacheConfig(device_memory_utilization=0.001), budget.step, hbm
        )
    assert f"weights {budget.step.weights / GiB:.2f} GiB" in str(e.value)
    assert "temporaries" in str(e.value) and "left for the KV cache -" in str(e.value)
