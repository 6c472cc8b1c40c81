"""DeepSeek multi-token-prediction speculative decoding in the engine (speculative_config method
"deepseek_mtp"; jaxserve/runner/draft_head_step.py `MtpHead`): the tiny `deepseek_v3` fixture with
one random MTP layer added (transformers writes none), drafting inside the compiled step.
Greedy and seeded outputs equal the outputs without speculation; the step's drafts equal a
dense reference of the MTP chain written here from the formula (no paged cache, MLA with
per-head keys and values, not the absorbed form); an MTP layer made to draft one token gets
exactly the drafts the target confirms accepted (and one drafting a token the target never
emits none); configurations it cannot serve are refused by name."""

from __future__ import annotations

import functools
import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file, save_file

from jaxserve import LLM, SamplingParams
from jaxserve.speculative_config import SpeculativeConfig
from jaxserve.models.arch_config import ArchConfig
from jaxserve.models.deepseek_v3 import LORA_NORM_EPS, softmax_scale
from jaxserve.models.layers.linear import module_weights
from jaxserve.models.layers.rotary import apply_rotary, rope_tables
from jaxserve.models.sharding import single_device_mesh
from jaxserve.models.weights import create_model
from jaxserve.runner.kv_cache import allocate_kv_cache
from jaxserve.runner.step_inputs import StepRequest, pack_step
from tests.engine.spec_checks import run_feeding_the_targets_tokens, spec_stats, tokens
from tests.model_dirs import write_model_dir

K = 2
VOCAB = 128
# Different lengths: one longer than a prefill chunk (the token budget is 32), one token.
PROMPTS = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [9, 10, 11], list(range(20, 60)), [30]]
# A page of the target's float32 latent rows: 3 layers x 8 tokens x (112 + 16) x 4 bytes.
PAGE_BYTES = 3 * 8 * 128 * 4
OPTIONS = dict(dtype="float32", max_num_seqs=8, max_num_batched_tokens=32, token_buckets=(32,),
               request_buckets=(8,), max_model_len=96, page_size=8, show_progress=False,
               kv_cache_memory_bytes=100 * PAGE_BYTES)
SPEC = {"method": "deepseek_mtp", "num_speculative_tokens": K}


def add_mtp_layer(model_dir: pathlib.Path, seed: int = 0) -> pathlib.Path:
    """The fixture's checkpoint with one MTP layer (`model.layers.3.*`, as DeepSeek V3 stores
    them): the last decoder layer's tensors perturbed, random enorm / hnorm / eh_proj /
    shared_head.norm, and the copies of the embedding and head a checkpoint carries."""
    rng = np.random.default_rng(seed)
    path = model_dir / "model.safetensors"
    tensors = load_file(str(path))
    cfg = json.loads((model_dir / "config.json").read_text())
    L, E = cfg["num_hidden_layers"], cfg["hidden_size"]
    pre = f"model.layers.{L}."
    for name, w in list(tensors.items()):
        if name.startswith(f"model.layers.{L - 1}."):
            noise = rng.normal(0, 0.5 * (float(w.std()) or 0.02), w.shape).astype(w.dtype)
            tensors[pre + name[len(f"model.layers.{L - 1}."):]] = w + noise
    near_one = lambda: (1 + 0.1 * rng.normal(size=E)).astype(np.float32)  # noqa: E731
    tensors.update({pre + "enorm.weight": near_one(), pre + "hnorm.weight": near_one(),
                    pre + "eh_proj.weight": rng.normal(0, 0.12, (E, 2 * E)).astype(np.float32),
                    pre + "shared_head.norm.weight": near_one(),
                    pre + "shared_head.head.weight": tensors["lm_head.weight"],
                    pre + "embed_tokens.weight": tensors["model.embed_tokens.weight"]})
    save_file(tensors, str(path))
    cfg["num_nextn_predict_layers"] = 1
    (model_dir / "config.json").write_text(json.dumps(cfg))
    return model_dir


