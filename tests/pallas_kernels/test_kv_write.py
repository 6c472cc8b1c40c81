"""write_kv: one in-place scatter into one layer's paged KV cache."""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.pallas_kernels import AttentionMetadata, ragged_paged_attention, write_kv
from jaxserve.pallas_kernels.kv_cache_update import ops as kv_ops

L, N, PS, HKV, D = 4, 9, 8, 2, 16
CACHE_SHAPE = f"f32[{N},{PS},{HKV * D}]"  # one layer's cache in HLO text


def cache_copies(hlo: str, cache_shape: str) -> list[str]:
    """Lines of an HLO text that copy a whole cache-shaped array."""
    pat = re.compile(rf"= {re.escape(cache_shape)}\S* copy\(")
    return [ln for ln in hlo.splitlines() if pat.search(ln)]


def random_cache(rng, dtype=np.float32):
    """One layer's (k_cache, v_cache), each [N, PS, HKV * D]."""
    shape = (N, PS, HKV * D)
    return (rng.standard_normal(shape).astype(dtype), rng.standard_normal(shape).astype(dtype))


def random_caches(rng):
    """L layers' caches: a tuple of L k arrays and a tuple of L v arrays."""
    kcs, vcs = zip(*(random_cache(rng) for _ in range(L)))
    return kcs, vcs


def naive_write(kc, vc, k, v, slots):
    kc, vc = kc.copy(), vc.copy()
    for t, s in enumerate(slots):
        if 0 <= s < N * PS:
            kc[s // PS, s % PS] = k[t].reshape(-1)  # a token's row: its heads in turn
            vc[s // PS, s % PS] = v[t].reshape(-1)
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
    with pytest.raises(ValueError, match=r"\[N, page_size, Hkv \* D\]"):  # a layer-stacked cache
        write_kv(kc[None], vc[None], k, k, slots)
    with pytest.raises(ValueError, match=r"\[T=2"):
        write_kv(kc, vc, k[:, :1], k, slots)


# ------------------------------------------------- the TPU kernel for one-byte caches (tpu.py)
ONE_BYTE = [jnp.int8, jnp.float8_e4m3fn]
QN, QPS, QHKV, QD = 4, 32, 2, 128  # rows of 2 x 128 bytes, pages of 32: the kernel's layout
# A run inside a page (37..41: part of a quad, a whole quad, part of one), a run across pages
# (62..67), a lone token, tokens of one quad from different runs (113, 112: serial), slots out
# of range (dropped), padding tokens wrapping around the null page (slots shared).
Q_SLOTS = [37, 38, 39, 40, 41, 62, 63, 64, 65, 66, 67, 100, 113, 127, 112, QN * QPS + 3, -1,
           30, 31, 0, 1, 30, 31, 0]


@pytest.mark.parametrize("dtype", ONE_BYTE, ids=lambda d: jnp.dtype(d).name)
def test_tpu_kernel_writes_one_byte_caches_like_the_reference(dtype, kernel_device):
    """The Pallas TPU write (interpret mode here) against the reference scatter, bit for bit:
    every slot written once holds its token's row, every slot not written is untouched, and a
    slot several padding tokens share holds one of theirs. Blocks of 8 tasks: two live blocks
    and a last one with none, where the serial tasks run."""
    from jaxserve.pallas_kernels.kv_cache_update import tpu

    for impl in ("tpu", "tpu-interpret"):  # what write_kv dispatches to for these caches
        fn = kv_ops._REGISTRY.impls[impl]
        assert getattr(fn, "func", fn) is kv_ops._write_kv_tpu
    rng = np.random.default_rng(5)
    shape = (QN, QPS, QHKV * QD)
    as_bits = lambda x: np.asarray(jax.lax.bitcast_convert_type(x, jnp.int8))  # noqa: E731
    kc, vc = (jnp.asarray(rng.integers(-100, 100, shape), dtype) for _ in range(2))
    slots = np.asarray(Q_SLOTS, np.int32)
    k, v = (jnp.asarray(rng.integers(-100, 100, (len(slots), QHKV, QD)), dtype) for _ in range(2))
    write = functools.partial(tpu.write_kv_tpu, quads_per_block=8, interpret=not kernel_device)
    got = jax.jit(write)(kc, vc, k, v, jnp.asarray(slots))
    want = write_kv(kc, vc, k, v, jnp.asarray(slots), impl="reference")
    for g, w, old, new in zip(got, want, (kc, vc), (k, v)):
        assert g.dtype == dtype
        g, w, old, new = as_bits(g), as_bits(w), as_bits(old), as_bits(new)
        for s in range(QN * QPS):
            writers = np.flatnonzero(slots == s)
            row, old_row = g[s // QPS, s % QPS], old[s // QPS, s % QPS]
            if len(writers) == 0:
                np.testing.assert_array_equal(row, old_row, err_msg=f"slot {s} not written")
            elif len(writers) == 1:
                np.testing.assert_array_equal(row, w[s // QPS, s % QPS], err_msg=f"slot {s}")
            else:
                assert any(np.array_equal(row, new[t].reshape(-1)) for t in writers), \
                    f"shared slot {s}"


def test_tpu_kernel_writes_in_place_when_compiled_for_v6e():
    """Compiled for a v6e chip (libtpu, no TPU): the write of 8 tokens into fp8 caches of 4,097
    pages of 32 x 2 x 128 moves under 1 % of the caches' bytes (XLA's cost analysis; its 8-bit
    scatter moves 6 times the caches'), and the caches are aliased with no cache-sized copy."""
    import importlib.util

    if importlib.util.find_spec("libtpu") is None:
        pytest.skip("libtpu is not installed (pip install 'jaxserve[tpu]'): no TPU compiles")
    from jax.sharding import SingleDeviceSharding

    from jaxserve.tools.plan_worker import target_devices

    devices, _, _ = target_devices({"kind": "tpu", "topology": "v6e:2x2"})
    n, t, dtype = 4097, 8, jnp.float8_e4m3fn
    sd = lambda shape, dt=dtype: jax.ShapeDtypeStruct(  # noqa: E731
        shape, dt, sharding=SingleDeviceSharding(devices[0]))
    cache = sd((n, QPS, QHKV * QD))
    compiled = jax.jit(lambda *a: write_kv(*a, impl="tpu"), donate_argnums=(0, 1)).lower(
        cache, cache, sd((t, QHKV, QD)), sd((t, QHKV, QD)), sd((t,), jnp.int32)).compile()
    hlo = compiled.as_text()
    caches_bytes = 2 * n * QPS * QHKV * QD
    assert compiled.cost_analysis()["bytes accessed"] < 0.01 * caches_bytes
    copies = [ln for ln in hlo.splitlines() if re.search(rf"= \S+\[{n},[^=]* copy\(", ln)]
    assert not copies, "a cache is copied:\n" + "\n".join(copies)
    assert compiled.memory_analysis().alias_size_in_bytes >= caches_bytes
    assert "tpu_custom_call" in hlo
