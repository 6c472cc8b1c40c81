"""vLLM's offline API as its users write it, on the default model (the session's `small_llm`):
every prompt form vLLM takes (jaxserve.inputs) gives the plain string's tokens, anything else is
a TypeError naming the forms; `LLM.chat` with vLLM's keywords; `LLM.beam_search`;
`reset_prefix_cache`, `sleep` / `wake_up`, `get_tokenizer`; and vLLM's offline examples
(basic generation, chat, structured outputs, beam search, prompt dicts) with the calls they make,
only the import lines changed."""

from __future__ import annotations

import json
import math
import re

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jaxserve import LLM, SamplingParams  # vLLM: from vllm import LLM, SamplingParams
from jaxserve.beam_search import BeamSearchOutput, beam_score  # vLLM: from vllm.beam_search import ...
from jaxserve.inputs import TextPrompt, TokensPrompt  # vLLM: from vllm.inputs import ...
from jaxserve.lora_request import LoRARequest
from jaxserve.sampling_params import BeamSearchParams, StructuredOutputsParams  # vllm.sampling_params

GREEDY = SamplingParams(temperature=0.0, max_tokens=4)
PROMPTS = ["The capital of France is", "Hello, my name is", "1, 2, 3,"]


@pytest.fixture(scope="module")
def llm(small_llm) -> LLM:
    return small_llm


@pytest.fixture(scope="module")
def plain(llm) -> dict[str, tuple[list[int], list[int]]]:
    """Each prompt's (prompt ids, greedy tokens) from the plain string."""
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    return {p: (o.prompt_token_ids, o.outputs[0].token_ids) for p, o in zip(PROMPTS, outs)}


def _form(kind: str, text: str, ids: list[int]):
    return {
        "str": text,
        "ids": list(ids),
        "tuple": tuple(ids),
        "text_dict": {"prompt": text},
        "text_typed": TextPrompt(prompt=text),
        "tokens_dict": {"prompt_token_ids": list(ids)},
        "tokens_typed": TokensPrompt(prompt_token_ids=list(ids), prompt=text),
        "salted": {"prompt": text, "cache_salt": "s1"},
    }[kind]


FORMS = ["str", "ids", "tuple", "text_dict", "text_typed", "tokens_dict", "tokens_typed", "salted"]


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.tuples(st.sampled_from(range(len(PROMPTS))), st.sampled_from(FORMS)), min_size=1, max_size=4),
       st.booleans())
def test_every_prompt_form_gives_the_plain_strings_tokens(llm, plain, items, bare):
    batch = [_form(kind, PROMPTS[i], plain[PROMPTS[i]][0]) for i, kind in items]
    prompts = batch[0] if bare and len(batch) == 1 else batch  # one prompt alone, or a batch
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert len(outs) == len(batch)
    for (i, kind), out in zip(items, outs):
        ids, tokens = plain[PROMPTS[i]]
        assert out.prompt_token_ids == ids, kind
        assert out.outputs[0].token_ids == tokens, kind
        sent_text = kind not in ("ids", "tuple", "tokens_dict")
        assert out.prompt == (PROMPTS[i] if sent_text else None), kind


