"""DeepSeek V3 (models/deepseek_v3.py) on its fixtures (tests/data/arch/deepseek_v3: q_lora,
interleaved RoPE, YaRN with both mscales, grouped routing with a shared expert, attention
biases; deepseek_v3_lite: V2-Lite's shape, q_lora_rank None): through the engine's LLM path
(the paged latent cache, MLA's split prefill forced, the CPU backend) the prompt log-probs are
transformers' and the greedy tokens transformers' `generate`, the same in one batch and one at
a time; tensor-parallel over 2
simulated devices (heads split, the latent cache whole on each) chunked prefill and decode
steps give transformers' logits; an fp8 latent cache keeps transformers' greedy tokens with
its prompt log-probs within fp8's drift; config.json, the cache's shape, the routing and the MTP
layers' weights. Both fixtures' logits in one step: test_arch_parity; the attention op against
a float64 oracle: tests/pallas_kernels/test_mla_attention.py."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P
from jaxserve.models.arch_config import ArchConfig
from jaxserve.models.deepseek_v3 import route_noaux_tc, softmax_scale
from jaxserve.models.weights import create_model

from jaxserve.parallel.mesh import make_mesh
from jaxserve.runner.kv_cache import allocate_kv_cache, bytes_per_page, kv_cache_shape
from tests.model_dirs import write_model_dir
from tests.models.model_utils import PagedRunner
from tests.models.test_arch_parity import load_fixture

CASES = ["deepseek_v3", "deepseek_v3_lite"]
GREEDY_TOKENS = 8  # scripts/make_arch_fixtures.py: the continuation transformers recorded


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


@pytest.fixture(scope="module", params=CASES)
def llm(request, data_dir, tmp_path_factory, compile_cache_dir):
    """(its expected.safetensors, an LLM serving the fixture in float32), its step compiled
    with MLA's split prefill (own rows expanded, cached context absorbed: models/layers/mla.py;
    the fixture's dims are too small for the cost model to choose it, so it is forced while
    the engine compiles, and the compiled step shows it)."""
    from jaxserve import LLM
    from jaxserve.models.layers.mla import PREFILL_FORM_ENV

    name = request.param
    model = write_model_dir(tmp_path_factory.mktemp(name), name)
    with pytest.MonkeyPatch.context() as env:
        env.setenv(PREFILL_FORM_ENV, "split")
        engine = LLM(model=str(model), dtype="float32", max_num_seqs=4,
                     max_num_batched_tokens=32, token_buckets=(32,), request_buckets=(4,),
                     max_model_len=32, num_pages=16, page_size=8,
                     compilation_cache_dir=compile_cache_dir, show_progress=False)
    assert "mla_split_prefill" in engine.engine.runner.executable((32, 4)).as_text()
    return load_fixture(data_dir, name)[2], engine


def _generate(engine, prompts):
    from jaxserve import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=GREEDY_TOKENS, ignore_eos=True,
                            logprobs=1, prompt_logprobs=0)
    return engine.generate(prompts, params, use_tqdm=False)


def test_prompt_logprobs_and_greedy_tokens_match_transformers(llm):
    """Both prompts in one batch: each prompt token's log-prob is transformers' (1e-4), the
    greedy continuation is transformers' `generate`; then each prompt alone gives the same."""
    expected, engine = llm
    prompts = [expected[f"tokens_{i}"].tolist() for i in range(2)]
    together = _generate(engine, prompts)
    for i, (ids, out) in enumerate(zip(prompts, together)):
        want = _log_softmax(expected[f"logits_{i}"])
        plp = out.prompt_logprobs
        assert plp[0] is None and len(plp) == len(ids)
        got = [plp[j][ids[j]].logprob for j in range(1, len(ids))]
        np.testing.assert_allclose(got, [want[j - 1, ids[j]] for j in range(1, len(ids))],
                                   atol=1e-4, rtol=0)
        assert list(out.outputs[0].token_ids) == expected[f"greedy_{i}"].tolist(), i
    for ids, both in zip(prompts, together):
        (alone,) = _generate(engine, [ids])
        assert alone.outputs[0].token_ids == both.outputs[0].token_ids
        np.testing.assert_allclose(_token_logprobs(alone), _token_logprobs(both), atol=1e-5)