@pytest.fixture(scope="module")
def mtp_dir(tmp_path_factory):
    return add_mtp_layer(write_model_dir(tmp_path_factory.mktemp("mtp"), "deepseek_v3"))


@pytest.fixture(scope="module")
def spec_llm(mtp_dir, compile_cache_dir):
    return LLM(str(mtp_dir), speculative_config=SPEC, compilation_cache_dir=compile_cache_dir, seed=1,
               **OPTIONS)


@pytest.fixture(scope="module")
def plain_llm(mtp_dir, compile_cache_dir):
    return LLM(str(mtp_dir), compilation_cache_dir=compile_cache_dir, seed=2, **OPTIONS)


def test_greedy_outputs_equal_no_speculation(spec_llm, plain_llm):
    before = spec_stats(spec_llm)
    greedy = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (20, 12, 16, 1)]
    assert tokens(spec_llm, PROMPTS, greedy) == tokens(plain_llm, PROMPTS, greedy)
    drafts, draft_tokens, _ = spec_stats(spec_llm) - before
    assert drafts > 10 and draft_tokens > 1.5 * drafts  # the MTP layer's drafts were fed and verified
    assert spec_llm.engine.runner.counter.recompiles == 0


def test_seeded_sampling_is_reproducible_and_unchanged(spec_llm, plain_llm):
    seeded = [SamplingParams(temperature=t, top_p=tp, max_tokens=10, seed=s, ignore_eos=True)
              for s, (t, tp) in enumerate([(0.7, 1.0), (1.0, 0.9), (0.4, 1.0), (1.0, 1.0)])]
    first = tokens(spec_llm, PROMPTS, seeded)
    assert first == tokens(plain_llm, PROMPTS, seeded)
    assert all(len(t) == 10 and all(0 <= x < VOCAB for x in t) for t in first)


# ---------------------------------------------------------------- the dense reference
@functools.cache
def loaded(model_dir: str):
    """The fixture with its MTP layer, loaded (float32)."""
    cfg = ArchConfig.from_hf(json.loads((pathlib.Path(model_dir) / "config.json").read_text()))
    tensors = load_file(str(pathlib.Path(model_dir) / "model.safetensors"))
    return create_model(cfg, dtype=jnp.float32, get_tensor=tensors.__getitem__)


@functools.cache
def reference_programs(model_dir: str):
    """(the target's final hidden states over one sequence of up to 64 tokens, `dense_mtp`),
    each compiled once."""
    model = loaded(model_dir)
    graphdef, state = nnx.split(model)
    kv = allocate_kv_cache(model.config, 9, 8, jnp.float32, single_device_mesh())

    @jax.jit
    def target(state, inputs):
        return nnx.merge(graphdef, state)(inputs.input_ids, inputs.positions, kv, inputs.md)[0]

    @jax.jit
    def mtp(state, tokens, positions, hidden, mask):
        return dense_mtp(nnx.merge(graphdef, state), tokens, positions, hidden, mask)

    return functools.partial(target, state), functools.partial(mtp, state)


def target_hidden(model_dir: str, seq: list[int]) -> np.ndarray:
    """The target's final hidden states (after the final norm: what its LM head reads) over
    one sequence, through its paged forward."""
    inputs = pack_step([StepRequest(seq, 0, list(range(1, 9)))], num_tokens=64, num_reqs=2, pages_per_req=8,
                       page_size=8)
    return np.asarray(reference_programs(model_dir)[0](jax.tree.map(jnp.asarray, inputs)))[: len(seq)]


def rms(x, w, eps):
    x = x.astype(jnp.float32)
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps) * w


