"""EAGLE-3 speculative decoding in the engine (jaxserve/runner/draft_head_step.py): the tiny
`llama` fixture served with its draft head (tests/data/arch/eagle3_llama, random weights), drafting
inside the compiled step. Greedy and seeded outputs equal the outputs without speculation; the
step's drafts equal the head's own dense chain (models/eagle3.py) over the target's taps; a head
made to draft one fixed token (an "oracle" for runs of that token) gets drafts accepted through
the whole path; configurations the drafting cannot serve are refused by name."""

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
from safetensors.numpy import load_file, save_file

from jaxserve import LLM, SamplingParams
from jaxserve.speculative_config import SpeculativeConfig
from jaxserve.models.arch_config import ArchConfig
from jaxserve.models.eagle3 import DenseKV
from jaxserve.models.eagle3_checkpoint import load_eagle3
from jaxserve.models.sharding import single_device_mesh
from jaxserve.models.weights import create_model
from jaxserve.runner.kv_cache import allocate_kv_cache
from jaxserve.runner.step_inputs import StepRequest, pack_step
from tests.engine.spec_checks import run_feeding_the_targets_tokens, spec_stats, tokens
from tests.model_dirs import write_model_dir
from tests.models.test_eagle3 import jitted

DATA = pathlib.Path(__file__).resolve().parent.parent / "data" / "arch"
HEAD = DATA / "eagle3_llama"
K = 3
# Different lengths: one longer than a prefill chunk (the token budget is 32), one token.
PROMPTS = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [9, 10, 11], list(range(20, 60)), [30]]
OPTIONS = dict(dtype="float32", max_num_seqs=8, max_num_batched_tokens=32, token_buckets=(32,),
               request_buckets=(8,), show_progress=False)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(write_model_dir(tmp_path_factory.mktemp("m")))


@pytest.fixture(scope="module")
def head_dir(tmp_path_factory):
    """The fixture's head with the target's LM head rows of its draft vocabulary: its random
    one drafts nearly one token whatever the input; this one's drafts vary with the context."""
    dst = tmp_path_factory.mktemp("head") / "eagle3"
    shutil.copytree(HEAD, dst)
    tensors = load_file(str(HEAD / "model.safetensors"))
    target_head = load_file(str(DATA / "llama" / "model.safetensors"))["lm_head.weight"]
    tensors["lm_head.weight"] = np.ascontiguousarray(target_head[np.flatnonzero(tensors["t2d"])])
    save_file(tensors, str(dst / "model.safetensors"))
    return dst


@pytest.fixture(scope="module")
def spec_llm(model_dir, head_dir, compile_cache_dir):
    return LLM(model_dir, speculative_config={"method": "eagle3", "model": str(head_dir),
                                              "num_speculative_tokens": K},
               compilation_cache_dir=compile_cache_dir, seed=1, **OPTIONS)


@pytest.fixture(scope="module")
def plain_llm(model_dir, compile_cache_dir):
    return LLM(model_dir, compilation_cache_dir=compile_cache_dir, seed=2, **OPTIONS)


def test_greedy_outputs_equal_no_speculation(spec_llm, plain_llm):
    before = spec_stats(spec_llm)
    greedy = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (20, 12, 16, 1)]
    assert tokens(spec_llm, PROMPTS, greedy) == tokens(plain_llm, PROMPTS, greedy)
    drafts, draft_tokens, _ = spec_stats(spec_llm) - before
    assert drafts > 10 and draft_tokens > 2 * drafts  # the head's drafts were fed and verified
    # A request with a penalty takes no drafts (its sampling reads state the drafts are not
    # folded into), next to one that does.
    mixed = [SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, repetition_penalty=1.3),
             SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)]
    before = spec_stats(spec_llm)
    assert tokens(spec_llm, PROMPTS[:2], mixed) == tokens(plain_llm, PROMPTS[:2], mixed)
    assert 0 < (spec_stats(spec_llm) - before)[0] <= 11  # only the second request's steps
    assert spec_llm.engine.runner.counter.recompiles == 0


def test_seeded_sampling_is_reproducible_and_unchanged(spec_llm, plain_llm):
    """A row's random number depends on the seed and the output position only: drafts change
    no seeded output."""
    seeded = [SamplingParams(temperature=t, top_p=tp, max_tokens=12, seed=s, ignore_eos=True)
              for s, (t, tp) in enumerate([(0.7, 1.0), (1.0, 0.9), (0.4, 1.0), (1.0, 1.0)])]
    first = tokens(spec_llm, PROMPTS, seeded)
    assert first == tokens(spec_llm, PROMPTS, seeded) == tokens(plain_llm, PROMPTS, seeded)
    assert all(len(t) == 12 and all(0 <= x < 128 for x in t) for t in first)


