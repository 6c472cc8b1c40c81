"""POST /v1/responses (OpenAI's Responses API, as vLLM serves it) through the real openai SDK's
`responses.create` / `responses.stream` / `responses.retrieve` / `responses.cancel` against the
session's live server on the default model (see conftest.py) and a tiny reasoning model, and
the response store, the input items' conversion and the event stream on their own.

Independent checks: the text of a response equals the chat route's for the same conversation
at temperature 0; a continued conversation's prompt (usage.input_tokens) equals /tokenize of the
same conversation written as chat messages; the stream's deltas add up to the final items."""

from __future__ import annotations

import json
import time

import jsonschema
import openai
import pytest

from jaxserve.server.protocol_responses import ResponsesRequest, ResponsesResponse
from jaxserve.server.responses_output import OutputStream, ReasoningItem
from jaxserve.server.serving_responses import (
    ResponseStore,
    StoredResponse,
    assistant_turn,
    input_messages,
)
from tests.server.conftest import MODEL, app_config

pytestmark = pytest.mark.slow

WEATHER = {"type": "function", "name": "get_weather",
           "description": "Get the current weather in a city",
           "parameters": {"type": "object", "properties": {
               "city": {"type": "string", "maxLength": 20},
               "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
               "required": ["city", "unit"], "additionalProperties": False}}
TIME = {"type": "function", "name": "get_time", "description": "Get the local time in a city",
        "parameters": {"type": "object",
                       "properties": {"city": {"type": "string", "maxLength": 20}},
                       "required": ["city"], "additionalProperties": False}}
ASK = "What is the weather in Paris?"
SHORT = {"temperature": 0.0, "max_output_tokens": 12}


def _chat_tool(tool: dict) -> dict:
    return {"type": "function", "function": {k: v for k, v in tool.items() if k != "type"}}


def _prompt_tokens(http, messages: list[dict], tools: list[dict] | None = None) -> int:
    body = {"model": MODEL, "messages": messages}
    if tools:
        body["tools"] = [_chat_tool(t) for t in tools]
    r = http.post("/tokenize", json=body)
    assert r.status_code == 200, r.text
    return r.json()["count"]


def _events(http, body: dict) -> list[tuple[str, dict]]:
    """(SSE event name, event) pairs of a raw streamed response."""
    frames = []
    with http.stream("POST", "/v1/responses", json={"model": MODEL, "stream": True, **body}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        for block in r.read().decode().split("\n\n"):
            if block.strip():
                name, data = block.split("\n")
                assert name.startswith("event: ") and data.startswith("data: "), block  # no [DONE]
                frames.append((name[len("event: "):], json.loads(data[len("data: "):])))
    assert [e["sequence_number"] for _, e in frames] == list(range(len(frames)))
    assert all(name == e["type"] for name, e in frames)
    return frames


def _frames(frames: list[str]) -> list[dict]:
    return [json.loads(f.split("data: ", 1)[1]) for f in frames]


# ---------------------------------------------------------------------------- text
def test_string_and_message_input_match_the_chat_route(client):
    question = "What is the capital of France?"
    r = client.responses.create(model=MODEL, input=question, **SHORT)
    c = client.chat.completions.create(model=MODEL, temperature=0.0, max_tokens=12,
                                       messages=[{"role": "user", "content": question}])
    assert r.id.startswith("resp_") and r.object == "response" and r.model == MODEL
    assert r.output_text == c.choices[0].message.content and r.output_text
    assert r.usage.input_tokens == c.usage.prompt_tokens
    assert r.usage.output_tokens == c.usage.completion_tokens
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    assert r.usage.output_tokens_details.reasoning_tokens == 0
    assert [item.type for item in r.output] == ["message"] and r.output[0].id.startswith("msg_")
    assert r.status == ("incomplete" if c.choices[0].finish_reason == "length" else "completed")

    instructions = "You are a geography teacher. Answer in one sentence."
    r = client.responses.create(model=MODEL, instructions=instructions, input=[
        {"role": "user", "content": [{"type": "input_text", "text": "Name a large river."}]}],
        **SHORT)
    c = client.chat.completions.create(model=MODEL, temperature=0.0, max_tokens=12, messages=[
        {"role": "system", "content": instructions},
        {"role": "user", "content": [{"type": "text", "text": "Name a large river."}]}])
    assert r.output_text == c.choices[0].message.content
    assert r.usage.input_tokens == c.usage.prompt_tokens and r.instructions == instructions


def test_stream_event_order_and_deltas(client, http):
    stop = [",", "\n"]
    body = {"input": "Count from one to ten.", "temperature": 0.0, "max_output_tokens": 40}
    with client.responses.stream(model=MODEL, **body, extra_body={"stop": stop}) as stream:
        events = list(stream)
        final = stream.get_final_response()
    types = [e.type for e in events]
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert types == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.content_part.added", *["response.output_text.delta"] * len(deltas),
                     "response.output_text.done", "response.content_part.done",
                     "response.output_item.done", "response.completed"], types
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert final.status == "completed" and deltas and "".join(deltas) == final.output_text
    assert events[0].response.status == "in_progress" and events[0].response.id == final.id
    message = final.output[0]
    assert all(getattr(e, "item_id", message.id) == message.id for e in events)
    assert events[-2].item.content[0].text == final.output_text
    assert events[-2].item.status == "completed"
    # the stream and the whole response agree (greedy), and the stored one is the streamed one
    whole = client.responses.create(model=MODEL, **body, extra_body={"stop": stop})
    assert whole.output_text == final.output_text
    assert client.responses.retrieve(final.id).output[0].id == message.id
    # raw SSE: `event:` names, numbered events, no [DONE]
    frames = _events(http, {**body, "stop": stop})
    assert frames[0][0] == "response.created" and frames[-1][0] == "response.completed"
    text = "".join(e["delta"] for name, e in frames if name == "response.output_text.delta")
    assert text == final.output_text


def test_max_output_tokens_cut_is_incomplete(client, http):
    r = client.responses.create(model=MODEL, input="Tell me a long story.", max_output_tokens=1)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 1 and r.max_output_tokens == 1
    assert r.output[0].status == "incomplete"
    frames = _events(http, {"input": "Tell me a long story.", "max_output_tokens": 2})
    name, last = frames[-1]
    assert name == "response.incomplete" and last["response"]["status"] == "incomplete"
    assert last["response"]["incomplete_details"] == {"reason": "max_output_tokens"}
    assert frames[-2][1]["item"]["status"] == "incomplete"


# ---------------------------------------------------------------------------- store, previous turns
def test_retrieve_store_false_and_previous_response_id(client, http):
    first = client.responses.create(model=MODEL, input="My name is Ada.", instructions="Be brief.",
                                    temperature=0.0, max_output_tokens=6,
                                    metadata={"topic": "names"})
    got = client.responses.retrieve(first.id)
    assert (got.id, got.output_text, got.status) == (first.id, first.output_text, first.status)
    assert got.metadata == {"topic": "names"} and got.usage.input_tokens == first.usage.input_tokens

    second = client.responses.create(model=MODEL, input="What is my name?", max_output_tokens=4,
                                     previous_response_id=first.id)
    assert second.previous_response_id == first.id
    # the first turn is in the prompt, its instructions are not (OpenAI's rule)
    conversation = [{"role": "user", "content": "My name is Ada."},
                    {"role": "assistant", "content": first.output_text},
                    {"role": "user", "content": "What is my name?"}]
    assert second.usage.input_tokens == _prompt_tokens(http, conversation)
    third = client.responses.create(model=MODEL, input="Thanks.", previous_response_id=second.id,
                                    instructions="Be kind.", max_output_tokens=2, store=False)
    conversation += [{"role": "assistant", "content": second.output_text},
                     {"role": "user", "content": "Thanks."}]
    system = [{"role": "system", "content": "Be kind."}]
    assert third.usage.input_tokens == _prompt_tokens(http, system + conversation)
    # store false: not kept
    for call in (lambda: client.responses.retrieve(third.id),
                 lambda: client.responses.create(model=MODEL, input="x",
                                                 previous_response_id=third.id)):
        with pytest.raises(openai.NotFoundError) as e:
            call()
        assert e.value.body["message"] == f"Response with id {third.id!r} not found."
    r = http.post("/v1/responses", json={"model": MODEL, "input": "x",
                                         "previous_response_id": "resp_nope"})
    assert r.status_code == 404
    assert http.get("/v1/responses/resp_nope").json() == r.json() == {"error": {
        "message": "Response with id 'resp_nope' not found.", "type": "invalid_request_error",
        "param": "response_id", "code": 404}}  # vLLM's envelope


def test_the_store_keeps_a_bounded_number_oldest_evicted():
    store = ResponseStore(capacity=2)

    def entry(rid: str, status: str = "completed") -> StoredResponse:
        return StoredResponse(ResponsesResponse(id=rid, status=status, model=MODEL), [])

    for rid in ("a", "b"):
        store.put(entry(rid))
    store.put(entry("a", "cancelled"))  # replaced in place: still the oldest
    store.put(entry("c"))
    assert len(store) == 2 and store.get("a") is None
    assert store.get("b").response.id == "b" and store.get("c").response.id == "c"
    with pytest.raises(ValueError, match="capacity of at least 1"):
        ResponseStore(0)


def test_input_items_become_chat_turns():
    body = ResponsesRequest.model_validate({"input": [
        {"role": "developer", "content": "Be terse."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "a"},
                                                        {"type": "input_text", "text": "b"}]},
        {"type": "reasoning", "id": "rs_1", "summary": [],
         "content": [{"type": "reasoning_text", "text": "hm"}]},
        {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
         "content": [{"type": "output_text", "text": "Let me check.", "annotations": []}]},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{\"x\": 1}"},
        {"type": "function_call", "call_id": "c2", "name": "g", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "one"},
        {"type": "function_call_output", "call_id": "c2",
         "output": [{"type": "input_text", "text": "two"}]},
    ]})
    calls = [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{\"x\": 1}"}},
             {"id": "c2", "type": "function", "function": {"name": "g", "arguments": "{}"}}]
    assert input_messages(body.input) == [
        {"role": "developer", "content": "Be terse."},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "Let me check."}],
         "reasoning": "hm", "tool_calls": calls},
        {"role": "tool", "tool_call_id": "c1", "content": "one"},
        {"role": "tool", "tool_call_id": "c2", "content": "two"}]
    assert body.ignored_fields == []  # output items sent back carry nothing unknown
    assert input_messages("hi") == [{"role": "user", "content": "hi"}]
    out = ResponsesResponse.model_validate({"id": "r", "status": "completed", "model": MODEL,
                                            "output": [
        ReasoningItem(id="rs", content=[{"text": "think"}]).model_dump(),
        {"type": "function_call", "id": "fc", "call_id": "c9", "name": "f", "arguments": "{}"}]})
    assert assistant_turn(out.output) == {
        "role": "assistant", "content": None, "reasoning": "think",
        "tool_calls": [{"id": "c9", "type": "function",
                        "function": {"name": "f", "arguments": "{}"}}]}


