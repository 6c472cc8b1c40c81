"""Lane-dense KV pages: zero KV heads appended where the TPU kernel needs rows of Hkv x D a
multiple of 128 lanes (DESIGN §9, "Lane-dense KV pages").

- the decision (`ops.lane_dense_kv_heads`, `recipe.serving_arch`, the engine's plan): which
  shapes are padded on which backend, with which tensor-parallel split, and when not;
- the padded model computes what the checkpoint's does: a default-model-shaped tiny Llama (9
  query heads, 3 KV heads of 64) served with 4 KV heads gives the same prompt log-probs and
  greedy tokens, batched, with the reference attention and the TPU kernel in interpret mode
  (which refuses the unpadded rows of 192); a Qwen2 (q/k/v biases) likewise, its real heads'
  weights untouched and in their GQA groups; gpt-oss (attention sinks) likewise; Gemma 2's
  scale and soft cap stay the checkpoint's;
- tensor parallelism over 2 simulated devices splits the 4 padded KV heads 2 and 2;
- shard-plan's plan and KV record count the padded heads;
- a quantized cache's per-head scales: 1.0 for the zero heads; LoRA refuses a padded model.
"""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.backends import select_backend
from jaxserve.backends.devices import DeviceSet
from jaxserve.config import EngineConfig
from jaxserve.engine.plan import ModelFiles, plan_engine
from jaxserve.models.arch_config import ArchConfig
from jaxserve.models.sharding import DEFAULT_RULES
from jaxserve.models.weights import create_model
from jaxserve.pallas_kernels.ragged_paged_attention.ops import lane_dense_kv_heads
from jaxserve.runner.recipe import serving_arch
from jaxserve.tools.shard_plan import PRESET_DIR
from tests.models.model_utils import PagedRunner

# SmolLM2-135M's attention shape (9 query heads, 3 KV heads of 64) in a tiny model.
SMOL_SHAPED = {
    "architectures": ["LlamaForCausalLM"], "vocab_size": 256, "hidden_size": 128,
    "intermediate_size": 256, "num_hidden_layers": 1, "num_attention_heads": 9,
    "num_key_value_heads": 3, "head_dim": 64, "max_position_embeddings": 512, "rms_norm_eps": 1e-5,
}
QWEN2 = {**SMOL_SHAPED, "architectures": ["Qwen2ForCausalLM"], "num_attention_heads": 6,
         "num_key_value_heads": 3}
PAGE, PAGES = 16, 40
PROMPTS = [37, 5, 20]  # prompt lengths, one batch: prefills of several pages, partial pages


def hf_tensors(cfg: ArchConfig, seed: int = 0) -> dict[str, np.ndarray]:
    """Random float32 weights of `cfg` under transformers' names ([out, in] projections)."""
    rng = np.random.default_rng(seed)
    E, Hq, Hkv, D, F = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size

    def r(*shape):
        return (rng.standard_normal(shape) * 0.2).astype(np.float32)

    t = {"model.embed_tokens.weight": r(cfg.vocab_size, E), "model.norm.weight": 1 + r(E),
         "lm_head.weight": r(cfg.vocab_size, E)}
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        t.update({p + "input_layernorm.weight": 1 + r(E), p + "post_attention_layernorm.weight": 1 + r(E),
                  p + "self_attn.q_proj.weight": r(Hq * D, E), p + "self_attn.k_proj.weight": r(Hkv * D, E),
                  p + "self_attn.v_proj.weight": r(Hkv * D, E), p + "self_attn.o_proj.weight": r(E, Hq * D),
                  p + "mlp.gate_proj.weight": r(F, E), p + "mlp.up_proj.weight": r(F, E),
                  p + "mlp.down_proj.weight": r(E, F)})
        if cfg.qkv_bias:
            t.update({p + "self_attn.q_proj.bias": r(Hq * D), p + "self_attn.k_proj.bias": r(Hkv * D),
                      p + "self_attn.v_proj.bias": r(Hkv * D)})
    return t


def prompts(seed: int = 1, vocab: int = 256) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, vocab, n).tolist() for n in PROMPTS]