def dense_mtp(model, tokens, positions, hidden, mask):
    """DeepSeek's MTP layer over S rows, densely: x = eh_proj([enorm(embed(token)) (zero at
    position 0), hnorm(hidden)]), the decoder layer with MLA expanded to per-head keys
    [W_UK c, rope(k_rope)] and values W_UV c under `mask` [S, S], then logits
    lm_head(final_norm(out)). Returns (logits [S, V], out [S, E])."""
    cfg, mtp = model.config, model.mtp[0]
    eps, C, Dn = cfg.rms_norm_eps, cfg.kv_lora_rank, cfg.qk_nope_head_dim
    layer = mtp.block
    p = module_weights(layer)
    embeds = jnp.where((positions == 0)[:, None], 0.0, model.embed[...][tokens])
    x = jnp.concatenate([rms(embeds, mtp.enorm[...], eps), rms(hidden, mtp.hnorm[...], eps)], -1)
    x = x @ mtp.eh_proj[...]
    a = rms(x, p["input_norm"], eps)
    q = jnp.einsum("sq,qhd->shd", rms(a @ p["wq_a"] + p["bq_a"], p["q_a_norm"], LORA_NORM_EPS), p["wq_b"])
    kv = a @ p["wkv_a"] + p["bkv_a"]
    c = rms(kv[:, :C], p["kv_a_norm"], LORA_NORM_EPS)
    cos, sin = rope_tables(layer.rope, positions)
    k_rope = apply_rotary(kv[:, None, C:], cos, sin)  # [S, 1, Dr]
    q = jnp.concatenate([q[..., :Dn], apply_rotary(q[..., Dn:], cos, sin)], -1)
    keys = jnp.concatenate([jnp.einsum("sc,hdc->shd", c, p["w_uk"]),
                            jnp.broadcast_to(k_rope, (*c.shape[:1], q.shape[1], k_rope.shape[-1]))], -1)
    values = jnp.einsum("sc,hcv->shv", c, p["w_uv"])
    scores = jnp.einsum("thd,shd->hts", q, keys) * softmax_scale(cfg)
    probs = jax.nn.softmax(jnp.where(mask[None], scores, -jnp.inf), axis=-1)
    attn = jnp.einsum("hts,shv->thv", probs, values)
    h = x + jnp.einsum("thv,hve->te", attn, p["wo"]) + p["bo"]
    out = h + model.mlp(layer, p, rms(h, p["post_norm"], eps))
    logits = rms(out, mtp.final_norm[...], eps) @ model.lm_head[...]
    return logits, out


def dense_chains(model_dir: str, seq: list[int], ends: list[int]) -> list[list[int]]:
    """The MTP layer's k greedy drafts after each prefix seq[:e + 1] of `ends` (seq[e] just
    sampled at position e - 1): rows 0 .. e - 1 take the next token and the target's hidden
    state there; chained row e - 1 + j the previous draft and the previous row's output; each
    row attends causally over the rows before it (64 rows, the unused ones after them)."""
    S = 64
    hid = target_hidden(model_dir, seq[:-1])
    mtp = reference_programs(model_dir)[1]
    mask = jnp.asarray(np.tril(np.ones((S, S), bool)))
    chains = []
    for e in ends:
        toks, hidden, out = np.zeros(S, np.int32), np.zeros((S, hid.shape[1]), np.float32), []
        toks[:e], hidden[:e] = seq[1: e + 1], hid[:e]
        for j in range(K):
            n = e + j  # rows so far
            logits, outs = mtp(jnp.asarray(toks), jnp.arange(S), jnp.asarray(hidden), mask)
            out.append(int(np.argmax(np.asarray(logits)[n - 1])))
            toks[n], hidden[n] = out[-1], np.asarray(outs)[n - 1]
        chains.append(out)
    return chains


def test_step_drafts_equal_the_dense_mtp_chain(spec_llm, plain_llm, mtp_dir):
    """The drafts each step returns (after the prefill and after each verifying step, whatever
    it kept) are the dense chain's over the target's final hidden states of the request's
    tokens so far. So that the steps keep 0 to k drafts, the engine is fed the target's own
    next tokens as drafts, wrong from a varying point; the outputs stay the plain ones. For
    one step's prefill, and for a prompt over two chunks (the pass across the boundary takes
    the next chunk's first token)."""
    for prompt in (PROMPTS[0], PROMPTS[2]):
        want, heads, _ = run_feeding_the_targets_tokens(spec_llm, plain_llm, prompt, K, VOCAB, max_tokens=8)
        assert len({tuple(d) for _, d in heads}) > 1  # the drafts vary
        ends = list(len(prompt) - 1 + np.cumsum([n for n, _ in heads]))
        seq = prompt + want[: ends[-1] + 1 - len(prompt)]
        assert [d for _, d in heads] == dense_chains(str(mtp_dir), seq, ends)