def _token_logprobs(out) -> list[float]:
    c = out.outputs[0]
    return [d[t].logprob for d, t in zip(c.logprobs, c.token_ids)]


@pytest.mark.parametrize("form", ["absorbed", "split"])
def test_tensor_parallel_chunked_prefill_and_decode_match_transformers(data_dir, form,
                                                                       monkeypatch):
    """Over 2 simulated devices: the heads split over "model" (the latent cache whole on each
    device); the first sequence in chunks of 5, then token by token beside the second's
    prefill in chunks of 3: the latent rows of earlier steps are read back; the logits stay
    transformers', all absorbed and split (own rows expanded, context absorbed)."""
    from jaxserve.models.layers.mla import PREFILL_FORM_ENV

    monkeypatch.setenv(PREFILL_FORM_ENV, form)
    cfg, tensors, expected = load_fixture(data_dir, "deepseek_v3")
    mesh = make_mesh(1, 2)
    model = create_model(cfg, dtype=jnp.float32, get_tensor=tensors.__getitem__, mesh=mesh)
    assert model.layers[0].wq_b[...].sharding.spec == P(None, "model", None)
    assert model.layers[0].w_uk[...].sharding.spec == P("model", None, None)
    runner = PagedRunner(model, page_size=4, num_pages=16, seed=1, mesh=mesh)
    assert runner.kv.v == () and runner.kv.k[0].sharding.is_fully_replicated
    a, b = (expected[f"tokens_{i}"].tolist() for i in range(2))
    out = [[], []]
    plan = [[(0, 0, 5)], [(0, 5, 10)], [(0, 10, 11), (1, 0, 3)], [(0, 11, 12), (1, 3, 6)],
            [(0, 12, 13), (1, 6, 7)]]
    for step in plan:
        chunks = [(s, (a, b)[s][lo:hi], lo) for s, lo, hi in step]
        for (s, _, _), logits in zip(chunks, runner.step(chunks, num_tokens=16, num_reqs=4,
                                                         pages_per_req=4)):
            out[s].append(logits)
    for i in range(2):  # 1e-5: tight enough to tell the attention norms' epsilon (1e-6) apart
        np.testing.assert_allclose(np.concatenate(out[i]), expected[f"logits_{i}"], atol=1e-5,
                                   rtol=0)


# ------------------------------------------------------------------ config, cache, routing


def test_config_and_the_latent_cache(data_dir):
    """config.json as transformers writes it; the cache: one array of 128-wide latent rows per
    layer (32 latent + 16 roped key), no V arrays; the scale with YaRN's mscale_all_dim."""
    cfg, _, _ = load_fixture(data_dir, "deepseek_v3")
    assert (cfg.q_lora_rank, cfg.kv_lora_rank, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim,
            cfg.v_head_dim) == (48, 112, 16, 16, 16)
    assert cfg.rope_interleave and (cfg.n_group, cfg.topk_group, cfg.n_shared_experts) == (4, 2, 1)
    assert [cfg.is_moe_layer(i) for i in range(3)] == [False, True, True]
    assert cfg.routed_scaling_factor == 2.5 and cfg.num_mtp_layers == 0
    assert cfg.rope_scaling.rope_type == "yarn" and cfg.rope_scaling.mscale_all_dim == 0.8
    m = 0.1 * 0.8 * np.log(4.0) + 1.0
    assert softmax_scale(cfg) == pytest.approx(32**-0.5 * m * m)
    assert (cfg.kv_cache_heads, cfg.kv_cache_head_dim, cfg.kv_cache_arrays) == (1, 128, 1)
    assert kv_cache_shape(cfg, 5, 8) == (5, 8, 128)
    assert bytes_per_page(cfg, 8, jnp.bfloat16) == 3 * 8 * 128 * 2  # layers x tokens x row
    from jaxserve.models.sharding import single_device_mesh

    kv = allocate_kv_cache(cfg, 3, 8, jnp.float32, single_device_mesh())
    assert len(kv.k) == 3 and kv.v == ()
    lite, _, _ = load_fixture(data_dir, "deepseek_v3_lite")
    assert lite.q_lora_rank is None and not lite.rope_interleave and lite.n_group == 1