@functools.cache
def target_program(num_tokens: int, taps: tuple[int, ...]):
    """The `llama` target's forward over one sequence of up to `num_tokens` through the paged
    path, returning its taps (compiled once per size)."""
    cfg = ArchConfig.from_hf(json.loads((DATA / "llama" / "config.json").read_text()))
    tensors = load_file(str(DATA / "llama" / "model.safetensors"))
    graphdef, state = nnx.split(create_model(cfg, dtype=jnp.float32, get_tensor=tensors.__getitem__))
    kv = allocate_kv_cache(cfg, num_tokens // 4 + 1, 4, jnp.float32, single_device_mesh())

    @jax.jit
    def forward(state, kv, inputs):
        return nnx.merge(graphdef, state)(inputs.input_ids, inputs.positions, kv, inputs.md, taps=taps)[2]

    return functools.partial(forward, state, kv)


def target_taps(seq: list[int], taps: tuple[int, ...]) -> np.ndarray:
    num_tokens = 16 if len(seq) <= 16 else 64
    pages = num_tokens // 4
    inputs = pack_step([StepRequest(seq, 0, list(range(1, pages + 1)))], num_tokens=num_tokens, num_reqs=2,
                       pages_per_req=pages, page_size=4)
    return np.asarray(target_program(num_tokens, taps)(jax.tree.map(jnp.asarray, inputs)))[: len(seq)]


def dense_chains(head, forward, seq: list[int], ends: list[int]) -> tuple[list[list[int]], np.ndarray]:
    """The head's k greedy drafts after each prefix seq[:e + 1] of `ends` (its last token just
    sampled), densely: the target's taps over seq[:-1], the head's causal context pass with each
    position's next token as input (a position's state depends on the ones before it only, so
    one pass serves every prefix), then the chain from position e - 1, its keys masked to the
    context up to there. Also the context pass's keys [len(seq) - 1, Hkv * D]."""
    n = len(seq) - 1
    taps = target_taps(seq[:-1], head.config.aux_layer_ids)
    first, context = forward(jnp.asarray(seq[1:], jnp.int32), jnp.arange(n), head.combine_hidden(taps),
                             DenseKV.empty(head.config))
    chains = []
    for e in ends:
        p, kv = e - 1, context
        out, hidden = [int(first.target_ids[p])], first.hidden[p:p + 1]
        for j in range(1, K):
            mask = jnp.concatenate([jnp.arange(n) <= p, jnp.ones(j, bool)])[None]
            step, kv = forward(jnp.asarray(out[-1:], jnp.int32), jnp.asarray([p + j]), hidden, kv, mask)
            out.append(int(step.target_ids[0]))
            hidden = step.hidden
        chains.append(out)
    return chains, np.asarray(context.k).reshape(n, -1)


def test_step_drafts_equal_the_heads_dense_chain(spec_llm, plain_llm, head_dir):
    """The drafts each step returns (after the prefill, and after each verifying step, whatever
    it kept) are the head's greedy chain over the target's taps of the request's tokens so far,
    the token sampled last as the last input (models/eagle3.py's dense path, checked against
    speculators' in tests/models/test_eagle3.py). So that the steps keep 0 to k drafts, the
    engine is fed the target's own next tokens as drafts, the j-th step's wrong from its
    (j mod k+1)-th on; the outputs stay the plain ones. The head's paged keys of the request's
    context (written by each step's pass over its tokens, the one across the chunk boundary
    with the next chunk's first token) are the dense pass's."""
    for prompt in (PROMPTS[0], PROMPTS[2]):  # one step's prefill, and two chunks' (32 + 8 tokens)
        check_drafts(spec_llm, plain_llm, head_dir, prompt)


def check_drafts(spec_llm, plain_llm, head_dir, prompt):
    runner = spec_llm.engine.runner
    want, heads, pages = run_feeding_the_targets_tokens(spec_llm, plain_llm, prompt, K, 128, max_tokens=6)
    head = load_eagle3(head_dir, target=DATA / "llama")
    forward = jitted(head)
    assert len({tuple(d) for _, d in heads}) > 1  # the head's drafts vary
    ends = list(len(prompt) - 1 + np.cumsum([n for n, _ in heads]))
    seq = prompt + want[: ends[-1] + 1 - len(prompt)]
    dense, keys = dense_chains(head, forward, seq, ends)
    assert [d for _, d in heads] == dense
    positions = np.arange(len(seq) - 1)
    page_size = runner.page_size
    paged = np.asarray(runner.kv.draft.k[0])[pages[-1][positions // page_size], positions % page_size]
    np.testing.assert_allclose(paged, keys, atol=1e-4, rtol=0)


def oracle_head(dst: pathlib.Path, token: int) -> pathlib.Path:
    """The fixture's head made to draft `token` always: a zero LM head (every draft id scores 0:
    the argmax is draft id 0) and a vocabulary map sending draft id 0 to `token`."""
    shutil.copytree(HEAD, dst)
    tensors = load_file(str(HEAD / "model.safetensors"))
    tensors["lm_head.weight"] = np.zeros_like(tensors["lm_head.weight"])
    targets = np.flatnonzero(tensors["t2d"])
    targets = np.concatenate([[token], [t for t in targets if t != token]])[: len(targets)]
    tensors["d2t"] = (targets - np.arange(len(targets))).astype(tensors["d2t"].dtype)
    t2d = np.zeros_like(tensors["t2d"])
    t2d[targets] = True
    tensors["t2d"] = t2d
    save_file(tensors, str(dst / "model.safetensors"))
    return dst


def test_accepted_drafts_end_to_end(spec_llm, plain_llm, tmp_path):
    """The head's weights swapped for an oracle of one token that the target repeats: drafts
    are accepted (several per step), and the outputs still equal plain decoding."""
    runner = spec_llm.engine.runner
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    (want,) = tokens(plain_llm, [PROMPTS[1]], greedy)
    token = max(set(want), key=want.count)
    assert want.count(token) >= 6
    oracle = load_eagle3(oracle_head(tmp_path / "oracle", token), target=DATA / "llama")
    n = len(runner.params) - len(runner.program.drafter_params)
    own = runner.params[n:]
    runner.params[n:] = jax.tree.leaves(nnx.state(oracle))
    try:
        before = spec_stats(spec_llm)
        assert tokens(spec_llm, [PROMPTS[1]], greedy) == [want]
        drafts, draft_tokens, accepted = spec_stats(spec_llm) - before
    finally:
        runner.params[n:] = own
    assert 0 < accepted < draft_tokens and accepted >= 3


def test_config_forms():
    c = SpeculativeConfig.parse('{"method": "eagle3", "model": "/some/head", "num_speculative_tokens": 3}')
    assert (c.method, c.model, c.num_speculative_tokens) == ("eagle3", "/some/head", 3)
    for bad, msg in [({"method": "eagle3", "num_speculative_tokens": 2}, 'needs "model"'),
                     ({"method": "eagle3", "model": "x", "num_speculative_tokens": 2, "prompt_lookup_max": 3},
                      "prompt_lookup"),
                     ({"method": "ngram", "model": "x", "num_speculative_tokens": 2}, 'is for method "eagle3"'),
                     ({"method": "eagle", "model": "x", "num_speculative_tokens": 2}, "'eagle3'")]:
        with pytest.raises(ValueError, match=msg):
            SpeculativeConfig.parse(bad)


def test_the_serve_flag_takes_vllms_json():
    from jaxserve.config import EngineConfig
    from jaxserve.server.cli import build_parser, engine_options

    flag = '{"method": "eagle3", "model": "/heads/llama3-eagle3", "num_speculative_tokens": 4}'
    opts = engine_options(build_parser().parse_args(["serve", "--speculative-config", flag]))
    spec = EngineConfig.from_kwargs(**opts).speculative_config
    assert (spec.method, spec.model, spec.num_speculative_tokens) == ("eagle3", "/heads/llama3-eagle3", 4)


def test_refused_at_start(model_dir, tmp_path):
    spec = {"method": "eagle3", "model": str(HEAD), "num_speculative_tokens": 2}
    with pytest.raises(ValueError, match="speculative_config model .*was not found"):
        LLM(model_dir, speculative_config={**spec, "model": str(tmp_path / "missing")}, **OPTIONS)
    wide = tmp_path / "wide"
    shutil.copytree(HEAD, wide)
    cfg = json.loads((wide / "config.json").read_text())
    cfg["transformer_layer_config"]["hidden_size"] = 96
    (wide / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"hidden size \(96\) differs from the target's \(64\)"):
        LLM(model_dir, speculative_config={**spec, "model": str(wide)}, **OPTIONS)
    deepseek = str(write_model_dir(tmp_path / "deepseek", "deepseek_v3"))
    with pytest.raises(ValueError, match="serves Llama-family targets; the DeepseekV3ForCausalLM forward"):
        LLM(deepseek, speculative_config=spec, **OPTIONS)
    with pytest.raises(ValueError, match="'eagle3' runs on one device without --enable-lora"):
        LLM(model_dir, speculative_config=spec, enable_lora=True, **OPTIONS)
    with pytest.raises(ValueError, match="without --num-decode-steps above 1"):
        LLM(model_dir, speculative_config=spec, num_decode_steps=4, **OPTIONS)


def test_the_compile_workers_lower_the_runners_program(spec_llm):
    """From the recipe alone (the head's abstract weights read from its directory), the compile
    workers and memory probes lower the program the runner runs."""
    from jaxserve.runner.compile_pool import abstract_step, lower_bucket
    from jaxserve.runner.recipe import program_fingerprint

    runner = spec_llm.engine.runner
    recipe = runner.recipe
    assert recipe.draft_model and recipe.num_speculative_tokens == K
    bucket = (32, 8)
    assert (program_fingerprint(lower_bucket(recipe, abstract_step(recipe), bucket))
            == program_fingerprint(runner.lower(bucket)))


def test_the_last_kept_row_of_each_request():
    """`accepted_rows`: a request keeps its samples while each equals the draft fed after its
    token; its last kept row is where the next token was sampled."""
    from jaxserve.runner.step_inputs import ModelInputs
    from jaxserve.runner.draft_head_step import DraftInputs, accepted_rows

    # Request 0 feeds [a, 7, 8] (drafts 7, 8), request 1 one token, request 2 [b, 4, 5, 6],
    # request 3 prefills without sampling; flat tokens 0-2, 3, 4-7, 8-9.
    next_tokens = np.array([7, 8, 0, 0, 4, 5, 6, 0, 11, 0], np.int32)
    d = DraftInputs(next_tokens=next_tokens, first_row=np.array([0, 3, 4, 0, 0, 0, 0, 0], np.int32),
                    num_rows=np.array([3, 1, 4, 0, 0, 0, 0, 0], np.int32),
                    num_pages=np.ones(8, np.int32))
    inputs = ModelInputs(input_ids=None, positions=None, md=None,
                         logits_indices=np.array([0, 1, 2, 3, 4, 5, 6, 7], np.int32))
    cases = [([7, 8, 9, 1, 4, 9, 6, 2], [2, 3, 5]),  # all kept; none fed; one of three kept
             ([3, 8, 9, 1, 1, 5, 6, 2], [0, 3, 4]),  # the first sample differs: none kept
             ([7, 2, 9, 1, 4, 5, 6, 2], [1, 3, 7])]  # one kept; all three kept
    for sampled, want in cases:
        rows = np.asarray(accepted_rows(jnp.asarray(sampled, jnp.int32), inputs, d, K))
        assert rows[:3].tolist() == want


def test_the_kv_budget_holds_the_heads_pages(spec_llm, plain_llm):
    """The head's layer of pages (the same shape as one of the two target layers' here) comes
    out of the same KV budget: a third fewer pages, the head's as many as the target's."""
    plain, spec = plain_llm.engine.runner, spec_llm.engine.runner
    assert abs(3 * spec.num_pages - 2 * plain.num_pages) <= 3
    assert spec.kv.draft.k[0].shape[0] == spec.kv.target.k[0].shape[0] == spec.num_pages


def test_an_fp8_cache_with_the_head(model_dir, head_dir, compile_cache_dir):
    """--kv-cache-dtype fp8: the target's pages in one byte with their measured scales, the
    head's in the model's dtype (runner/draft_head_step.py `draft_cache_dtype`); greedy outputs
    equal plain decoding over the same fp8 cache, drafts verified."""
    fp8 = dict(OPTIONS, kv_cache_dtype="fp8", compilation_cache_dir=compile_cache_dir)
    spec = LLM(model_dir, speculative_config={"method": "eagle3", "model": str(head_dir),
                                              "num_speculative_tokens": K}, **fp8)
    kv = spec.engine.runner.kv
    assert str(kv.target.k[0].dtype) == "float8_e4m3fn" and kv.draft.k[0].dtype == jnp.float32
    greedy = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (12, 8)]
    assert tokens(spec, PROMPTS[:2], greedy) == tokens(LLM(model_dir, **fp8), PROMPTS[:2], greedy)
    assert spec_stats(spec)[1] > 4