def test_output_stream_keeps_one_item_open_in_output_order():
    out = OutputStream()
    call = [{"index": 0, "id": "c1", "type": "function",
             "function": {"name": "f", "arguments": "{\"a\""}},
            {"index": 0, "function": {"arguments": ": 1}"}}]
    events = _frames(out.text("Let me ", []) + out.text("check.", []) + out.tool_calls(call)
                     + out.text("Done.", []) + out.finish(complete=False))
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert [(e["type"][len("response.output_item."):], e["output_index"])
            for e in events if "item" in e] == [
        ("added", 0), ("done", 0), ("added", 1), ("done", 1), ("added", 2), ("done", 2)]
    assert [(i.type, i.status) for i in out.items] == [
        ("message", "completed"), ("function_call", "completed"), ("message", "incomplete")]
    assert out.items[0].text == "Let me check." and out.items[1].arguments == '{"a": 1}'
    assert out.items[1].call_id == "c1" and out.items[2].text == "Done."
    empty = OutputStream()
    assert [e["type"] for e in _frames(empty.finish(complete=True))] == [
        "response.output_item.added", "response.content_part.added", "response.output_text.done",
        "response.content_part.done", "response.output_item.done"]
    assert [(i.type, i.text) for i in empty.items] == [("message", "")]


