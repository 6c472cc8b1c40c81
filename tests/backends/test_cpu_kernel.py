"""The native CPU ragged paged attention kernel (XLA FFI) vs the naive float64 attention, on
each kernel build target (`kernel_checks.CPU_TARGETS`: the host's instruction sets, AVX2
without AVX-512, the portable loops), and how the native kernel library is built, cached,
selected and replaced by XLA when it cannot be."""

from __future__ import annotations

import functools
import math
import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.pallas_kernels import ragged_paged_attention
from jaxserve.backends.cpu import kernels as native
from jaxserve.backends.cpu.kernels import attention as cpu
from jaxserve.pallas_kernels.ragged_paged_attention import ops as attn_ops
from tests.pallas_kernels.attention_cases import assert_close_to_naive, make_case, random_sinks
from tests.pallas_kernels.kernel_checks import (
    CPU_TARGETS,
    check_random_batches,
    need_cpu_target,
    query_length_sweep_cases,
    tiny_llama_run,
)

STATIC = ("sm_scale", "sliding_window", "soft_cap", "impl", "chunk_pages", "interpret")
attn_jit = jax.jit(ragged_paged_attention, static_argnames=STATIC)
cpu_attn = functools.partial(attn_jit, impl="cpu")


@functools.cache
def _target_attn(target: str):
    """The attention op on `target`'s kernel build: the op's own dispatch (`impl="cpu"`) for
    the process's build, the kernel's entry point with `target=` for the others."""
    if target == native.selected_target():
        return cpu_attn
    return jax.jit(functools.partial(cpu.ragged_paged_attention_cpu, target=target),
                   static_argnames=("sm_scale", "sliding_window", "soft_cap"))


@pytest.fixture(params=CPU_TARGETS)
def target_attn(request):
    need_cpu_target(request.param)
    return _target_attn(request.param)

