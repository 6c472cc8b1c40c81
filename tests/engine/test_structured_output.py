"""Structured output in the engine: StructuredOutputsParams, the grammar compiler (llguidance on
the default model's tokenizer), the engine core's matchers and bitmasks on a fake runner
(steps stop overlapping while a constrained request runs, preemption, n > 1, aborts), and
LLM.generate on the real default model: ten JSON schemas validated with jsonschema (greedy
and sampled), regex, choice and grammar constraints, free and constrained requests in one
batch, zero recompiles."""

from __future__ import annotations

import json
import re

import jsonschema
import numpy as np
import pytest

from jaxserve import LLM, SamplingParams
from jaxserve.engine.llm_engine import LLMEngine
from jaxserve.sampling_params import StructuredOutputsParams
from jaxserve.structured.compiler import GrammarCompiler, bitmask_words
from tests.engine.fakes import allowed_ids, fake_parts
from tests.structured_cases import MAX_TOKENS, SCHEMAS

EOS = 2  # SmolLM2's <|im_end|>


@pytest.fixture(scope="module")
def tokenizer():
    from jaxserve.engine.tokenizer import Tokenizer
    from jaxserve.models.loader import resolve_model

    return Tokenizer.from_pretrained(resolve_model(None))


@pytest.fixture(scope="module")
def compiler(tokenizer):
    return GrammarCompiler(tokenizer.hf_tokenizer, tokenizer.vocab_size, [EOS])


# ---------------------------------------------------------------------------- params
def test_params_take_exactly_one_constraint():
    assert StructuredOutputsParams(json={"type": "object"}).kind == "json"
    assert StructuredOutputsParams(json_object=True).kind == "json_object"
    for bad in ({}, {"json": {}, "regex": "a"}, {"choice": []}, {"choice": ["a", 1]}, {"regex": ""},
                {"json": 3}):
        with pytest.raises(ValueError):
            StructuredOutputsParams(**bad)
    with pytest.raises(ValueError, match="structured_outputs"):
        SamplingParams(structured_outputs={"json": {}})  # type: ignore[arg-type]
    # the key ignores the schema's key order; the layout is part of it
    a = StructuredOutputsParams(json={"type": "object", "properties": {}})
    b = StructuredOutputsParams(json={"properties": {}, "type": "object"})
    assert a.key() == b.key() != StructuredOutputsParams(json=b.json, disable_any_whitespace=True).key()


def test_truncate_prompt_tokens_keeps_the_last_tokens(tokenizer):
    engine = LLMEngine(fake_parts(tokenizer=tokenizer, vocab_size=tokenizer.vocab_size, eos=EOS))
    ids = list(range(100, 140))
    engine.add_request("a", ids, SamplingParams(max_tokens=1, truncate_prompt_tokens=8))
    assert engine.core.runner.prompts == [] and engine.scheduler.get_request("a").prompt_token_ids == ids[-8:]
    engine.add_request("b", ids, SamplingParams(max_tokens=1, truncate_prompt_tokens=-1))
    assert engine.scheduler.get_request("b").prompt_token_ids == ids
    for bad in (0, -2):
        with pytest.raises(ValueError, match="truncate_prompt_tokens"):
            SamplingParams(truncate_prompt_tokens=bad)
    with pytest.raises(ValueError, match="truncate_prompt_tokens"):
        engine.add_request("c", ids, SamplingParams(max_tokens=1, truncate_prompt_tokens=500))


# ---------------------------------------------------------------------------- compiler
@pytest.mark.parametrize("params, needle", [
    (StructuredOutputsParams(json={"type": "objectx"}), "Invalid type"),
    (StructuredOutputsParams(json={"not": {"type": "string"}}), "not"),
    (StructuredOutputsParams(json='{"type": "object"'), "not valid JSON"),
    (StructuredOutputsParams(json={"properties": {"a": {"$ref": "#/$defs/missing"}}}), "does not exist"),
    (StructuredOutputsParams(regex="[a-"), "unclosed character class"),
    (StructuredOutputsParams(grammar='start: foo\nfoo: "x" bar'), "unknown name"),
], ids=["type", "unsupported", "bad-json", "ref", "regex", "grammar"])
def test_uncompilable_constraints_name_the_problem(compiler, params, needle):
    with pytest.raises(ValueError) as ei:
        compiler.compile(params)
    assert needle in str(ei.value) and "structured output" in str(ei.value)


def test_compiled_grammars_are_cached_and_matchers_independent(compiler, tokenizer):
    p = StructuredOutputsParams(choice=["yes", "no"])
    g = compiler.compile(p)
    assert compiler.compile(StructuredOutputsParams(choice=["yes", "no"])) is g
    a, b = g.matcher(), g.matcher()
    row = np.zeros(bitmask_words(tokenizer.vocab_size), np.int32)
    a.fill(row)
    first = {tokenizer.decode([int(t)]) for t in allowed_ids(row)}
    assert first == {"y", "ye", "yes", "n", "no"}
    for t in tokenizer.encode("yes", add_special_tokens=False):
        assert a.accept(t)
    a.fill(row)
    assert list(allowed_ids(row)) == [EOS] and a.is_terminated  # only the end is left
    b.fill(row)
    assert len(allowed_ids(row)) == 5  # b did not move