def test_a_failure_mid_stream_is_an_error_event_after_the_abort():
    import asyncio

    from jaxserve.server.engine_requests import RequestTimeoutError
    from jaxserve.server.serving_responses import ResponseEventSource

    out = OutputStream()

    async def frames():
        yield out.event("response.created", response={})
        raise RequestTimeoutError("the request did not finish within 5 s")

    aborted = []
    source = ResponseEventSource(frames(), out)
    source.on_error = lambda: aborted.append(True)

    async def read():
        return [f async for f in source]

    got = asyncio.run(read())
    assert aborted == [True] and len(got) == 2 and "[DONE]" not in "".join(got)
    assert got[1].startswith("event: error\n")
    assert _frames(got)[1] == {"type": "error", "sequence_number": 1, "code": "504",
                               "message": "the request did not finish within 5 s", "param": None}


# ---------------------------------------------------------------------------- tools
def test_function_tools_required_named_and_a_follow_up_turn(client, http):
    schemas = {t["name"]: t["parameters"] for t in (WEATHER, TIME)}
    r = client.responses.create(model=MODEL, input=ASK, tools=[WEATHER, TIME],
                                tool_choice="required", parallel_tool_calls=False,
                                temperature=0.0, max_output_tokens=60)
    assert r.status == "completed" and [item.type for item in r.output] == ["function_call"]
    call = r.output[0]
    assert call.id.startswith("fc_") and call.call_id and call.status == "completed"
    jsonschema.validate(json.loads(call.arguments), schemas[call.name])
    assert r.tool_choice == "required" and [t.name for t in r.tools] == ["get_weather", "get_time"]

    named = client.responses.create(model=MODEL, input=ASK, tools=[WEATHER, TIME],
                                    tool_choice={"type": "function", "name": "get_weather"},
                                    temperature=0.0, max_output_tokens=40)
    (call,) = named.output
    assert call.type == "function_call" and call.name == "get_weather"
    jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])

    # the follow-up turn: the call and its output, sent back as items or by previous_response_id
    result = {"type": "function_call_output", "call_id": call.call_id,
              "output": "22 degrees and sunny"}
    follow = {"model": MODEL, "tools": [WEATHER], "temperature": 0.0, "max_output_tokens": 8}
    sent_back = call.model_dump(exclude_none=True)
    explicit = client.responses.create(
        **follow, input=[{"role": "user", "content": ASK}, sent_back, result])
    chained = client.responses.create(**follow, previous_response_id=named.id, input=[result])
    chat_call = {"id": call.call_id, "type": "function",
                 "function": {"name": "get_weather", "arguments": call.arguments}}
    chat_turns = [{"role": "user", "content": ASK},
                  {"role": "assistant", "tool_calls": [chat_call]},
                  {"role": "tool", "tool_call_id": call.call_id, "content": "22 degrees and sunny"}]
    expected = _prompt_tokens(http, chat_turns, [WEATHER])
    assert explicit.usage.input_tokens == chained.usage.input_tokens == expected
    assert explicit.output_text == chained.output_text