def test_a_text_prompt_dict_is_never_read_as_a_list_of_prompts(llm, plain):
    """The first report: a TextPrompt was iterated and its key "prompt" became the prompt text."""
    text, ids = PROMPTS[0], plain[PROMPTS[0]]
    (out,) = llm.generate({"prompt": text}, GREEDY, use_tqdm=False)
    assert out.outputs[0].token_ids == ids[1] and out.prompt == text
    (out,) = llm.generate({"prompt_token_ids": ids[0]}, GREEDY, use_tqdm=False)
    assert out.outputs[0].token_ids == ids[1] and out.prompt_token_ids == ids[0]
    outs = llm.generate([{"prompt": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [plain[p][1] for p in PROMPTS]


@pytest.mark.parametrize("bad, match", [
    ({"text": "x"}, "no key"), ({"prompt": 5}, "must be a string"), ({"prompt_token_ids": "abc"}, "list of ints"),
    ({"prompt_token_ids": [1, "a"]}, "list of ints"), ({}, "needs 'prompt'"), (5, "unsupported prompt"),
    (None, "unsupported prompt"), ({1, 2}, "unsupported prompt"), (b"bytes", "unsupported prompt"),
    ([["a"]], "prompt 0|unsupported"), ([1, "a"], "prompt 0|unsupported"), (["a", 5], "prompt 1: unsupported"),
    ([True, False], "unsupported prompt"), ({"prompt": "x", "cache_salt": ""}, "cache_salt"),
    (iter(["a"]), "unsupported prompt"),
])
def test_what_is_not_a_prompt_is_a_type_error_naming_the_forms(llm, bad, match):
    with pytest.raises(TypeError, match=match) as info:
        llm.generate(bad, GREEDY, use_tqdm=False)
    assert "TextPrompt" in str(info.value) or "'prompt" in str(info.value) or "cache_salt" in str(info.value)


@pytest.mark.parametrize("bad, match", [
    ({"prompt": "x", "multi_modal_data": {"image": "img.png"}}, "takes text alone"),
    ({"prompt_embeds": [[0.0]]}, "prompt embeddings"),
    ({"encoder_prompt": "a", "decoder_prompt": "b"}, "encoder-decoder"),
    ([[]], "empty"), ("", "empty"), ({"prompt_token_ids": []}, "empty"),
])
def test_forms_no_served_model_takes_and_empty_prompts_are_value_errors(llm, bad, match):
    with pytest.raises(ValueError, match=match):
        llm.generate(bad, GREEDY, use_tqdm=False)


def test_an_empty_batch_gives_no_outputs_and_counts_must_match(llm):
    assert llm.generate([], GREEDY, use_tqdm=False) == []
    with pytest.raises(ValueError, match="2 sampling params for 1 prompts"):
        llm.generate(["a"], [GREEDY, GREEDY], use_tqdm=False)


def test_a_prompts_cache_salt_separates_its_prefix_cache_entries(llm):
    text = " ".join(f"word{i}" for i in range(40))  # several full KV blocks
    sp = SamplingParams(temperature=0.0, max_tokens=1)
    first = llm.generate({"prompt": text, "cache_salt": "alice"}, sp, use_tqdm=False)[0]
    other = llm.generate({"prompt": text, "cache_salt": "bob"}, sp, use_tqdm=False)[0]
    again = llm.generate(TextPrompt(prompt=text, cache_salt="alice"), sp, use_tqdm=False)[0]
    assert first.num_cached_tokens == 0 and other.num_cached_tokens == 0
    assert again.num_cached_tokens > 0
    assert again.outputs[0].token_ids == first.outputs[0].token_ids == other.outputs[0].token_ids


def test_truncate_prompt_tokens_keeps_the_last_tokens(llm, plain):
    ids = plain[PROMPTS[0]][0]
    (out,) = llm.generate(PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=2, truncate_prompt_tokens=3),
                          use_tqdm=False)
    assert out.prompt_token_ids == ids[-3:]


# ---------------------------------------------------------------------------- chat
CONVERSATION = [
    {"role": "system", "content": "You are a helpful assistant"},
    {"role": "user", "content": "Hello"},
    {"role": "assistant", "content": "Hello! How can I assist you today?"},
    {"role": "user", "content": "Write an essay about the importance of higher education."},
]


def test_chat_renders_the_model_template_and_generates_as_the_rendered_prompt(llm):
    (out,) = llm.chat(CONVERSATION, GREEDY, use_tqdm=False)
    rendered = llm.get_tokenizer().hf_tokenizer.apply_chat_template(CONVERSATION, tokenize=False,
                                                                    add_generation_prompt=True)
    assert out.prompt == rendered
    (same,) = llm.generate({"prompt_token_ids": out.prompt_token_ids}, GREEDY, use_tqdm=False)
    assert same.outputs[0].token_ids == out.outputs[0].token_ids


def test_chat_keywords_reach_the_template(llm):
    template = ("{% if greeting %}{{ greeting }} {% endif %}{% if enable_thinking %}THINK {% endif %}"
                "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }} {% endfor %}"
                "{% if add_generation_prompt %}[assistant]{% endif %}")
    (out,) = llm.chat([{"role": "user", "content": "Hi"}], GREEDY, use_tqdm=False, chat_template=template,
                      chat_template_kwargs={"greeting": "HELLO", "enable_thinking": True})
    assert out.prompt == "HELLO THINK [user] Hi [assistant]"
    (off,) = llm.chat([{"role": "user", "content": "Hi"}], GREEDY, use_tqdm=False, chat_template=template,
                      chat_template_kwargs={"enable_thinking": False})
    assert off.prompt == "[user] Hi [assistant]"


def test_continue_final_message_continues_the_assistant_turn(llm):
    conv = [{"role": "user", "content": "Name a color."}, {"role": "assistant", "content": "My favourite color is"}]
    (out,) = llm.chat(conv, GREEDY, use_tqdm=False, add_generation_prompt=False, continue_final_message=True)
    assert out.prompt.endswith("My favourite color is")  # no end-of-turn after it
    with pytest.raises(ValueError, match="cannot both be true"):
        llm.chat(conv, GREEDY, use_tqdm=False, continue_final_message=True)


def test_chat_content_format_and_tools(llm):
    parts = "{% for m in messages %}{% for p in m['content'] %}<{{ p['type'] }}:{{ p['text'] }}>{% endfor %}{% endfor %}"
    msg = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    (out,) = llm.chat(msg, GREEDY, use_tqdm=False, chat_template=parts)  # "auto" reads the loop
    assert out.prompt == "<text:a><text:b>"
    (out,) = llm.chat([{"role": "user", "content": "c"}], GREEDY, use_tqdm=False, chat_template=parts,
                      chat_template_content_format="openai")
    assert out.prompt == "<text:c>"
    (out,) = llm.chat(msg, GREEDY, use_tqdm=False, chat_template_content_format="string",
                      chat_template="{% for m in messages %}{{ m['content'] }}{% endfor %}")
    assert out.prompt == "a\nb"
    weather = {"type": "function", "function": {"name": "get_weather", "description": "The weather",
                                                "parameters": {"type": "object", "properties": {}}}}
    (out,) = llm.chat([{"role": "user", "content": "Weather?"}], GREEDY, use_tqdm=False, tools=[weather])
    assert "get_weather" in out.prompt  # the default template has no tools section: a system block shows them


def test_chat_passes_its_lora_request_and_refuses_bad_messages(llm):
    with pytest.raises(ValueError, match="LoRA is not enabled"):
        llm.chat([{"role": "user", "content": "Hi"}], GREEDY, use_tqdm=False,
                 lora_request=LoRARequest("sql", 1, "/nonexistent"))
    with pytest.raises(ValueError, match="message 0"):
        llm.chat([{"content": "no role"}], GREEDY, use_tqdm=False)
    with pytest.raises(TypeError, match="list of message dicts"):
        llm.chat(["just a string"], GREEDY, use_tqdm=False)


# ---------------------------------------------------------------------------- beam search
def test_beam_search_of_width_one_is_greedy(llm, plain):
    (out,) = llm.beam_search([PROMPTS[0]], BeamSearchParams(beam_width=1, max_tokens=4))
    (seq,) = out.sequences
    ids, greedy = plain[PROMPTS[0]]
    assert seq.tokens == ids + greedy
    (g,) = llm.generate(PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=4, logprobs=0), use_tqdm=False)
    assert seq.cum_logprob == pytest.approx(sum(d[t].logprob for t, d in zip(greedy, g.outputs[0].logprobs)),
                                            abs=1e-4)


def test_beam_search_returns_the_best_beams_ranked_with_their_own_logprobs(llm, plain):
    text = PROMPTS[0]
    (out,) = llm.beam_search([{"prompt": text}], BeamSearchParams(beam_width=3, max_tokens=4))
    ids = plain[text][0]
    eos = llm.engine.info.eos_token_id
    assert isinstance(out, BeamSearchOutput) and len(out.sequences) == 3
    scores = [beam_score(s.tokens, s.cum_logprob, eos, 1.0) for s in out.sequences]
    assert scores == sorted(scores, reverse=True)
    assert len({tuple(s.tokens) for s in out.sequences}) == 3
    for s in out.sequences:
        gen = s.tokens[len(ids):]
        assert s.tokens[: len(ids)] == ids and 1 <= len(gen) <= 4 and len(s.logprobs) == len(gen)
        assert s.cum_logprob == pytest.approx(sum(d[t].logprob for t, d in zip(gen, s.logprobs)), abs=1e-5)
        assert s.text == llm.get_tokenizer().decode(s.tokens, skip_special_tokens=False)
        assert s.finish_reason in ("stop", "length")
    # The best beam's last token has the log-prob the model gives it after the beam's prefix.
    best = out.sequences[0]
    (check,) = llm.generate({"prompt_token_ids": best.tokens[:-1]}, SamplingParams(temperature=0.0, max_tokens=1,
                                                                                   logprobs=6), use_tqdm=False)
    assert check.outputs[0].logprobs[0][best.tokens[-1]].logprob == pytest.approx(best.logprobs[-1][best.tokens[-1]].logprob,
                                                                                   abs=1e-4)


def test_beam_search_reuses_the_prefix_cache_across_steps(llm):
    """Each step's requests are whole sequences: the prefix cache serves the full blocks earlier
    steps computed (the prompt's included), so a step computes about a block per beam."""
    text = " ".join(f"beam{i}" for i in range(60))
    before = llm.engine.scheduler.make_stats()
    llm.beam_search([text], BeamSearchParams(beam_width=2, max_tokens=3))
    after = llm.engine.scheduler.make_stats()
    queries = after.prefix_cache_queries - before.prefix_cache_queries
    hits = after.prefix_cache_hits - before.prefix_cache_hits
    assert queries > 0 and hits / queries > 0.6, (hits, queries)


def test_beam_search_length_penalty_and_eos(llm):
    params = BeamSearchParams(beam_width=2, max_tokens=3, length_penalty=0.0, ignore_eos=True)
    (out,) = llm.beam_search(["Hi"], params)
    assert [s.cum_logprob for s in out.sequences] == sorted((s.cum_logprob for s in out.sequences), reverse=True)
    assert all(s.finish_reason == "length" for s in out.sequences)
    with pytest.raises(ValueError, match="beam_width"):
        BeamSearchParams(beam_width=0, max_tokens=3)
    with pytest.raises(ValueError, match="max-logprobs"):
        llm.beam_search(["Hi"], BeamSearchParams(beam_width=11, max_tokens=1))


# ---------------------------------------------------------------------------- engine commands
def test_reset_prefix_cache_sleep_and_wake_up(llm, plain):
    text = " ".join(f"token{i}" for i in range(40))
    sp = SamplingParams(temperature=0.0, max_tokens=3)
    first = llm.generate(text, sp, use_tqdm=False)[0]
    assert llm.generate(text, sp, use_tqdm=False)[0].num_cached_tokens > 0
    assert llm.reset_prefix_cache() is True
    assert llm.generate(text, sp, use_tqdm=False)[0].num_cached_tokens == 0
    with pytest.raises(ValueError, match="level"):
        llm.sleep(level=2)
    llm.sleep()  # right after a request finished: its runner slot is released first
    assert llm.engine.core.is_sleeping
    with pytest.raises(RuntimeError, match="sleeping"):
        llm.generate(text, sp, use_tqdm=False)
    llm.wake_up()
    again = llm.generate(text, sp, use_tqdm=False)[0]
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
    assert llm.generate(PROMPTS, GREEDY, use_tqdm=False)[1].outputs[0].token_ids == plain[PROMPTS[1]][1]


# ---------------------------------------------------------------------------- vLLM's examples
def test_vllm_basic_example(llm):
    prompts = ["Hello, my name is", "The president of the United States is", "The capital of France is",
               "The future of AI is"]
    sampling_params = SamplingParams(temperature=0.8, top_p=0.95)
    outputs = llm.generate(prompts, sampling_params)
    for prompt, output in zip(prompts, outputs):
        assert output.prompt == prompt
        generated_text = output.outputs[0].text
        assert isinstance(generated_text, str) and 0 < len(output.outputs[0].token_ids) <= 16


def test_vllm_chat_example(llm):
    sampling_params = SamplingParams(max_tokens=8, temperature=0.0)
    outputs = llm.chat(CONVERSATION, sampling_params, use_tqdm=False)
    assert len(outputs) == 1 and outputs[0].outputs[0].text
    conversations = [CONVERSATION for _ in range(3)]
    outputs = llm.chat(conversations, sampling_params, use_tqdm=True)
    assert len({o.outputs[0].text for o in outputs}) == 1
    chat_template = "{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n{% endfor %}"
    outputs = llm.chat(conversations, sampling_params, use_tqdm=False, chat_template=chat_template)
    assert outputs[0].prompt.startswith("system: You are a helpful assistant\n")


def test_vllm_structured_outputs_example(llm):
    choice = SamplingParams(structured_outputs=StructuredOutputsParams(choice=["Positive", "Negative"]))
    out = llm.generate("Classify this sentiment: vLLM is wonderful!", sampling_params=choice)
    assert out[0].outputs[0].text in ("Positive", "Negative")
    regex = SamplingParams(structured_outputs=StructuredOutputsParams(regex=r"\w+@\w+\.com\n"), stop=["\n"],
                           temperature=0.0, max_tokens=24)
    out = llm.generate("Generate an email address for Alan Turing, who works in Enigma. End in .com and new line. "
                       "Example result: alan.turing@enigma.com\n", sampling_params=regex)
    email = out[0].outputs[0]
    if email.finish_reason == "stop":
        assert re.fullmatch(r"\w+@\w+\.com", email.text), email.text
    else:  # cut by max_tokens: a prefix of a match
        assert re.fullmatch(r"\w+(@(\w+(\.(c(om?)?)?)?)?)?", email.text), email.text
    schema = {"type": "object", "properties": {"brand": {"type": "string", "maxLength": 12},
                                               "model": {"type": "string", "maxLength": 12},
                                               "car_type": {"enum": ["sedan", "SUV", "Truck", "Coupe"]}},
              "required": ["brand", "model", "car_type"]}
    json_params = SamplingParams(structured_outputs=StructuredOutputsParams(json=schema), temperature=0.0,
                                 max_tokens=80)
    out = llm.generate("Generate a JSON with the brand, model and car_type of the most iconic car from the 90's",
                       sampling_params=json_params)
    car = json.loads(out[0].outputs[0].text)
    assert set(car) == {"brand", "model", "car_type"} and car["car_type"] in schema["properties"]["car_type"]["enum"]
    grammar = 'start: "SELECT " column " FROM " table\ncolumn: "col_1" | "col_2"\ntable: "table_1" | "table_2"\n'
    sql = SamplingParams(structured_outputs=StructuredOutputsParams(grammar=grammar), temperature=0.0, max_tokens=16)
    out = llm.generate("Generate an SQL query to show the 'username' and 'email' from the 'users' table.",
                       sampling_params=sql)
    assert re.fullmatch(r"SELECT col_[12] FROM table_[12]", out[0].outputs[0].text), out[0].outputs[0].text


def test_vllm_beam_search_and_prompt_dict_examples(llm):
    outputs = llm.beam_search([{"prompt": "The capital of France is"}, {"prompt": "1, 2, 3,"}],
                              BeamSearchParams(beam_width=2, max_tokens=3))
    assert len(outputs) == 2 and all(len(o.sequences) == 2 for o in outputs)
    assert outputs[0].sequences[0].text.startswith("The capital of France is")
    tokenizer = llm.get_tokenizer()
    ids = tokenizer.encode("The capital of France is")
    outs = llm.generate([TokensPrompt(prompt_token_ids=ids), TextPrompt(prompt="The capital of France is")],
                        SamplingParams(temperature=0.0, max_tokens=4))
    assert outs[0].outputs[0].text == outs[1].outputs[0].text
    assert math.isfinite(outputs[1].sequences[0].cum_logprob)
