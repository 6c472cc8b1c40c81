"""Paged multi-head latent attention (pallas_kernels/mla_paged_attention) against a float64
numpy oracle: this step's latent rows written into a cache of shuffled pages that already holds
random context, then every query head scored against the rows (the roped part included) and
the values read from their first value_dim columns; with each implementation it dispatches to
(the reference; the TPU, GPU and CPU kernels, at a row width they take); one-byte pages
widened by each, and the layer's quantized write with its q and output scales."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from jaxserve.pallas_kernels.mla_paged_attention.ops import (
    kernel_name,
    mla_paged_attention,
    write_latent_and_attend,
)

import jaxserve.backends.cpu.kernels.attention  # noqa: F401 - registers the "cpu" kernel
from tests.pallas_kernels.attention_cases import make_case

# (cached context, new queries) per request: decode rows, a prefill, a chunk after context
REQS = [(0, 9), (21, 1), (5, 4), (16, 7)]
VALUE_DIM, ROPE_DIM, HEADS, SCALE = 96, 32, 4, 0.11  # row width 128: every kernel takes it


def _oracle(q, cache, case, value_dim=VALUE_DIM, scale=SCALE) -> np.ndarray:
    """float64 absorbed MLA, position by position."""
    ps, bt, qsl = case["ps"], case["bt"], case["qsl"]
    out = np.zeros((*q.shape[:2], value_dim))
    for r, (ctx, n) in enumerate(case["reqs"]):
        rows = np.concatenate([cache[bt[r, i]] for i in range(-(-(ctx + n) // ps))])
        rows = rows[: ctx + n].astype(np.float64)
        for j in range(n):
            t, pos = qsl[r] + j, ctx + j
            s = scale * q[t].astype(np.float64) @ rows[: pos + 1].T  # [H, pos + 1]
            p = np.exp(s - s.max(-1, keepdims=True))
            p /= p.sum(-1, keepdims=True)
            out[t] = p @ rows[: pos + 1, :value_dim]
    return out


@pytest.mark.parametrize("impl", ["reference", "tpu-interpret", "gpu-interpret", "cpu"])
def test_write_and_attend_match_the_float64_oracle(impl):
    """Rows 96 + 32 wide: the GQA kernels' dispatch (MLA's GPU kernel needs powers of two)."""
    case = make_case(REQS, page_size=8, hq=HEADS, hkv=1, d=VALUE_DIM + ROPE_DIM, t_pad=24,
                     seed=3)
    assert kernel_name(impl, case["q"], case["kc"], VALUE_DIM) == impl
    _check_write_and_attend(case, impl, VALUE_DIM)


@pytest.mark.parametrize("reqs, t_pad, heads", [
    (REQS, 24, 4),  # prefill-shaped: one split, 4 queries x 4 heads a block
    ([(21, 1), (40, 1), (3, 1), (0, 1)], 8, 32),  # decode: 4 key splits, 2 blocks of 16 heads
])
def test_mlas_gpu_kernel_matches_the_float64_oracle(reqs, t_pad, heads):
    """MLA's own GPU kernel (interpret mode), rows 64 + 32 wide (not a power of two)."""
    case = make_case(reqs, page_size=8, hq=heads, hkv=1, d=96, t_pad=t_pad, seed=7)
    assert kernel_name("gpu-interpret", case["q"], case["kc"], 64) == "mla-gpu-interpret"
    _check_write_and_attend(case, "gpu-interpret", 64)


def test_mlas_tpu_kernel_matches_the_float64_oracle():
    """MLA's own TPU kernel (interpret mode), rows 128 + 32 wide (not lane-dense)."""
    case = make_case(REQS, page_size=8, hq=4, hkv=1, d=160, t_pad=24, seed=8)
    assert kernel_name("tpu-interpret", case["q"], case["kc"], 128) == "mla-tpu-interpret"
    assert kernel_name("auto", case["q"], case["kc"], 128, backend="tpu") == "reference"
    _check_write_and_attend(case, "tpu-interpret", 128)


def _check_write_and_attend(case, impl, value_dim):
    md, q = case["md"], case["q"]
    latent = np.random.default_rng(4).standard_normal((q.shape[0], q.shape[2]), np.float32)
    out, cache = write_latent_and_attend(jnp.asarray(q), jnp.asarray(latent),
                                         jnp.asarray(case["kc"]), md, sm_scale=SCALE,
                                         value_dim=value_dim, impl=impl)
    cache = np.asarray(cache)
    live = int(case["qsl"][len(case["reqs"])])
    written = np.asarray(md.slot_mapping)[:live]
    np.testing.assert_array_equal(cache.reshape(-1, q.shape[2])[written], latent[:live])
    expected = _oracle(q, cache, case, value_dim=value_dim)
    assert out.shape == (*q.shape[:2], value_dim)
    np.testing.assert_allclose(np.asarray(out)[:live], expected[:live], atol=2e-5, rtol=1e-5)
    assert not np.asarray(out)[live:].any()  # padding tokens: zeros


