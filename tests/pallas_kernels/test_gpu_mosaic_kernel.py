"""The Pallas Mosaic GPU ragged paged attention kernel vs the naive float64 attention.

On the CPU the kernel runs in Pallas's Mosaic GPU interpreter (`impl="gpu-mosaic-interpret"`:
TMA copies, barriers, shared memory and the kernel's page walk, masks and softmax, with `jnp`
products in place of its two wgmmas); under `pytest --kernel-device` on a Hopper GPU it runs
compiled. Its compiles for H100/H200 are in tests/tools/test_gpu_topology.py.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import pytest
from jaxserve.pallas_kernels import ragged_paged_attention
from jaxserve.pallas_kernels.ragged_paged_attention import gpu_mosaic
from jaxserve.pallas_kernels.ragged_paged_attention import ops as attn_ops

from tests.pallas_kernels.attention_cases import assert_close_to_naive, make_case
from tests.pallas_kernels.kernel_checks import check_random_batches

STATIC = ("sm_scale", "sliding_window", "soft_cap", "impl", "chunk_pages", "interpret")
attn_jit = jax.jit(ragged_paged_attention, static_argnames=STATIC)
CONFIGS = {  # GQA ratios 3 and 8; head dims 64 and 128; pages of 8, 16 and 64 tokens
    "gqa3-d128-p16": dict(hq=6, hkv=2, d=128, page_size=16, dtype=jnp.bfloat16),
    "gqa8-d64-p64": dict(hq=8, hkv=1, d=64, page_size=64, dtype=jnp.bfloat16),
}


@pytest.fixture(scope="module")
def impl(kernel_device):
    if kernel_device:
        if jax.default_backend() != "gpu":
            pytest.skip("--kernel-device: no GPU backend")
        capability = float(getattr(jax.devices()[0], "compute_capability", "0") or 0)
        if capability < 9.0:
            pytest.skip(
                f"--kernel-device: Mosaic GPU needs Hopper or newer (compute capability "
                f"{capability})"
            )
        return "gpu-mosaic"
    return "gpu-mosaic-interpret"


@pytest.mark.parametrize("name", list(CONFIGS))
def test_random_ragged_batches(name, impl):
    # decode-only, prefill-only and mixed batches (partial last pages, padding requests)
    n = 2 if name.startswith("gqa3") else 3  # the interpreter takes seconds a batch
    errs = check_random_batches(
        functools.partial(attn_jit, impl=impl), CONFIGS[name], n=n, seed0=11
    )
    assert len(errs) == n


def test_sliding_window_soft_cap_splits_and_small_pages(impl):
    cfg = dict(hq=3, hkv=1, d=64, page_size=8, dtype=jnp.bfloat16)
    kernel = jax.jit(
        gpu_mosaic.ragged_paged_attention_gpu_mosaic,
        static_argnames=("sm_scale", "sliding_window", "soft_cap", "kv_splits", "interpret"),
    )
    attn = functools.partial(kernel, kv_splits=3, interpret=impl.endswith("interpret"))
    check_random_batches(attn, cfg, n=1, seed0=11, sliding_window=7, soft_cap=2.0)


def test_padding_only_batch_and_interpret_mapping():
    case = make_case(
        [(31, 33), (15, 1)],
        page_size=16,
        hq=4,
        hkv=1,
        d=64,
        r_pad=4,
        t_pad=48,
        dtype=jnp.bfloat16,
        seed=3,
    )
    out = ragged_paged_attention(
        jnp.asarray(case["q"]),
        jnp.asarray(case["kc"]),
        jnp.asarray(case["vc"]),
        case["md"],
        sm_scale=0.2,
        impl="gpu-mosaic",
        interpret=True,
    )
    assert_close_to_naive(out, case, atol=2e-2, sm_scale=0.2)
    assert (
        attn_ops.dispatch_name("gpu-mosaic", case["q"], case["kc"], interpret=True)
        == "gpu-mosaic-interpret"
    )
    with pytest.raises(ValueError, match="shared memory for head dim 256"):  # 136 bytes too many
        gpu_mosaic.supports(
            jnp.zeros((1, 4, 256), jnp.bfloat16), jnp.zeros((2, 16, 1, 256), jnp.bfloat16)
        )
    with pytest.raises(ValueError, match="bfloat16 or float16"):
        ragged_paged_attention(
            jnp.asarray(case["q"], jnp.float32),
            jnp.asarray(case["kc"], jnp.float32),
            jnp.asarray(case["vc"], jnp.float32),
            case["md"],
            sm_scale=0.2,
            impl="gpu-mosaic-interpret",
        )