def test_what_it_cannot_serve_is_refused_by_name(data_dir):
    """Other routings, groups that do not split the experts, a checkpoint's per-KV-head cache
    scales (a latent cache takes one k_scale per layer), quantized weights."""
    import json

    from jaxserve.models.deepseek_v3 import DeepseekV3ForCausalLM

    from jaxserve.runner.kv_scales import latent_scales

    raw = json.loads((data_dir / "arch" / "deepseek_v3" / "config.json").read_text())
    with pytest.raises(ValueError, match="scoring_func='softmax'"):
        ArchConfig.from_hf({**raw, "scoring_func": "softmax"})
    with pytest.raises(ValueError, match="n_group=3 equal groups"):
        ArchConfig.from_hf({**raw, "n_group": 3})
    fp8 = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
           "weight_block_size": [128, 128]}  # V3's hub checkpoint
    with pytest.raises(ValueError, match="mixture-of-experts models .DeepseekV3ForCausalLM."):
        ArchConfig.from_hf({**raw, "quantization_config": fp8})
    cfg = ArchConfig.from_hf(raw)
    with pytest.raises(ValueError, match="a latent cache takes one k_scale per layer"):
        latent_scales([((0.5, 0.25), (0.5, 0.25))])  # per KV head: the latent has one head
    with pytest.raises(ValueError, match="float weights only"):
        DeepseekV3ForCausalLM(cfg, dtype=jnp.float32, rngs=None, quantization="int8")


def test_grouped_routing_chooses_with_the_bias_and_weighs_without_it():
    """8 experts in 4 groups of 2, the best 2 groups eligible, top 2, a bias on expert 6: it
    brings expert 6 (and its group) into token 0's choice, whose weights are still the
    unbiased sigmoid scores, renormalised, times the scaling factor; token 1's best single
    expert (0) is left out with its group, whose two best scores sum lower than two others'."""
    logits = np.array([[1.5, 1.4, 0.0, 0.0, 0.0, 0.0, -2.0, 0.0],
                       [2.0, -3.0, 1.0, 1.0, 0.8, 0.8, -3.0, -3.0]], np.float32)
    bias = np.array([0, 0, 0, 0, 0, 0, 0.9, 0], np.float32)
    w, ids = route_noaux_tc(jnp.asarray(logits), jnp.asarray(bias), top_k=2, n_group=4,
                            topk_group=2, normalize=True, scaling=2.5)
    s = 1 / (1 + np.exp(-logits.astype(np.float64)))
    assert sorted(np.asarray(ids[0]).tolist()) == [0, 6]
    assert sorted(np.asarray(ids[1]).tolist()) == [2, 3]
    for t in range(2):
        chosen = s[t, np.asarray(ids[t])]
        np.testing.assert_allclose(np.asarray(w[t]), 2.5 * chosen / chosen.sum(), rtol=1e-6)
    w, _ = route_noaux_tc(jnp.asarray(logits), jnp.asarray(bias), top_k=2, n_group=4,
                          topk_group=2, normalize=False, scaling=1.0)
    np.testing.assert_allclose(np.asarray(w[0]), s[0, np.asarray(ids[0])], rtol=1e-6)