# ---------------------------------------------------------------- an oracle MTP layer
def constant_output(lm_head: np.ndarray, token: int) -> np.ndarray:
    """A hidden state [E] whose logits lm_head^T h have their maximum at `token`."""
    h = lm_head[:, token].copy()
    for _ in range(500):
        logits = h @ lm_head
        if np.argmax(logits) == token and np.sort(logits)[-2] < logits[token] - 1:
            return h
        p = np.exp(logits - logits.max())
        h += 0.5 * lm_head @ (np.eye(lm_head.shape[1])[token] - p / p.sum())
    raise AssertionError(f"no hidden state makes token {token} the argmax")


def swap_mtp(runner, model, token: int | None):
    """Replace the runner's MTP weights by an oracle drafting `token` whatever its input (the
    layer's input projection, attention output and experts zeroed, the attention output bias
    a hidden state the head maps to `token`, the final norm ones); None: restore. Returns the
    replaced leaves."""
    state = jax.tree.unflatten(runner._params_treedef, runner.params[: runner._params_treedef.num_leaves])
    paths = [jax.tree_util.keystr(k) for k, _ in jax.tree_util.tree_flatten_with_path(state)[0]]
    idx = {p: i for i, p in enumerate(paths) if "'mtp'" in p}
    old = {i: runner.params[i] for i in idx.values()}
    if token is None:
        return old
    lm_head = np.asarray(model.lm_head[...])
    new = {"eh_proj": 0.0, "'wo'": 0.0, "'x_down'": 0.0, "'s_down'": 0.0,
           "'bo'": constant_output(lm_head, token), "final_norm": 1.0}
    for path, i in idx.items():
        for name, value in new.items():
            if name in path:
                x = runner.params[i]
                runner.params[i] = jnp.asarray(np.broadcast_to(value, x.shape), x.dtype)
    return old


def test_oracle_mtp_drafts_are_accepted(spec_llm, plain_llm, mtp_dir):
    """An MTP layer drafting the token the target's greedy output repeats most: its drafts are
    accepted (several), and the outputs still equal plain decoding; the same layer drafting a
    token the output never holds has none accepted."""
    runner, model = spec_llm.engine.runner, loaded(str(mtp_dir))
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    prompt = PROMPTS[1]
    (want,) = tokens(plain_llm, [prompt], greedy)
    common = max(set(want), key=want.count)
    assert want.count(common) >= 4
    never = next(t for t in range(3, VOCAB) if t not in want and t not in prompt)
    accepted = {}
    for token in (common, never):
        old = swap_mtp(runner, model, token)
        try:
            before = spec_stats(spec_llm)
            assert tokens(spec_llm, [prompt], greedy) == [want]
            accepted[token] = (spec_stats(spec_llm) - before)[2]
        finally:
            for i, x in old.items():
                runner.params[i] = x
    assert accepted[common] >= 3 and accepted[never] == 0


# ---------------------------------------------------------------- configuration and refusals
def test_config_forms():
    for method in ("deepseek_mtp", "mtp"):
        c = SpeculativeConfig.parse(json.dumps({"method": method, "num_speculative_tokens": 2}))
        assert (c.method, c.model, c.num_speculative_tokens) == ("deepseek_mtp", None, 2)
    with pytest.raises(ValueError, match='leave out "model"'):
        SpeculativeConfig.parse({"method": "mtp", "model": "x", "num_speculative_tokens": 2})