def run(model, steps: int = 2, mesh=None, vocab: int = 256):
    """(each prompt's log-probs of its own next tokens, each prompt's greedy continuation of
    `steps` tokens), the prompts batched in one prefill, then batched decode steps."""
    runner = PagedRunner(model, page_size=PAGE, num_pages=PAGES, mesh=mesh)
    seqs = prompts(vocab=vocab)
    logits = runner.step([(i, s, 0) for i, s in enumerate(seqs)], num_tokens=64, num_reqs=4, pages_per_req=4)
    logprobs = [np.take_along_axis(np.asarray(jax.nn.log_softmax(jnp.asarray(lg[:-1]), -1)),
                                   np.asarray(s[1:])[:, None], -1)[:, 0] for lg, s in zip(logits, seqs)]
    greedy = [[int(lg[-1].argmax())] for lg in logits]
    for _ in range(steps - 1):
        chunks = [(i, [g[-1]], len(s) + len(g) - 1) for i, (s, g) in enumerate(zip(seqs, greedy))]
        out = runner.step(chunks, num_tokens=8, num_reqs=4, pages_per_req=4)
        for g, lg in zip(greedy, out):
            g.append(int(lg[-1].argmax()))
    return logprobs, greedy, runner


@pytest.fixture(scope="module")
def smol():
    cfg = ArchConfig.from_hf(SMOL_SHAPED)
    tensors = hf_tensors(cfg)
    model = create_model(cfg, attention_impl="reference", get_tensor=tensors.__getitem__)
    return cfg, tensors, run(model)


# ------------------------------------------------------------------------------ the decision
@pytest.mark.parametrize("impl, heads, head_dim, split, served", [
    ("tpu", 3, 64, 1, 4),  # SmolLM2: rows of 192 -> 256
    ("tpu-interpret", 3, 64, 1, 4),
    ("tpu", 3, 64, 2, 4),  # 2 heads of 64 a device
    ("tpu", 3, 64, 4, 8),
    ("tpu", 1, 64, 1, 2),  # one KV head (MQA)
    ("tpu", 5, 128, 1, 5),  # already lane-dense
    ("tpu", 8, 64, 1, 8),
    ("tpu", 3, 96, 1, 4),  # 384 lanes
    ("tpu", 2, 80, 1, 8),  # 640 lanes
    ("reference", 3, 64, 1, 3), ("cpu", 3, 64, 1, 3), ("gpu", 3, 64, 1, 3),
    ("gpu-mosaic", 3, 64, 1, 3), ("gpu-interpret", 3, 64, 1, 3),
])
def test_which_shapes_are_padded_for_which_implementation(impl, heads, head_dim, split, served):
    assert lane_dense_kv_heads(impl, heads, head_dim, split) == served


class _Mesh:  # a mesh's shape, as the plan passes it
    def __init__(self, model: int):
        self.shape = {"data": 1, "model": model}


@pytest.mark.parametrize("platform, requested, model_axis, page_size, rules, served", [
    ("tpu", "auto", 1, 16, None, 4),
    ("tpu", "auto", 2, 16, None, 4),
    ("tpu", "auto", 4, 16, None, 8),
    ("tpu", "auto", 2, 16, "tp-kv-replicated", 4),  # heads replicated: 4 on each device
    ("tpu", "auto", 1, 8, None, 3),  # bfloat16 pages of 8 rows: the kernel refuses anyway
    ("tpu", "reference", 1, 16, None, 3),
    ("cpu", "auto", 1, 16, None, 3),
    ("gpu", "auto", 1, 16, None, 3),
    ("cpu", "tpu-interpret", 1, 16, None, 4),  # forced by name: how these tests pad on a CPU
])
def test_serving_arch_pads_only_where_the_tpu_kernel_then_runs(platform, requested, model_axis, page_size,
                                                               rules, served):
    from jaxserve.models.sharding import RULE_PRESETS

    cfg = ArchConfig.from_hf(SMOL_SHAPED)
    out = serving_arch(requested, platform, cfg, _Mesh(model_axis), RULE_PRESETS[rules] if rules else DEFAULT_RULES,
                       page_size, jnp.bfloat16, jnp.bfloat16)
    assert out.num_kv_heads == served and out.num_heads == 3 * served
    assert out.checkpoint_config() == cfg and out.head_dim == 64
    assert serving_arch(requested, platform, cfg, _Mesh(model_axis), DEFAULT_RULES, page_size, jnp.bfloat16,
                        jnp.bfloat16, lora=True) == cfg  # adapters hold the checkpoint's heads


