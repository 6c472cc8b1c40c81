"""Structured output, tool calling and the rest of the OpenAI/vLLM surface through the openai SDK
against the live server on the default model (see conftest.py): ten JSON schemas validated with
jsonschema (greedy and sampled, concurrently), regex / choice / grammar and vLLM's older
guided_* names, a tool-call round trip (auto, required, named; streaming and not), unknown
fields logged and listed in a header, every known-but-unimplemented field a 400, chat echo,
continuous usage stats, return_token_ids, truncate_prompt_tokens, cache_salt, /ping, and no
recompilation with constrained and free requests mixed."""

from __future__ import annotations

import asyncio
import json
import logging
import re

import jsonschema
import openai
import pytest

from tests.server.conftest import API_KEY, MODEL
from tests.structured_cases import MAX_TOKENS, SCHEMAS

pytestmark = pytest.mark.slow

WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 30},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"], "additionalProperties": False}}}
TIME_TOOL = {"type": "function", "function": {
    "name": "get_time", "description": "Get the local time in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30}},
                   "required": ["city"], "additionalProperties": False}}}
TOOLS = [WEATHER_TOOL, TIME_TOOL]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def _schema_of(name: str) -> dict:
    return next(t["function"]["parameters"] for t in TOOLS if t["function"]["name"] == name)


def _assemble(chunks) -> tuple[str, list[dict], str | None]:
    """Content, tool calls and finish reason from streamed chunks, as the openai SDK's stream
    helpers assemble them (calls by index: id, type and name from the first delta, arguments
    concatenated)."""
    content, calls, finish = "", {}, None
    for c in chunks:
        if not c.choices:
            continue
        d = c.choices[0].delta
        content += d.content or ""
        for tc in d.tool_calls or []:
            if tc.index not in calls:
                assert tc.id and tc.type == "function" and tc.function.name, tc
                calls[tc.index] = {"id": tc.id, "name": tc.function.name, "arguments": tc.function.arguments or ""}
            else:
                assert tc.id is None and not tc.function.name
                calls[tc.index]["arguments"] += tc.function.arguments or ""
        finish = c.choices[0].finish_reason or finish
    return content, [calls[i] for i in sorted(calls)], finish


# ---------------------------------------------------------------------------- structured output
def test_ten_json_schemas_validate_greedy_and_sampled(live_server):
    async def one(ac, name, schema, prompt, temperature):
        r = await ac.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": prompt}], max_tokens=MAX_TOKENS,
            temperature=temperature, seed=11,
            response_format={"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}})
        return name, schema, r

    async def run():
        async with openai.AsyncOpenAI(base_url=live_server.base_url + "/v1", api_key=API_KEY, max_retries=0,
                                      timeout=600) as ac:
            return await asyncio.gather(*(one(ac, n, s, p, t) for n, s, p in SCHEMAS for t in (0.0, 0.8)))

    for name, schema, r in asyncio.run(run()):
        c = r.choices[0]
        assert c.finish_reason == "stop", (name, c.message.content)
        jsonschema.validate(json.loads(c.message.content), schema)
        assert r.usage.completion_tokens > 0


def test_regex_choice_grammar_guided_names_and_streaming(client):
    prompt = "The capital of France is"
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=20, temperature=0,
                                  extra_body={"structured_outputs": {"regex": r" [A-Z][a-z]+\."}})
    assert re.fullmatch(r" [A-Z][a-z]+\.", r.choices[0].text) and r.choices[0].finish_reason == "stop"
    chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=20, temperature=0, stream=True,
                                            extra_body={"guided_regex": r" [A-Z][a-z]+\."}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == r.choices[0].text
    r = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=10, temperature=1.0, seed=3, n=3,
                                       extra_body={"guided_choice": ["sunny", "rainy", "cloudy"]})
    assert sorted(c.index for c in r.choices) == [0, 1, 2]
    assert all(c.message.content in ("sunny", "rainy", "cloudy") and c.finish_reason == "stop" for c in r.choices)
    for body in ({"guided_grammar": 'root ::= "It is " ("warm" | "cold") "."'},
                 {"structured_outputs": {"grammar": 'start: "It is " ("warm" | "cold") "."'}}):
        r = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=10, temperature=0, extra_body=body)
        assert r.choices[0].message.content in ("It is warm.", "It is cold.")
    r = client.completions.create(model=MODEL, prompt="A JSON object describing a cat:", max_tokens=60, temperature=0,
                                  extra_body={"response_format": {"type": "json_object"}})
    assert r.choices[0].finish_reason == "stop" and isinstance(json.loads(r.choices[0].text), dict)
    schema = SCHEMAS[0][1]
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": SCHEMAS[0][2]}], max_tokens=MAX_TOKENS, temperature=0,
        stream=True, extra_body={"guided_json": schema}))
    content, calls, finish = _assemble(chunks)
    assert finish == "stop" and not calls
    jsonschema.validate(json.loads(content), schema)