def test_refused_at_start(mtp_dir, tmp_path):
    no_mtp = str(write_model_dir(tmp_path / "plain", "deepseek_v3"))
    with pytest.raises(ValueError, match="num_nextn_predict_layers is 0"):
        LLM(no_mtp, speculative_config=SPEC, **OPTIONS)
    llama = str(write_model_dir(tmp_path / "llama"))
    with pytest.raises(ValueError, match="MTP layers; the target is LlamaForCausalLM$"):
        LLM(llama, speculative_config=SPEC, **OPTIONS)
    qwen3_next = tmp_path / "llama" / "config.json"  # as Qwen3-Next names itself
    qwen3_next.write_text(json.dumps({**json.loads(qwen3_next.read_text()), "model_type": "qwen3_next",
                                      "architectures": ["Qwen3NextForCausalLM"]}))
    with pytest.raises(ValueError, match="Qwen3-Next's mtp.* layers: jaxserve does not serve Qwen3-Next"):
        LLM(llama, speculative_config={**SPEC, "method": "mtp"}, **OPTIONS)
    with pytest.raises(ValueError, match="serves Llama-family targets; the DeepseekV3ForCausalLM forward"):
        LLM(str(mtp_dir), speculative_config={"method": "eagle3", "model": str(tmp_path),
                                              "num_speculative_tokens": 2}, **OPTIONS)
    with pytest.raises(ValueError, match="'deepseek_mtp' runs on one device without --num-decode-steps"):
        LLM(str(mtp_dir), speculative_config=SPEC, num_decode_steps=4, **OPTIONS)
    with pytest.raises(ValueError, match="'deepseek_mtp' runs on one device without --enable-lora"):
        LLM(str(mtp_dir), speculative_config=SPEC, enable_lora=True, **OPTIONS)


def test_the_kv_budget_holds_the_mtp_pages(spec_llm, plain_llm):
    """The MTP layer has its own latent pages, the target's page count and row width, out of
    the same KV budget: a page costs 4 layers' rows instead of 3."""
    kv = spec_llm.engine.runner.kv
    assert kv.draft.v == () and kv.draft.k[0].shape == kv.target.k[0].shape
    assert (plain_llm.engine.runner.num_pages, spec_llm.engine.runner.num_pages) == (100, 75)


def test_an_fp8_cache_with_the_mtp_layer(mtp_dir, data_dir, compile_cache_dir):
    """--kv-cache-dtype fp8: the target's latent rows in one byte, the MTP layer's in the
    model's dtype (runner/draft_head_step.py `draft_cache_dtype`); the greedy tokens are
    transformers' (as without speculation: tests/models/test_deepseek_v3.py), drafts verified."""
    llm = LLM(str(mtp_dir), speculative_config=SPEC, kv_cache_dtype="fp8",
              compilation_cache_dir=compile_cache_dir, **OPTIONS)
    kv = llm.engine.runner.kv
    assert str(kv.target.k[0].dtype) == "float8_e4m3fn" and kv.draft.k[0].dtype == jnp.float32
    # a page: the target's 3 layers of one-byte rows and the MTP layer's float32 ones
    assert llm.engine.runner.num_pages == 100 * PAGE_BYTES // (PAGE_BYTES // 4 + PAGE_BYTES // 3)
    expected = load_file(str(data_dir / "arch" / "deepseek_v3" / "expected.safetensors"))
    prompts = [expected[f"tokens_{i}"].tolist() for i in range(2)]
    n = len(expected["greedy_0"])
    greedy = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    assert tokens(llm, prompts, greedy) == [expected[f"greedy_{i}"].tolist() for i in range(2)]
    assert spec_stats(llm)[1] > 4


def test_the_compile_workers_lower_the_runners_program(spec_llm):
    """From the recipe alone (method deepseek_mtp: the MTP layer among the target's abstract
    weights), the compile workers and memory probes lower the program the runner runs."""
    from jaxserve.runner.compile_pool import abstract_step, lower_bucket
    from jaxserve.runner.recipe import program_fingerprint

    runner = spec_llm.engine.runner
    recipe = runner.recipe
    assert recipe.draft_method == "deepseek_mtp" and not recipe.draft_model
    assert (program_fingerprint(lower_bucket(recipe, abstract_step(recipe), (32, 8)))
            == program_fingerprint(runner.lower((32, 8))))