def test_gbnf_and_lark_grammars(compiler, tokenizer):
    row = np.zeros(bitmask_words(tokenizer.vocab_size), np.int32)
    for text in ('root ::= "on" | "off"', 'start: "on" | "off"'):
        m = compiler.compile(StructuredOutputsParams(grammar=text)).matcher()
        m.fill(row)
        assert {tokenizer.decode([int(t)]) for t in allowed_ids(row)} == {"o", "on", "of", "off"}


# ---------------------------------------------------------------------------- engine core (fake runner)
def _engine(tokenizer, **kw) -> LLMEngine:
    kw.setdefault("max_model_len", 256)
    return LLMEngine(fake_parts(tokenizer=tokenizer, vocab_size=tokenizer.vocab_size, eos=EOS, **kw))


def _run(engine: LLMEngine, requests: dict) -> dict:
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params)
    done, steps = {}, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = [(o.text, o.token_ids, o.finish_reason) for o in out.outputs]
        steps += 1
        assert steps < 5000
    return done


WORDS = ["alpha", "beta", "gamma", "delta"]
CODE = r"[0-9]{2}-[a-c]{3}( [a-z]{4}){2}"


def _mixed(tokenizer) -> dict:
    ids = tokenizer.encode("Pick one word from the list below, or write a code:", add_special_tokens=False)
    reqs = {}
    for i in range(10):
        prompt = ids + [200 + i] * (i % 4)
        if i % 3 == 0:
            p = SamplingParams(max_tokens=12, temperature=0, structured_outputs=StructuredOutputsParams(choice=WORDS))
        elif i % 3 == 1:
            p = SamplingParams(max_tokens=30, n=2, seed=i,
                               structured_outputs=StructuredOutputsParams(regex=CODE))
        else:
            p = SamplingParams(max_tokens=6 + i, temperature=0)  # free
        reqs[f"r{i}"] = (prompt, p)
    return reqs


@pytest.mark.parametrize("tight", [False, True], ids=["roomy", "preempting"])
def test_constrained_and_free_requests_share_steps(tokenizer, tight):
    """Constrained (choice, regex with n = 2) and free requests run together; overlapped steps
    give the outputs of plain steps, also when the KV cache is small enough to preempt; every
    constrained output obeys its constraint and ends with EOS."""
    kw = dict(budget=16, num_blocks=16 if tight else 512, max_model_len=60)
    plain = _run(_engine(tokenizer, async_scheduling=False, **kw), _mixed(tokenizer))
    over_engine = _engine(tokenizer, async_scheduling=True, **kw)
    over = _run(over_engine, _mixed(tokenizer))
    assert over == plain
    assert over_engine.core.runner.masked_steps > 0
    if tight:
        assert over_engine.scheduler.num_preemptions > 0
    for i in range(10):
        outs = over[f"r{i}"]
        for text, toks, finish in outs:
            if i % 3 == 0:
                assert text in WORDS and finish == "stop" and toks[-1] == EOS
            elif i % 3 == 1:
                assert re.fullmatch(CODE, text) and finish == "stop"
    assert not over_engine.core.structured.active  # every matcher dropped


def test_steps_do_not_overlap_while_a_constrained_request_runs(tokenizer):
    engine = _engine(tokenizer, async_scheduling=True)
    core = engine.core
    engine.add_request("free", tokenizer.encode("Hello"), SamplingParams(max_tokens=30, temperature=0))
    engine.step()
    assert core._in_flight is not None  # overlapped
    engine.add_request("c", tokenizer.encode("Hello"), SamplingParams(
        max_tokens=30, temperature=0, structured_outputs=StructuredOutputsParams(regex="[a-z]{20}")))
    scheduled_before = len(core.runner.scheduled)
    engine.step()  # collects the step in flight, launches nothing
    assert core._in_flight is None and len(core.runner.scheduled) == scheduled_before
    while core.structured.active:
        engine.step()
        assert core._in_flight is None
    engine.step()
    while engine.has_unfinished_requests():
        engine.step()


def test_abort_drops_the_matcher(tokenizer):
    engine = _engine(tokenizer)
    engine.add_request("c", tokenizer.encode("Hi"), SamplingParams(
        max_tokens=50, temperature=0, structured_outputs=StructuredOutputsParams(regex="[a-z]{40}")))
    engine.step()
    engine.step()
    assert engine.core.structured.active
    engine.abort_request("c")
    assert not engine.core.structured.active


