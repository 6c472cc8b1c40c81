"""Checks shared by the TPU and GPU kernel tests: seeded random ragged batches vs the naive
float64 attention, and a tiny random Llama run end to end through a given attention impl."""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from tests.pallas_kernels.attention_cases import (
    assert_close_to_naive,
    make_case,
    random_reqs,
)

# The CPU kernels' build targets the kernel tests run on (`backends/cpu/kernels.BUILD_TARGETS`):
# the host's own instruction sets, AVX2 + FMA without AVX-512 (the code AVX2-only CPUs run),
# and the portable loops of the x86-64 baseline.
CPU_TARGETS = ("native", "haswell", "x86-64")


def need_cpu_target(target: str) -> None:
    """Skip the calling test, with the reason, when `target`'s kernel build cannot run here."""
    import pytest

    from jaxserve.backends.cpu import kernels as cpu

    missing = cpu.missing_isa(target)
    if missing:
        pytest.skip(f"this CPU lacks {', '.join(missing)} (kernel build target {target!r})")
    if not cpu.available(target):
        pytest.skip(f"the CPU kernels cannot be built for target {target!r} on this host")


# Fixed shapes per config, so each config compiles once whatever the batch.
T_PAD, R_PAD, MAX_KV = 72, 6, 80
KINDS = ("decode", "prefill", "mixed")
TOL = {np.float32: 1e-5, jnp.bfloat16: 2e-2}


def random_batches(cfg: dict, n: int, seed0: int):
    """n seeded random cases of config cfg (hq, hkv, d, page_size, dtype), kinds cycling."""
    ps = cfg["page_size"]
    P = math.ceil(MAX_KV / ps)
    for i in range(n):
        rng = np.random.default_rng(seed0 + i)
        kind = KINDS[i % 3]
        # Leave padding requests and padding tokens most of the time.
        reqs = random_reqs(rng, kind, page_size=ps, max_tokens=T_PAD - (i % 2) * 8,
                           max_reqs=R_PAD - (i % 2), max_kv=MAX_KV)
        yield kind, make_case(
            reqs, page_size=ps, hq=cfg["hq"], hkv=cfg["hkv"], d=cfg["d"], r_pad=R_PAD,
            t_pad=T_PAD, pages_per_req=P, dtype=cfg["dtype"], seed=seed0 + 1000 + i,
        )


def check_random_batches(attn, cfg: dict, n: int, seed0: int, sinks=None, **static):
    """attn(q, kc, vc, md, sm_scale=..., **static) on n random batches (with `sinks=` when
    given: [Hq] attention-sink logits); returns errors."""
    errs = []
    sm_scale = 1.0 / math.sqrt(cfg["d"])
    extra = {} if sinks is None else {"sinks": jnp.asarray(sinks)}
    for _, case in random_batches(cfg, n, seed0):
        out = attn(jnp.asarray(case["q"]), jnp.asarray(case["kc"]), jnp.asarray(case["vc"]),
                   case["md"], sm_scale=sm_scale, **static, **extra)
        errs.append(assert_close_to_naive(
            out, case, atol=TOL[cfg["dtype"]], sm_scale=sm_scale,
            sliding_window=static.get("sliding_window"), soft_cap=static.get("soft_cap"),
            sinks=sinks))
    return errs


def query_length_sweep_cases(cfg: dict, seed: int):
    """Prefill-only batches in which every query length 1..64 appears once."""
    lens = list(range(1, 65))
    np.random.default_rng(seed).shuffle(lens)
    batches, cur = [], []
    for n in lens:
        if sum(cur) + n > 256 or len(cur) == 8:
            batches.append(cur)
            cur = []
        cur.append(n)
    batches.append(cur)
    for i, b in enumerate(batches):
        yield make_case([(0, n) for n in b], page_size=cfg["page_size"], hq=cfg["hq"],
                        hkv=cfg["hkv"], d=cfg["d"], r_pad=8, t_pad=256,
                        pages_per_req=math.ceil(64 / cfg["page_size"]), dtype=cfg["dtype"],
                        seed=seed + i)


# A tiny Llama whose attention shapes every kernel takes: D = 64, Hkv * D = 128, GQA 2.
TINY_LLAMA = dict(
    architectures=["LlamaForCausalLM"], vocab_size=96, hidden_size=128, intermediate_size=128,
    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
    rope_theta=10000.0, tie_word_embeddings=True,
)


@functools.lru_cache(maxsize=None)  # the reference run is shared by the test files
def tiny_llama_run(impl: str, page_size: int = 16, kv_dtype=jnp.float32, layers: int = 2):
    """Logits of a mixed step sequence (prefill, chunked prefill + decode, decode) and greedy
    tokens of 4 decode steps, through `attention_impl=impl`, the KV cache in `kv_dtype`
    (attention then computes in it), `layers` of the model's layers. The model's own float32 products run at full precision:
    on a GPU XLA's default lets float32 dots use TF32 (logits ~5e-3 off between two runs),
    while the kernels compute theirs in IEEE float32."""
    with jax.default_matmul_precision("highest"):
        return _tiny_llama_run(impl, page_size, kv_dtype, layers)


def _tiny_llama_run(impl: str, page_size: int, kv_dtype, layers: int):
    from jaxserve.models.arch_config import ArchConfig
    from jaxserve.models.weights import create_model
    from tests.models.model_utils import PagedRunner

    cfg = ArchConfig.from_hf({**TINY_LLAMA, "num_hidden_layers": layers})
    model = create_model(cfg, dtype=jnp.float32, seed=7, attention_impl=impl)
    assert model.attn_spec.impl == impl  # the impl string reaches the attention op
    rng = np.random.default_rng(3)
    seqs = [rng.integers(0, cfg.vocab_size, size=n).tolist() for n in (21, 16, 5)]
    run = PagedRunner(model, page_size=page_size, num_pages=32, seed=11, dtype=kv_dtype)
    kw = dict(num_tokens=32, num_reqs=4, pages_per_req=4)
    logits = []
    # step 1: seq 0 partial prefill (17 tokens), seq 2 full prefill
    logits += run.step([(0, seqs[0][:17], 0), (2, seqs[2], 0)], **kw)
    # step 2: seq 0 rest (chunked prefill), seq 1 prefill
    logits += run.step([(0, seqs[0][17:], 17), (1, seqs[1], 0)], **kw)
    # greedy decode, all three sequences per step
    toks = [int(np.argmax(lg[-1])) for lg in (logits[2], logits[3], logits[1])]
    lens = [len(s) for s in seqs]
    greedy = []
    for _ in range(4):
        out = run.step([(i, [toks[i]], lens[i]) for i in range(3)], **kw)
        logits += out
        lens = [x + 1 for x in lens]
        toks = [int(np.argmax(o[-1])) for o in out]
        greedy.append(toks)
    return [np.asarray(x) for x in logits], greedy