def test_uncompilable_constraints_are_400s_naming_the_problem(client):
    for extra, needle in (({"guided_json": {"type": "object", "properties": {"a": {"not": {"type": "string"}}}}},
                           "not"),
                          ({"structured_outputs": {"regex": "[a-"}}, "unclosed character class"),
                          ({"guided_grammar": "start: foo"}, "unknown name"),
                          ({"response_format": {"type": "json_schema",
                                                "json_schema": {"name": "x", "schema": {"type": "integr"}}}},
                           "integr")):
        with pytest.raises(openai.BadRequestError) as ei:
            client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=5, extra_body=extra)
        assert needle in ei.value.body["message"], (extra, ei.value.body)


@pytest.mark.parametrize("stream", [False, True])
def test_a_constraint_the_engine_stops_enforcing_is_an_error_not_free_text(http, stream):
    """A choice among 5,000 strings passes llguidance's parser limits after its first token:
    the answer is a 400 (an error event once a stream has started) naming it, never text
    generated without the constraint."""
    many = [f"option number {i}" for i in range(5000)]
    body = {"model": MODEL, "prompt": "Pick:", "max_tokens": 12, "temperature": 0, "stream": stream,
            "structured_outputs": {"choice": many}}
    r = http.post("/v1/completions", json=body)
    if stream:
        events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
        assert r.text.rstrip().endswith("data: [DONE]")
        errors = [e["error"] for e in events if "error" in e]
        assert errors and errors[0]["code"] == 400 and "cannot be enforced" in errors[0]["message"], r.text[-500:]
    else:
        assert r.status_code == 400, r.text
        assert "cannot be enforced" in r.json()["error"]["message"]


# ---------------------------------------------------------------------------- tools
def test_tool_call_round_trip_required_and_named(client, http):
    for choice, finish in (("required", "tool_calls"),
                           ({"type": "function", "function": {"name": "get_weather"}}, "stop")):
        r = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=choice,
                                           max_tokens=80, temperature=0)
        c = r.choices[0]
        assert c.finish_reason == finish and c.message.content is None and c.message.tool_calls, c
        call = c.message.tool_calls[0]
        assert call.type == "function" and call.id and call.function.name in ("get_weather", "get_time")
        if isinstance(choice, dict):
            assert call.function.name == "get_weather" and len(c.message.tool_calls) == 1
        args = json.loads(call.function.arguments)
        jsonschema.validate(args, _schema_of(call.function.name))
        # the same, streamed: the SDK's assembly gives the same calls
        chunks = list(client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=choice,
                                                     max_tokens=80, temperature=0, stream=True))
        content, calls, s_finish = _assemble(chunks)
        assert s_finish == finish and content == ""
        assert [(x["name"], x["arguments"]) for x in calls] == [(t.function.name, t.function.arguments)
                                                               for t in c.message.tool_calls]
        # the SDK's own stream helper assembles the same message
        with client.chat.completions.stream(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=choice,
                                            max_tokens=80, temperature=0) as s:
            final = s.get_final_completion()
        assert [(t.function.name, t.function.arguments) for t in final.choices[0].message.tool_calls] == [
            (t.function.name, t.function.arguments) for t in c.message.tool_calls]
        assert final.choices[0].finish_reason == finish
        # next turn: the assistant's calls and the tool's answer go back into the conversation
        follow = ASK + [c.message.model_dump(exclude_none=True)] + [
            {"role": "tool", "tool_call_id": t.id, "content": json.dumps({"temperature": 18, "unit": "celsius"})}
            for t in c.message.tool_calls]
        r2 = client.chat.completions.create(model=MODEL, messages=follow, tools=TOOLS, tool_choice="none",
                                            max_tokens=12, temperature=0)
        assert r2.choices[0].message.content and not r2.choices[0].message.tool_calls
        rendered = http.post("/tokenize", json={"messages": follow, "tools": TOOLS,
                                                "return_token_strs": False}).json()
        text = http.post("/detokenize", json={"tokens": rendered["tokens"]}).json()["prompt"]
        assert "<tool_call>" in text and '"temperature": 18' in text and "<tool_response>" in text
    # parallel_tool_calls false: one call at most
    r = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required",
                                       parallel_tool_calls=False, max_tokens=80, temperature=0.9, seed=2)
    assert len(r.choices[0].message.tool_calls) == 1


FORCED = ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>'
          '\n<tool_call>\n{"name": "get_time", "arguments": {"city": "Paris"}}\n</tool_call>')


