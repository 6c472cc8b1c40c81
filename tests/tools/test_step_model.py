"""The step-time model's inputs against what the engine and the compiler do: weights and KV
bytes per device as `shard-plan` places them (8 simulated devices, replication included), and
the matmul flops of a compiled step as the HLO's dots count them."""

from __future__ import annotations

import pytest

from jaxserve.parallel.mesh import make_mesh
from jaxserve.tools.chips import CHIPS
from jaxserve.tools.plan_compile import PlanSettings, plan_one
from jaxserve.tools.step_model import Shapes, fits, layout, predict, step_cost

TINY = dict(
    architectures=["LlamaForCausalLM"],
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=16,
    max_position_embeddings=512,
    tie_word_embeddings=False,
)


@pytest.mark.parametrize("chips", [1, 8])
def test_layout_is_the_placement_and_flops_are_the_compiled_dots(chips):
    settings = PlanSettings(
        arch=TINY,
        platform="cpu",
        max_model_len=128,
        max_num_seqs=8,
        dtype="bfloat16",
        kv_cache_dtype="bfloat16",
    )
    rec = plan_one(settings, make_mesh(1, chips), "tp", (16, 8), "cpu")
    lay = layout(TINY, chips)
    assert lay.weight_bytes == rec["params"]["per_device"]
    assert (
        lay.kv_bytes_per_token == rec["kv"]["bytes_per_page_per_device"] // rec["kv"]["page_size"]
    )
    # 4 KV heads do not split 8 ways: K/V projections and the cache whole, attention replicated
    assert (lay.replicated, lay.local_q_heads) == (
        (("wk", "wv"), 8) if chips == 8 else ((), 8 // chips)
    )
    if chips > 1:  # the JAX sampler (the native one needs one device) adds dots of its own
        return
    # the compiled step's dots: the T-token matmuls, the LM head on R rows, and the sampler's
    # prompt-logprob branch (every token's logits; both branches of a cond are compiled);
    # attention and sampling are native kernels, custom calls
    T, R = 16, 8
    matmuls = (
        step_cost(Shapes.from_hf(TINY), lay, tokens=T, seqs=R, context=1, prefill=False).flops
        - 4 * R * lay.local_q_heads * 16 * 2
    )
    assert rec["cost"]["dot_flops"] == matmuls + 2 * T * lay.lm_head_params


def test_a_decode_step_is_bound_by_memory_and_a_prefill_by_compute():
    from jaxserve.tools.shard_plan import model_config

    hf = model_config("llama3-8b")[1]
    shapes, lay = Shapes.from_hf(hf), layout(hf, 1)
    assert round(lay.weight_bytes / 2**30, 2) == 14.96 and lay.kv_bytes_per_token == 131072
    h100 = CHIPS["h100"]
    one = predict(step_cost(shapes, lay, tokens=1, seqs=1, context=2048, prefill=False), h100)
    many = predict(step_cost(shapes, lay, tokens=256, seqs=256, context=2048, prefill=False), h100)
    prefill = predict(step_cost(shapes, lay, tokens=2048, seqs=1, context=0, prefill=True), h100)
    assert one.bound == many.bound == "memory" and prefill.bound == "compute"
    assert one.collective_s == 0 and one.memory_s == pytest.approx(
        lay.weight_bytes / h100.hbm_bandwidth, rel=0.05
    )
    assert many.seconds > one.seconds  # the KV cache of 256 sequences is read too
    assert fits(lay, h100, 8 * 2048) and not fits(lay, h100, 512 * 2048)
