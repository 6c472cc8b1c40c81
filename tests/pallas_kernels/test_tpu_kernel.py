"""The Pallas Mosaic TPU ragged paged attention kernel vs the naive float64 attention.

On the CPU the kernel runs in TPU interpret mode (`pltpu.force_tpu_interpret_mode()`, which
simulates HBM, VMEM, the page DMAs and their semaphores); under `pytest --kernel-device` on a
TPU it runs compiled. The Mosaic lowering is checked on the CPU too, for a TPU v5e target.
"""

from __future__ import annotations

import contextlib
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from jaxserve.pallas_kernels import ragged_paged_attention
from jaxserve.pallas_kernels.ragged_paged_attention import ops as attn_ops
from jaxserve.pallas_kernels.ragged_paged_attention.tpu import ragged_paged_attention_tpu
from tests.pallas_kernels.attention_cases import assert_close_to_naive, make_case, random_sinks
from tests.pallas_kernels.kernel_checks import (
    check_random_batches,
    query_length_sweep_cases,
    tiny_llama_run,
)

STATIC = ("sm_scale", "sliding_window", "soft_cap", "impl", "chunk_pages", "interpret")
attn_jit = jax.jit(ragged_paged_attention, static_argnames=STATIC)
KNOBS = ("sm_scale", "sliding_window", "soft_cap", "chunk_pages", "queries_per_block",
         "interpret")
kernel_jit = jax.jit(ragged_paged_attention_tpu, static_argnames=KNOBS)

CONFIGS = {  # GQA ratios 1, 3, 8; head dims 64 and 128; Hkv * D a multiple of 128
    "gqa1-d64-p8-f32": dict(hq=2, hkv=2, d=64, page_size=8, dtype=np.float32),
    "gqa3-d64-p16-f32": dict(hq=6, hkv=2, d=64, page_size=16, dtype=np.float32),
    "gqa8-d128-p8-f32": dict(hq=8, hkv=1, d=128, page_size=8, dtype=np.float32),
    "gqa3-d128-p16-bf16": dict(hq=3, hkv=1, d=128, page_size=16, dtype=jnp.bfloat16),
}


@pytest.fixture(scope="module")
def on_device(kernel_device):
    if kernel_device and jax.default_backend() != "tpu":
        pytest.skip("--kernel-device: no TPU backend")
    return kernel_device


@pytest.fixture
def tpu_mode(on_device):
    """TPU interpret mode on the CPU, the real chip under --kernel-device."""
    ctx = contextlib.nullcontext() if on_device else pltpu.force_tpu_interpret_mode()
    with ctx:
        yield


@pytest.mark.parametrize("name", list(CONFIGS))
def test_random_ragged_batches(name, tpu_mode):
    # 5 seeded batches per config (decode-only, prefill-only, mixed in turn): 20 in all, 15 f32.
    attn = functools.partial(attn_jit, impl="tpu")
    errs = check_random_batches(attn, CONFIGS[name], n=5, seed0=100 * len(name) + 1)
    assert len(errs) == 5


def test_sliding_window_soft_cap_small_blocks(tpu_mode):
    cfg = CONFIGS["gqa3-d64-p16-f32"]
    attn = functools.partial(kernel_jit, chunk_pages=1, queries_per_block=4)
    check_random_batches(attn, cfg, n=2, seed0=17, sliding_window=9, soft_cap=2.0)


@pytest.mark.parametrize("window", [None, 9])
def test_sinks(window, tpu_mode):
    # Attention sinks (gpt-oss), with a sliding window and without, GQA 3 (each row's sink is
    # its query head's); small blocks: several query blocks per request and KV blocks per row.
    cfg = CONFIGS["gqa3-d64-p16-f32"]
    attn = functools.partial(kernel_jit, chunk_pages=1, queries_per_block=4)
    check_random_batches(attn, cfg, n=2, seed0=23, sinks=random_sinks(cfg["hq"], seed=5),
                         sliding_window=window)


def test_query_lengths_1_to_64(tpu_mode):
    cfg = CONFIGS["gqa1-d64-p8-f32"]
    for case in query_length_sweep_cases(cfg, seed=6):
        out = attn_jit(jnp.asarray(case["q"]), jnp.asarray(case["kc"]), jnp.asarray(case["vc"]),
                       case["md"], sm_scale=0.125, impl="tpu")
        assert_close_to_naive(out, case, atol=1e-5, sm_scale=0.125)