def test_the_engine_plan_serves_the_default_model_on_a_tpu_with_its_kernel():
    """SmolLM2 on one v6e chip: 4 KV heads, the TPU kernel, the reason and the recipe say so,
    and the KV budget's bytes per page grow by a third; on this CPU nothing changes."""
    from jaxserve.runner.kv_cache import bytes_per_page

    files = ModelFiles(None, json.loads((PRESET_DIR / "smollm2-135m.json").read_text()))
    tpu = plan_engine(EngineConfig.from_kwargs(model="smollm2-135m"), files, select_backend("tpu"),
                      DeviceSet.described("tpu", "TPU v6 lite", 1, slice_shape=(1, 1)))
    assert tpu.attention_impl == "tpu" and (tpu.arch.num_heads, tpu.arch.num_kv_heads) == (12, 4)
    note = "KV heads padded 3 -> 4 for lane-dense TPU pages (+33 % KV bytes)"
    assert tpu.arch.kv_padding_note() == note and note in tpu.reasons["attention"]
    assert f"pages of 4 KV heads ({note})" in tpu.reasons["kv_cache"]
    recipe = tpu.recipe(num_pages=8, max_model_len=256)
    assert recipe.kv_heads == 4 and recipe.arch_config() == tpu.arch
    stored = tpu.arch.checkpoint_config()
    assert bytes_per_page(tpu.arch, 16, jnp.bfloat16) * 3 == bytes_per_page(stored, 16, jnp.bfloat16) * 4
    cpu = plan_engine(EngineConfig.from_kwargs(model="smollm2-135m", dtype="float32"), files,
                      select_backend("cpu"), DeviceSet.described("cpu", "cpu", 1))
    assert cpu.arch.checkpoint_heads is None and cpu.recipe(num_pages=8, max_model_len=256).kv_heads == 0


def test_shard_plans_memory_report_counts_the_padded_heads():
    """`jaxserve shard-plan`'s plan and KV record for a TPU kernel named on this host: 4 KV heads,
    the recipe carries them, and a page's bytes are 4/3 of the checkpoint's."""
    from jaxserve.models.sharding import single_device_mesh
    from jaxserve.tools.plan_compile import PlanSettings, kv_record, plan_recipe, resolve_plan

    settings = PlanSettings(arch=SMOL_SHAPED, platform="cpu", max_model_len=64, max_num_seqs=2,
                            dtype="float32", attention_impl="tpu-interpret")
    cfg, mesh = ArchConfig.from_hf(SMOL_SHAPED), single_device_mesh()
    plan = resolve_plan(settings, cfg, mesh, DEFAULT_RULES)
    assert plan["attention_impl"] == "tpu-interpret" and plan["kv_heads"] == 4
    assert plan["kv_heads_note"] == "KV heads padded 3 -> 4 for lane-dense TPU pages (+33 % KV bytes)"
    padded, _, _ = kv_record(settings, cfg.with_kv_heads(4), mesh, DEFAULT_RULES, plan["kv_dtype"])
    stored, _, _ = kv_record(settings, cfg, mesh, DEFAULT_RULES, plan["kv_dtype"])
    assert padded["bytes_per_page_per_device"] * 3 == stored["bytes_per_page_per_device"] * 4
    assert plan_recipe(settings, cfg, mesh, DEFAULT_RULES, plan, 8).arch_config() == cfg.with_kv_heads(4)