def test_bad_constraint_is_refused_before_anything_is_queued(tokenizer):
    engine = _engine(tokenizer)
    with pytest.raises(ValueError, match="regex"):
        engine.add_request("c", tokenizer.encode("Hi"), SamplingParams(
            structured_outputs=StructuredOutputsParams(regex="(")))
    assert not engine.has_unfinished_requests() and not engine.output_processor.has("c")


# ---------------------------------------------------------------------------- the real model
@pytest.fixture
def llm(small_llm):
    return small_llm


def _chat_ids(llm: LLM, text: str) -> list[int]:
    tok = llm.get_tokenizer()
    return tok.encode(tok.apply_chat_template([{"role": "user", "content": text}]), add_special_tokens=False)


@pytest.mark.slow
def test_ten_json_schemas_greedy_and_sampled(llm):
    """One generate call: each schema greedy and sampled (seeded), plus free requests in the
    same batches; every constrained output is JSON valid for its schema; nothing recompiles."""
    prompts, params = [], []
    for _, schema, prompt in SCHEMAS:
        for temperature in (0.0, 0.8):
            prompts.append(_chat_ids(llm, prompt))
            params.append(SamplingParams(max_tokens=MAX_TOKENS, temperature=temperature, seed=5,
                                         structured_outputs=StructuredOutputsParams(json=schema)))
    free = [_chat_ids(llm, "Tell me a joke.")] * 2
    outs = llm.generate(prompts + free, params + [SamplingParams(max_tokens=8, temperature=0)] * 2, use_tqdm=False)
    for (name, schema, _), pair in zip(SCHEMAS, zip(outs[0::2], outs[1::2])):
        for out in pair:
            o = out.outputs[0]
            assert o.finish_reason == "stop", (name, o.text)
            jsonschema.validate(json.loads(o.text), schema)
    assert all(o.outputs[0].finish_reason == "length" for o in outs[-2:])
    # the free requests are what they are alone
    (alone,) = llm.generate(free[:1], SamplingParams(max_tokens=8, temperature=0), use_tqdm=False)
    assert alone.outputs[0].token_ids == outs[-1].outputs[0].token_ids
    assert llm.engine.num_compiles_after_warmup == 0


@pytest.mark.slow
def test_regex_choice_grammar_and_json_object(llm):
    ids = _chat_ids(llm, "What is the capital of France?")
    S = StructuredOutputsParams
    cases = [
        (S(regex=r"[A-Z][a-z]{2,10}, [0-9]{4}"), lambda t: re.fullmatch(r"[A-Z][a-z]{2,10}, [0-9]{4}", t)),
        (S(choice=["Paris", "London", "Berlin"]), lambda t: t in ("Paris", "London", "Berlin")),
        (S(grammar='root ::= "The answer is " ("yes" | "no") "."'), lambda t: t in ("The answer is yes.",
                                                                                  "The answer is no.")),
        (S(json_object=True), lambda t: isinstance(json.loads(t), dict)),
    ]
    outs = llm.generate([ids] * len(cases), [SamplingParams(max_tokens=60, temperature=0, structured_outputs=c)
                                             for c, _ in cases], use_tqdm=False)
    for (c, check), out in zip(cases, outs):
        o = out.outputs[0]
        assert o.finish_reason == "stop" and check(o.text), (c, o.text)
    # n > 1 with a seed: every sample obeys the constraint. Log-probs are those of the masked
    # logits (vLLM's raw logprobs): the closing EOS, the only token left, has probability 1.
    (out,) = llm.generate([ids], SamplingParams(n=3, seed=1, max_tokens=10, logprobs=2,
                                                structured_outputs=S(choice=["Paris", "London"])), use_tqdm=False)
    for o in out.outputs:
        assert o.text in ("Paris", "London") and o.finish_reason == "stop" and o.token_ids[-1] == EOS
        assert all(lp[tok].logprob > -1e9 for tok, lp in zip(o.token_ids, o.logprobs))
        assert o.logprobs[-1][EOS].logprob == pytest.approx(0.0, abs=1e-5)
    assert llm.engine.num_compiles_after_warmup == 0


def test_a_constraint_past_the_grammar_engines_limits_fails_its_request(tokenizer):
    """llguidance stops enforcing a choice among 5,000 strings after its first token (its parser
    row limit, 2,000 items, bounds the time of a step's masks): the request fails with that
    error instead of going on unconstrained, and the free request beside it is unaffected."""
    engine = _engine(tokenizer)
    many = [f"option number {i}" for i in range(5000)]
    engine.add_request("c", tokenizer.encode("Pick:"), SamplingParams(
        max_tokens=20, temperature=0, structured_outputs=StructuredOutputsParams(choice=many)))
    engine.add_request("free", tokenizer.encode("Hello"), SamplingParams(max_tokens=8, temperature=0))
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    assert [rid for rid, _ in engine.failures] == ["c"]
    error = engine.failures[0][1]
    assert isinstance(error, ValueError) and "cannot be enforced" in str(error) and "2000" in str(error)
    assert len(done["free"].outputs[0].token_ids) == 8
    assert not engine.core.structured.active
