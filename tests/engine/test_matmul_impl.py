"""`matmul_impl`: which engines pack their weights for the CPU product kernels, and a bfloat16 engine
(bfloat16 KV cache, written by the native attention kernel) on AMX agreeing with the same engine
on XLA's dot (on the real default model)."""

from __future__ import annotations

import jax.numpy as jnp
import pytest

from jaxserve import LLM, SamplingParams
from jaxserve.pallas_kernels.cpu.matmul import amx_available

needs_amx = pytest.mark.skipif(not amx_available(), reason="this CPU has no AMX-BF16")


@needs_amx
@pytest.mark.slow
def test_bfloat16_engine_on_amx_agrees_with_xla(small_engine_options, golden):
    opts = dict(small_engine_options, dtype="bfloat16")
    amx, xla = LLM(**opts), LLM(**opts, matmul_impl="xla")
    assert (amx.engine.parts.plan.matmul_impl, xla.engine.parts.plan.matmul_impl) == ("amx", "xla")
    # The native attention kernel writes the cache itself, so the cache is bfloat16 too.
    assert amx.engine.core.runner.kv_dtype == xla.engine.core.runner.kv_dtype == jnp.bfloat16
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
