"""Tool calling without a model: the parsers (Hermes, Llama 3 JSON, Mistral) on crafted model
output, streamed in every chunking (the deltas add up to the final extraction, name first),
"required" and named outputs, the protocol's checks and schemas, and the chat template's
rendering of tools and tool-call history (a template with a tools section, and the default
model's, which has none)."""

from __future__ import annotations

import json

import pytest

from jaxserve.chat.template import conversation, knows_tools
from jaxserve.server.chat_template import render_chat
from jaxserve.server.protocol_chat import ChatCompletionRequest, ChatMessage
from jaxserve.server.protocol_tools import ChatTool, required_schema, tool_dicts
from jaxserve.chat.tool_parsers import (
    TOOL_PARSERS,
    FunctionCallText,
    ToolCallStream,
    get_tool_parser,
    parse_required,
)

WEATHER = {"city": "Paris", "unit": "celsius"}
CASES = {
    "hermes": [
        ('I will check.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n'
         '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"tz": "CET"}}\n</tool_call>',
         "I will check.", [("get_weather", WEATHER), ("get_time", {"tz": "CET"})]),
        ('<tool_call>{"name": "noop", "arguments": {}}</tool_call>', None, [("noop", {})]),
        ('<tool_call>{"arguments": {"s": "a\\"}{<tool_call>"}, "name": "odd"}</tool_call>', None,
         [("odd", {"s": 'a"}{<tool_call>'})]),
        ("Just text with a < sign and <tool", "Just text with a < sign and <tool", []),
        ('<tool_call>{"name": "broken", "arguments": {"a": </tool_call>', None, None),  # unparsable: all content
    ],
    "llama3_json": [
        ('{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}; '
         '{"name": "get_time", "parameters": {"tz": "CET"}}', None,
         [("get_weather", WEATHER), ("get_time", {"tz": "CET"})]),
        ('<|python_tag|>{"name": "noop", "parameters": {}}', None, [("noop", {})]),
        ("The weather is fine.", "The weather is fine.", []),
    ],
    "mistral": [
        ('[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}, '
         '{"name": "get_time", "arguments": {"tz": "CET"}}]', None,
         [("get_weather", WEATHER), ("get_time", {"tz": "CET"})]),
        ('Sure [TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "unit": "celsius"}', "Sure ",
         [("get_weather", WEATHER)]),
        ("No tools needed.", "No tools needed.", []),
    ],
}


def _stream(mode: str, text: str, chunk: int, parser=None, name=None, max_calls=None):
    """Feed `text` in pieces of `chunk` characters; the content and each call assembled from
    the deltas as the openai SDK does (by index; name once, arguments concatenated)."""
    st = ToolCallStream(mode, parser, name, max_calls)  # type: ignore[arg-type]
    content, calls = "", {}
    for end in list(range(chunk, len(text), chunk)) + [len(text)]:
        c, deltas = st.update(text[:end], final=end == len(text))
        content += c
        for d in deltas:
            if d["index"] not in calls:
                assert set(d) == {"index", "id", "type", "function"} and d["function"]["name"], d  # name first
                calls[d["index"]] = {"id": d["id"], "name": d["function"]["name"], "arguments": ""}
            else:
                assert "id" not in d and "name" not in d["function"]
            calls[d["index"]]["arguments"] += d["function"]["arguments"]
    return content, [calls[i] for i in sorted(calls)], st


@pytest.mark.parametrize("name", sorted(CASES))
def test_parsers_extract_and_stream_the_same_calls(name):
    parser = get_tool_parser(name)
    for text, content, want in CASES[name]:
        got_content, calls = parser.extract(text)
        if want is None:  # not a valid call: everything is content
            assert calls == [] and got_content == text
            continue
        assert got_content == content, text
        assert [(c.name, json.loads(c.arguments)) for c in calls] == want
        for chunk in (1, 2, 3, 7, len(text)):
            s_content, s_calls, st = _stream("auto", text, chunk, parser)
            assert (s_content or None) == content and st.called == bool(want), (text, chunk)
            assert [(c["name"], c["arguments"]) for c in s_calls] == [(c.name, c.arguments) for c in calls]


def test_required_and_named_outputs():
    text = '[{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}, {"name": "noop", "parameters": {}}]'
    calls = parse_required(text)
    assert calls == [FunctionCallText("get_weather", '{"city": "Paris", "unit": "celsius"}'),
                     FunctionCallText("noop", "{}")]
    assert parse_required(text[:-5]) is None and parse_required("[]") is None
    for chunk in (1, 4, len(text)):
        _, s_calls, _ = _stream("required", text, chunk)
        assert [(c["name"], c["arguments"]) for c in s_calls] == [(c.name, c.arguments) for c in calls]
        _, one, _ = _stream("required", text, chunk, max_calls=1)
        assert [c["name"] for c in one] == ["get_weather"]
    args = '{"city": "Paris", "unit": "celsius"}'
    for chunk in (1, 5, len(args)):
        _, s_calls, _ = _stream("named", args, chunk, name="get_weather")
        assert s_calls[0]["name"] == "get_weather" and s_calls[0]["arguments"] == args


def test_registry_and_cli_agree():
    from jaxserve.server.cli import TOOL_PARSER_NAMES

    assert set(TOOL_PARSERS) == set(TOOL_PARSER_NAMES) == {"hermes", "llama3_json", "mistral", "openai"}
    with pytest.raises(ValueError, match="available"):
        get_tool_parser("nope")