def test_auto_tool_choice_parses_the_models_calls(client):
    """tool_choice "auto" with the Hermes parser: a 135M model rarely calls tools by itself, so the
    output is forced into Hermes' format by a regex (structured output and auto tools combine);
    the parser finds both calls, streamed and not."""
    extra = {"structured_outputs": {"regex": re.escape(FORCED)}}
    r = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=80, temperature=0,
                                       extra_body=extra)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content is None
    assert [(t.function.name, json.loads(t.function.arguments)) for t in c.message.tool_calls] == [
        ("get_weather", {"city": "Paris", "unit": "celsius"}), ("get_time", {"city": "Paris"})]
    chunks = list(client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="auto",
                                                 max_tokens=80, temperature=0, stream=True, extra_body=extra))
    content, calls, finish = _assemble(chunks)
    assert finish == "tool_calls" and content == ""
    assert [(x["name"], x["arguments"]) for x in calls] == [(t.function.name, t.function.arguments)
                                                           for t in c.message.tool_calls]
    r = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=80, temperature=0,
                                       parallel_tool_calls=False, extra_body=extra)
    assert [t.function.name for t in r.choices[0].message.tool_calls] == ["get_weather"]
    # plain answers stay content
    r = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=8, temperature=0)
    assert r.choices[0].message.content and not r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "length"


# ---------------------------------------------------------------------------- the rest of the surface
def test_unknown_fields_are_logged_once_and_listed(http, caplog):
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 2, "max_token": 3, "unknown_thing": {"a": 1}}
    with caplog.at_level(logging.WARNING, logger="jaxserve.server.field_policy"):
        for _ in range(2):
            r = http.post("/v1/completions", json=body)
            assert r.status_code == 200 and r.headers["x-ignored-fields"] == "max_token, unknown_thing"
        r = http.post("/v1/chat/completions", json={"model": MODEL, "max_tokens": 1, "stream": True,
                                                    "messages": [{**ASK[0], "refusal": "x"}]})
        assert r.status_code == 200 and r.headers["x-ignored-fields"] == "messages[].refusal"
    logged = [rec.getMessage() for rec in caplog.records if "max_token" in rec.getMessage()]
    assert len(logged) <= 1  # once per process (an earlier test may have logged it already)
    assert "x-ignored-fields" not in http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 1}).headers


REJECTED = [
    ("/v1/completions", {"suffix": "x"}), ("/v1/completions", {"best_of": 3}),
    ("/v1/completions", {"use_beam_search": True, "stop": ["x"]}),
    ("/v1/chat/completions", {"use_beam_search": True, "logit_bias": {"5": 1.0}}),
    ("/v1/completions", {"logits_processors": ["x"]}), ("/v1/completions", {"return_tokens_as_token_ids": True}),
    ("/v1/completions", {"prompt_embeds": "AAAA"}), ("/v1/completions", {"kv_transfer_params": {}}),
    ("/v1/completions", {"vllm_xargs": {"a": 1}}), ("/v1/completions", {"guided_whitespace_pattern": " "}),
    ("/v1/completions", {"guided_decoding_backend": "xgrammar"}),
    ("/v1/chat/completions", {"functions": [{"name": "f"}]}), ("/v1/chat/completions", {"function_call": "auto"}),
    ("/v1/chat/completions", {"audio": {"voice": "x"}}), ("/v1/chat/completions", {"modalities": ["audio"]}),
    ("/v1/chat/completions", {"prediction": {"type": "content", "content": "x"}}),
    ("/v1/chat/completions", {"web_search_options": {}}),
    ("/v1/chat/completions", {"documents": [{"text": "x"}]}), ("/v1/chat/completions", {"store": True}),
    ("/v1/chat/completions", {"mm_processor_kwargs": {}}), ("/v1/chat/completions", {"best_of": 2}),
    ("/v1/chat/completions", {"response_format": {"type": "structural_tag"}}),
    ("/v1/chat/completions", {"structured_outputs": {"json": {}, "structural_tag": "x"}}),
    ("/v1/chat/completions", {"structured_outputs": {"json": {}, "disable_additional_properties": True}}),
    ("/v1/chat/completions", {"tool_choice": "required"}), ("/v1/chat/completions", {"priority": 5}),
    ("/v1/chat/completions", {"cache_salt": ""}), ("/v1/completions", {"truncate_prompt_tokens": 0}),
]


