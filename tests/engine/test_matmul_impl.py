"""`matmul_impl`: which engines pack their weights for the CPU product kernels, and bfloat16 engines
(bfloat16 KV cache, written by the native attention kernel) on AMX and on the AVX2 build's strips
kernel agreeing with the same engine on XLA's dot (on the real default model)."""

from __future__ import annotations

import jax.numpy as jnp
import pytest

from jaxserve import LLM, SamplingParams
from jaxserve.backends.cpu.kernels.matmul import amx_available

needs_amx = pytest.mark.skipif(not amx_available(), reason="this CPU has no AMX-BF16")


@needs_amx
@pytest.mark.slow
def test_bfloat16_engine_on_amx_agrees_with_xla(small_engine_options, golden):
    opts = dict(small_engine_options, dtype="bfloat16")
    amx, xla = LLM(**opts), LLM(**opts, matmul_impl="xla")
    plans = amx.engine.parts.plan, xla.engine.parts.plan
    assert (plans[0].matmul_impl, plans[1].matmul_impl) == ("amx", "xla")
    # The native attention kernel writes the cache itself, so the cache is bfloat16 too.
    assert plans[0].kv_dtype == plans[1].kv_dtype == "bfloat16"
    assert amx.engine.runner.kv_dtype == xla.engine.runner.kv_dtype == jnp.bfloat16
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


_STRIPS_VS_XLA = """
import json, sys
from jaxserve import LLM, SamplingParams
opts, prompts = json.loads(sys.argv[1]), json.loads(sys.argv[2])
sp = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=2)
out = {}
for impl in ("auto", "xla"):
    llm = LLM(**opts, matmul_impl=impl)
    plan = llm.engine.parts.plan
    res = llm.generate(prompts, sp, use_tqdm=False)
    out[impl] = {"plan": [plan.matmul_impl, plan.kv_dtype],
                 "tokens": [r.outputs[0].token_ids for r in res],
                 "logprobs": [[{str(t): v.logprob for t, v in lp.items()} for lp in r.outputs[0].logprobs]
                              for r in res]}
print("RESULT " + json.dumps(out))
"""


@pytest.mark.slow
def test_bfloat16_engine_on_the_avx2_build_agrees_with_xla(small_engine_options, golden):
    """On the AVX2 build (what AVX2-only CPUs run), bfloat16 weights go through the strips
    kernel (widened to float32 in the kernel) instead of XLA's bfloat16 dot, and give the same
    greedy tokens and log-probs up to bfloat16 rounding of the activations (which XLA does at
    each product and the kernel does not). A process of its own: the build is chosen per
    process."""
    import json
    import os
    import subprocess
    import sys

    from jaxserve.backends.cpu import kernels as cpu

    if cpu.missing_isa("haswell"):
        pytest.skip("this CPU cannot run the haswell build")
    # The six prompts run together: every step has 8 request slots (a bucket of 1 would go unused).
    opts = dict(small_engine_options, dtype="bfloat16", cpu_kernel_target="haswell", request_buckets=(8,))
    cases = golden["cases"]
    prompts = [c["prompt_token_ids"] for c in cases]
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    res = subprocess.run([sys.executable, "-c", _STRIPS_VS_XLA, json.dumps(opts), json.dumps(prompts)],
                         cwd=root, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads(res.stdout.split("RESULT ", 1)[1])
    assert out["auto"]["plan"] == ["avx2", "bfloat16"] and out["xla"]["plan"] == ["xla", "bfloat16"]
    diffs = []
    for ta, tx, las, lxs in zip(out["auto"]["tokens"], out["xla"]["tokens"], out["auto"]["logprobs"],
                                out["xla"]["logprobs"]):
        for i, (la, lx) in enumerate(zip(las, lxs)):
            diffs += [abs(la[t] - lx[t]) for t in set(la) & set(lx)]
            top = sorted(lx.values(), reverse=True)
            if ta[i] != tx[i]:
                assert top[0] - top[1] < 0.15, f"diverged at step {i}"
                break
    assert len(diffs) >= 2 * len(cases)
    assert max(diffs) < 0.3 and sum(diffs) / len(diffs) < 0.05, sorted(diffs)[-5:]