def test_deepseek_v3s_row_width():
    """DeepSeek V3's 576-wide rows (512 + 64): not lane-dense, so "auto" on a TPU runs the
    reference (MLA's TPU kernel by name); the CPU kernel takes them, and on a GPU MLA's own
    kernel does; each gives the oracle's output."""
    case = make_case([(3, 2)], page_size=8, hq=2, hkv=1, d=576, seed=5)
    q, kc = case["q"], case["kc"]
    assert kernel_name("auto", q, kc, 512, backend="tpu") == "reference"
    assert kernel_name("auto", q, kc, 512, backend="cpu") == "cpu"
    assert kernel_name("gpu-mosaic", q, kc, 512) == "mla-gpu"
    assert kernel_name("tpu", q, kc, 512) == "mla-tpu"
    expected = _oracle(q, kc, case, value_dim=512, scale=0.05)
    for impl in ("cpu", "gpu-interpret", "tpu-interpret"):
        out = mla_paged_attention(jnp.asarray(q), jnp.asarray(kc), case["md"], sm_scale=0.05,
                                  value_dim=512, impl=impl)
        np.testing.assert_allclose(np.asarray(out), expected, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("bad, message", [
    ({"value_dim": 128}, "value_dim must be in"),
    ({"q_width": 64}, "q must be"),
])
def test_bad_shapes_are_refused(bad, message):
    case = make_case([(0, 2)], page_size=8, hq=2, hkv=1, d=128)
    q = jnp.asarray(case["q"])[..., : bad.get("q_width", 128)]
    with pytest.raises(ValueError, match=message):
        mla_paged_attention(q, jnp.asarray(case["kc"]), case["md"], sm_scale=1.0,
                            value_dim=bad.get("value_dim", 96))


@pytest.mark.parametrize("dense_step", [False, True])
def test_the_references_values_from_the_key_rows(dense_step):
    """The GQA reference's `value_dim` (what MLA's reference runs): the values read from the
    keys' first columns, on its chunked paths and with this step's keys as one dense block."""
    from jaxserve.pallas_kernels.ragged_paged_attention.reference import (
        ragged_paged_attention_reference,
    )

    case = make_case(REQS, page_size=8, hq=HEADS, hkv=1, d=VALUE_DIM + ROPE_DIM, t_pad=24,
                     seed=9)
    kc = jnp.asarray(case["kc"])
    out = ragged_paged_attention_reference(jnp.asarray(case["q"]), kc, kc, case["md"],
                                           sm_scale=SCALE, value_dim=VALUE_DIM,
                                           dense_step=dense_step, chunk_pages=2)
    live = int(case["qsl"][len(REQS)])
    expected = _oracle(case["q"], case["kc"], case)
    np.testing.assert_allclose(np.asarray(out)[:live], expected[:live], atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("impl, width, value_dim, page_size, kernel", [
    ("reference", 128, 96, 8, "reference"),
    ("cpu", 128, 96, 8, "cpu"),
    ("gpu-interpret", 96, 64, 8, "mla-gpu-interpret"),
    ("tpu-interpret", 160, 128, 32, "mla-tpu-interpret"),  # one-byte pages: 32-row tiles
])
def test_fp8_pages_are_widened_by_every_implementation(impl, width, value_dim, page_size,
                                                       kernel):
    """float8_e4m3fn latent pages read by each implementation (float32 queries): the oracle's
    output on the rows the pages hold, widened. (The GQA kernels widen one-byte pages handed
    as any array: tests/pallas_kernels' quantized-cache cases.)"""
    case = make_case([(9, 2)], page_size=page_size, hq=2, hkv=1, d=width, r_pad=1, seed=11)
    q, pages = jnp.asarray(case["q"]), jnp.asarray(case["kc"]).astype(jnp.float8_e4m3fn)
    assert kernel_name(impl, q, pages, value_dim) == kernel
    out = mla_paged_attention(q, pages, case["md"], sm_scale=SCALE, value_dim=value_dim,
                              impl=impl)
    live = int(case["qsl"][len(case["reqs"])])
    rows = np.asarray(pages.astype(jnp.float32))
    expected = _oracle(case["q"], rows, case, value_dim=value_dim)
    np.testing.assert_allclose(np.asarray(out)[:live], expected[:live], atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [jnp.float8_e4m3fn, jnp.int8])
def test_the_layer_quantizes_the_rows_and_scales_q_and_out(dtype):
    """models/layers/mla.py over a one-byte cache with a scale for the latent columns and one
    for the rope columns: this step's rows are written as rows / their column's scale, rounded
    to the dtype, and the output is the float64 oracle's on the dequantized rows (pages times
    the column scales) for the unscaled q: the scales are exact outside the kernel."""
    from jaxserve.models.layers.attention import AttentionSpec
    from jaxserve.models.layers.mla import paged_mla_attention

    s_latent, s_rope = 0.02, 0.05
    case = make_case(REQS, page_size=8, hq=HEADS, hkv=1, d=VALUE_DIM + ROPE_DIM, t_pad=24,
                     seed=12)
    q = case["q"]
    cols = np.where(np.arange(q.shape[2]) < VALUE_DIM, s_latent, s_rope).astype(np.float32)
    pages = jnp.asarray(np.clip(np.round(case["kc"] * 4), -100, 100)).astype(dtype)  # context
    latent = np.random.default_rng(13).standard_normal((q.shape[0], q.shape[2]), np.float32)
    spec = AttentionSpec(sm_scale=SCALE, impl="cpu", k_scale=(s_latent, s_rope),
                         v_scale=(s_latent,))
    out, cache = paged_mla_attention(jnp.asarray(q), jnp.asarray(latent), pages, case["md"],
                                     spec, VALUE_DIM, mesh=None)
    assert cache.dtype == jnp.dtype(dtype)
    live = int(case["qsl"][len(REQS)])
    written = np.asarray(case["md"].slot_mapping)[:live]
    stored = np.asarray(cache.astype(jnp.float32)).reshape(-1, q.shape[2])[written]
    want = latent[:live] / cols
    want = np.clip(np.round(want), -127, 127) if dtype == jnp.int8 else np.asarray(
        jnp.asarray(want).astype(dtype).astype(jnp.float32))
    np.testing.assert_array_equal(stored, want)
    rows = np.asarray(cache.astype(jnp.float32)).astype(np.float64) * cols
    expected = _oracle(q, rows, case)
    np.testing.assert_allclose(np.asarray(out)[:live], expected[:live], atol=2e-5, rtol=1e-5)