def test_streamed_function_call_events(client):
    with client.responses.stream(model=MODEL, input=ASK, tools=[WEATHER], temperature=0.0,
                                 tool_choice={"type": "function", "name": "get_weather"},
                                 max_output_tokens=40) as stream:
        events = list(stream)
        final = stream.get_final_response()
    types = [e.type for e in events]
    n = types.count("response.function_call_arguments.delta")
    assert types == ["response.created", "response.in_progress", "response.output_item.added",
                     *["response.function_call_arguments.delta"] * n,
                     "response.function_call_arguments.done", "response.output_item.done",
                     "response.completed"], types
    (call,) = final.output
    assert events[2].item.type == "function_call" and events[2].item.call_id == call.call_id
    deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert deltas == events[-3].arguments == call.arguments and call.name == "get_weather"
    jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])


# ---------------------------------------------------------------------------- text.format, logprobs
def test_text_format_json_schema_and_output_logprobs(client):
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
              "required": ["city"], "additionalProperties": False}
    fmt = {"type": "json_schema", "name": "city", "schema": schema, "strict": True}
    r = client.responses.create(model=MODEL, input="Name a city in JSON.", temperature=0.0,
                                max_output_tokens=30, text={"format": fmt})
    assert r.status == "completed"
    jsonschema.validate(json.loads(r.output_text), schema)
    assert r.text.format.type == "json_schema" and r.text.format.name == "city"
    r = client.responses.create(model=MODEL, input="Any JSON object.", temperature=0.0,
                                max_output_tokens=6, text={"format": {"type": "json_object"}},
                                include=["message.output_text.logprobs"], top_logprobs=2)
    lps = r.output[0].content[0].logprobs
    assert len(lps) == r.usage.output_tokens and all(len(lp.top_logprobs) == 2 for lp in lps)
    assert "".join(lp.token for lp in lps) == r.output_text and r.output_text.startswith("{")


