"""Speculative decoding with a draft model (jaxserve/runner/draft_head_step.py,
`DraftModelHead`): the tiny `llama` fixture served with the tiny `qwen2` one (another
architecture, the same vocabulary and tokenizer; random weights) drafting inside the target's
compiled step. Greedy and seeded outputs equal the outputs without speculation (over an fp8
cache too, the draft model's pages in float); the step's drafts equal the draft model's greedy
chain recomputed densely over the whole context; the target drafting for itself gets its drafts
accepted; a draft model that does not fit the target is refused by name."""

from __future__ import annotations

import functools
import json
import pathlib
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxserve import LLM, SamplingParams
from jaxserve.config import EngineConfig
from jaxserve.speculative_config import SpeculativeConfig
from jaxserve.models.sharding import single_device_mesh
from jaxserve.runner.draft_model import load_draft_model
from jaxserve.runner.kv_cache import allocate_kv_cache
from jaxserve.runner.step_inputs import StepRequest, pack_step
from tests.engine.spec_checks import run_feeding_the_targets_tokens, spec_stats, tokens
from tests.model_dirs import word_tokenizer, write_model_dir

DATA = pathlib.Path(__file__).resolve().parent.parent / "data" / "arch"
K = 3
# Different lengths: one longer than a prefill chunk (the token budget is 32), one token.
PROMPTS = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [9, 10, 11], list(range(20, 60)), [30]]
OPTIONS = dict(dtype="float32", max_num_seqs=8, max_num_batched_tokens=32, token_buckets=(32,),
               request_buckets=(8,), show_progress=False)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(write_model_dir(tmp_path_factory.mktemp("m"), "llama"))


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory):
    return str(write_model_dir(tmp_path_factory.mktemp("d"), "qwen2"))


@pytest.fixture(scope="module")
def spec_llm(model_dir, draft_dir, compile_cache_dir):
    """Method omitted: inferred "draft_model" from the model, as vLLM does."""
    return LLM(model_dir, speculative_config={"model": draft_dir, "num_speculative_tokens": K},
               compilation_cache_dir=compile_cache_dir, seed=1, **OPTIONS)


@pytest.fixture(scope="module")
def plain_llm(model_dir, compile_cache_dir):
    return LLM(model_dir, compilation_cache_dir=compile_cache_dir, seed=2, **OPTIONS)


def test_greedy_outputs_equal_no_speculation(spec_llm, plain_llm):
    """Batched, one prompt over two chunks, max_tokens 1, and each request's last steps (where
    fewer drafts fit than k)."""
    before = spec_stats(spec_llm)
    greedy = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (20, 12, 16, 1)]
    out = tokens(spec_llm, PROMPTS, greedy)
    assert out == tokens(plain_llm, PROMPTS, greedy)
    assert [len(t) for t in out] == [20, 12, 16, 1]
    drafts, draft_tokens, _ = spec_stats(spec_llm) - before
    assert drafts > 10 and draft_tokens > 2 * drafts  # the draft model's drafts were fed and verified
    assert spec_llm.engine.runner.counter.recompiles == 0


def test_seeded_sampling_is_unchanged(spec_llm, plain_llm):
    """A row's random number depends on the seed and the output position only: drafts change
    no seeded output."""
    seeded = [SamplingParams(temperature=t, top_p=tp, max_tokens=12, seed=s, ignore_eos=True)
              for s, (t, tp) in enumerate([(0.7, 1.0), (1.0, 0.9), (0.4, 1.0), (1.0, 1.0)])]
    first = tokens(spec_llm, PROMPTS, seeded)
    assert first == tokens(plain_llm, PROMPTS, seeded)
    assert all(len(t) == 12 for t in first)