# ---------------------------------------------------------------------------- protocol
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}, "unit": {"$ref": "#/$defs/unit"}},
        "required": ["city"], "$defs": {"unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}}}},
    {"type": "function", "function": {"name": "noop"}},
]
MSG = [{"role": "user", "content": "Weather in Paris?"}]


def test_required_schema_is_vllms_with_defs_hoisted():
    tools = [ChatTool.model_validate(t) for t in TOOLS]
    schema = required_schema(tools)
    assert schema["type"] == "array" and schema["minItems"] == 1 and "maxItems" not in schema
    assert schema["$defs"] == {"unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}
    names = [item["properties"]["name"]["enum"] for item in schema["items"]["anyOf"]]
    assert names == [["get_weather"], ["noop"]]
    assert "$defs" not in schema["items"]["anyOf"][0]["properties"]["parameters"]
    assert required_schema(tools, parallel=False)["maxItems"] == 1
    assert tool_dicts(tools)[1]["function"]["parameters"] == {"type": "object", "properties": {}}


@pytest.mark.parametrize("extra, needle", [
    ({"tool_choice": "required"}, "tool_choice needs tools"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "other"}}}, "not among the tools"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "cannot be combined"),
    ({"tools": TOOLS, "tool_choice": "maybe"}, "tool_choice"),
    ({"functions": [{"name": "f"}]}, "functions"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "json_schema.schema"),
    ({"guided_json": {}, "guided_regex": "a"}, "only one"),
    ({"structured_outputs": {"regex": "a", "whitespace_pattern": " "}}, "whitespace_pattern"),
    ({"guided_decoding_backend": "xgrammar"}, "llguidance"),
])
def test_request_checks(extra, needle):
    with pytest.raises(ValueError) as ei:
        ChatCompletionRequest.model_validate({"messages": MSG, **extra})
    assert needle in str(ei.value)


def test_tool_choice_defaults_and_unknown_fields():
    r = ChatCompletionRequest.model_validate({"messages": [{**MSG[0], "refusal": None}], "tools": TOOLS,
                                              "max_token": 3, "stream_options": None})
    assert r.effective_tool_choice == "auto"
    assert r.ignored_fields == ["max_token", "messages[].refusal"]
    assert ChatCompletionRequest.model_validate({"messages": MSG}).effective_tool_choice == "none"
    p = ChatCompletionRequest.model_validate({"messages": MSG, "guided_choice": ["a", "b"]}).to_sampling_params()
    assert p.structured_outputs.choice == ["a", "b"]
    p = ChatCompletionRequest.model_validate({"messages": MSG, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}, "strict": True}}})
    assert p.to_sampling_params().structured_outputs.json == {"type": "object"}


# ---------------------------------------------------------------------------- chat templates
HISTORY = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
        {"id": "c2", "type": "function", "function": {"name": "noop", "arguments": "{}"}}]},
    {"role": "tool", "tool_call_id": "c1", "content": "18 C"},
    {"role": "tool", "tool_call_id": "c2", "content": "done"},
]


@pytest.fixture(scope="module")
def tokenizer():
    from jaxserve.engine.tokenizer import Tokenizer
    from jaxserve.models.loader import resolve_model

    return Tokenizer.from_pretrained(resolve_model(None))


def test_template_without_tools_gets_a_system_block_and_hermes_history(tokenizer):
    msgs = [ChatMessage.model_validate(m) for m in HISTORY]
    text = render_chat(tokenizer, msgs, tools=tool_dicts([ChatTool.model_validate(t) for t in TOOLS]))
    assert not knows_tools(tokenizer.hf_tokenizer.chat_template)
    assert text.startswith("<|im_start|>system\n# Tools") and '"name": "get_weather"' in text
    assert ('<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
            "</tool_call>\n<tool_call>\n" in text)
    assert "<|im_start|>user\n<tool_response>\n18 C\n</tool_response>\n<tool_response>\ndone\n</tool_response>" in text
    # a system message keeps its text, the block follows it
    conv = conversation([ChatMessage(role="system", content="Be brief."), *msgs[:1]], [{"type": "function",
                        "function": {"name": "f", "parameters": {}}}], template_knows_tools=False,
                        fmt=get_tool_parser("llama3_json"))
    assert conv[0]["content"].startswith("Be brief.\n\nGiven the following functions") and len(conv) == 2


def test_template_with_tools_gets_them_as_transformers_passes_them(tokenizer):
    template = ("{% for t in tools %}[{{ t.function.name }}]{% endfor %}"
                "{% for m in messages %}<{{ m.role }}>{{ m.content }}"
                "{% for c in m.tool_calls or [] %}{{ c.function.name }}({{ c.function.arguments.city }}){% endfor %}"
                "{% endfor %}")
    msgs = [ChatMessage.model_validate(m) for m in HISTORY[:2]]
    text = render_chat(tokenizer, msgs, tools=tool_dicts([ChatTool.model_validate(t) for t in TOOLS]),
                       chat_template=template, trust_chat_template=True, add_generation_prompt=False)
    assert text == "[get_weather][noop]<user>Weather in Paris?<assistant>get_weather(Paris)noop()"