def test_models_that_cannot_be_padded_say_why():
    from tests.model_dirs import DATA

    smol = ArchConfig.from_hf(SMOL_SHAPED)
    with pytest.raises(ValueError, match="cannot serve 3 KV heads as 2"):
        smol.with_kv_heads(2)
    assert smol.with_kv_heads(3) == smol and smol.kv_padding_note() is None
    mla = ArchConfig.from_hf(json.loads((DATA / "deepseek_v3" / "config.json").read_text()))
    with pytest.raises(ValueError, match="multi-head latent attention"):
        mla.with_kv_heads(mla.num_kv_heads + 1)
    assert serving_arch("tpu-interpret", "cpu", mla, _Mesh(1), DEFAULT_RULES, 16, jnp.bfloat16,
                        jnp.bfloat16) == mla


# ------------------------------------------------------------------------------ exactness
@pytest.mark.parametrize("impl", ["reference", "tpu-interpret"])
def test_the_padded_default_shape_computes_what_the_checkpoint_does(smol, impl):
    cfg, tensors, (want_lp, want_greedy, _) = smol
    padded = cfg.with_kv_heads(4)
    assert (padded.num_heads, padded.num_kv_heads, padded.head_dim) == (12, 4, 64)
    model = create_model(padded, attention_impl=impl, get_tensor=tensors.__getitem__)
    got_lp, got_greedy, runner = run(model)
    assert runner.kv.k[0].shape[-1] == 256  # lane-dense rows
    for got, want in zip(got_lp, want_lp):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    assert got_greedy == want_greedy


def test_the_tpu_kernel_refuses_the_unpadded_rows(smol):
    cfg, tensors, _ = smol
    model = create_model(cfg, attention_impl="tpu-interpret", get_tensor=tensors.__getitem__)
    with pytest.raises(ValueError, match="multiple of 128"):
        run(model, steps=1)


def test_qwen2_biases_and_gqa_groups_survive_padding():
    """Qwen2 (q/k/v biases; 6 query heads over 3 KV heads, groups of 2) served with 4 KV heads:
    the real heads' weights and biases are the checkpoint's, in place (query head h still reads
    KV head h // 2), the appended ones are zeros, and the outputs are the checkpoint's."""
    cfg = ArchConfig.from_hf(QWEN2)
    assert cfg.qkv_bias
    tensors = hf_tensors(cfg, seed=3)
    base = create_model(cfg, attention_impl="reference", get_tensor=tensors.__getitem__)
    padded = create_model(cfg.with_kv_heads(4), attention_impl="reference", get_tensor=tensors.__getitem__)
    b, p = base.layers[0], padded.layers[0]
    for name, real in (("wq", 6), ("bq", 6)):
        got = np.asarray(getattr(p, name)[...])
        np.testing.assert_array_equal(got[..., :real, :] if name == "wq" else got[:real],
                                      np.asarray(getattr(b, name)[...]))
        assert not np.any(got[..., real:, :] if name == "wq" else got[real:])
    for name in ("wk", "wv"):
        got = np.asarray(getattr(p, name)[...])
        np.testing.assert_array_equal(got[:, :3], np.asarray(getattr(b, name)[...]))
        assert not np.any(got[:, 3:])
    for name in ("bk", "bv"):
        got = np.asarray(getattr(p, name)[...])
        np.testing.assert_array_equal(got[:3], np.asarray(getattr(b, name)[...]))
        assert not np.any(got[3:])
    wo = np.asarray(p.wo[...])  # [Hq, D, E]: the appended heads' rows are zero
    np.testing.assert_array_equal(wo[:6], np.asarray(b.wo[...]))
    assert not np.any(wo[6:])
    want_lp, want_greedy, _ = run(base, steps=1)
    got_lp, got_greedy, _ = run(padded, steps=1)
    for got, want in zip(got_lp, want_lp):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    assert got_greedy == want_greedy


