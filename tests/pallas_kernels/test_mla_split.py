"""Multi-head latent attention's split prefill: the absorbed op's log-sum-exp and its
context-only reading (every implementation against a float64 oracle; the Pallas kernels in
interpret mode), the expanded attention over a step's own rows merged with the absorbed
context by log-sum-exp (models/layers/mla.py's `mla_attention`) equal to the all-absorbed
attention on a ragged batch, float and fp8 pages, and the per-shape choice between them."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jaxserve.models.layers.attention import AttentionSpec
from jaxserve.models.layers.mla import (
    PREFILL_FORM_ENV,
    mla_attention,
    own_rows_macs,
    prefill_form,
)
from jaxserve.pallas_kernels.mla_paged_attention.expanded import expanded_pairs
from jaxserve.pallas_kernels.mla_paged_attention.ops import kernel_name, mla_paged_attention

import jaxserve.backends.cpu.kernels.attention  # noqa: F401 - registers the "cpu" kernel
from tests.pallas_kernels.attention_cases import make_case

# (cached context, new queries) per request: a prefill with no context, a decode row, chunks
# after context; then padding requests and padding tokens
REQS = [(0, 9), (21, 1), (5, 4), (16, 7)]
SCALE = 0.11
V3 = dict(latent=512, nope=128, rope=64, value=128)


def _oracle(q, rows_of, case, value_dim, *, context_only=False):
    """float64 absorbed MLA: (out [T, H, value_dim], lse [T, H]); `rows_of(r, n)`: request r's
    first n rows; a row that reads no key: zeros, -inf."""
    T, H, _ = q.shape
    out, lse = np.zeros((T, H, value_dim)), np.full((T, H), -np.inf)
    for r, (ctx, n) in enumerate(case["reqs"]):
        for j in range(n):
            t, seen = case["qsl"][r] + j, ctx if context_only else ctx + j + 1
            if not seen:
                continue
            rows = rows_of(r, seen)
            s = SCALE * q[t].astype(np.float64) @ rows.T  # [H, seen]
            m = s.max(-1, keepdims=True)
            e = np.exp(s - m)
            out[t] = (e / e.sum(-1, keepdims=True)) @ rows[:, :value_dim]
            lse[t] = (m + np.log(e.sum(-1, keepdims=True)))[:, 0]
    return out, lse


def _cached_rows(cache, case):
    ps, bt = case["ps"], case["bt"]
    return lambda r, n: np.concatenate(
        [cache[bt[r, i]] for i in range(-(-n // ps))] + [cache[:0, 0]])[:n].astype(np.float64)


# a smaller ragged batch for the kernels' interpret mode (its cost grows with the grid)
SMALL = [(0, 3), (10, 1), (5, 2)]


@pytest.mark.parametrize("impl, width, value_dim, reqs, t_pad, kernel, context_only", [
    ("reference", 128, 96, REQS, 24, "reference", False),
    ("reference", 128, 96, REQS, 24, "reference", True),
    ("cpu", 128, 96, REQS, 24, "cpu", False),  # the native kernel's log-sum-exp entry point
    ("cpu", 128, 96, REQS, 24, "cpu", True),
    ("gpu-interpret", 96, 64, SMALL, 8, "mla-gpu-interpret", False),
    ("gpu-interpret", 96, 64, SMALL, 8, "mla-gpu-interpret", True),
    # decode-shaped: the GPU kernel's 4 key splits merged
    ("gpu-interpret", 96, 64, [(21, 1), (40, 1), (3, 1), (0, 1)], 4, "mla-gpu-interpret", False),
    ("tpu-interpret", 160, 128, SMALL, 8, "mla-tpu-interpret", False),
    ("tpu-interpret", 160, 128, SMALL, 8, "mla-tpu-interpret", True),
])
def test_every_absorbed_implementation_returns_the_oracles_lse(impl, width, value_dim, reqs,
                                                               t_pad, kernel, context_only):
    """out and log-sum-exp per (query, head) over all the keys a query sees, or over its
    request's cached context only (a request without context: -inf and zeros)."""
    case = make_case(reqs, page_size=8, hq=4, hkv=1, d=width, t_pad=t_pad, r_pad=4, seed=21)
    q, kc = jnp.asarray(case["q"]), jnp.asarray(case["kc"])
    assert kernel_name(impl, q, kc, value_dim) == kernel
    op = jax.jit(functools.partial(mla_paged_attention, sm_scale=SCALE, value_dim=value_dim,
                                   impl=impl, context_only=context_only, return_lse=True))
    out, lse = op(q, kc, case["md"])
    if impl == "cpu":  # the native kernel itself, not the reference
        assert "jaxserve_ragged_paged_attention_lse" in op.lower(q, kc, case["md"]).as_text()
    want, want_lse = _oracle(case["q"], _cached_rows(case["kc"], case), case, value_dim,
                             context_only=context_only)
    live = int(case["qsl"][len(reqs)])
    assert lse.shape == q.shape[:2] and lse.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(out)[:live], want[:live], atol=2e-5, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(lse)[:live], want_lse[:live], atol=2e-5, rtol=1e-5)
    assert np.all(np.asarray(lse)[live:] == -np.inf)  # padding tokens
    if context_only and reqs[0][0] == 0:
        assert np.all(np.asarray(lse)[: reqs[0][1]] == -np.inf)


# The layer's weights and inputs: H heads, latent C, nope Dn, rope Dr, value Dv.
H, C, DN, DR, DV = 4, 96, 16, 32, 24


