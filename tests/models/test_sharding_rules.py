"""Sharding rules as configuration: presets, rules files, the attention specs derived from the
rules, and every preset giving the unsharded model's logits and greedy tokens on 8 simulated
devices for every architecture fixture."""

from __future__ import annotations

import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P
from safetensors.numpy import load_file

from jaxserve.models import sharding
from jaxserve.models.arch_config import ArchConfig
from jaxserve.models.layers.attention import attention_specs
from jaxserve.models.sharding import (
    RULE_PRESETS,
    check_servable,
    load_rules,
    logical_to_spec,
    single_device_mesh,
    spec_entries,
)
from jaxserve.models.weights import abstract_model, create_model
from jaxserve.parallel.mesh import make_mesh
from jaxserve.runner.kv_cache import allocate_kv_cache, bytes_per_page, kv_cache_sharding
from tests.models.model_utils import PagedRunner
from tests.models.test_arch_parity import CASES

SERVABLE = [name for name in RULE_PRESETS if name != "attn-dp"]
# Gemma 4's dense fixture adds no sharding rule the others lack (its tensor-parallel run is in
# tests/models/test_gemma4.py); its MoE fixture stays, for the MoE layer's expert-scale path.
# DeepSeek V3's fixtures run tensor-parallel in tests/models/test_deepseek_v3.py.
SHARDED_CASES = [name for name in CASES
                 if name not in ("gemma4", "gpt_oss", "deepseek_v3", "deepseek_v3_lite")]
# Every architecture under "tp" (the served default); each other preset on the architectures
# whose weights it splits differently: tied embeddings and soft-capped logits under the
# replicated vocabulary, q/k norms and Gemma's layer pattern with the KV heads replicated,
# biases, Phi-3's fused projections and the experts' scales under fsdp, every MoE under
# expert-parallel (gpt-oss only there: its tensor-parallel run, the packed MXFP4 experts split,
# is in test_gpt_oss.py).
OTHER_PRESETS = {
    "tp-replicate-vocab": ["llama_tied", "gemma2", "qwen3_moe"],
    "tp-kv-replicated": ["llama", "qwen3", "gemma3", "mixtral"],
    "fsdp": ["qwen2", "phi3", "mixtral", "gemma4_moe"],
    "expert-parallel": ["mixtral", "qwen3_moe", "gemma4_moe", "gpt_oss"],
}
PRESET_CASES = [(name, "tp") for name in SHARDED_CASES] + [
    (name, preset) for preset, names in OTHER_PRESETS.items() for name in names]


def test_every_servable_preset_and_architecture_runs():
    assert set(OTHER_PRESETS) | {"tp"} == set(SERVABLE)
    assert {name for name, _ in PRESET_CASES} == set(CASES) - {"gemma4", "deepseek_v3", "deepseek_v3_lite"}


def test_presets_and_files(tmp_path):
    assert load_rules("tp") == load_rules(None) == sharding.validate_rules(sharding.DEFAULT_RULES)
    assert load_rules("tp-replicate-vocab")["vocab"] is None
    assert load_rules("tp-kv-replicated")["kv_heads"] is None
    assert load_rules("fsdp")["embed"] == "data"
    assert load_rules("expert-parallel")["expert"] == "model"
    f = tmp_path / "rules.json"
    f.write_text(json.dumps({"base": "tp", "mlp": ["data", "model"], "vocab": None}))
    rules = load_rules(str(f))
    assert rules["mlp"] == ("data", "model") and rules["vocab"] is None and rules["q_heads"] == "model"
    y = tmp_path / "rules.yaml"
    y.write_text("kv_heads: null\nembed: data\n")
    assert load_rules(str(y))["kv_heads"] is None and load_rules(str(y))["embed"] == "data"
    for bad, match in (({"mlpp": "model"}, "unknown logical axis 'mlpp'"),
                       ({"mlp": "tensor"}, "mesh axes are data, model"),
                       ({"mlp": ["model", "model"]}, "twice")):
        f.write_text(json.dumps(bad))
        with pytest.raises(ValueError, match=match):
            load_rules(str(f))
    with pytest.raises(ValueError, match="neither a preset"):
        load_rules("no-such-preset")
    check_servable(load_rules("attn-dp"))  # pages over "data": each data rank owns a range
    with pytest.raises(ValueError, match="only the data axis can own pages"):
        check_servable(load_rules({"pages": "model"}))


def test_specs_over_several_mesh_axes():
    mesh = make_mesh(2, 4)
    rules = load_rules({"mlp": ("data", "model"), "embed": "data"})
    assert logical_to_spec(("embed", "mlp"), (64, 96), mesh, rules) == P("data", "model")  # data used once
    assert logical_to_spec(("mlp", "embed"), (96, 64), mesh, rules) == P(("data", "model"), None)
    # 12 is not divided by 8: replicated, and the report says what was asked
    assert spec_entries(("mlp",), (12,), mesh, rules) == [(("data", "model"), ())]


