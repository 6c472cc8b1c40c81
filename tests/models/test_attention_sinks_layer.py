"""A layer's attention sinks through `models/layers/attention.py`: on one device and in the
tensor-parallel `shard_map` over KV heads (the sinks split like the query heads), for the
layer that writes its cache and for a layer that reads another's, against the float64 oracle."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.models.layers.attention import AttentionSpec, paged_attention, paged_attention_read
from jaxserve.parallel.mesh import make_mesh
from tests.pallas_kernels.attention_cases import make_case, naive_attention, random_sinks

HQ, HKV, D, PS = 6, 2, 64, 8
REQS = [(0, 13), (21, 1), (9, 6)]


@pytest.fixture(scope="module")
def case():
    """A batch whose new K/V are the cache's own rows at `slot_mapping` (so writing them
    changes nothing and the oracle reads the case's caches), with sinks and a window."""
    c = make_case(REQS, page_size=PS, hq=HQ, hkv=HKV, d=D, r_pad=4, t_pad=24, seed=12)
    slots = np.asarray(c["md"].slot_mapping)
    T = c["q"].shape[0]
    n_live = int(c["qsl"][len(REQS)])
    # Padding tokens write the null page (page 0), which no request reads.
    c["k"] = c["kc"][slots // PS, slots % PS].reshape(T, HKV, D)
    c["v"] = c["vc"][slots // PS, slots % PS].reshape(T, HKV, D)
    c["sinks"] = random_sinks(HQ, seed=11)
    c["n_live"] = n_live
    return c


SPEC = AttentionSpec(sm_scale=0.125, sliding_window=9, impl="reference")


@functools.cache
def _mesh(tp: int):
    return None if tp == 1 else make_mesh(1, tp)


@pytest.mark.parametrize("tp", [1, 2])
def test_layer_sinks(tp, case):
    mesh = _mesh(tp)
    sinks = jnp.asarray(case["sinks"])
    args = [jnp.asarray(case[k]) for k in ("q", "k", "v", "kc", "vc")]

    @jax.jit
    def write_and_read(q, k, v, kc, vc, md, sinks):
        out, kc, vc = paged_attention(q, k, v, kc, vc, md, SPEC, mesh, sinks=sinks)
        return out, paged_attention_read(q, kc, vc, md, SPEC, mesh, sinks=sinks)

    out, read = write_and_read(*args, case["md"], sinks)
    want = naive_attention(case, sm_scale=0.125, sliding_window=9, sinks=case["sinks"])
    n = case["n_live"]
    for got in (out, read):
        np.testing.assert_allclose(np.asarray(got)[:n], want[:n], atol=1e-5, rtol=0)
    # Each device's query heads took their own sinks: the second half of the heads differs
    # from what the first half's sinks would give (a replicated or unsplit sinks array).
    swapped = np.concatenate([case["sinks"][3:], case["sinks"][:3]])
    wrong = naive_attention(case, sm_scale=0.125, sliding_window=9, sinks=swapped)
    assert np.abs(wrong[:n] - want[:n]).max() > 0.1
    # Without sinks the layer is the plain attention.
    plain = jax.jit(lambda *a: paged_attention(*a, SPEC, mesh)[0])(*args, case["md"])
    np.testing.assert_allclose(np.asarray(plain)[:n],
                               naive_attention(case, sm_scale=0.125, sliding_window=9)[:n],
                               atol=1e-5, rtol=0)