# ---------------------------------------------------------------------------- vLLM's bodies, errors
def test_a_vllm_request_body_is_accepted_unchanged(http):
    body = {"model": MODEL, "input": "Say hi.", "instructions": "Be brief.", "max_output_tokens": 4,
            "temperature": 0.0, "top_p": 1.0, "top_k": 1, "repetition_penalty": 1.0, "seed": 7,
            "stop": [], "ignore_eos": False, "skip_special_tokens": True,
            "include_stop_str_in_output": False, "priority": 0,
            "request_id": "resp_from_vllm_client", "cache_salt": "salt", "service_tier": "auto",
            "truncation": "disabled", "store": True, "parallel_tool_calls": True,
            "tool_choice": "auto", "tools": [], "top_logprobs": 0,
            "enable_response_messages": False, "background": False, "logit_bias": {"0": -100},
            "user": "u1", "metadata": {"k": "v"}, "reasoning": None, "include": None,
            "prompt_cache_key": None}
    r = http.post("/v1/responses", json=body)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["id"] == "resp_from_vllm_client" and out["status"] in ("completed", "incomplete")
    assert out["usage"]["output_tokens"] >= 1 and out["user"] == "u1"
    assert out["temperature"] == 0.0
    ignored = "service_tier, enable_response_messages, prompt_cache_key"
    assert r.headers["x-ignored-fields"] == ignored
    refused = http.post("/v1/responses", json={**body, "vllm_xargs": {"a": 1}})
    assert refused.status_code == 400 and "vllm_xargs" in refused.json()["error"]["message"]


BAD = [
    ({"input": ""}, "input must not be empty"),
    ({"input": []}, "input must not be empty"),
    ({"input": "x", "tools": [{"type": "web_search_preview"}]},
     "tool type 'web_search_preview' is not supported"),
    ({"input": "x", "tools": [{"type": "function", "parameters": {}}]},
     "a function tool needs 'name'"),
    ({"input": "x", "tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}},
     "tool_choice names the function 'nope', which is not among the tools"),
    ({"input": "x", "tool_choice": "required"}, "tool_choice needs tools"),
    ({"input": "x", "tool_choice": {"type": "file_search"}},
     "tool_choice type 'file_search' is not supported"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x"}]}]},
     "content part type 'input_image' is not supported"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]},
     "input item type 'item_reference' is not supported"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{bad"}]},
     "'arguments' must be JSON text"),
    ({"input": "x", "background": True, "stream": True}, "background streaming is not supported"),
    ({"input": "x", "background": True, "store": False}, "background needs store true"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "s"}}}, "needs 'schema'"),
    ({"input": "x", "temperature": 3}, "temperature"),
    ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "x", "prompt": {"id": "pmpt_1"}},
     "prompt templates (stored prompts) are not supported"),
    ({"input": "x", "logit_bias": {"a": 1}}, "logit_bias keys must be token ids"),
]


@pytest.mark.parametrize("body, message", BAD, ids=[m[:30] for _, m in BAD])
def test_bad_requests_are_400s(client, body, message):
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=MODEL, extra_body=body)
    assert message in e.value.body["message"], e.value.body


