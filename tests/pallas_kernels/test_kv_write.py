"""write_kv: one in-place scatter into the layer-stacked paged KV cache."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from jaxserve.pallas_kernels import AttentionMetadata, ragged_paged_attention, write_kv
from jaxserve.pallas_kernels.kv_cache_update import ops as kv_ops

L, N, PS, HKV, D = 4, 9, 8, 2, 16


def cache_copies(hlo: str, cache_shape: str) -> list[str]:
    """Lines of an HLO text that copy a whole cache-shaped array."""
    pat = re.compile(rf"= {re.escape(cache_shape)}\S* copy\(")
    return [ln for ln in hlo.splitlines() if pat.search(ln)]


def random_cache(rng, dtype=np.float32):
    shape = (L, N, PS, HKV, D)
    return (rng.standard_normal(shape).astype(dtype), rng.standard_normal(shape).astype(dtype))


def naive_write(kc, vc, layer, k, v, slots):
    kc, vc = kc.copy(), vc.copy()
    for t, s in enumerate(slots):
        if 0 <= s < N * PS:
            kc[layer, s // PS, s % PS] = k[t]
            vc[layer, s // PS, s % PS] = v[t]
    return kc, vc


def test_write_layer_python_int_and_traced():
    rng = np.random.default_rng(0)
    kc, vc = random_cache(rng)
    T = 13
    # Distinct slots on shuffled pages, across page boundaries and partial pages.
    slots = rng.permutation(np.arange(PS, N * PS))[:T].astype(np.int32)
    k = rng.standard_normal((T, HKV, D), np.float32)
    v = rng.standard_normal((T, HKV, D), np.float32)
    want_k, want_v = naive_write(kc, vc, 2, k, v, slots)

    got_k, got_v = write_kv(jnp.asarray(kc), jnp.asarray(vc), 2, k, v, jnp.asarray(slots))
    np.testing.assert_array_equal(np.asarray(got_k), want_k)
    np.testing.assert_array_equal(np.asarray(got_v), want_v)
    # Other layers are untouched, bit for bit.
    for other in (0, 1, 3):
        np.testing.assert_array_equal(np.asarray(got_k)[other], kc[other])
        np.testing.assert_array_equal(np.asarray(got_v)[other], vc[other])

    jitted = jax.jit(write_kv)
    got_k, got_v = jitted(jnp.asarray(kc), jnp.asarray(vc), jnp.int32(2), k, v, jnp.asarray(slots))
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
    got_k, got_v = jax.jit(write_kv)(kc, vc, jnp.int32(3), k, v, jnp.asarray(slots))
    assert got_k.dtype == jnp.bfloat16 and got_v.dtype == jnp.bfloat16
    want_k, want_v = naive_write(
        np.asarray(kc, np.float32), np.asarray(vc, np.float32), 3,
        np.asarray(jnp.asarray(k, jnp.bfloat16), np.float32),
        np.asarray(jnp.asarray(v, jnp.bfloat16), np.float32), live,
    )
    # Everything but the null page of layer 3 is exactly as expected (padding writes land there,
    # the out-of-range slot is dropped).
    gk, gv = np.asarray(got_k, np.float32), np.asarray(got_v, np.float32)
    np.testing.assert_array_equal(gk[:3], want_k[:3])
    np.testing.assert_array_equal(gk[3, 1:], want_k[3, 1:])
    np.testing.assert_array_equal(gv[3, 1:], want_v[3, 1:])
    np.testing.assert_array_equal(gk[3, 0, 3:], want_k[3, 0, 3:])  # null slots 3.. untouched


def _scan_step(kc, vc, ks, vs, slots):
    def body(carry, xs):
        kc, vc = carry
        layer, k, v = xs
        kc, vc = write_kv(kc, vc, layer, k, v, slots)
        # Read the layer back (as attention would), so the carry is both read and written.
        return (kc, vc), kc[layer, slots // PS, slots % PS].sum()

    (kc, vc), sums = lax.scan(body, (kc, vc), (jnp.arange(L, dtype=jnp.int32), ks, vs))
    return kc, vc, sums


def test_scan_carry_donated_updates_in_place():
    rng = np.random.default_rng(2)
    kc, vc = random_cache(rng)
    T = 5
    slots = jnp.asarray(rng.permutation(np.arange(PS, N * PS))[:T].astype(np.int32))
    ks = rng.standard_normal((L, T, HKV, D), np.float32)
    vs = rng.standard_normal((L, T, HKV, D), np.float32)
    step = jax.jit(_scan_step, donate_argnums=(0, 1))

    compiled = step.lower(jnp.asarray(kc), jnp.asarray(vc), ks, vs, slots).compile()
    hlo = compiled.as_text()
    cache_shape = f"f32[{L},{N},{PS},{HKV},{D}]"
    copies = cache_copies(hlo, cache_shape)
    assert not copies, "the cache is copied:\n" + "\n".join(copies)
    scatters = [
        ln for ln in hlo.splitlines() if "scatter(" in ln and cache_shape in ln.split("=")[1][:80]
    ]
    assert scatters, "expected a scatter on the full stacked cache"
    mem = compiled.memory_analysis()
    if mem is not None:  # both caches are aliased input->output, and no cache-sized temporary
        assert mem.alias_size_in_bytes >= 2 * kc.nbytes
        assert mem.temp_size_in_bytes < kc.nbytes

    kc_in, vc_in = jnp.asarray(kc), jnp.asarray(vc)
    ptr = kc_in.unsafe_buffer_pointer()
    got_k, got_v, _ = step(kc_in, vc_in, ks, vs, slots)
    assert kc_in.is_deleted()  # donated
    if jax.default_backend() == "cpu":
        assert got_k.unsafe_buffer_pointer() == ptr, "the cache was not updated in place"
    want_k, want_v = kc, vc
    for layer in range(L):
        want_k, want_v = naive_write(want_k, want_v, layer, ks[layer], vs[layer], np.asarray(slots))
    np.testing.assert_array_equal(np.asarray(got_k), want_k)
    np.testing.assert_array_equal(np.asarray(got_v), want_v)


def test_scan_with_attention_keeps_cache_in_place():
    """The model's layer scan: write_kv then attention (which reads the cache in while loops)."""
    rng = np.random.default_rng(4)
    kc, vc = random_cache(rng)
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

    def step(kc, vc, qs, ks, vs, md):
        def body(carry, xs):
            kc, vc = carry
            layer, q, k, v = xs
            kc, vc = write_kv(kc, vc, layer, k, v, md.slot_mapping)
            return (kc, vc), ragged_paged_attention(q, kc, vc, layer, md, sm_scale=0.25)

        xs = (jnp.arange(L, dtype=jnp.int32), qs, ks, vs)
        (kc, vc), out = lax.scan(body, (kc, vc), xs)
        return kc, vc, out

    step = jax.jit(step, donate_argnums=(0, 1))
    hlo = step.lower(jnp.asarray(kc), jnp.asarray(vc), qs, ks, vs, md).compile().as_text()
    cache_shape = f"f32[{L},{N},{PS},{HKV},{D}]"
    copies = cache_copies(hlo, cache_shape)
    assert not copies, "the cache is copied:\n" + "\n".join(copies)
    kc_in, vc_in = jnp.asarray(kc), jnp.asarray(vc)
    ptrs = kc_in.unsafe_buffer_pointer(), vc_in.unsafe_buffer_pointer()
    got_k, got_v, out = step(kc_in, vc_in, qs, ks, vs, md)
    if jax.default_backend() == "cpu":
        assert (got_k.unsafe_buffer_pointer(), got_v.unsafe_buffer_pointer()) == ptrs
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
                write_kv(kc, vc, 0, k, k, slots, impl=impl)
    with pytest.raises(ValueError, match="unknown impl"):
        write_kv(kc, vc, 0, k, k, slots, impl="nope")
    with pytest.raises(ValueError, match="out of range"):
        write_kv(kc, vc, L, k, k, slots)
    with pytest.raises(ValueError, match=r"\[T=2"):
        write_kv(kc, vc, 0, k[:, :1], k, slots)
