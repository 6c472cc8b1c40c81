"""A forward on a simulated 4-device mesh (tensor-parallel over heads and MLP) equals the
single-device result; parameters and the KV cache really are sharded."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from jaxserve.models.arch_config import ArchConfig
from jaxserve.models.sharding import logical_to_spec, single_device_mesh
from jaxserve.models.weights import create_model
from jaxserve.parallel.mesh import make_mesh
from tests.models.model_utils import PagedRunner

TINY = dict(
    architectures=["LlamaForCausalLM"], vocab_size=128, hidden_size=64, intermediate_size=128,
    num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=4, rope_theta=10000.0,
    tie_word_embeddings=False,
)


def test_logical_rules_replicate_indivisible_axes():
    mesh = make_mesh(1, 4)
    assert logical_to_spec(("embed", "q_heads", "head_dim"), (64, 8, 16), mesh) == P(None, "model", None)
    # 9 heads do not split 4 ways: replicated
    assert logical_to_spec(("embed", "q_heads", "head_dim"), (64, 9, 16), mesh) == P(None, None, None)


def test_sharded_forward_equals_unsharded():
    assert len(jax.devices()) >= 4
    cfg = ArchConfig.from_hf(TINY)
    single = create_model(cfg, dtype=jnp.float32, seed=5, mesh=single_device_mesh())
    mesh = make_mesh(1, 4)
    sharded = create_model(cfg, dtype=jnp.float32, seed=5, mesh=mesh)
    for layer in sharded.layers:
        assert layer.wq[...].sharding.spec == P(None, "model", None)
        assert len(layer.w_up[...].addressable_shards) == 4
    rng = np.random.default_rng(0)
    seqs = [rng.integers(0, 128, size=n).tolist() for n in (21, 5)]
    outs = []
    for model, m in ((single, None), (sharded, mesh)):
        runner = PagedRunner(model, page_size=8, num_pages=16, seed=1, mesh=m)
        first = runner.step([(0, seqs[0], 0), (1, seqs[1], 0)], num_tokens=32, num_reqs=2, pages_per_req=4)
        nxt = runner.step([(0, [3], 21), (1, [7], 5)], num_tokens=16, num_reqs=2, pages_per_req=4)
        if m is not None:
            assert all(k.sharding.spec[2] == "model" for k in runner.kv.k)
        outs.append(np.concatenate(first + nxt))
    np.testing.assert_allclose(outs[1], outs[0], atol=1e-4, rtol=0)
