"""The backend's positive capability check: a fused decoder layer replaces a model's own only
when the model declares its layer features and the backend implements all of them."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.backends import layer_features_covered
from jaxserve.backends.cpu import layer as cpu_layer
from jaxserve.backends.base import DevicePlan
from jaxserve.backends.cpu import CpuBackend
from jaxserve.models import interface as features
from jaxserve.models.llama import LlamaForCausalLM
from jaxserve.models.weights import create_model
from jaxserve.backends.cpu.kernels.matmul import avx512_available
from tests.models.model_utils import PagedRunner
from tests.models.test_arch_parity import CASES, load_fixture

PACK = DevicePlan("float32", "float32", "cpu", "avx512", "cpu", "ragged")


def test_the_check_is_positive():
    supported = frozenset({features.RMS_NORM, features.ROPE})

    class Declares:
        layer_features = frozenset({features.RMS_NORM})

    class Unknown:
        layer_features = frozenset({features.RMS_NORM, "gelu_tanh_mlp"})

    assert layer_features_covered(Declares(), supported)
    assert not layer_features_covered(Unknown(), supported)
    assert not layer_features_covered(object(), supported)  # declares nothing: never fused


@pytest.mark.skipif(not avx512_available(), reason="no float32 product kernel on this CPU")
@pytest.mark.parametrize("name", CASES)
def test_packed_models_take_the_fused_layer_only_when_covered(data_dir, name):
    """Every fixture, packed for the CPU product kernel, runs the fused layer where its
    features are covered and every product packed (Llama, Mistral, the dynamic-RoPE Llama)
    and its own layer otherwise (Qwen2's biases, Qwen3's q/k norms, Phi-3's partial rotary,
    Gemma's norms and MLP, the MoE layers; the tied Llama's single 16-wide KV head does not
    pack); either way its logits equal transformers'."""
    cfg, tensors, expected = load_fixture(data_dir, name)
    model = create_model(cfg, dtype=jnp.float32, get_tensor=tensors.__getitem__)
    backend = CpuBackend()
    backend.prepare_model(model, PACK)
    impl = backend.layer_impl(model)
    covered = model.layer_features <= cpu_layer.FEATURES
    assert covered == (name in ("llama", "llama_tied", "mistral", "llama_dynamic"))
    assert impl is (cpu_layer.fused_layer if name in ("llama", "mistral", "llama_dynamic") else None)
    runner = PagedRunner(model, page_size=4, num_pages=16, layer_impl=impl)
    seqs = [expected["tokens_0"].tolist(), expected["tokens_1"].tolist()]
    out = runner.step([(0, seqs[0], 0), (1, seqs[1], 0)], num_tokens=32, num_reqs=4, pages_per_req=8)
    for i in range(2):
        np.testing.assert_allclose(out[i], expected[f"logits_{i}"], atol=1e-4, rtol=0)


@pytest.mark.skipif(not avx512_available(), reason="no float32 product kernel on this CPU")
def test_a_feature_the_fused_layer_lacks_keeps_the_plain_layer(data_dir):
    """A Llama whose config has a feature the CPU fused layer does not implement (here a
    made-up soft-capped attention) is packed but keeps its own layer."""
    cfg, tensors, _ = load_fixture(data_dir, "llama")

    class SoftCapped(LlamaForCausalLM):
        def __init__(self, config, **kw):
            super().__init__(config, **kw)
            self.layer_features = self.layer_features | {"attn_soft_cap"}

    model = SoftCapped(cfg, dtype=jnp.float32, rngs=None)
    backend = CpuBackend()
    backend.prepare_model(model, PACK)
    assert backend.layer_impl(model) is None
    plain = create_model(cfg, dtype=jnp.float32, get_tensor=tensors.__getitem__)
    backend.prepare_model(plain, PACK)
    assert backend.layer_impl(plain) is cpu_layer.fused_layer
    assert dataclasses.replace(cfg) == plain.config