@functools.cache
def dense_forward(draft_dir: str, num_tokens: int = 64):
    """The draft model's plain forward over one whole sequence of up to `num_tokens` (one page
    holds it all: nothing incremental, nothing paged), returning [T, V] logits and the keys of
    its first layer [T, Hkv * D]."""
    model = load_draft_model(draft_dir, jnp.float32, single_device_mesh(), None)
    graphdef, state = nnx.split(model)
    kv = allocate_kv_cache(model.config, 2, num_tokens, jnp.float32, single_device_mesh())

    @jax.jit
    def forward(state, kv, inputs):
        m = nnx.merge(graphdef, state)
        hidden, kv = m(inputs.input_ids, inputs.positions, kv, inputs.md)
        return m.compute_logits(hidden), kv.k[0][1]

    def run(seq):
        inputs = pack_step([StepRequest(seq, 0, [1])], num_tokens=num_tokens, num_reqs=2, pages_per_req=1,
                           page_size=num_tokens)
        logits, keys = forward(state, kv, jax.tree.map(jnp.asarray, inputs))
        return np.asarray(logits)[: len(seq)], np.asarray(keys)[: len(seq)]

    return run


def dense_chain(run, seq: list[int]) -> list[int]:
    """The draft model's k greedy tokens after `seq`, each from a forward over the whole
    sequence so far."""
    out = []
    for _ in range(K):
        logits, _ = run(seq + out)
        out.append(int(np.argmax(logits[-1])))
    return out


@pytest.mark.parametrize("prompt", [PROMPTS[0], PROMPTS[2]], ids=["one-step-prefill", "two-chunks"])
def test_step_drafts_equal_the_draft_models_dense_chain(spec_llm, plain_llm, draft_dir, prompt):
    """The drafts each step returns (after the prefill, and after each verifying step, whatever
    it kept) are the draft model's greedy chain over the request's tokens so far, the token
    sampled last included. So that the steps keep 0 to k drafts, the engine is fed the target's
    own next tokens as drafts, the j-th step's wrong from its (j mod k+1)-th on; the outputs stay
    the plain ones. The draft model's paged keys of the context (written by the steps' passes
    over their fed tokens and by the chains) are the dense forward's."""
    runner = spec_llm.engine.runner
    want, steps, pages = run_feeding_the_targets_tokens(spec_llm, plain_llm, prompt, K, 128, max_tokens=8)
    run = dense_forward(draft_dir)
    seq = prompt + want
    ends = list(len(prompt) + np.cumsum([n for n, _ in steps]))  # the context after each step
    dense = [dense_chain(run, seq[:e]) for e in ends]
    assert [d for _, d in steps] == dense
    assert len({tuple(d) for d in dense}) > 1  # the drafts vary with the context
    # The keys of the context up to the last token sampled (at ends[-1] - 1: fed by the last
    # chain's first pass).
    n = ends[-1]
    _, keys = run(seq[:n])
    positions = np.arange(n)
    page_size = runner.page_size
    paged = np.asarray(runner.kv.draft.k[0])[pages[-1][positions // page_size], positions % page_size]
    np.testing.assert_allclose(paged.reshape(n, -1), keys.reshape(n, -1), atol=1e-4, rtol=0)


def test_the_target_as_its_own_draft_model_gets_its_drafts_accepted(model_dir, plain_llm, compile_cache_dir):
    """Explicit method; the target drafting for itself: greedy drafts are its own greedy tokens,
    so (nearly) every draft is accepted, and the outputs are still the plain ones."""
    llm = LLM(model_dir, speculative_config={"method": "draft_model", "model": model_dir,
                                             "num_speculative_tokens": K},
              compilation_cache_dir=compile_cache_dir, seed=1, **OPTIONS)
    greedy = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (20, 12, 16)]
    assert tokens(llm, PROMPTS[:3], greedy) == tokens(plain_llm, PROMPTS[:3], greedy)
    drafts, draft_tokens, accepted = spec_stats(llm)
    assert draft_tokens >= 2 * drafts > 0
    assert accepted >= 0.9 * draft_tokens
    # Several tokens per step: 48 tokens in far fewer verifying steps than tokens.
    assert drafts <= 48 // 2


def test_an_fp8_cache_keeps_the_draft_models_pages_in_float(model_dir, compile_cache_dir):
    """--kv-cache-dtype fp8: the target's pages in one byte with their measured scales, the draft
    model's in the model's dtype (`draft_cache_dtype`: its scales are not measured) and counted
    so in the budget (the target drafting for itself: 1 + 4 bytes a page for 1); greedy
    outputs equal plain decoding over the same fp8 cache, and its drafts are still accepted."""
    fp8 = dict(OPTIONS, kv_cache_dtype="fp8", compilation_cache_dir=compile_cache_dir)
    spec = LLM(model_dir, speculative_config={"model": model_dir, "num_speculative_tokens": K}, **fp8)
    plain = LLM(model_dir, **fp8)
    kv = spec.engine.runner.kv
    assert str(kv.target.k[0].dtype) == "float8_e4m3fn" and kv.draft.k[0].dtype == jnp.float32
    assert abs(5 * spec.engine.runner.num_pages - plain.engine.runner.num_pages) <= 5
    greedy = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (16, 12, 8)]
    assert tokens(spec, PROMPTS[:3], greedy) == tokens(plain, PROMPTS[:3], greedy)
    drafts, draft_tokens, accepted = spec_stats(spec)
    assert draft_tokens >= 2 * drafts > 0 and accepted >= 0.5 * draft_tokens, (drafts, draft_tokens, accepted)