def _layer_inputs(seed, dtype=np.float32):
    case = make_case(REQS, page_size=8, hq=H, hkv=1, d=C + DR, t_pad=24, seed=seed)
    rng = np.random.default_rng(seed + 1)
    T = case["q"].shape[0]
    f = lambda *s: jnp.asarray(rng.standard_normal(s, np.float32) * 0.5)  # noqa: E731
    args = dict(q_nope=f(T, H, DN), q_rope=f(T, H, DR), latent=f(T, C), k_rope=f(T, DR),
                w_uk=f(H, DN, C) * 0.3, w_uv=f(H, C, DV) * 0.3)
    return case, args


def _run(monkeypatch, form, case, args, cache, spec):
    monkeypatch.setenv(PREFILL_FORM_ENV, form)  # read as the step is traced

    @jax.jit
    def layer(a, cache, md):
        return mla_attention(a["q_nope"], a["q_rope"], a["latent"], a["k_rope"], cache, md, spec,
                             a["w_uk"], a["w_uv"], mesh=None)

    return layer(args, cache, case["md"])


@pytest.mark.parametrize("impl", ["reference", "cpu"])
def test_the_split_equals_the_absorbed_attention(monkeypatch, impl):
    """A request with no context, a decode row, two chunks after context, padding requests
    and tokens in one step: expanded over the step's own rows, absorbed over the cached
    context, merged by log-sum-exp = all absorbed (float32); both write the same rows."""
    case, args = _layer_inputs(31)
    spec = AttentionSpec(sm_scale=SCALE, impl=impl)
    cache = jnp.asarray(case["kc"])
    absorbed, cache_a = _run(monkeypatch, "absorbed", case, args, cache, spec)
    split, cache_s = _run(monkeypatch, "split", case, args, cache, spec)
    np.testing.assert_array_equal(np.asarray(cache_s), np.asarray(cache_a))
    live = int(case["qsl"][len(REQS)])
    assert split.shape == (case["q"].shape[0], H, DV)
    np.testing.assert_allclose(np.asarray(split)[:live], np.asarray(absorbed)[:live], atol=2e-5,
                               rtol=1e-4)
    assert not np.asarray(split)[live:].any()  # padding tokens: zeros


def test_the_split_reads_fp8_pages_for_the_context_only(monkeypatch):
    """fp8 latent pages with a scale per part: the cached context is read from the pages
    (dequantized by the column scales), the step's own rows as computed; the float64 oracle
    over exactly those rows."""
    s_latent, s_rope = 0.03, 0.07
    case, args = _layer_inputs(41)
    pages = jnp.asarray(np.clip(case["kc"] * 8, -200, 200)).astype(jnp.float8_e4m3fn)
    spec = AttentionSpec(sm_scale=SCALE, impl="reference", k_scale=(s_latent, s_rope),
                         v_scale=(s_latent,))
    out, cache = _run(monkeypatch, "split", case, args, pages, spec)
    assert cache.dtype == jnp.float8_e4m3fn
    cols = np.where(np.arange(C + DR) < C, s_latent, s_rope)
    stored = _cached_rows(np.asarray(pages.astype(jnp.float32)), case)
    own = np.concatenate([np.asarray(args["latent"]), np.asarray(args["k_rope"])], -1)
    f64 = {k: np.asarray(v, np.float64) for k, v in args.items()}
    q_rows = np.concatenate([np.einsum("thd,hdc->thc", f64["q_nope"], f64["w_uk"]),
                             f64["q_rope"]], -1)

    def rows_of(r, n):  # context from the pages, this step's rows exact
        ctx = case["reqs"][r][0]
        start = case["qsl"][r]
        return np.concatenate([stored(r, min(n, ctx)) * cols, own[start: start + n - ctx]])

    lat, _ = _oracle(q_rows, rows_of, case, C)
    want = np.einsum("thc,hcv->thv", lat, f64["w_uv"])
    live = int(case["qsl"][len(REQS)])
    np.testing.assert_allclose(np.asarray(out)[:live], want[:live], atol=5e-5, rtol=1e-4)


def test_which_step_shapes_take_the_split(monkeypatch):
    """V3's dimensions: decode shapes stay absorbed; a lone long prefill is split; the
    break-even of one request's causal chunk is past 341 tokens (the 170 of counting every
    (query, key) pair would ignore causality); many short chunks in one bucket stay absorbed;
    the environment variable forces either form."""
    monkeypatch.delenv(PREFILL_FORM_ENV, raising=False)
    assert expanded_pairs(300, 128) == 128 * 128 + 128 * 256 + 44 * 300
    for t in (1, 8, 64, 256):
        assert prefill_form(t, t, **V3) == "absorbed"
    assert prefill_form(2048, 1, **V3) == "split"
    assert prefill_form(512, 1, **V3) == "split"
    assert prefill_form(2048, 64, **V3) == "absorbed"  # 32 tokens a request
    first = next(t for t in range(1, 2049) if prefill_form(t, 1, **V3) == "split")
    assert 341 < first < 512, first
    macs = own_rows_macs(first - 1, 1, **V3)
    assert macs["split"] >= macs["absorbed"]
    monkeypatch.setenv(PREFILL_FORM_ENV, "split")
    assert prefill_form(8, 8, **V3) == "split"
    monkeypatch.setenv(PREFILL_FORM_ENV, "absorbed")
    assert prefill_form(2048, 1, **V3) == "absorbed"
    monkeypatch.setenv(PREFILL_FORM_ENV, "expanded")
    with pytest.raises(ValueError, match=PREFILL_FORM_ENV):
        prefill_form(8, 1, **V3)
