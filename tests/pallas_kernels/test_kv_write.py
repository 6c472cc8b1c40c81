"""write_kv: one in-place scatter into one layer's paged KV cache."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.pallas_kernels import AttentionMetadata, ragged_paged_attention, write_kv
from jaxserve.pallas_kernels.kv_cache_update import ops as kv_ops

L, N, PS, HKV, D = 4, 9, 8, 2, 16
CACHE_SHAPE = f"f32[{N},{PS},{HKV},{D}]"  # one layer's cache in HLO text


def cache_copies(hlo: str, cache_shape: str) -> list[str]:
    """Lines of an HLO text that copy a whole cache-shaped array."""
    pat = re.compile(rf"= {re.escape(cache_shape)}\S* copy\(")
    return [ln for ln in hlo.splitlines() if pat.search(ln)]


def random_cache(rng, dtype=np.float32):
    """One layer's (k_cache, v_cache), each [N, PS, HKV, D]."""
    shape = (N, PS, HKV, D)
    return (rng.standard_normal(shape).astype(dtype), rng.standard_normal(shape).astype(dtype))


def random_caches(rng):
    """L layers' caches: a tuple of L k arrays and a tuple of L v arrays."""
    kcs, vcs = zip(*(random_cache(rng) for _ in range(L)))
    return kcs, vcs