def test_attention_specs_follow_the_rules():
    """The attention shard_map's specs come from the rules table: changing kv_heads there
    changes them (no hard-coded mesh axis)."""
    mesh = make_mesh(2, 4)
    k, cache = (16, 8, 64), (32, 16, 8 * 64)  # the cache's rows: its 8 heads of 64
    assert attention_specs(k, cache, mesh, load_rules("tp")) == (P(None, "model", None), P(None, None, "model"))
    assert attention_specs(k, cache, mesh, load_rules({"kv_heads": "data"})) == (
        P(None, "data", None), P(None, None, "data"))
    assert attention_specs(k, cache, mesh, load_rules("tp-kv-replicated")) == (P(None, None, None), P(None, None, None))
    assert attention_specs(k, cache, mesh, load_rules({"kv_heads": ["data", "model"]})) == (
        P(None, ("data", "model"), None), P(None, None, ("data", "model")))
    # Split by heads, not by the row's width: 2 KV heads on a 4-way axis stay whole (replicated),
    # though the row (128) would divide.
    assert attention_specs((16, 2, 64), (32, 16, 128), mesh, load_rules("tp")) == (
        P(None, None, None), P(None, None, None))
    with pytest.raises(ValueError, match="pages and head_dim must stay whole"):
        attention_specs(k, cache, mesh, load_rules("attn-dp"))


def test_kv_bytes_per_page_are_per_device():
    cfg, _ = _fixture("llama")
    mesh = make_mesh(4, 2)
    whole = bytes_per_page(cfg, 16, jnp.float32)
    assert bytes_per_page(cfg, 16, jnp.float32, mesh, load_rules("tp")) == whole // 2
    assert bytes_per_page(cfg, 16, jnp.float32, mesh, load_rules("tp-kv-replicated")) == whole
    kv = allocate_kv_cache(cfg, 8, 16, jnp.float32, mesh, load_rules("tp"))
    per_device = sum(a.addressable_shards[0].data.nbytes for a in (*kv.k, *kv.v))
    assert per_device == 8 * bytes_per_page(cfg, 16, jnp.float32, mesh, load_rules("tp"))


@functools.cache
def _fixture(name: str):
    import pathlib

    d = pathlib.Path(__file__).parent.parent / "data" / "arch" / name
    cfg = ArchConfig.from_hf(json.loads((d / "config.json").read_text()))
    return cfg, load_file(str(d / "model.safetensors"))


def _logits(model, mesh, rules):
    rng = np.random.default_rng(0)
    seqs = [rng.integers(3, 128, size=n).tolist() for n in (13, 5)]
    runner = PagedRunner(model, page_size=4, num_pages=24, seed=1, mesh=mesh)
    if mesh is not None:  # the test's own KV cache, laid out by the same rules
        runner.kv = allocate_kv_cache(model.config, 24, 4, jnp.float32, mesh, rules)
    first = runner.step([(0, seqs[0], 0), (1, seqs[1], 0)], num_tokens=32, num_reqs=4, pages_per_req=8)
    nxt = runner.step([(0, [7], 13), (1, [9], 5)], num_tokens=32, num_reqs=4, pages_per_req=8)  # one compile
    return np.concatenate(first + nxt)


@functools.cache
def _unsharded(name: str) -> np.ndarray:
    cfg, tensors = _fixture(name)
    model = create_model(cfg, dtype=jnp.float32, mesh=single_device_mesh(), get_tensor=tensors.__getitem__)
    return _logits(model, None, None)


def _layout(cfg, mesh, rules):
    """Every parameter's and the KV cache's PartitionSpec under `rules`."""
    _, _, shardings = abstract_model(cfg, mesh=mesh, rules=rules)
    specs = [s.spec for s in jax.tree.leaves(shardings)]
    return specs, kv_cache_sharding(cfg, 8, 4, mesh, rules).spec


@pytest.mark.parametrize("name, preset", PRESET_CASES)
def test_preset_equals_unsharded(name, preset):
    """A 4 x 2 (data x model) mesh of 8 simulated devices: the fixtures' 4 query and 2 KV
    heads split over model, fsdp's embed dim over data."""
    assert len(jax.devices()) >= 8
    cfg, tensors = _fixture(name)
    mesh = make_mesh(4, 2)
    rules = load_rules(preset)
    if preset != "tp" and _layout(cfg, mesh, rules) == _layout(cfg, mesh, load_rules("tp")):
        return  # the same shardings as "tp" for this model (e.g. expert-parallel on a dense one): same program
    model = create_model(cfg, dtype=jnp.float32, mesh=mesh, get_tensor=tensors.__getitem__, rules=rules)
    want = _unsharded(name)
    got = _logits(model, mesh, rules)
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)
    np.testing.assert_array_equal(got.argmax(-1), want.argmax(-1))
