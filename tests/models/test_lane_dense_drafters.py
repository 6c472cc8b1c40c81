"""Lane-dense KV pages for the drafters run inside the step (DESIGN §9, "Lane-dense KV pages"):
an EAGLE-3 head's layer and a draft model are served with zero KV heads appended where the TPU
kernel runs, as the target is, by the same decision (`recipe.serving_draft_heads`: `serving_arch`
of the drafter's own pages) and the same application (`ArchConfig.with_kv_heads`, the loaders'
`pad_heads`); MTP's layer is the target's own (MLA: never padded).

- the decision: which drafters are padded on which backend and attention, the engine's plan
  (`EnginePlan.with_drafter`: the recipe, the reason, the KV budget's bytes per page) and
  shard-plan's (the abstract step the compile workers build: padded weights and pages, and on a
  compile-only TPU the drafter's attention resolved to the TPU kernel);
- the padded drafters draft what the checkpoint's do: a SmolLM2-shaped EAGLE-3 head (9 query
  heads, 3 KV heads of 64; with the reference attention and the TPU kernel in interpret mode,
  which refuses the unpadded rows) and a Qwen2-shaped draft model (q/k/v biases; the TPU kernel)
  served with 4 KV heads give the checkpoint's drafts, outputs and real heads' keys over a
  ragged context pass and the chained passes of the drafting step (`DraftHead.layer` /
  `propose`, `chain_metadata`) with the reference attention.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import save_file

from jaxserve.backends import select_backend
from jaxserve.backends.devices import DeviceSet
from jaxserve.config import EngineConfig
from jaxserve.engine.plan import ModelFiles, plan_engine
from jaxserve.models.arch_config import ArchConfig
from jaxserve.models.eagle3_checkpoint import load_eagle3
from jaxserve.models.sharding import DEFAULT_RULES, single_device_mesh
from jaxserve.runner.draft_head_step import DraftModelHead, Eagle3Head, chain_metadata
from jaxserve.runner.draft_model import load_draft_model
from jaxserve.runner.kv_cache import allocate_kv_cache
from jaxserve.runner.recipe import serving_draft_heads
from jaxserve.runner.step_inputs import StepRequest, pack_step
from jaxserve.tools.shard_plan import PRESET_DIR
from tests.models.test_lane_dense_kv import QWEN2, SMOL_SHAPED, _Mesh, hf_tensors

PAGE, PAGES, PAGES_PER_REQ = 16, 8, 2
SEQS = [21, 5, 16]  # context lengths of one ragged pass: two pages, partial pages, a whole one
CHAIN = 2  # chained single-token passes after it
NOTE = "KV heads padded 3 -> 4 for lane-dense TPU pages (+33 % KV bytes)"


def eagle3_config(layer: dict, draft_vocab: int, aux: list[int]) -> dict:
    """A speculators-layout config.json of an EAGLE-3 head whose decoder layer is `layer`."""
    layer = {k: v for k, v in layer.items() if k != "architectures"}
    return {"architectures": ["Eagle3DraftModel"], "speculators_model_type": "eagle3",
            "transformer_layer_config": {**layer, "model_type": "llama", "num_hidden_layers": 1},
            "draft_vocab_size": draft_vocab, "eagle_aux_hidden_state_layer_ids": aux}


def write_eagle3_head(dst: pathlib.Path, layer: dict, seed: int = 5) -> pathlib.Path:
    """A SmolLM2-shaped head (the layer's shape) over the whole vocabulary, random weights,
    shipping its own embedding table."""
    cfg = ArchConfig.from_hf(layer)
    rng = np.random.default_rng(seed)
    E, Hq, Hkv, D, F, V = (cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                           cfg.intermediate_size, cfg.vocab_size)

    def r(*shape, scale=0.1):
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    p = "layers.0."
    tensors = {"fc.weight": r(E, 3 * E), p + "input_layernorm.weight": 1 + r(E),
               p + "hidden_norm.weight": 1 + r(E), p + "self_attn.q_proj.weight": r(Hq * D, 2 * E),
               p + "self_attn.k_proj.weight": r(Hkv * D, 2 * E), p + "self_attn.v_proj.weight": r(Hkv * D, 2 * E),
               p + "self_attn.o_proj.weight": r(E, Hq * D), p + "post_attention_layernorm.weight": 1 + r(E),
               p + "mlp.gate_proj.weight": r(F, E), p + "mlp.up_proj.weight": r(F, E),
               p + "mlp.down_proj.weight": r(E, F), "norm.weight": 1 + r(E), "lm_head.weight": r(V, E, scale=0.5),
               "embed_tokens.weight": r(V, E, scale=0.5)}
    dst.mkdir(parents=True, exist_ok=True)
    (dst / "config.json").write_text(json.dumps(eagle3_config(layer, V, [0, 1, 2])))
    save_file(tensors, str(dst / "model.safetensors"))
    return dst


def write_draft_model(dst: pathlib.Path, config: dict) -> pathlib.Path:
    dst.mkdir(parents=True, exist_ok=True)
    (dst / "config.json").write_text(json.dumps(config))
    save_file(hf_tensors(ArchConfig.from_hf(config), seed=7), str(dst / "model.safetensors"))
    return dst


def config_only(dst: pathlib.Path, config: dict) -> str:
    """A drafter directory with a config.json only (the decision and abstract steps read no weight)."""
    dst.mkdir(parents=True, exist_ok=True)
    (dst / "config.json").write_text(json.dumps(config))
    header = b"{}"
    (dst / "model.safetensors").write_bytes(len(header).to_bytes(8, "little") + header)
    return str(dst)


@pytest.fixture(scope="module")
def head_dir(tmp_path_factory):
    return write_eagle3_head(tmp_path_factory.mktemp("head") / "eagle3", SMOL_SHAPED)


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory):
    return write_draft_model(tmp_path_factory.mktemp("draft") / "qwen2", QWEN2)


@pytest.fixture(scope="module")
def smollm2_drafters(tmp_path_factory):
    """Config-only drafters of the default model's shape: an EAGLE-3 head, a 4-layer draft model."""
    arch = json.loads((PRESET_DIR / "smollm2-135m.json").read_text())
    root = tmp_path_factory.mktemp("smollm2")
    n = arch["num_hidden_layers"]
    return arch, {"eagle3": config_only(root / "head", eagle3_config(arch, 4096, [2, n // 2, n - 3])),
                  "draft_model": config_only(root / "draft", {**arch, "num_hidden_layers": 4})}


# ------------------------------------------------------------------------------ the decision
@pytest.mark.parametrize("platform, requested, page_size, served", [
    ("tpu", "auto", 16, 4),
    ("tpu", "tpu", 16, 4),
    ("cpu", "tpu-interpret", 16, 4),  # forced by name: how these tests pad on a CPU
    ("tpu", "auto", 8, 0),  # pages of 8 bfloat16 rows: the kernel refuses them anyway
    ("tpu", "reference", 16, 0),
    ("cpu", "auto", 16, 0),
    ("gpu", "auto", 16, 0),
])
@pytest.mark.parametrize("method", ["eagle3", "draft_model"])
def test_drafters_are_padded_where_the_targets_are(smollm2_drafters, method, platform, requested, page_size,
                                                   served):
    arch, dirs = smollm2_drafters
    target = ArchConfig.from_hf(arch)
    assert serving_draft_heads(method, dirs[method], target, requested, platform, _Mesh(1), DEFAULT_RULES,
                               page_size, jnp.bfloat16, jnp.bfloat16) == served


def test_lane_dense_drafters_and_mtp_are_served_as_stored(tmp_path):
    """A drafter whose rows are already lane-dense (2 KV heads of 64) keeps its heads; MTP's
    layer is the target's (DeepSeek V3's latent rows: never padded), and no method has none."""
    from tests.model_dirs import DATA

    arch = {**SMOL_SHAPED, "num_attention_heads": 8, "num_key_value_heads": 2}
    head = config_only(tmp_path / "head", eagle3_config(arch, 256, [0, 1, 2]))
    target = ArchConfig.from_hf(SMOL_SHAPED)
    for method, directory in (("eagle3", head), ("draft_model", config_only(tmp_path / "draft", arch))):
        assert serving_draft_heads(method, directory, target, "auto", "tpu", _Mesh(1), DEFAULT_RULES, 16,
                                   jnp.bfloat16, jnp.bfloat16) == 0
    mla = ArchConfig.from_hf(json.loads((DATA / "deepseek_v3" / "config.json").read_text()))
    for method in ("deepseek_mtp", ""):
        assert serving_draft_heads(method, "", mla, "tpu-interpret", "cpu", _Mesh(1), DEFAULT_RULES, 16,
                                   jnp.bfloat16, jnp.bfloat16) == 0


@pytest.mark.parametrize("method", ["eagle3", "draft_model"])
def test_the_engine_plan_pads_the_drafters_pages_on_a_tpu(smollm2_drafters, method):
    """SmolLM2 on one v6e chip with a drafter of its shape: the drafter's pages have 4 KV heads
    (the plan's reason says so, the recipe carries them) and the KV budget's drafter bytes per
    page grow by a third; on this CPU nothing changes."""
    from jaxserve.engine.kv_sizing import draft_bytes_per_page

    arch, dirs = smollm2_drafters
    files = ModelFiles(None, arch)
    tpu = plan_engine(EngineConfig.from_kwargs(model="smollm2-135m"), files, select_backend("tpu"),
                      DeviceSet.described("tpu", "TPU v6 lite", 1, slice_shape=(1, 1)))
    padded = tpu.with_drafter(method, dirs[method])
    assert (padded.draft_method, padded.draft_model, padded.draft_kv_heads) == (method, dirs[method], 4)
    assert padded.reasons["attention"].endswith(f"; {NOTE}; the drafter's {NOTE}")
    assert padded.recipe(num_pages=8, max_model_len=256).draft_kv_heads == 4
    mesh = single_device_mesh()
    stored = dataclasses.replace(padded, draft_kv_heads=0)
    assert draft_bytes_per_page(padded, mesh) * 3 == draft_bytes_per_page(stored, mesh) * 4
    cpu = plan_engine(EngineConfig.from_kwargs(model="smollm2-135m", dtype="float32"), files,
                      select_backend("cpu"), DeviceSet.described("cpu", "cpu", 1)).with_drafter(method, dirs[method])
    assert cpu.draft_kv_heads == 0 and "drafter" not in cpu.reasons["attention"]
    assert cpu.recipe(num_pages=8, max_model_len=256).draft_kv_heads == 0


def test_the_compile_workers_step_holds_the_padded_drafter(head_dir):
    """shard-plan's plan (as the compile workers' recipe): the abstract step's head has 12 query
    heads over 4 KV heads (zero-padded weights' shapes), its pages rows of 256, and the padded
    config's attention on a compile-only TPU is the TPU kernel (the checkpoint's: the reference)."""
    from jaxserve.runner.compile_pool import abstract_step
    from jaxserve.tools.plan_compile import PlanSettings, kv_record, plan_recipe, resolve_plan

    target = {**SMOL_SHAPED, "num_hidden_layers": 2}
    settings = PlanSettings(arch=target, platform="cpu", max_model_len=64, max_num_seqs=2, dtype="float32",
                            attention_impl="tpu-interpret", num_speculative_tokens=2, draft_model=str(head_dir),
                            draft_method="eagle3")
    cfg, mesh = ArchConfig.from_hf(target), single_device_mesh()
    plan = resolve_plan(settings, cfg, mesh, DEFAULT_RULES)
    assert (plan["kv_heads"], plan["draft_kv_heads"]) == (4, 4)
    served = cfg.with_kv_heads(4)
    page = {}
    for name, s, heads in (("padded", settings, 4), ("stored", settings, 0),
                           ("target", dataclasses.replace(settings, draft_method="", draft_model=""), 0)):
        rec, num_pages, _ = kv_record(s, served, mesh, DEFAULT_RULES, plan["kv_dtype"], plan["dtype"],
                                      draft_kv_heads=heads)
        page[name] = rec["bytes_per_page_per_device"]
    assert (page["padded"] - page["target"]) * 3 == (page["stored"] - page["target"]) * 4  # the head's layer
    recipe = plan_recipe(settings, served, mesh, DEFAULT_RULES, plan, num_pages)
    program = abstract_step(recipe, devices=[mesh.devices.flat[0]]).program
    layer = program.drafter_cfg
    assert (layer.num_heads, layer.num_kv_heads, layer.checkpoint_heads) == (12, 4, (9, 3))
    assert program.abstract_draft_kv().k[0].shape[-1] == 256
    shapes = {tuple(p.shape) for p in program.drafter_params}
    assert {(256, 12, 64), (256, 4, 64), (12, 64, 128)} <= shapes  # wq, wk / wv, wo
    tpu = dataclasses.replace(recipe, platform="tpu", attention_impl="auto")
    assert tpu.model_attention(layer, mesh, jnp.float32) == "tpu"
    assert tpu.model_attention(layer.checkpoint_config(), mesh, jnp.float32) == "reference"


# ------------------------------------------------------------------------------ exactness
def draft_passes(drafter, head, cache_cfg, seed: int = 11):
    """The drafting step's passes over a drafter's own pages: a ragged context pass over SEQS
    (three requests, a random hidden input for a head), each request's greedy draft at its
    last token, then CHAIN chained single-token passes from there (`chain_metadata` in a
    `fori_loop`, as the step's chain). Returns ([passes, requests] drafts, the outputs at the
    drafting rows, the K pages)."""
    rng = np.random.default_rng(seed)
    R, T, n = 4, sum(SEQS), len(SEQS)
    seqs = [rng.integers(3, 256, length).tolist() for length in SEQS]
    tables = [list(range(1 + i * PAGES_PER_REQ, 1 + (i + 1) * PAGES_PER_REQ)) for i in range(n)]
    inputs = jax.tree.map(jnp.asarray, pack_step([StepRequest(s, 0, t) for s, t in zip(seqs, tables)],
                                                 num_tokens=T, num_reqs=R, pages_per_req=PAGES_PER_REQ,
                                                 page_size=PAGE))
    ends = np.zeros(R, np.int32)
    ends[:n] = np.cumsum(SEQS) - 1
    live = jnp.asarray(np.arange(R) < n)
    num_pages = jnp.asarray(np.where(np.arange(R) < n, PAGES_PER_REQ, 0), jnp.int32)
    hidden = jnp.asarray(rng.standard_normal((T, cache_cfg.hidden_size)).astype(np.float32))
    kv = allocate_kv_cache(cache_cfg, PAGES, PAGE, jnp.float32, single_device_mesh())
    graphdef, state = nnx.split(drafter)

    @jax.jit
    def run(state, kv, inputs, hidden):
        m = nnx.merge(graphdef, state)
        out, kv = head.layer(m, inputs.input_ids, inputs.positions, hidden if head.shifted else None, kv,
                             inputs.md)
        token, hidden = head.propose(m, out[ends])
        drafts = jnp.zeros((CHAIN + 1, R), jnp.int32).at[0].set(token)
        outs = jnp.zeros((CHAIN + 1, *out[ends].shape), out.dtype).at[0].set(out[ends])
        pos = inputs.positions[ends]

        def chain(j, carry):
            kv, drafts, outs, token, hidden = carry
            md = chain_metadata(inputs.md, pos + j, live, num_pages, PAGE)
            out, kv = head.layer(m, token, pos + j, hidden, kv, md)
            token, hidden = head.propose(m, out)
            return kv, drafts.at[j].set(token), outs.at[j].set(out), token, hidden

        kv, drafts, outs, _, _ = jax.lax.fori_loop(1, CHAIN + 1, chain, (kv, drafts, outs, token, hidden))
        return drafts, outs, kv.k

    drafts, outs, k_pages = run(state, kv, inputs, hidden)
    return np.asarray(drafts)[:, :n], np.asarray(outs)[:, :n], [np.asarray(k) for k in k_pages]


def eagle3_passes(head_dir, impl: str, kv_heads: int = 0):
    drafter = load_eagle3(head_dir, attention_impl=impl, kv_heads=kv_heads)
    graphdef, state = nnx.split(drafter)
    head = Eagle3Head(graphdef, jax.tree.structure(state), (0, 1, 2))
    return drafter, draft_passes(drafter, head, drafter.config.layer)


def draft_model_passes(draft_dir, impl: str, kv_heads: int = 0):
    drafter = load_draft_model(str(draft_dir), jnp.float32, single_device_mesh(), None, impl, kv_heads=kv_heads)
    graphdef, state = nnx.split(drafter)
    return drafter, draft_passes(drafter, DraftModelHead(graphdef, jax.tree.structure(state)), drafter.config)


@pytest.fixture(scope="module")
def eagle3_stored(head_dir):
    return eagle3_passes(head_dir, "reference")


@pytest.fixture(scope="module")
def draft_model_stored(draft_dir):
    return draft_model_passes(draft_dir, "reference")


def assert_same_drafts(got, want):
    """The padded drafter's drafts are the stored one's, its outputs too (float32 round-off), and
    its pages hold the stored keys in the real heads' lanes and zeros in the appended head's."""
    (got_drafts, got_outs, got_k), (want_drafts, want_outs, want_k) = got, want
    np.testing.assert_array_equal(got_drafts, want_drafts)
    np.testing.assert_allclose(got_outs, want_outs, rtol=1e-5, atol=1e-5)
    for g, w in zip(got_k, want_k, strict=True):
        assert (g.shape[-1], w.shape[-1]) == (256, 192)
        np.testing.assert_allclose(g[..., :192], w, rtol=1e-5, atol=1e-5)
        assert not np.any(g[..., 192:])


@pytest.mark.parametrize("impl", ["reference", "tpu-interpret"])
def test_a_padded_eagle3_head_drafts_what_the_checkpoints_does(head_dir, eagle3_stored, impl):
    stored, want = eagle3_stored
    padded, got = eagle3_passes(head_dir, impl, kv_heads=4)
    layer = padded.layer
    assert (padded.config.layer.num_heads, padded.config.layer.num_kv_heads) == (12, 4)
    for name, real in (("wq", 9), ("wk", 3), ("wv", 3)):  # [2E, heads, D]: the real heads in place
        weight = np.asarray(getattr(layer, name)[...])
        np.testing.assert_array_equal(weight[:, :real], np.asarray(getattr(stored.layer, name)[...]))
        assert not np.any(weight[:, real:])
    wo = np.asarray(layer.wo[...])  # [Hq, D, E]
    np.testing.assert_array_equal(wo[:9], np.asarray(stored.layer.wo[...]))
    assert not np.any(wo[9:])
    assert_same_drafts(got, want)
    assert len(set(want[0].ravel().tolist())) > 3  # the drafts vary: their equality means something


def test_a_padded_draft_model_drafts_what_the_checkpoints_does(draft_dir, draft_model_stored):
    """Through the TPU kernel (interpret mode); a padded Qwen2 with the reference attention is
    test_lane_dense_kv.py's (a draft model is loaded as a target is)."""
    _, want = draft_model_stored
    padded, got = draft_model_passes(draft_dir, "tpu-interpret", kv_heads=4)
    assert (padded.config.num_heads, padded.config.num_kv_heads, padded.config.checkpoint_heads) == (8, 4, (6, 3))
    assert_same_drafts(got, want)
    assert len(set(want[0].ravel().tolist())) > 3


def test_the_tpu_kernel_refuses_an_unpadded_drafter(head_dir):
    with pytest.raises(ValueError, match="multiple of 128"):
        eagle3_passes(head_dir, "tpu-interpret")