def test_gpt_oss_sinks_padded_compute_what_the_checkpoint_does():
    """gpt-oss (attention sinks: zero logits for the added query heads, whose values are zero)
    served with twice its KV heads: the same prompt log-probs and first greedy tokens."""
    from jaxserve.models.loader import load_checkpoint
    from tests.model_dirs import DATA

    ckpt = load_checkpoint(DATA / "gpt_oss")
    cfg = ArchConfig.from_hf(ckpt.config)
    base = create_model(cfg, attention_impl="reference", get_tensor=ckpt.get_tensor)
    padded = create_model(cfg.with_kv_heads(2 * cfg.num_kv_heads), attention_impl="reference",
                          get_tensor=ckpt.get_tensor)
    sinks = np.asarray(padded.layers[0].sinks[...])
    np.testing.assert_array_equal(sinks[:cfg.num_heads], np.asarray(base.layers[0].sinks[...]))
    assert not np.any(sinks[cfg.num_heads:])
    want_lp, want_greedy, _ = run(base, steps=1, vocab=cfg.vocab_size)
    got_lp, got_greedy, _ = run(padded, steps=1, vocab=cfg.vocab_size)
    for got, want in zip(got_lp, want_lp):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    assert got_greedy == want_greedy


def test_gemmas_scale_and_soft_cap_are_the_checkpoints():
    """Gemma 2's attention scale (query_pre_attn_scalar ** -0.5, not the head count's) and soft
    cap are per head: a padded model's layers attend with the checkpoint's settings."""
    from jaxserve.models.loader import load_checkpoint
    from tests.model_dirs import DATA

    ckpt = load_checkpoint(DATA / "gemma2")
    cfg = ArchConfig.from_hf(ckpt.config)
    base = create_model(cfg, attention_impl="reference", get_tensor=ckpt.get_tensor)
    padded = create_model(cfg.with_kv_heads(8), attention_impl="reference", get_tensor=ckpt.get_tensor)
    assert [la.attn_spec for la in padded.layers] == [la.attn_spec for la in base.layers]
    assert base.layers[0].attn_spec.sm_scale == cfg.query_pre_attn_scalar ** -0.5
    assert base.layers[0].attn_spec.soft_cap is not None


def test_tensor_parallel_splits_the_padded_heads(smol):
    """TP=2 over simulated devices: 3 KV heads cannot be split (replicated), 4 are, 2 a device;
    the outputs are the unsharded checkpoint's."""
    from jaxserve.parallel.mesh import make_mesh

    if len(jax.devices()) < 2:
        pytest.skip("needs 2 (simulated) devices")
    cfg, tensors, (want_lp, want_greedy, _) = smol
    mesh = make_mesh(1, 2, devices=jax.devices()[:2])
    model = create_model(cfg.with_kv_heads(4), attention_impl="reference", get_tensor=tensors.__getitem__,
                         mesh=mesh)
    got_lp, got_greedy, runner = run(model, mesh=mesh)
    k0 = runner.kv.k[0]
    assert k0.sharding.shard_shape(k0.shape)[-1] == 128  # 2 heads of 64 on each device
    for got, want in zip(got_lp, want_lp):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    assert got_greedy == want_greedy


# ------------------------------------------------------------------------------ the rest
def test_kv_scales_of_the_appended_heads_are_one(smol):
    from jaxserve.runner.kv_scales import padded_head_scales

    padded = smol[0].with_kv_heads(4)
    per_head = [((0.5, 0.25, 0.125), (2.0,)), ((0.5, 0.25, 0.125, 1e-6), (3.0, 3.0, 3.0, 1e-6))]
    assert padded_head_scales(per_head, padded) == [((0.5, 0.25, 0.125, 1.0), (2.0,)),
                                                    ((0.5, 0.25, 0.125, 1.0), (3.0, 3.0, 3.0, 1.0))]
    assert padded_head_scales(per_head[:1], smol[0]) == per_head[:1]


def test_lora_refuses_a_padded_model_by_name(smol):
    from jaxserve.config import LoRAConfig
    from jaxserve.models.sharding import single_device_mesh
    from jaxserve.runner.lora_weights import LoRAWeights

    with pytest.raises(ValueError, match="LoRA adapters hold the checkpoint's heads"):
        LoRAWeights(smol[0].with_kv_heads(4), LoRAConfig(enable_lora=True, max_loras=1, max_lora_rank=8),
                    jnp.float32, single_device_mesh())