def naive_write(kc, vc, k, v, slots):
    kc, vc = kc.copy(), vc.copy()
    for t, s in enumerate(slots):
        if 0 <= s < N * PS:
            kc[s // PS, s % PS] = k[t]
            vc[s // PS, s % PS] = v[t]
    return kc, vc


def test_write_eager_and_jitted():
    rng = np.random.default_rng(0)
    kc, vc = random_cache(rng)
    T = 13
    # Distinct slots on shuffled pages, across page boundaries and partial pages.
    slots = rng.permutation(np.arange(PS, N * PS))[:T].astype(np.int32)
    k = rng.standard_normal((T, HKV, D), np.float32)
    v = rng.standard_normal((T, HKV, D), np.float32)
    # (The whole arrays are compared: every slot not written is untouched, bit for bit.)
    want_k, want_v = naive_write(kc, vc, k, v, slots)

    got_k, got_v = write_kv(jnp.asarray(kc), jnp.asarray(vc), k, v, jnp.asarray(slots))
    np.testing.assert_array_equal(np.asarray(got_k), want_k)
    np.testing.assert_array_equal(np.asarray(got_v), want_v)

    jitted = jax.jit(write_kv)
    got_k, got_v = jitted(jnp.asarray(kc), jnp.asarray(vc), k, v, jnp.asarray(slots))
    np.testing.assert_array_equal(np.asarray(got_k), want_k)
    np.testing.assert_array_equal(np.asarray(got_v), want_v)


def test_padding_tokens_and_dtype_cast_and_out_of_range():
    rng = np.random.default_rng(1)
    kc, vc = random_cache(rng)
    kc, vc = jnp.asarray(kc, jnp.bfloat16), jnp.asarray(vc, jnp.bfloat16)
    live = np.array([17, 18, 40, 71], np.int32)
    pad = np.array([0, 1, 2, 0, 1, 2], np.int32)  # padding tokens: null page, shared slots
    slots = np.concatenate([live, pad, [N * PS + 5]]).astype(np.int32)  # last: out of range
    T = len(slots)
    k = rng.standard_normal((T, HKV, D), np.float32)
    v = rng.standard_normal((T, HKV, D), np.float32)
    got_k, got_v = jax.jit(write_kv)(kc, vc, k, v, jnp.asarray(slots))
    assert got_k.dtype == jnp.bfloat16 and got_v.dtype == jnp.bfloat16
    want_k, want_v = naive_write(
        np.asarray(kc, np.float32), np.asarray(vc, np.float32),
        np.asarray(jnp.asarray(k, jnp.bfloat16), np.float32),
        np.asarray(jnp.asarray(v, jnp.bfloat16), np.float32), live,
    )
    # Everything but the null page is exactly as expected (padding writes land there, the
    # out-of-range slot is dropped).
    gk, gv = np.asarray(got_k, np.float32), np.asarray(got_v, np.float32)
    np.testing.assert_array_equal(gk[1:], want_k[1:])
    np.testing.assert_array_equal(gv[1:], want_v[1:])
    np.testing.assert_array_equal(gk[0, 3:], want_k[0, 3:])  # null slots 3.. untouched


def _layers_step(kcs, vcs, ks, vs, slots):
    """The model's layer loop: one write per layer, each into that layer's own arrays."""
    kcs, vcs, sums = list(kcs), list(vcs), []
    for i in range(L):
        kcs[i], vcs[i] = write_kv(kcs[i], vcs[i], ks[i], vs[i], slots)
        # Read the layer back (as attention would), so each cache is both read and written.
        sums.append(kcs[i][slots // PS, slots % PS].sum())
    return tuple(kcs), tuple(vcs), jnp.stack(sums)


def test_per_layer_caches_donated_update_in_place():
    rng = np.random.default_rng(2)
    kcs, vcs = random_caches(rng)
    T = 5
    slots = jnp.asarray(rng.permutation(np.arange(PS, N * PS))[:T].astype(np.int32))
    ks = rng.standard_normal((L, T, HKV, D), np.float32)
    vs = rng.standard_normal((L, T, HKV, D), np.float32)
    step = jax.jit(_layers_step, donate_argnums=(0, 1))
    as_jax = lambda xs: tuple(jnp.asarray(x) for x in xs)  # noqa: E731

    compiled = step.lower(as_jax(kcs), as_jax(vcs), ks, vs, slots).compile()
    hlo = compiled.as_text()
    copies = cache_copies(hlo, CACHE_SHAPE)
    assert not copies, "a cache is copied:\n" + "\n".join(copies)
    scatters = [
        ln for ln in hlo.splitlines() if "scatter(" in ln and CACHE_SHAPE in ln.split("=")[1][:80]
    ]
    assert scatters, "expected a scatter on a layer's cache"
    mem = compiled.memory_analysis()
    layer_bytes = kcs[0].nbytes
    if mem is not None:  # all 2 L caches are aliased input->output, no cache-sized temporary
        assert mem.alias_size_in_bytes >= 2 * L * layer_bytes
        assert mem.temp_size_in_bytes < layer_bytes

    kc_in, vc_in = as_jax(kcs), as_jax(vcs)
    ptrs = [x.unsafe_buffer_pointer() for x in kc_in + vc_in]
    got_k, got_v, _ = step(kc_in, vc_in, ks, vs, slots)
    assert all(x.is_deleted() for x in kc_in + vc_in)  # donated
    if jax.default_backend() == "cpu":
        got_ptrs = [x.unsafe_buffer_pointer() for x in got_k + got_v]
        assert got_ptrs == ptrs, "a cache was not updated in place"
    for i in range(L):
        want_k, want_v = naive_write(kcs[i], vcs[i], ks[i], vs[i], np.asarray(slots))
        np.testing.assert_array_equal(np.asarray(got_k[i]), want_k)
        np.testing.assert_array_equal(np.asarray(got_v[i]), want_v)


def test_layer_loop_with_attention_keeps_caches_in_place():
    """The model's layer loop: write_kv then attention (which reads the cache in while loops)."""
    rng = np.random.default_rng(4)
    kcs, vcs = random_caches(rng)
    # Two requests: a 3-token chunk after 9 cached tokens (pages 5, 2) and a decode (pages 7, 1).
    md = AttentionMetadata(
        block_tables=jnp.asarray([[5, 2], [7, 1]], jnp.int32),
        kv_lens=jnp.asarray([12, 10], jnp.int32),
        query_start_loc=jnp.asarray([0, 3, 4], jnp.int32),
        num_seqs=jnp.asarray(2, jnp.int32),
        slot_mapping=jnp.asarray([2 * PS + 1, 2 * PS + 2, 2 * PS + 3, 1 * PS + 1, 0, 1],
                                 jnp.int32),
    )
    T, HQ = 6, 4
    qs = rng.standard_normal((L, T, HQ, D), np.float32)
    ks = rng.standard_normal((L, T, HKV, D), np.float32)
    vs = rng.standard_normal((L, T, HKV, D), np.float32)

    def step(kcs, vcs, qs, ks, vs, md):
        kcs, vcs, outs = list(kcs), list(vcs), []
        for i in range(L):
            kcs[i], vcs[i] = write_kv(kcs[i], vcs[i], ks[i], vs[i], md.slot_mapping)
            outs.append(ragged_paged_attention(qs[i], kcs[i], vcs[i], md, sm_scale=0.25))
        return tuple(kcs), tuple(vcs), jnp.stack(outs)

    step = jax.jit(step, donate_argnums=(0, 1))
    as_jax = lambda xs: tuple(jnp.asarray(x) for x in xs)  # noqa: E731
    hlo = step.lower(as_jax(kcs), as_jax(vcs), qs, ks, vs, md).compile().as_text()
    copies = cache_copies(hlo, CACHE_SHAPE)
    assert not copies, "a cache is copied:\n" + "\n".join(copies)
    kc_in, vc_in = as_jax(kcs), as_jax(vcs)
    ptrs = [x.unsafe_buffer_pointer() for x in kc_in + vc_in]
    got_k, got_v, out = step(kc_in, vc_in, qs, ks, vs, md)
    if jax.default_backend() == "cpu":
        assert [x.unsafe_buffer_pointer() for x in got_k + got_v] == ptrs
    assert np.all(np.isfinite(np.asarray(out))) and np.all(np.asarray(out)[:, 4:] == 0)


def test_dispatch_and_shape_errors():
    assert kv_ops.resolve_impl("reference") == "reference"
    assert kv_ops.resolve_impl("auto", backend="cpu") == "reference"
    rng = np.random.default_rng(3)
    kc, vc = random_cache(rng)
    k = np.ones((2, HKV, D), np.float32)
    slots = jnp.asarray([8, 9], jnp.int32)
    for impl in ("tpu", "gpu"):
        if impl not in kv_ops.available_impls():
            with pytest.raises(ValueError, match="not available yet"):
                write_kv(kc, vc, k, k, slots, impl=impl)
    with pytest.raises(ValueError, match="unknown impl"):
        write_kv(kc, vc, k, k, slots, impl="nope")
    with pytest.raises(ValueError, match=r"\[N, page_size, Hkv, D\]"):  # a layer-stacked cache
        write_kv(kc[None], vc[None], k, k, slots)
    with pytest.raises(ValueError, match=r"\[T=2"):
        write_kv(kc, vc, k[:, :1], k, slots)