def test_all_padding_batch(tpu_mode):
    case = make_case([(31, 33), (15, 1)], page_size=8, hq=4, hkv=2, d=64, r_pad=4, t_pad=40,
                     seed=3)
    md = case["md"]
    empty = type(md)(block_tables=md.block_tables, kv_lens=jnp.zeros_like(md.kv_lens),
                     query_start_loc=jnp.zeros_like(md.query_start_loc),
                     num_seqs=jnp.asarray(0, jnp.int32), slot_mapping=md.slot_mapping)
    out = kernel_jit(jnp.asarray(case["q"]), jnp.asarray(case["kc"]), jnp.asarray(case["vc"]),
                     empty, sm_scale=0.2)
    assert np.all(np.asarray(out) == 0)


@pytest.fixture
def v5e_target():
    """Let the Mosaic lowering run on a CPU host by describing a TPU v5e (private API)."""
    tpu_info = pytest.importorskip("jax._src.pallas.mosaic.tpu_info")
    kind = jax.devices()[0].device_kind
    if kind in tpu_info.registry or tpu_info.chip_version_from_device_kind(kind) is not None:
        yield
        return
    tpu_info.registry[kind] = lambda: tpu_info.get_tpu_info_for_chip(
        tpu_info.ChipVersion.TPU_V5E, 1)
    try:
        yield
    finally:
        tpu_info.registry.pop(kind, None)


@pytest.mark.parametrize("dtype,d,hkv,sinks", [(jnp.float32, 64, 2, False),
                                               (jnp.bfloat16, 128, 2, False),
                                               (jnp.bfloat16, 128, 2, True)])
def test_lowers_to_mosaic(dtype, d, hkv, sinks, v5e_target):
    """Pallas -> Mosaic MLIR (scalar prefetch, DMAs, semaphores) for a TPU target, on any host,
    with attention sinks too. Mosaic's own layout passes run only when a TPU compiles the
    kernel."""
    case = make_case([(20, 1), (0, 12)], page_size=16, hq=4 * hkv, hkv=hkv, d=d, r_pad=4,
                     t_pad=16)
    args = [jnp.asarray(case[k], dtype) for k in ("q", "kc", "vc")] + [case["md"]]
    extra = dict(sinks=jnp.zeros(4 * hkv, jnp.float32)) if sinks else {}
    lowered = kernel_jit.trace(*args, sm_scale=0.1, sliding_window=8, soft_cap=5.0,
                               **extra).lower(lowering_platforms=("tpu",))
    assert "tpu_custom_call" in lowered.as_text()


def test_validation_errors():
    case = make_case([(3, 2)], page_size=16, hq=4, hkv=1, d=64, r_pad=2, t_pad=4)
    q, kc, vc = (jnp.asarray(case[k]) for k in ("q", "kc", "vc"))
    with pytest.raises(ValueError, match="multiple of 128"):
        ragged_paged_attention(q, kc, vc, case["md"], sm_scale=0.1, impl="tpu-interpret")
    case = make_case([(3, 2)], page_size=8, hq=4, hkv=2, d=64, r_pad=2, t_pad=4)
    q, kc, vc = (jnp.asarray(case[k], jnp.bfloat16) for k in ("q", "kc", "vc"))
    with pytest.raises(ValueError, match="multiple of 16"):  # bf16 pages: whole (16, 128) tiles
        ragged_paged_attention_tpu(q, kc, vc, case["md"], sm_scale=0.1)
    assert attn_ops.resolve_impl("auto", backend="tpu") == "tpu"


def test_tiny_llama_end_to_end(on_device):
    impl = "tpu" if on_device else "tpu-interpret"
    ref_logits, ref_greedy = tiny_llama_run("reference")
    logits, greedy = tiny_llama_run(impl)
    assert greedy == ref_greedy
    for a, b in zip(logits, ref_logits):
        assert np.abs(b).max() > 0.1
        np.testing.assert_allclose(a, b, atol=1e-4, rtol=0)