def test_mtp_layer_weights_are_loaded_and_kept(data_dir):
    """A checkpoint with one MTP layer (`model.layers.3.*`: enorm, hnorm, eh_proj,
    shared_head.norm and a decoder layer with routed and shared experts) loads onto
    `model.mtp[0]`, its projections in our layouts; the logits are those without it."""
    cfg, tensors, expected = load_fixture(data_dir, "deepseek_v3")
    cfg = dataclasses.replace(cfg, num_mtp_layers=1)
    rng = np.random.default_rng(0)
    extra = {}
    for name, value in tensors.items():
        if name.startswith("model.layers.2."):  # a MoE layer's tensors, renamed and redrawn
            extra[name.replace("layers.2.", "layers.3.")] = rng.standard_normal(
                value.shape).astype(np.float32)
    E = cfg.hidden_size
    for name, shape in (("enorm.weight", (E,)), ("hnorm.weight", (E,)),
                        ("eh_proj.weight", (E, 2 * E)), ("shared_head.norm.weight", (E,))):
        extra["model.layers.3." + name] = rng.standard_normal(shape).astype(np.float32)
    model = create_model(cfg, dtype=jnp.float32, get_tensor={**tensors, **extra}.__getitem__)
    mtp = model.mtp[0]
    np.testing.assert_array_equal(mtp.eh_proj[...], extra["model.layers.3.eh_proj.weight"].T)
    np.testing.assert_array_equal(mtp.enorm[...], extra["model.layers.3.enorm.weight"])
    np.testing.assert_array_equal(mtp.final_norm[...],
                                  extra["model.layers.3.shared_head.norm.weight"])
    kv_b = extra["model.layers.3.self_attn.kv_b_proj.weight"].reshape(4, 32, cfg.kv_lora_rank)
    np.testing.assert_array_equal(mtp.block.w_uk[...], kv_b[:, :16])
    np.testing.assert_array_equal(mtp.block.e_bias[...],
                                  extra["model.layers.3.mlp.gate.e_score_correction_bias"])
    np.testing.assert_array_equal(mtp.block.x_down[...][5],
                                  extra["model.layers.3.mlp.experts.5.down_proj.weight"].T)
    assert mtp.block.is_moe and mtp.block.s_up[...].shape == (E, 32)
    runner = PagedRunner(model, page_size=4, num_pages=16)
    seq = expected["tokens_1"].tolist()
    (logits,) = runner.step([(0, seq, 0)], num_tokens=16, num_reqs=2, pages_per_req=4)
    np.testing.assert_allclose(logits, expected["logits_1"], atol=1e-4, rtol=0)


# DeepSeek-V3's config.json on the hub (its quantization_config left out: the float conversion)
V3_HUB = {
    "architectures": ["DeepseekV3ForCausalLM"], "vocab_size": 129280, "hidden_size": 7168,
    "intermediate_size": 18432, "moe_intermediate_size": 2048, "num_hidden_layers": 61,
    "num_attention_heads": 128, "num_key_value_heads": 128, "n_shared_experts": 1,
    "n_routed_experts": 256, "routed_scaling_factor": 2.5, "kv_lora_rank": 512,
    "q_lora_rank": 1536, "qk_rope_head_dim": 64, "v_head_dim": 128, "qk_nope_head_dim": 128,
    "topk_method": "noaux_tc", "n_group": 8, "topk_group": 4, "num_experts_per_tok": 8,
    "first_k_dense_replace": 3, "norm_topk_prob": True, "scoring_func": "sigmoid",
    "hidden_act": "silu", "max_position_embeddings": 163840, "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False, "rope_theta": 10000, "num_nextn_predict_layers": 1,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0,
                     "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096,
                     "type": "yarn"},
}


def test_the_hub_config_builds_deepseek_v3s_671b_parameters():
    """V3's config.json (abstract shapes only): 671.0B parameters in the model (DeepSeek's
    published count) and 11.6B in the MTP layer (without its copies of the embedding and
    head); 576-wide latent rows; the scale 192 ** -0.5 * (0.1 ln 40 + 1) ** 2."""
    import math

    import jax
    from jaxserve.models.weights import abstract_model

    cfg = ArchConfig.from_hf(V3_HUB)
    _, state, _ = abstract_model(cfg, dtype=jnp.bfloat16)
    sizes = [(jax.tree_util.keystr(p), math.prod(x.shape))
             for p, x in jax.tree_util.tree_leaves_with_path(state)]
    mtp = sum(n for p, n in sizes if "mtp" in p)
    assert round((sum(n for _, n in sizes) - mtp) / 1e9, 1) == 671.0
    assert round(mtp / 1e9, 1) == 11.6
    assert (cfg.kv_cache_head_dim, cfg.num_mtp_layers, cfg.rope_interleave) == (576, 1, True)
    assert softmax_scale(cfg) == pytest.approx(192**-0.5 * (0.1 * np.log(40) + 1) ** 2)
    # what the engine plans for its attention: MLA's own GPU kernel; the reference on TPUs
    from jaxserve.runner.recipe import target_attention

    plan = lambda platform: target_attention("auto", platform, cfg, None, None, 16,
                                             jnp.bfloat16, jnp.bfloat16)
    assert plan("gpu") == ("gpu", None)
    assert plan("tpu") == ("reference", "no tpu kernel takes 576-wide latent rows")


