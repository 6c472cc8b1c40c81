"""`matmul_impl`: which engines pack their weights for the CPU product kernels, and a bfloat16 engine
(bfloat16 KV cache, written by the native attention kernel) on AMX agreeing with the same engine
on XLA's dot (on the real default model)."""

from __future__ import annotations

import types

import jax.numpy as jnp
import pytest

from jaxserve import LLM, SamplingParams
from jaxserve.pallas_kernels.cpu.matmul import (
    amx_available,
    avx2_available,
    avx512_available,
    resolve_matmul_impl,
)

needs_amx = pytest.mark.skipif(not amx_available(), reason="this CPU has no AMX-BF16")
ONE = types.SimpleNamespace(size=1)


def test_resolve_matmul_impl():
    assert resolve_matmul_impl("xla", "cpu", jnp.bfloat16, ONE) == "xla"
    eight = types.SimpleNamespace(size=8)
    for backend, dtype, mesh in (("gpu", jnp.bfloat16, ONE), ("cpu", jnp.float32, ONE),
                                 ("cpu", jnp.bfloat16, eight)):
        if dtype == jnp.bfloat16:
            assert resolve_matmul_impl("auto", backend, dtype, mesh) == "xla"
        with pytest.raises(ValueError, match="matmul_impl='amx' cannot run here"):
            resolve_matmul_impl("amx", backend, dtype, mesh)
    for backend, dtype, mesh in (("gpu", jnp.float32, ONE), ("cpu", jnp.bfloat16, ONE),
                                 ("cpu", jnp.float32, eight)):
        if dtype == jnp.float32:
            assert resolve_matmul_impl("auto", backend, dtype, mesh) == "xla"
        with pytest.raises(ValueError, match="matmul_impl='avx512' cannot run here"):
            resolve_matmul_impl("avx512", backend, dtype, mesh)
        with pytest.raises(ValueError, match="matmul_impl='avx2' cannot run here"):
            resolve_matmul_impl("avx2", backend, dtype, mesh)
    with pytest.raises(ValueError, match="'auto', 'xla', 'amx', 'avx512' or 'avx2'"):
        resolve_matmul_impl("onednn", "cpu", jnp.bfloat16, ONE)
    assert resolve_matmul_impl("auto", "cpu", jnp.bfloat16, ONE) == (
        "amx" if amx_available() else "xla")
    # float32: AVX-512 where the process's kernel build has it, else AVX2 (a build without
    # AVX-512 on a CPU with AVX2 and FMA), else XLA.
    assert resolve_matmul_impl("auto", "cpu", jnp.float32, ONE) == (
        "avx512" if avx512_available() else "avx2" if avx2_available() else "xla")
    for name, ok in (("avx512", avx512_available()), ("avx2", avx2_available())):
        if ok:
            assert resolve_matmul_impl(name, "cpu", jnp.float32, ONE) == name
        else:
            with pytest.raises(ValueError, match=f"matmul_impl='{name}' cannot run here"):
                resolve_matmul_impl(name, "cpu", jnp.float32, ONE)


@needs_amx
@pytest.mark.slow
def test_bfloat16_engine_on_amx_agrees_with_xla(small_engine_options, golden):
    opts = dict(small_engine_options, dtype="bfloat16")
    amx, xla = LLM(**opts), LLM(**opts, matmul_impl="xla")
    assert (amx.engine.matmul_impl, xla.engine.matmul_impl) == ("amx", "xla")
    # The native attention kernel writes the cache itself, so the cache is bfloat16 too.
    assert amx.engine.kv_dtype == xla.engine.kv_dtype == jnp.bfloat16
    cases = golden["cases"]
    sp = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=2)
    prompts = [c["prompt_token_ids"] for c in cases]
    outs_a = amx.generate(prompts, sp, use_tqdm=False)
    outs_x = xla.generate(prompts, sp, use_tqdm=False)
    diffs = []
    for a, x in zip(outs_a, outs_x):
        ta, tx = a.outputs[0].token_ids, x.outputs[0].token_ids
        for i, (la, lx) in enumerate(zip(a.outputs[0].logprobs, x.outputs[0].logprobs)):
            # The same bfloat16 products up to the order of float32 additions; rounding each
            # layer's activations to bfloat16 turns that into log-prob noise of a few hundredths.
            # Tokens agree until a near-tie.
            diffs += [abs(la[t].logprob - lx[t].logprob) for t in set(la) & set(lx)]
            top = sorted(lx.values(), key=lambda v: -v.logprob)
            if ta[i] != tx[i]:
                assert top[0].logprob - top[1].logprob < 0.1, f"diverged at step {i}"
                break
    assert len(diffs) >= 2 * len(cases)
    assert max(diffs) < 0.2 and sum(diffs) / len(diffs) < 0.03, sorted(diffs)[-5:]
