"""Step 0: structured output's token bitmask, applied before everything else, to greedy and
random rows alike, on the JAX steps and the CPU kernel; logprobs are those of the masked
logits (vLLM's raw logprobs); rows of all ones change nothing."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest

from jaxserve.backends.cpu import kernels as cpu_kernels
from jaxserve.sampling import SamplerConfig, sampler
from jaxserve.sampling_params import SamplingParams
from tests.sampling.harness import Req, build, jitted

V, R = 1000, 8  # V not a multiple of 32: the last word is partly padding
W = (V + 31) // 32


def pack(allowed: list[set[int] | None]) -> np.ndarray:
    """[R, W] int32 bitmask rows; None = every token allowed."""
    out = np.full((len(allowed), W), -1, np.int32)
    for i, ids in enumerate(allowed):
        if ids is None:
            continue
        bits = np.zeros(W * 32, np.uint8)
        bits[list(ids)] = 1
        out[i] = np.packbits(bits.reshape(W, 32)[:, ::-1], axis=1).view(">u4")[:, 0].astype(np.uint32).view(np.int32)
    return out


@pytest.mark.parametrize("native", [None, "cpu"], ids=["jax", "native"])
def test_bitmask_applies_to_greedy_and_random_rows(native):
    if native and not cpu_kernels.available():
        pytest.skip("the CPU kernels cannot be built on this host")
    cfg = SamplerConfig(max_num_seqs=16, vocab_size=V, max_logprobs=4, topk_candidates=16, native=native)
    rng = np.random.default_rng(0)
    reqs = []
    for i in range(R):
        kw = {"temperature": 0.0} if i % 2 == 0 else {"temperature": 1.0, "top_p": 0.9, "seed": i}
        if i == 3:
            kw["presence_penalty"] = 0.5
        reqs.append(Req(SamplingParams(logprobs=3, **kw), slot=i, prompt=[1, 2, 3]))
    state, meta, _ = build(cfg, reqs, R)
    allowed = [set(rng.choice(V, 5, replace=False).tolist()) for _ in range(R - 2)] + [{V - 1}, None]
    logits = rng.normal(size=(R, V)).astype(np.float32) * 3
    meta = dataclasses.replace(meta, token_bitmask=pack(allowed))
    sample, _, _ = jitted(cfg)
    out = jax.device_get(sample(logits, meta, state))
    for i, ids in enumerate(allowed):
        tok = int(out.token_ids[i])
        if ids is not None:
            assert tok in ids, (i, tok, ids)
        if i % 2 == 0 and ids is not None:  # greedy: the best allowed token
            assert tok == max(ids, key=lambda t: logits[i, t])
        # logprobs of the masked logits: the allowed tokens share all the mass
        x = logits[i].astype(np.float64)
        if ids is not None:
            x = np.where(np.isin(np.arange(V), list(ids)), x, -np.inf)
        lse = np.log(np.sum(np.exp(x - x.max()))) + x.max()
        assert out.logprobs[i] == pytest.approx(x[tok] - lse, abs=1e-4)
        assert all(t in ids for t, lp in zip(out.topk_ids[i], out.topk_logprobs[i]) if ids and lp > -1e30)
    assert out.logprobs[R - 2] == pytest.approx(0.0, abs=1e-6)  # one allowed token: probability 1
    # rows of all ones: the same tokens as with no bitmask at all
    free = dataclasses.replace(meta, token_bitmask=np.full((R, W), -1, np.int32))
    none = dataclasses.replace(meta, token_bitmask=None)
    a, b = jax.device_get(sample(logits, free, state)), jax.device_get(jax.jit(
        lambda lg, m, s: sampler.sample(lg, m, s, cfg))(logits, none, state))
    assert (a.token_ids == b.token_ids).all() and np.allclose(a.logprobs, b.logprobs)


def test_pack_matches_the_engine_layout():
    """Bit t % 32 of word t // 32, as llguidance writes its masks."""
    rows = pack([{0, 33, V - 1}])
    assert rows[0, 0] == 1 and rows[0, 1] == 2 and rows[0, (V - 1) // 32] == np.int32(1 << ((V - 1) % 32))
    from tests.engine.fakes import allowed_ids

    assert list(allowed_ids(rows[0])) == [0, 33, V - 1]