def test_the_kv_budget_holds_both_caches(spec_llm, plain_llm):
    """The draft model's cache (two layers of the target's page shape here) comes out of the
    same KV budget: half the pages, the draft model's as many as the target's."""
    plain, spec = plain_llm.engine.runner, spec_llm.engine.runner
    assert abs(2 * spec.num_pages - plain.num_pages) <= 2
    assert len(spec.kv.draft.k) == 2
    assert spec.kv.draft.k[0].shape[0] == spec.kv.target.k[0].shape[0] == spec.num_pages
    assert len(spec.kv.k) == 4  # what the budget checks count: both caches
    assert spec_llm.engine.scheduler.num_lookahead_tokens == K  # the chain writes P + 1 .. P + k


def test_the_compile_workers_lower_the_runners_program(spec_llm):
    """From the recipe alone (the draft model's abstract weights read from its directory), the
    compile workers and memory probes lower the program the runner runs."""
    from jaxserve.runner.compile_pool import abstract_step, lower_bucket
    from jaxserve.runner.recipe import program_fingerprint

    runner = spec_llm.engine.runner
    recipe = runner.recipe
    assert recipe.draft_model and recipe.draft_method == "draft_model" and recipe.num_speculative_tokens == K
    bucket = (32, 8)
    assert (program_fingerprint(lower_bucket(recipe, abstract_step(recipe), bucket))
            == program_fingerprint(runner.lower(bucket)))


def test_config_forms():
    """vLLM's forms: the method inferred from "model" (a draft model, or "ngram"), or given."""
    c = SpeculativeConfig.parse('{"model": "/some/draft", "num_speculative_tokens": 3}')
    assert (c.method, c.model, c.num_speculative_tokens) == ("draft_model", "/some/draft", 3)
    c = SpeculativeConfig.parse({"method": "draft_model", "model": "org/draft", "num_speculative_tokens": 2})
    assert (c.method, c.model) == ("draft_model", "org/draft")
    c = SpeculativeConfig.parse({"model": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3})
    assert (c.method, c.model, c.prompt_lookup_max) == ("ngram", None, 3)
    for bad, msg in [({"method": "draft_model", "num_speculative_tokens": 2}, 'needs "model", the draft model'),
                     ({"model": "x", "num_speculative_tokens": 2, "prompt_lookup_max": 3}, "prompt_lookup"),
                     ({"method": "medusa", "model": "x", "num_speculative_tokens": 2}, "'draft_model'")]:
        with pytest.raises(ValueError, match=msg):
            SpeculativeConfig.parse(bad)
    from jaxserve.server.cli import build_parser, engine_options

    flag = '{"model": "/drafts/small", "num_speculative_tokens": 4}'
    opts = engine_options(build_parser().parse_args(["serve", "--speculative-config", flag]))
    spec = EngineConfig.from_kwargs(**opts).speculative_config
    assert (spec.method, spec.model, spec.num_speculative_tokens) == ("draft_model", "/drafts/small", 4)