def test_bfloat16_weights_and_cache_run_on_the_cpu(data_dir):
    """bfloat16 weights and latent cache (the per-head absorbed products head-major: XLA:CPU
    has no bfloat16 batched dot with the batch dim in the middle): transformers' float32
    logits within bfloat16's rounding."""
    cfg, tensors, expected = load_fixture(data_dir, "deepseek_v3_lite")
    model = create_model(cfg, dtype=jnp.bfloat16, get_tensor=tensors.__getitem__)
    runner = PagedRunner(model, page_size=4, num_pages=16, dtype=jnp.bfloat16)
    seq = expected["tokens_0"].tolist()
    (logits,) = runner.step([(0, seq, 0)], num_tokens=16, num_reqs=2, pages_per_req=4)
    np.testing.assert_allclose(logits, expected["logits_0"], atol=0.1, rtol=0)


@pytest.mark.parametrize("impl", ["gpu-interpret", "tpu-interpret", "cpu"])
def test_each_attention_implementation_on_the_latent_cache(data_dir, impl):
    """The fixture's logits through each attention implementation reading the latent pages
    (the reference: test_arch_parity): MLA's own Triton kernel and the TPU kernel in interpret
    mode (the fixture's rows are 128 wide, lane-dense), the CPU kernel; a chunked prefill then
    a decode step. (V3's 576-wide rows through each kernel, MLA's own TPU kernel among them,
    against a float64 oracle: tests/pallas_kernels/test_mla_attention.py.)"""
    import jaxserve.backends.cpu  # noqa: F401  (registers the "cpu" attention kernel)

    cfg, tensors, expected = load_fixture(data_dir, "deepseek_v3")
    model = create_model(cfg, dtype=jnp.float32, get_tensor=tensors.__getitem__,
                         attention_impl=impl)
    runner = PagedRunner(model, page_size=8, num_pages=16)
    seq = expected["tokens_0"].tolist()
    n = len(seq)
    kw = dict(num_tokens=16, num_reqs=2, pages_per_req=8)
    got = runner.step([(0, seq[: n - 5], 0)], **kw) + runner.step([(0, seq[n - 5: n - 1], n - 5)], **kw)
    got += runner.step([(0, seq[n - 1:], n - 1)], **kw)
    np.testing.assert_allclose(np.concatenate(got), expected["logits_0"][:n], atol=1e-4, rtol=0)



def test_an_fp8_latent_cache_keeps_transformers_tokens(data_dir, tmp_path_factory,
                                                       compile_cache_dir):
    """--kv-cache-dtype fp8 through the engine (its scales measured at start-up: the latent
    columns' and the rope columns' per layer): the prompt log-probs are transformers' within
    fp8's drift (measured 0.047 at most, 0.019 on average: docs/DESIGN.md's MLA section) and
    the greedy tokens its `generate`'s, both prompts in one batch."""
    from jaxserve import LLM

    model = write_model_dir(tmp_path_factory.mktemp("deepseek_v3_fp8"), "deepseek_v3")
    engine = LLM(model=str(model), dtype="float32", kv_cache_dtype="fp8", max_num_seqs=4,
                 max_num_batched_tokens=32, token_buckets=(32,), request_buckets=(4,),
                 max_model_len=32, num_pages=16, page_size=8,
                 compilation_cache_dir=compile_cache_dir, show_progress=False)
    assert str(engine.engine.runner.kv.k[0].dtype) == "float8_e4m3fn"
    k_scale, v_scale = engine.engine.runner.kv_scales[0]  # layer 0's
    assert len(k_scale) == 2 and k_scale[0] != k_scale[1] and v_scale == k_scale[:1]
    expected = load_fixture(data_dir, "deepseek_v3")[2]
    prompts = [expected[f"tokens_{i}"].tolist() for i in range(2)]
    for i, (ids, out) in enumerate(zip(prompts, _generate(engine, prompts))):
        want = _log_softmax(expected[f"logits_{i}"])
        plp = out.prompt_logprobs
        got = [plp[j][ids[j]].logprob for j in range(1, len(ids))]
        drift = np.abs(np.subtract(got, [want[j - 1, ids[j]] for j in range(1, len(ids))]))
        assert drift.max() < 0.1 and drift.mean() < 0.03, (i, drift.max(), drift.mean())
        assert np.any(drift > 1e-4)  # the one-byte pages were read
        assert list(out.outputs[0].token_ids) == expected[f"greedy_{i}"].tolist(), i
