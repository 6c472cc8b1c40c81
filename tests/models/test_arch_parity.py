"""Logits of tiny random models of every registered architecture equal transformers' own.

The fixtures (tests/data/arch/*) come from scripts/make_arch_fixtures.py, which runs the
PyTorch implementations; this test needs no torch.
"""

from __future__ import annotations

import json
import pathlib

import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file

from jaxserve.models.arch_config import ArchConfig
from jaxserve.models.registry import get_model_class, supported_architectures
from jaxserve.models.weights import create_model
from tests.models.model_utils import PagedRunner

CASES = ["llama", "llama_tied", "qwen2", "qwen3", "mistral", "qwen2_sliding", "llama_dynamic", "phi3", "gemma2",
         "gemma3", "gemma4", "gemma4_moe", "mixtral", "qwen3_moe", "gpt_oss", "deepseek_v3",
         "deepseek_v3_lite"]
MOE_CASES = ["mixtral", "qwen3_moe", "gemma4_moe", "gpt_oss"]


def load_fixture(data_dir, name):
    d = data_dir / "arch" / name
    cfg = ArchConfig.from_hf(json.loads((d / "config.json").read_text()))
    tensors = load_file(str(d / "model.safetensors"))
    expected = load_file(str(d / "expected.safetensors"))
    return cfg, tensors, expected


def test_every_architecture_has_a_fixture(data_dir):
    archs = {json.loads((data_dir / "arch" / c / "config.json").read_text())["architectures"][0] for c in CASES}
    assert archs == set(supported_architectures())


@pytest.mark.parametrize("name", CASES)
def test_logits_match_transformers(data_dir, name):
    cfg, tensors, expected = load_fixture(data_dir, name)
    model = create_model(cfg, dtype=jnp.float32, get_tensor=tensors.__getitem__)
    runner = PagedRunner(model, page_size=4, num_pages=16)
    seqs = [expected["tokens_0"].tolist(), expected["tokens_1"].tolist()]
    out = runner.step([(0, seqs[0], 0), (1, seqs[1], 0)], num_tokens=32, num_reqs=4, pages_per_req=8)
    for i in range(2):
        np.testing.assert_allclose(out[i], expected[f"logits_{i}"], atol=1e-4, rtol=0)


def test_unknown_architecture_lists_every_served_one(data_dir):
    """The refusal names every architecture the fixtures show served (not a hand-kept list)."""
    served = {json.loads((data_dir / "arch" / c / "config.json").read_text())["architectures"][0]
              for c in CASES}
    with pytest.raises(ValueError, match="'DeepseekV2ForCausalLM' is not supported") as e:
        get_model_class("DeepseekV2ForCausalLM")
    listed = str(e.value).split("Supported architectures: ")[1].rstrip(".").split(", ")
    assert set(listed) == served and len(listed) == len(served)


def test_readme_names_every_served_architecture():
    readme = (pathlib.Path(__file__).resolve().parents[2] / "README.md").read_text()
    models = readme.split("## Models and checkpoints")[1].split("\n## ")[0]
    assert [a for a in supported_architectures() if f"`{a}`" not in models] == []


@pytest.mark.parametrize("name", MOE_CASES)
def test_moe_fixtures_route_unevenly(data_dir, name):
    """The MoE fixtures' routers are skewed: some experts get many tokens, some none."""
    _, _, expected = load_fixture(data_dir, name)
    counts = expected["expert_counts"]  # [MoE layers, experts], transformers' own routing
    for row in counts:
        assert row.max() >= 10 and (row == 0).any() and len(set(row.tolist())) >= 3


@pytest.mark.parametrize("impl", ["dense", "ragged", "tiled"])
@pytest.mark.parametrize("name", MOE_CASES)
def test_moe_implementations_match_transformers(data_dir, name, impl):
    """Each MoE implementation (every expert on every token; jax.lax.ragged_dot; the CPU's
    tiled grouped products) gives transformers' logits."""
    cfg, tensors, expected = load_fixture(data_dir, name)
    model = create_model(cfg, dtype=jnp.float32, get_tensor=tensors.__getitem__, moe_impl=impl)
    runner = PagedRunner(model, page_size=4, num_pages=16)
    seqs = [expected["tokens_0"].tolist(), expected["tokens_1"].tolist()]
    out = runner.step([(0, seqs[0], 0), (1, seqs[1], 0)], num_tokens=32, num_reqs=4, pages_per_req=8)
    for i in range(2):
        np.testing.assert_allclose(out[i], expected[f"logits_{i}"], atol=1e-4, rtol=0)