def test_an_eagle3_head_given_as_a_draft_model_drafts_as_eagle3(model_dir):
    """As vLLM: the method is detected from the draft checkpoint, an EAGLE-3 head's is
    "eagle3" (with or without "method": "draft_model")."""
    from jaxserve.engine.draft_check import detect_eagle3_head

    for spec in ({"model": str(DATA / "eagle3_llama"), "num_speculative_tokens": 2},
                 {"method": "draft_model", "model": str(DATA / "eagle3_llama"), "num_speculative_tokens": 2}):
        config = detect_eagle3_head(EngineConfig.from_kwargs(model=model_dir, speculative_config=spec))
        assert config.speculative_config.method == "eagle3"
        assert config.speculative_config.model == str(DATA / "eagle3_llama")
    config = EngineConfig.from_kwargs(model=model_dir, speculative_config={"model": model_dir,
                                                                           "num_speculative_tokens": 2})
    assert detect_eagle3_head(config) is config


def edited(src: str, dst: pathlib.Path, **changes) -> str:
    """A copy of the model directory `src` with config.json's keys changed."""
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg.update(changes)
    (dst / "config.json").write_text(json.dumps(cfg))
    return str(dst)


def test_refused_at_start(model_dir, draft_dir, tmp_path):
    spec = {"model": draft_dir, "num_speculative_tokens": 2}
    with pytest.raises(ValueError, match="speculative_config model .*was not found"):
        LLM(model_dir, speculative_config={**spec, "model": str(tmp_path / "missing")}, **OPTIONS)
    wide = edited(draft_dir, tmp_path / "wide", vocab_size=256)
    with pytest.raises(ValueError, match=r"vocabulary size \(256\) differs from the target's \(128\)"):
        LLM(model_dir, speculative_config={**spec, "model": wide}, **OPTIONS)
    other = pathlib.Path(edited(draft_dir, tmp_path / "other-tokenizer"))
    tok = word_tokenizer(128)  # the same size, two words swapped
    vocab = tok.backend_tokenizer.get_vocab()
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab["w3"], vocab["w4"] = vocab["w4"], vocab["w3"]
    swapped = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    swapped.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    swapped.save(str(other / "tokenizer.json"))
    with pytest.raises(ValueError, match="its tokenizer differs from the target's"):
        LLM(model_dir, speculative_config={**spec, "model": str(other)}, **OPTIONS)
    medusa = edited(draft_dir, tmp_path / "medusa", speculators_model_type="medusa")
    with pytest.raises(ValueError, match=r"is a speculator checkpoint \(medusa\), not a draft model"):
        LLM(model_dir, speculative_config={**spec, "model": medusa}, **OPTIONS)
    base = edited(draft_dir, tmp_path / "base", architectures=["Qwen2Model"])
    with pytest.raises(ValueError, match=r"is a base model \(Qwen2Model\), not a causal LM"):
        LLM(model_dir, speculative_config={**spec, "model": base}, **OPTIONS)
    quantized = edited(draft_dir, tmp_path / "fp8", quantization_config={"quant_method": "fp8"})
    with pytest.raises(ValueError, match="is quantized .*a draft model runs in float weights"):
        LLM(model_dir, speculative_config={**spec, "model": quantized}, **OPTIONS)
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 8}))
    with pytest.raises(ValueError, match="it is a LoRA adapter, not a model"):
        LLM(model_dir, speculative_config={**spec, "model": str(adapter)}, **OPTIONS)
    with pytest.raises(ValueError, match="'draft_model' runs on one device without --enable-lora"):
        LLM(model_dir, speculative_config=spec, enable_lora=True, **OPTIONS)
    with pytest.raises(ValueError, match="'draft_model' runs on one device without --num-decode-steps above 1"):
        LLM(model_dir, speculative_config=spec, num_decode_steps=4, **OPTIONS)
    with pytest.raises(ValueError, match="'draft_model' runs on one device without --runner pooling"):
        LLM(model_dir, speculative_config=spec, runner="pooling", **OPTIONS)