@pytest.mark.parametrize("path, extra", REJECTED, ids=[next(iter(e)) + str(i) for i, (_, e) in enumerate(REJECTED)])
def test_known_but_unimplemented_fields_are_400s(http, path, extra):
    base = {"model": MODEL, "max_tokens": 1}
    base.update({"prompt": "Hi"} if path == "/v1/completions" else {"messages": ASK})
    r = http.post(path, json={**base, **extra})
    assert r.status_code == 400, (extra, r.text[:300])
    err = r.json()["error"]
    assert err["code"] == 400 and next(iter(extra)).split("_")[0] in err["message"] + str(err["param"]), err


def test_chat_echo_continuous_usage_token_ids_and_ping(client, http):
    conv = ASK + [{"role": "assistant", "content": "The weather in Paris is"}]
    r = client.chat.completions.create(model=MODEL, messages=conv, max_tokens=4, temperature=0,
                                       extra_body={"echo": True, "add_generation_prompt": False,
                                                   "continue_final_message": True, "return_token_ids": True})
    plain = client.chat.completions.create(model=MODEL, messages=conv, max_tokens=4, temperature=0,
                                           extra_body={"add_generation_prompt": False,
                                                       "continue_final_message": True})
    c = r.choices[0]
    assert c.message.content == "The weather in Paris is" + plain.choices[0].message.content
    raw = r.model_dump()
    assert len(raw["prompt_token_ids"]) == r.usage.prompt_tokens and len(raw["choices"][0]["token_ids"]) == 4
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=conv, max_tokens=4, temperature=0, stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True},  # type: ignore[typeddict-unknown-key]
        extra_body={"echo": True, "add_generation_prompt": False, "continue_final_message": True,
                    "return_token_ids": True}))
    assert "".join(x.choices[0].delta.content or "" for x in chunks if x.choices) == c.message.content
    body = [x for x in chunks if x.choices]
    assert all(x.usage is not None for x in body)  # continuous usage: every chunk
    assert [x.usage.completion_tokens for x in body][-1] == 4 == chunks[-1].usage.completion_tokens
    assert body[0].model_dump()["prompt_token_ids"] == raw["prompt_token_ids"]
    assert sum(len(x.model_dump()["choices"][0]["token_ids"] or []) for x in body) == 4
    cr = http.post("/v1/completions", json={"model": MODEL, "prompt": "Hello there", "max_tokens": 2,
                                            "return_token_ids": True, "temperature": 0}).json()
    assert cr["choices"][0]["prompt_token_ids"] == http.post("/tokenize", json={"prompt": "Hello there"}).json()["tokens"]
    assert len(cr["choices"][0]["token_ids"]) == cr["usage"]["completion_tokens"]
    for method in ("GET", "POST"):
        assert http.request(method, "/ping").status_code == 200


def test_truncate_prompt_tokens_and_cache_salt(client):
    long = "The quick brown fox jumps over the lazy dog. " * 20
    r = client.completions.create(model=MODEL, prompt=long, max_tokens=1, temperature=0,
                                  extra_body={"truncate_prompt_tokens": 10})
    assert r.usage.prompt_tokens == 10
    with pytest.raises(openai.BadRequestError, match="truncate_prompt_tokens"):
        client.completions.create(model=MODEL, prompt=long, max_tokens=1, extra_body={"truncate_prompt_tokens": 5000})
    a = client.completions.create(model=MODEL, prompt=long, max_tokens=3, temperature=0,
                                  extra_body={"cache_salt": "tenant-a"})
    b = client.completions.create(model=MODEL, prompt=long, max_tokens=3, temperature=0,
                                  extra_body={"cache_salt": "tenant-b"})
    assert a.choices[0].text == b.choices[0].text


def test_no_recompiles_with_constrained_and_free_requests_mixed(live_server, http):
    async def run():
        async with openai.AsyncOpenAI(base_url=live_server.base_url + "/v1", api_key=API_KEY, max_retries=0,
                                      timeout=600) as ac:
            jobs = []
            for i in range(12):
                extra = {"guided_choice": ["yes", "no"]} if i % 3 == 0 else (
                    {"guided_regex": "[a-z]{3,8}"} if i % 3 == 1 else {})
                jobs.append(ac.chat.completions.create(model=MODEL, messages=ASK, max_tokens=6, temperature=0.5,
                                                       seed=i, extra_body=extra))
            return await asyncio.gather(*jobs)

    outs = asyncio.run(run())
    assert all(o.choices[0].message.content in ("yes", "no") for o in outs[0::3])
    assert all(re.fullmatch("[a-z]{3,8}", o.choices[0].message.content) for o in outs[1::3])
    text = http.get("/metrics").text
    m = re.search(r'^jaxserve:recompiles_total\{[^}]*\} (\S+)$', text, re.MULTILINE)
    assert m and float(m.group(1)) == 0
    assert live_server.engine.transport.core.runner.counter.recompiles == 0