CONFIGS = {  # GQA ratios 1, 3 (SmolLM2's 9 / 3 heads), 8; head dims 64, 128, 80; page sizes
    "gqa1-d64-p8-f32": dict(hq=2, hkv=2, d=64, page_size=8, dtype=np.float32),
    "gqa3-d64-p16-f32": dict(hq=9, hkv=3, d=64, page_size=16, dtype=np.float32),
    "gqa8-d128-p8-f32": dict(hq=8, hkv=1, d=128, page_size=8, dtype=np.float32),
    "gqa2-d80-p4-f32": dict(hq=4, hkv=2, d=80, page_size=4, dtype=np.float32),
    "gqa3-d128-p16-bf16": dict(hq=6, hkv=2, d=128, page_size=16, dtype=jnp.bfloat16),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_random_ragged_batches(name, target_attn):
    # 6 seeded batches per config: decode-only, prefill-only and mixed in turn, with padding.
    errs = check_random_batches(target_attn, CONFIGS[name], n=6, seed0=31 * len(name))
    assert len(errs) == 6


@pytest.mark.parametrize("window,cap", [(7, None), (None, 3.0), (20, 2.0), (1, None)])
def test_sliding_window_and_soft_cap(window, cap, target_attn):
    check_random_batches(target_attn, CONFIGS["gqa3-d64-p16-f32"], n=3,
                         seed0=11 + (window or 0), sliding_window=window, soft_cap=cap)


@pytest.mark.parametrize("window", [None, 7])
def test_sinks(window, target_attn):
    # Attention sinks (gpt-oss), with a sliding window and without: GQA 3, each row's softmax
    # starting from its query head's sink.
    cfg = CONFIGS["gqa3-d64-p16-f32"]
    check_random_batches(target_attn, cfg, n=3, seed0=51 + (window or 0),
                         sinks=random_sinks(cfg["hq"], seed=8), sliding_window=window)


def test_fused_entry_points_take_sinks():
    """The fused write + attend and rotary + write + attend entry points with attention sinks
    (their optional last argument) equal the composed ops on the reference."""
    from jaxserve.models.layers.rotary import apply_rotary, rotary_tables
    from jaxserve.pallas_kernels import write_kv_and_attend

    hq, hkv, d = 6, 2, 64
    case = make_case([(31, 33), (15, 1), (0, 17)], page_size=8, hq=hq, hkv=hkv, d=d, r_pad=4,
                     t_pad=56, seed=10)
    rng = np.random.default_rng(2)
    T = case["q"].shape[0]
    qkv = jnp.asarray(rng.standard_normal((T, (hq + 2 * hkv) * d)), jnp.float32)
    rope = rotary_tables(jnp.asarray(rng.integers(0, 2000, size=T), jnp.int32),
                         jnp.asarray(10000.0 ** -(np.arange(0, d, 2) / d), jnp.float32))
    kc, vc, md = jnp.asarray(case["kc"]), jnp.asarray(case["vc"]), case["md"]
    sinks = jnp.asarray(random_sinks(hq, seed=9))
    x = qkv.reshape(T, hq + 2 * hkv, d)
    q, k, v = apply_rotary(x[:, :hq], *rope), apply_rotary(x[:, hq:hq + hkv], *rope), x[:, hq + hkv:]

    def composed(impl):
        return jax.jit(lambda *a: write_kv_and_attend(*a, sm_scale=0.125, sliding_window=9,
                                                      impl=impl, sinks=sinks))(q, k, v, kc, vc, md)

    want = composed("reference")
    got = composed("cpu")  # the fused write + attend entry point
    cos, sin = (t.reshape(T, d // 2) for t in rope)
    got_rope = jax.jit(lambda *a: cpu.rope_write_kv_and_attend_cpu(
        *a, num_heads=hq, sm_scale=0.125, sliding_window=9, sinks=sinks))(qkv, cos, sin, kc, vc, md)
    for out in (got[0], got_rope[0]):
        np.testing.assert_allclose(np.asarray(out), np.asarray(want[0]), atol=1e-5, rtol=0)
    no_sinks = jax.jit(lambda *a: write_kv_and_attend(*a, sm_scale=0.125, sliding_window=9,
                                                      impl="cpu"))(q, k, v, kc, vc, md)
    assert np.abs(np.asarray(no_sinks[0]) - np.asarray(want[0])).max() > 0.1  # they matter


def test_query_lengths_1_to_64_and_long_context(target_attn):
    cfg = CONFIGS["gqa1-d64-p8-f32"]
    for case in query_length_sweep_cases(cfg, seed=5):
        out = target_attn(jnp.asarray(case["q"]), jnp.asarray(case["kc"]),
                          jnp.asarray(case["vc"]), case["md"], sm_scale=0.125)
        assert_close_to_naive(out, case, atol=1e-5, sm_scale=0.125)
    # Contexts spanning many key chunks, with chunked prefill on top of a long cache.
    case = make_case([(700, 1), (513, 40), (0, 3), (64, 1)], page_size=16, hq=4, hkv=2, d=64,
                     r_pad=5, t_pad=48, seed=9)
    out = target_attn(jnp.asarray(case["q"]), jnp.asarray(case["kc"]), jnp.asarray(case["vc"]),
                      case["md"], sm_scale=0.125)
    assert_close_to_naive(out, case, atol=1e-5, sm_scale=0.125)


def test_mixed_dtypes_and_padding(target_attn):
    """bfloat16 queries over a float32 cache (the CPU bfloat16 serving layout), and a batch
    with no live request at all (every output exactly zero)."""
    case = make_case([(31, 33), (15, 1), (16, 1), (0, 17)], page_size=8, hq=8, hkv=2, d=64,
                     r_pad=6, t_pad=64, seed=3)
    q = jnp.asarray(case["q"], jnp.bfloat16)
    out = target_attn(q, jnp.asarray(case["kc"]), jnp.asarray(case["vc"]), case["md"],
                      sm_scale=0.2)
    assert out.dtype == jnp.bfloat16
    case_bf16q = dict(case, q=np.asarray(q.astype(jnp.float32)))
    assert_close_to_naive(out.astype(jnp.float32), case_bf16q, atol=2e-2, sm_scale=0.2)
    md = case["md"]
    empty = type(md)(block_tables=md.block_tables, kv_lens=jnp.zeros_like(md.kv_lens),
                     query_start_loc=jnp.zeros_like(md.query_start_loc),
                     num_seqs=jnp.asarray(0, jnp.int32), slot_mapping=md.slot_mapping)
    out = target_attn(jnp.asarray(case["q"]), jnp.asarray(case["kc"]), jnp.asarray(case["vc"]),
                      empty, sm_scale=0.2)
    assert np.all(np.asarray(out) == 0)


def test_auto_picks_the_kernel_on_cpu():
    assert jax.default_backend() == "cpu"
    assert attn_ops.resolve_impl("auto") == "cpu"
    case = make_case([(5, 3)], page_size=16, hq=4, hkv=2, d=64, r_pad=2, t_pad=4)
    lowered = attn_jit.trace(jnp.asarray(case["q"]), jnp.asarray(case["kc"]),
                             jnp.asarray(case["vc"]), case["md"], sm_scale=0.1).lower()
    assert cpu.TARGET in lowered.as_text()
    with pytest.raises(ValueError, match="float32, bfloat16, float8_e4m3fn or int8 caches, not "
                                         "float16"):
        ragged_paged_attention(jnp.asarray(case["q"], jnp.float16),
                               jnp.asarray(case["kc"], jnp.float16),
                               jnp.asarray(case["vc"], jnp.float16), case["md"], sm_scale=0.1,
                               impl="cpu")


def test_library_is_cached(tmp_path, monkeypatch):
    """The library goes to $XDG_CACHE_HOME with its checksum and is built once. (The compiler
    is a stand-in writing the output file: the real build serves every other kernel test.)"""
    builds = []

    def compile_(cmd, **kw):
        builds.append(cmd)
        pathlib.Path(cmd[cmd.index("-o") + 1]).write_bytes(b"\x7fELF" + " ".join(cmd).encode())
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(native.subprocess, "run", compile_)
    first = native.library_path()
    assert len(builds) == 1
    assert first.parent == tmp_path / "jaxserve" / "kernels" and first.exists()
    mtime = first.stat().st_mtime_ns
    assert native.library_path() == first and first.stat().st_mtime_ns == mtime  # not rebuilt
    assert len(builds) == 1
    # the library and its checksum, no temporary files left
    assert sorted(p.name for p in first.parent.iterdir()) == [first.name, first.name + ".xxh3"]


def test_no_compiler_falls_back_to_the_reference(tmp_path):
    """Without a C++ compiler (and no cached library) `auto` serves attention through the
    reference, with a warning, and products through XLA; naming the kernel is a clear error."""
    code = """
import jax, jax.numpy as jnp, numpy as np
from jaxserve.pallas_kernels import ragged_paged_attention
from jaxserve.backends.cpu import kernels as cpu
from tests.pallas_kernels.attention_cases import make_case, assert_close_to_naive
case = make_case([(5, 3), (9, 1)], page_size=16, hq=4, hkv=2, d=64, r_pad=2, t_pad=4)
args = [jnp.asarray(case[k]) for k in ("q", "kc", "vc")] + [case["md"]]
out = ragged_paged_attention(*args, sm_scale=0.1)
assert_close_to_naive(out, case, atol=1e-5, sm_scale=0.1)
try:
    ragged_paged_attention(*args, sm_scale=0.1, impl="cpu")
except cpu.KernelUnavailable as e:
    print("ERROR", e)
from jaxserve.backends.cpu import CpuBackend
from jaxserve.backends.cpu.kernels.matmul import amx_available
one = jax.sharding.Mesh(jax.devices()[:1], ("model",))
print("AMX", amx_available(), CpuBackend().resolve_matmul_impl("auto", "bfloat16", one))
"""
    env = dict(os.environ, CXX="no-such-compiler-here", XDG_CACHE_HOME=str(tmp_path))
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    res = subprocess.run([sys.executable, "-c", code], env=env, cwd=root, capture_output=True,
                         text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "ERROR no C++ compiler" in res.stdout
    assert "AMX False xla" in res.stdout  # and products stay on XLA
    assert "using the pure-JAX reference" in res.stderr


def test_build_target_is_chosen_per_process():
    """`select_target` before first use makes every default call use that build (the haswell
    one here: the AVX2 strips product, `auto` picking it for float32 and bfloat16); choosing another afterwards is an
    error, and another build's kernels stay callable under their own FFI names."""
    need_cpu_target("haswell")
    code = """
import jax.numpy as jnp, numpy as np
from jaxserve.backends.cpu import kernels as cpu
from jaxserve.backends.cpu.kernels import matmul
cpu.select_target("haswell")
assert cpu.selected_target() == "haswell"
assert cpu.ensure_loaded() is cpu.ensure_loaded("haswell")
assert cpu.ffi_target(matmul.TARGET) == "jaxserve_packed_matmul_haswell"
assert not matmul.avx512_available() and matmul.avx2_available()
import jax
from jaxserve.backends.cpu import CpuBackend
one = jax.sharding.Mesh(jax.devices()[:1], ("model",))
assert CpuBackend().resolve_matmul_impl("auto", "float32", one) == "avx2"
assert CpuBackend().resolve_matmul_impl("auto", "bfloat16", one) == "avx2"
w = np.arange(64 * 32, dtype=np.float32).reshape(64, 32) / 1000
x = np.ones((3, 64), np.float32)
got = matmul.packed_matmul(jnp.asarray(x), jnp.asarray(matmul.pack_weight(w, tiles=False)))
np.testing.assert_allclose(np.asarray(got), x @ w, rtol=1e-6)
cpu.select_target("haswell")  # the same again is fine
try:
    cpu.select_target("native")
except ValueError as e:
    print("ERROR", e)
try:
    cpu.select_target("pentium")
except ValueError as e:
    print("ERROR", e)
print("NATIVE", cpu.ffi_target(matmul.TARGET, "native"), cpu.library_path("haswell").name)
"""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    res = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "ERROR the CPU kernels of this process already use build target 'haswell'" in res.stdout
    assert "ERROR unknown CPU kernel build target 'pentium'" in res.stdout
    assert "NATIVE jaxserve_packed_matmul kernels-haswell-" in res.stdout


def test_tiny_llama_end_to_end():
    ref_logits, ref_greedy = tiny_llama_run("reference")
    logits, greedy = tiny_llama_run("cpu")
    assert greedy == ref_greedy
    for a, b in zip(logits, ref_logits):
        assert np.abs(b).max() > 0.1
        np.testing.assert_allclose(a, b, atol=1e-4, rtol=0)
    assert math.isfinite(float(np.abs(logits[-1]).max()))


@pytest.mark.parametrize("target", CPU_TARGETS)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_fused_write_and_attend_matches_the_two_ops(dtype, target):
    """`write_kv_and_attend` on the kernel (one call, caches updated in place) equals write_kv
    + the reference: the same caches bit for bit, the same attention. Compiled with the caches
    donated, there is no copy of a cache."""
    need_cpu_target(target)
    from jaxserve.pallas_kernels import write_kv, write_kv_and_attend
    from jaxserve.pallas_kernels.ragged_paged_attention.reference import (
        ragged_paged_attention_reference,
    )
    from tests.pallas_kernels.test_kv_write import cache_copies

    case = make_case([(31, 33), (15, 1), (0, 17)], page_size=8, hq=6, hkv=2, d=64, r_pad=4,
                     t_pad=56, seed=8)
    rng = np.random.default_rng(0)
    T = case["q"].shape[0]
    q = jnp.asarray(case["q"], dtype)
    k, v = (jnp.asarray(rng.standard_normal((T, 2, 64)), dtype) for _ in range(2))
    kc, vc = jnp.asarray(case["kc"], dtype), jnp.asarray(case["vc"], dtype)
    md = case["md"]

    def fused(q, k, v, kc, vc, md):
        if target != native.selected_target():
            return cpu.write_kv_and_attend_cpu(q, k, v, kc, vc, md, sm_scale=0.125,
                                               target=target)
        return write_kv_and_attend(q, k, v, kc, vc, md, sm_scale=0.125, impl="cpu")

    def two_ops(q, k, v, kc, vc, md):
        kc, vc = write_kv(kc, vc, k, v, md.slot_mapping)
        return ragged_paged_attention_reference(q, kc, vc, md, sm_scale=0.125), kc, vc

    want = jax.jit(two_ops)(q, k, v, kc, vc, md)
    fused_jit = jax.jit(fused, donate_argnums=(3, 4))
    hlo = fused_jit.lower(q, k, v, kc, vc, md).compile().as_text()
    assert native.ffi_target(cpu.FUSED_TARGET, target) in hlo
    name = 'bf16' if dtype == jnp.bfloat16 else 'f32'
    for shape in (f"{name}[{kc.shape[0]},8,128]", f"{name}[{kc.shape[0]},8,2,64]"):  # and per head
        assert cache_copies(hlo, shape) == []
    got = fused_jit(q, k, v, kc, vc, md)
    np.testing.assert_array_equal(np.asarray(got[1], np.float32)[1:],
                                  np.asarray(want[1], np.float32)[1:])  # page 0: padding writes
    np.testing.assert_array_equal(np.asarray(got[2], np.float32)[1:],
                                  np.asarray(want[2], np.float32)[1:])
    atol = 1e-5 if dtype == jnp.float32 else 2e-2
    np.testing.assert_allclose(np.asarray(got[0], np.float32), np.asarray(want[0], np.float32),
                               atol=atol, rtol=0)


@pytest.mark.parametrize("target", CPU_TARGETS)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_rope_write_and_attend_matches_the_composed_ops(dtype, target):
    """The kernel's whole attention block (rotary on q and k of a fused q/k/v product, casts,
    cache write, attention; one call) equals `apply_rotary` + casts + `write_kv_and_attend`:
    the caches bit for bit, the output to float32 rounding."""
    need_cpu_target(target)
    from jaxserve.backends.cpu.layer import attention_qkv
    from jaxserve.models.layers.attention import AttentionSpec
    from jaxserve.models.layers.rotary import rotary_tables

    hq, hkv, d = 6, 2, 64
    case = make_case([(31, 33), (15, 1), (0, 17)], page_size=8, hq=hq, hkv=hkv, d=d, r_pad=4,
                     t_pad=56, seed=9)
    rng = np.random.default_rng(1)
    T = case["q"].shape[0]
    qkv = jnp.asarray(rng.standard_normal((T, (hq + 2 * hkv) * d)), jnp.float32)
    positions = jnp.asarray(rng.integers(0, 2000, size=T), jnp.int32)
    inv_freq = jnp.asarray(10000.0 ** -(np.arange(0, d, 2) / d), jnp.float32)
    rope = rotary_tables(positions, inv_freq)
    kc, vc = jnp.asarray(case["kc"], dtype), jnp.asarray(case["vc"], dtype)
    md = case["md"]

    def kernel_of(target):  # the entry point attention_qkv calls, on another build
        def attend(qkv, rope, kc, vc, md):
            cos, sin = (t.reshape(T, d // 2) for t in rope)
            return cpu.rope_write_kv_and_attend_cpu(qkv, cos, sin, kc, vc, md, num_heads=hq,
                                                    sm_scale=0.125, target=target)
        return attend

    def run(impl):
        spec = AttentionSpec(sm_scale=0.125, impl=impl)
        if impl == "cpu" and target != native.selected_target():
            f = jax.jit(kernel_of(target))
        else:
            f = jax.jit(lambda qkv, rope, kc, vc, md: attention_qkv(qkv, rope, kc, vc, md, spec, hq, d))
        # At the optimisation level XLA serves with (the tests' default is the lowest, where
        # LLVM leaves multiply-adds unfused: tests/conftest.py)
        compiled = f.lower(qkv, rope, kc, vc, md).compile(
            compiler_options={"xla_backend_optimization_level": 3})
        return f, compiled(qkv, rope, kc, vc, md)

    fused, got = run("cpu")
    _, want = run("reference")  # no fused entry point: apply_rotary + write_kv + reference
    hlo = fused.lower(qkv, rope, kc, vc, md).compile().as_text()
    rope_name = native.ffi_target(cpu.ROPE_TARGET, target)
    assert rope_name in hlo and native.ffi_target(cpu.FUSED_TARGET, target) not in hlo
    # Bit for bit where the kernel's rotation fuses its multiply-adds as XLA's does; the
    # baseline build has no FMA, so its rotated keys may differ in the last bit.
    fma = target != "x86-64"
    for i in (1, 2):  # page 0 takes the padding tokens' writes
        a, b = np.asarray(got[i], np.float32)[1:], np.asarray(want[i], np.float32)[1:]
        if fma:
            np.testing.assert_array_equal(a, b)
        else:
            np.testing.assert_allclose(a, b, rtol=2.0**-7 if dtype == jnp.bfloat16 else 1e-6,
                                       atol=1e-6)
    atol = 1e-5 if dtype == jnp.float32 else 2e-2
    np.testing.assert_allclose(np.asarray(got[0], np.float32), np.asarray(want[0], np.float32),
                               atol=atol, rtol=0)
    assert np.abs(np.asarray(want[0], np.float32)).max() > 0.1