# ---------------------------------------------------------------------------- background
def test_background_response_and_cancel(client):
    r = client.responses.create(model=MODEL, input="Hello.", background=True, max_output_tokens=3)
    assert r.status == "queued" and r.background is True
    deadline = time.monotonic() + 120
    while (got := client.responses.retrieve(r.id)).status in ("queued", "in_progress"):
        assert time.monotonic() < deadline, "the background response did not finish"
        time.sleep(0.05)
    assert got.status in ("completed", "incomplete") and got.usage.output_tokens >= 1
    assert got.output_text

    long = client.responses.create(model=MODEL, input="Write an essay.", background=True,
                                   max_output_tokens=1500, extra_body={"ignore_eos": True})
    cancelled = client.responses.cancel(long.id)
    assert cancelled.id == long.id and cancelled.status == "cancelled"
    assert cancelled.usage.output_tokens < 1500
    assert client.responses.retrieve(long.id).status == "cancelled"
    with pytest.raises(openai.BadRequestError, match="only a background response that is still"):
        client.responses.cancel(long.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.cancel("resp_nope")


# ---------------------------------------------------------------------------- reasoning items
@pytest.fixture(scope="module")
def tiny(tmp_path_factory, compile_cache_dir):
    """The tiny reasoning model (tests/model_dirs.py: greedy decoding follows known chains, with
    `<think>`/`</think>` tokens and Qwen3's template in miniature) served with the qwen3 parser."""
    from jaxserve.config import EngineConfig
    from jaxserve.engine.async_client import AsyncEngineClient
    from jaxserve.engine.setup import build_engine
    from jaxserve.server.app import build_app
    from tests.live_server import LiveServer, free_port
    from tests.model_dirs import write_reasoning_model_dir

    model_dir = write_reasoning_model_dir(tmp_path_factory.mktemp("reasoning") / "qwen3", "qwen3")
    parts = build_engine(EngineConfig.from_kwargs(
        model=str(model_dir), reasoning_parser="qwen3", dtype="float32", max_num_seqs=8,
        max_num_batched_tokens=64, token_buckets=(16, 64), request_buckets=(8,), max_model_len=512,
        num_pages=256, page_size=8, compilation_cache_dir=compile_cache_dir, show_progress=False))
    app = build_app(AsyncEngineClient.in_thread(parts),
                    app_config(served_model_name=("tiny",), tool_call_parser="hermes",
                               enable_auto_tool_choice=True))
    with LiveServer(app, free_port()) as srv:
        yield openai.OpenAI(base_url=srv.base_url + "/v1", api_key="none", max_retries=0,
                            timeout=120)


TINY = {"model": "tiny", "input": "w40 w41", "temperature": 0.0, "max_output_tokens": 32}


def _tiny_chat(tiny, **kw):
    ask = [{"role": "user", "content": "w40 w41"}]
    return tiny.chat.completions.create(model="tiny", messages=ask, temperature=0, max_tokens=32,
                                        **kw).choices[0]


def test_reasoning_item_before_the_message(tiny):
    from tests.model_dirs import END_THINK

    c = _tiny_chat(tiny, extra_body={"return_token_ids": True})
    # the fixture's chain: reasoning, then an answer
    assert c.message.reasoning_content and c.message.content
    r = tiny.responses.create(**TINY)
    assert [item.type for item in r.output] == ["reasoning", "message"] and r.status == "completed"
    reasoning = r.output[0]
    assert reasoning.id.startswith("rs_") and reasoning.summary == []
    assert reasoning.status == "completed" and reasoning.content[0].type == "reasoning_text"
    assert reasoning.content[0].text == c.message.reasoning_content
    assert r.output_text == c.message.content and "think>" not in r.output_text
    assert r.usage.output_tokens == len(c.token_ids)
    assert r.usage.output_tokens_details.reasoning_tokens == c.token_ids.index(END_THINK)

    with tiny.responses.stream(**TINY) as stream:
        events = list(stream)
        final = stream.get_final_response()
    types = [e.type for e in events]
    n_r = types.count("response.reasoning_text.delta")
    n_t = types.count("response.output_text.delta")
    assert types == ["response.created", "response.in_progress",
                     "response.output_item.added", "response.content_part.added",
                     *["response.reasoning_text.delta"] * n_r, "response.reasoning_text.done",
                     "response.content_part.done", "response.output_item.done",
                     "response.output_item.added", "response.content_part.added",
                     *["response.output_text.delta"] * n_t, "response.output_text.done",
                     "response.content_part.done", "response.output_item.done",
                     "response.completed"], types
    assert [e.output_index for e in events if e.type == "response.output_item.added"] == [0, 1]
    thought = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert thought == final.output[0].content[0].text == reasoning.content[0].text
    assert final.output_text == r.output_text
    assert final.usage.output_tokens_details == r.usage.output_tokens_details


def test_reasoning_with_function_tools_and_a_cut(tiny):
    tools = [{"type": "function", "name": name, "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
        for name in ("get_weather", "get_time")]
    c = _tiny_chat(tiny, tools=[_chat_tool(t) for t in tools])
    r = tiny.responses.create(**TINY, tools=tools)
    calls = [(item.name, item.arguments) for item in r.output if item.type == "function_call"]
    assert calls == [(t.function.name, t.function.arguments) for t in c.message.tool_calls]
    assert calls
    assert r.output[0].type == "reasoning"
    assert r.output[0].content[0].text == c.message.reasoning_content
    assert r.output_text == (c.message.content or "")  # a call inside the reasoning is no call

    cut = tiny.responses.create(**{**TINY, "max_output_tokens": 1})
    assert [item.type for item in cut.output] == ["reasoning"] and cut.status == "incomplete"
    assert cut.output[0].status == "incomplete"
    assert cut.usage.output_tokens_details.reasoning_tokens == 1
