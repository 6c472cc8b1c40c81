"""gpt-oss's Harmony format: the completion read into its channels (jaxserve/chat/harmony.py), the
reasoning parser `gpt_oss` and the tool-call parser `openai` on known completions, whole and
streamed in every chunking (a marker split over deltas held back), a Harmony chat template in
miniature rendered with tools, tool history and reasoning_effort; and end to end, the real engine
serving a tiny gpt-oss model (`GptOssForCausalLM`) whose tokenizer has Harmony's special tokens
through the real app with `--reasoning-parser gpt_oss --tool-call-parser openai`, read with the
openai SDK.

The tiny model's greedy output is known: the gpt_oss fixture's shapes with lookup-table weights
(as tests/model_dirs.py's reasoning model: attention and experts add nothing to the residual
stream, so the next token is a function of the last one). That memory of one token cannot
write the same token twice, so the first message's header is one ordinary token whose text is
the header, and `<|start|>assistant` after it two ordinary tokens that split `<|start|>`; the
final channel's header (`<|channel|>final<|message|>`, which structured output waits for), the
`<|end|>` and the stop tokens are the real special tokens. After the analysis message's
`<|end|>` the model answers on the final channel; a logit_bias against that branch makes it call
`get_weather` instead."""

from __future__ import annotations

import itertools
import json

import openai
import pytest

from jaxserve.chat import harmony
from jaxserve.chat.tool_parsers import ToolCallStream, get_tool_parser
from jaxserve.reasoning import get_reasoning_parser
from tests.live_server import LiveServer, free_port
from tests.model_dirs import make_lookup_table, word_tokenizer, write_model_dir
from tests.server.conftest import app_config

ANALYSIS = "<|channel|>analysis<|message|>User asks the weather.<|end|>"
FINAL = "<|start|>assistant<|channel|>final<|message|>It is sunny."
WEATHER = ('<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json'
           '<|message|>{"city": "Paris"}')
TIME = '<|start|>assistant to=functions.get_time<|channel|>commentary json<|message|>{"tz": "CET"}'
PREAMBLE = "<|start|>assistant<|channel|>commentary<|message|>Looking it up."
CASES = [  # completion -> (reasoning, content, [(function, arguments)])
    (ANALYSIS + FINAL + "<|return|>", ("User asks the weather.", "It is sunny.", [])),
    (ANALYSIS + FINAL, ("User asks the weather.", "It is sunny.", [])),  # stop token not shown
    (FINAL[len("<|start|>assistant"):] + "<|return|>", (None, "It is sunny.", [])),  # final only
    (ANALYSIS + WEATHER + "<|call|>",
     ("User asks the weather.", None, [("get_weather", '{"city": "Paris"}')])),
    (ANALYSIS + WEATHER, ("User asks the weather.", None, [("get_weather", '{"city": "Paris"}')])),
    # a preamble, then two calls (the recipient in the role part, a bare content type)
    (ANALYSIS + PREAMBLE + "<|end|>" + WEATHER + "<|call|>" + TIME + "<|call|>",
     ("User asks the weather.", "Looking it up.",
      [("get_weather", '{"city": "Paris"}'), ("get_time", '{"tz": "CET"}')])),
    # two analysis messages: one per line
    (ANALYSIS + "<|start|>assistant<|channel|>analysis<|message|>Sunny.<|end|>" + FINAL,
     ("User asks the weather.\nSunny.", "It is sunny.", [])),
    # cut short (finish_reason "length"): inside the reasoning, inside a header, inside a call
    ("<|channel|>analysis<|message|>User asks", ("User asks", None, [])),
    (ANALYSIS + "<|start|>assistant<|channel|>fin", ("User asks the weather.", None, [])),
    (ANALYSIS + WEATHER[:-5], ("User asks the weather.", None, [])),
    ("<|channel|>analy", (None, None, [])),
    ("", (None, None, [])),
]


@pytest.fixture(scope="module")
def gpt_oss():
    return get_reasoning_parser("gpt_oss")(_harmony_tokenizer())


def _whole(parser, text):
    reasoning, answer = parser.extract(text, with_calls=True)
    content, calls = get_tool_parser("openai").extract(answer or "")
    return reasoning, content, [(c.name, c.arguments) for c in calls]


def _streamed(parser, pieces):
    """The completion fed in `pieces`: reasoning, content, calls (assembled from the tool-call
    deltas), and every delta given out."""
    stream = parser.streamer(with_calls=True)
    calls = ToolCallStream("auto", get_tool_parser("openai"))
    reasoning = content = answer = ""
    assembled: dict[int, list[str]] = {}
    deltas = []
    for i, piece in enumerate(pieces):
        final = i == len(pieces) - 1
        thought, said = stream.update(piece, final)
        answer += said
        text, call_deltas = calls.update(answer, final)
        reasoning, content = reasoning + thought, content + text
        deltas += [d for d in (thought, text) if d]
        for d in call_deltas:
            entry = assembled.setdefault(d["index"], ["", ""])
            entry[0] += d["function"].get("name", "")
            entry[1] += d["function"]["arguments"]
    return (reasoning or None, content or None, [tuple(v) for _, v in sorted(assembled.items())],
            deltas)


def test_the_openai_tool_parser_needs_the_gpt_oss_reasoning_parser():
    from types import SimpleNamespace

    from jaxserve.server.state import ServerState

    engine = SimpleNamespace(model_name="m", max_model_len=256, tokenizer=None,
                             info=SimpleNamespace(reasoning_parser=None))
    with pytest.raises(ValueError, match="--tool-call-parser openai reads the calls the reasoning "
                                         "parser 'gpt_oss' finds: start the server with "
                                         "--reasoning-parser gpt_oss too"):
        ServerState(engine, app_config(tool_call_parser="openai", enable_auto_tool_choice=True))


def test_registry_names_and_refusals():
    assert get_reasoning_parser("gpt_oss") is get_reasoning_parser("openai_gptoss")  # vLLM's name
    with pytest.raises(ValueError,
                       match=r"unknown reasoning parser 'harmony'; available: .*gpt_oss"):
        get_reasoning_parser("harmony")
    with pytest.raises(ValueError, match=r"needs Harmony's special tokens <\|start\|>, <\|end\|>"):
        get_reasoning_parser("gpt_oss")(word_tokenizer())
    from jaxserve.config import EngineConfig

    with pytest.raises(ValueError, match="unknown reasoning parser 'gptoss'"):
        EngineConfig.from_kwargs(model=None, reasoning_parser="gptoss")


@pytest.mark.parametrize("text,expected", CASES)
def test_whole_completions(gpt_oss, text, expected):
    assert _whole(gpt_oss, text) == expected


@pytest.mark.parametrize("text,expected", CASES)
def test_streamed_completions_equal_the_whole_in_every_chunking(gpt_oss, text, expected):
    calls_expected = expected[2]
    if text == ANALYSIS + WEATHER[:-5]:
        # cut inside a call: the stream has sent what there was of it (as every tool-call
        # stream does); the whole response makes no call of it
        calls_expected = [("get_weather", '{"city": "Pa')]
    for size in (1, 2, 3, 7, len(text) or 1):
        pieces = [text[i:i + size] for i in range(0, len(text), size)] or [""]
        reasoning, content, calls, deltas = _streamed(gpt_oss, pieces)
        assert (reasoning, content, calls) == (*expected[:2], calls_expected), size
        assert not any("<|" in d or "|>" in d for d in deltas), deltas  # no marker leaks


def _random_completion(rng) -> str:
    """Harmony messages of every kind in a random order, with a random way of ending (or cut at
    a random point), contents that hold marker-like text ("<", "<|x|>")."""
    parts = ["", " to=functions.f"][rng.integers(2)] + "<|channel|>" + ["analysis", "final"][
        rng.integers(2)]
    headers = ["assistant<|channel|>analysis", "assistant<|channel|>final",
               "assistant<|channel|>commentary", "assistant to=functions.get_weather"
               "<|channel|>commentary json", "assistant<|channel|>commentary to=functions.g "
               "<|constrain|>json", "functions.g to=assistant<|channel|>commentary",
               "assistant to=browser.search<|channel|>analysis"]
    contents = ["a b", "x < y", '{"k": [1, 2]}', "<|x|>", "", "\n", "{"]
    text = parts + "<|message|>" + contents[rng.integers(len(contents))]
    for _ in range(rng.integers(0, 5)):
        text += ["<|end|>", "<|end|>\n", "<|call|>", ""][rng.integers(4)]
        text += "<|start|>" + headers[rng.integers(len(headers))] + "<|message|>"
        text += contents[rng.integers(len(contents))]
    text += ["<|return|>", "<|call|>", "<|end|>", ""][rng.integers(4)]
    return text[: rng.integers(len(text) + 1)] if rng.integers(3) == 0 else text


def test_streams_of_random_completions_equal_their_whole_reading(gpt_oss):
    import numpy as np

    rng = np.random.default_rng(7)
    for _ in range(300):
        text = _random_completion(rng)
        cuts = sorted(set(rng.integers(0, len(text) + 1, rng.integers(0, 8)).tolist()))
        pieces = [text[a:b] for a, b in itertools.pairwise([0, *cuts, len(text)])]
        for with_calls in (False, True):
            stream = gpt_oss.streamer(with_calls)
            out = [stream.update(p, final=i == len(pieces) - 1) for i, p in enumerate(pieces)]
            whole = tuple(x or "" for x in gpt_oss.extract(text, with_calls))
            assert ("".join(r for r, _ in out), "".join(a for _, a in out)) == whole, (text, cuts)


def test_markers_split_over_deltas_are_held_back(gpt_oss):
    stream = gpt_oss.streamer()
    assert stream.update("<|channel|>analysis<|message|>Hm<|en") == ("Hm", "")
    assert stream.update("d|><|start|>assistant<|chan") == ("", "")
    assert stream.update("nel|>final<|message|>Yes<") == ("", "Yes")
    assert stream.update("|return|>", final=True) == ("", "")


def test_calls_are_left_out_of_the_content_without_auto_tool_choice(gpt_oss):
    text = ANALYSIS + PREAMBLE + "<|end|>" + WEATHER + "<|call|>"
    assert gpt_oss.extract(text) == ("User asks the weather.", "Looking it up.")
    stream = gpt_oss.streamer()
    deltas = [stream.update(c, final=i == len(text) - 1) for i, c in enumerate(text)]
    assert ("".join(r for r, _ in deltas), "".join(a for _, a in deltas)) == (
        "User asks the weather.", "Looking it up.")


def test_answer_start_for_structured_output(gpt_oss):
    hf = _harmony_tokenizer()
    ids = hf.encode("<|channel|>analysis<|message|> w20<|end|><|start|>assistant<|channel|>final"
                    "<|message|> w30 w31", add_special_tokens=False)
    at = gpt_oss.answer_start(ids)
    assert ids[at:] == [30, 31]
    assert gpt_oss.answer_start(ids, start=at - 1) == at  # a header across the searched boundary
    assert gpt_oss.answer_start(ids[:at - 1]) is None
    assert gpt_oss.reasoning_tokens(ids) == at - 3  # up to the final header (3 tokens here)
    assert not gpt_oss.reasoning_ended(hf.encode(FINAL, add_special_tokens=False))


def test_tools_and_calls_for_a_template_without_a_tools_section():
    """The `openai` format's tools block is Harmony's functions namespace (the example of
    Harmony's format guide), and earlier calls are written as the model writes them."""
    from jaxserve.chat.tool_parsers import FunctionCallText

    tools = [
        {"type": "function", "function": {"name": "get_location",
                                          "description": "Gets the location of the user."}},
        {"type": "function", "function": {
            "name": "get_current_weather",
            "description": "Gets the current weather in the provided location.",
            "parameters": {"type": "object", "required": ["location"], "properties": {
                "location": {"type": "string",
                             "description": "The city and state, e.g. San Francisco, CA"},
                "format": {"type": "string", "enum": ["celsius", "fahrenheit"],
                           "default": "celsius"}}}}},
        {"type": "function", "function": {
            "name": "get_multiple_weathers", "parameters": {"type": "object", "properties": {
                "locations": {"type": "array", "items": {"type": "string"}}}}}},
    ]
    parser = get_tool_parser("openai")
    assert parser.system_prompt(tools) == (
        "# Tools\n\n## functions\n\nnamespace functions {\n\n"
        "// Gets the location of the user.\ntype get_location = () => any;\n\n"
        "// Gets the current weather in the provided location.\n"
        "type get_current_weather = (_: {\n// The city and state, e.g. San Francisco, CA\n"
        'location: string,\nformat?: "celsius" | "fahrenheit", // default: celsius\n}) => any;\n\n'
        "type get_multiple_weathers = (_: {\nlocations?: string[],\n}) => any;\n\n"
        "} // namespace functions")
    written = parser.render_calls([FunctionCallText("get_weather", '{"city": "Paris"}')])
    assert written == WEATHER + "<|call|>"
    assert parser.extract(written)[1] == [FunctionCallText("get_weather", '{"city": "Paris"}')]


# ---------------------------------------------------------------------------- the chat template
# gpt-oss's chat template in miniature: the system message with the reasoning effort and the
# knowledge cutoff, a developer message with the instructions and the functions in Harmony's
# TypeScript-like namespace, earlier calls after their reasoning (which gpt-oss's template reads
# as `thinking`), tool results from `functions.NAME to=assistant`.
TEMPLATE = "".join([
    "{%- set effort = reasoning_effort if reasoning_effort is defined and reasoning_effort "
    "else 'medium' -%}",
    "<|start|>system<|message|>You are ChatGPT, a large language model trained by OpenAI.\n",
    "Knowledge cutoff: 2024-06\n\nReasoning: {{ effort }}\n\n",
    "# Valid channels: analysis, commentary, final. Channel must be included for every message.",
    "{%- if tools %}{{ '\\n' }}Calls to these tools must go to the commentary channel: 'functions'."
    "{%- endif %}<|end|>",
    "{%- set first = messages[0] if messages[0].role in ['system', 'developer'] else none -%}",
    "{%- if first or tools -%}<|start|>developer<|message|>",
    "{%- if first %}# Instructions\n\n{{ first.content }}",
    "{% if tools %}{{ '\\n\\n' }}{% endif %}{% endif %}",
    "{%- if tools %}# Tools\n\n## functions\n\nnamespace functions {\n\n",
    "{% for t in tools %}{% set f = t.function %}// {{ f.description }}\n",
    "type {{ f.name }} = (_: {\n{% for name, p in f.parameters.properties.items() %}",
    "{{ name }}{% if name not in f.parameters.required %}?{% endif %}: {{ p.type }},\n",
    "{% endfor %}}) => any;\n\n{% endfor %}} // namespace functions{% endif %}<|end|>",
    "{%- endif -%}",
    "{%- set ns = namespace(fn='') -%}",
    "{%- for m in messages -%}",
    "{%- if m.role == 'user' -%}<|start|>user<|message|>{{ m.content }}<|end|>",
    "{%- elif m.role == 'assistant' and m.tool_calls -%}",
    "{%- if m.thinking -%}<|start|>assistant<|channel|>analysis<|message|>",
    "{{ m.thinking }}<|end|>{%- endif -%}",
    "{%- for c in m.tool_calls -%}{%- set ns.fn = c.function.name -%}",
    "<|start|>assistant to=functions.{{ c.function.name }}<|channel|>commentary json<|message|>",
    "{{ c.function.arguments | tojson }}<|call|>{%- endfor -%}",
    "{%- elif m.role == 'assistant' -%}",
    "<|start|>assistant<|channel|>final<|message|>{{ m.content }}<|end|>",
    "{%- elif m.role == 'tool' -%}",
    "<|start|>functions.{{ ns.fn }} to=assistant<|channel|>commentary<|message|>",
    "{{ m.content }}<|end|>",
    "{%- endif -%}{%- endfor -%}",
    "{%- if add_generation_prompt -%}<|start|>assistant{%- endif -%}",
])
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}, "unit": {"type": "string"}},
        "required": ["city"]}}}]
CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "reasoning_content": "Call the tool.",
     "tool_calls": [{"id": "c1", "type": "function", "function": {
         "name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
]
RENDERED = (
    "<|start|>system<|message|>You are ChatGPT, a large language model trained by OpenAI.\n"
    "Knowledge cutoff: 2024-06\n\nReasoning: high\n\n"
    "# Valid channels: analysis, commentary, final. Channel must be included for every message.\n"
    "Calls to these tools must go to the commentary channel: 'functions'.<|end|>"
    "<|start|>developer<|message|># Instructions\n\nBe brief.\n\n# Tools\n\n## functions\n\n"
    "namespace functions {\n\n// The weather in a city.\ntype get_weather = (_: {\ncity: string,\n"
    "unit?: string,\n}) => any;\n\n} // namespace functions<|end|>"
    "<|start|>user<|message|>Weather in Paris?<|end|>"
    "<|start|>assistant<|channel|>analysis<|message|>Call the tool.<|end|>"
    "<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>"
    '{"city": "Paris"}<|call|>'
    "<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>sunny<|end|>"
    "<|start|>assistant")


def _harmony_tokenizer():
    """The tiny model's tokenizer: byte-level words " w10" … " w99", the pieces below, and
    Harmony's markers as special tokens (ids 121 …); the miniature template."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    vocab = {"<unk>": 0, "<s>": 1, "<|endoftext|>": 2, **{f"Ġw{i}": i for i in range(10, 99)}}
    for i, text in PIECES.items():
        vocab["".join(t for t, _ in byte_level.pre_tokenize_str(text))] = i
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(" ", "merged_with_next"),
                                                 byte_level])
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", unk_token="<unk>",
                                   pad_token="<|endoftext|>")
    fast.add_tokens([AddedToken(f"<pad{i}>", special=True) for i in range(100, 121)],
                    special_tokens=True)
    fast.add_tokens([AddedToken(m, special=True, normalized=False) for m in harmony.MARKERS],
                    special_tokens=True)
    fast.eos_token = "<|return|>"  # gpt-oss's (and <|call|>: generation_config.json)
    assert fast.convert_tokens_to_ids(list(harmony.MARKERS)) == list(MARKER_IDS.values())
    assert len(fast) == 128
    fast.chat_template = TEMPLATE
    return fast


MARKER_IDS = dict(zip(harmony.MARKERS, range(121, 128)))
START, END, MESSAGE, CHANNEL, _, RETURN, CALL = MARKER_IDS.values()
PIECES = {
    3: "assistant", 4: '"', 9: "final",
    99: "<|channel|>analysis<|message|>",  # the first header
    5: "<|sta", 6: "rt|>assistant",  # the second message's start, in two pieces
    7: ("<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
        "<|message|>"),
    8: '{"city": "Paris"}',
}
FINAL_BRANCH, CALL_BRANCH = 5, 7
CHAINS = [  # (token chain, weight): greedy decoding follows the heaviest link out of a token
    ([3, 99, 20, 21, END, FINAL_BRANCH, 6, CHANNEL, 9, MESSAGE, 30, 31, RETURN], 0.25),
    ([END, CALL_BRANCH, 8, CALL], 0.2),  # taken when the final branch is biased away
]
REASONING, CONTENT = " w20 w21", " w30 w31"


def write_harmony_model_dir(dst):
    write_model_dir(dst, "gpt_oss", generation_config={"eos_token_id": [RETURN, CALL]})
    make_lookup_table(dst, CHAINS, zeroed=("o_proj.weight", "o_proj.bias", "experts.down_proj",
                                           "experts.down_proj_bias"))
    _harmony_tokenizer().save_pretrained(dst)
    return dst


def test_the_template_renders_harmony_with_tools_history_and_reasoning_effort():
    from jaxserve.chat.template import render_chat
    from jaxserve.chat.turns import turns_from_dicts
    from jaxserve.engine.tokenizer import Tokenizer

    hf = _harmony_tokenizer()
    tok = Tokenizer(hf)
    turns = turns_from_dicts(CONVERSATION)
    text = render_chat(tok, turns, chat_template_kwargs={"reasoning_effort": "high"}, tools=TOOLS)
    assert text == RENDERED
    plain = render_chat(tok, turns[1:2])
    assert "Reasoning: medium" in plain and "developer" not in plain
    # a chat request's reasoning_effort reaches the template as vLLM passes it
    from jaxserve.server.protocol_chat import ChatCompletionRequest
    from jaxserve.server.serving_chat import template_kwargs

    body = ChatCompletionRequest(model="tiny", messages=CONVERSATION[1:2], reasoning_effort="low")
    assert "Reasoning: low\n" in render_chat(tok, turns[1:2],
                                              chat_template_kwargs=template_kwargs(body))
    assert hf.encode(plain, add_special_tokens=False)[-2:] == [START, 3]  # "<|start|>assistant"


# ---------------------------------------------------------------------------- served
@pytest.fixture(scope="module")
def client(tmp_path_factory, compile_cache_dir):
    from jaxserve.config import EngineConfig
    from jaxserve.engine.async_client import AsyncEngineClient
    from jaxserve.engine.setup import build_engine
    from jaxserve.server.app import build_app

    model_dir = write_harmony_model_dir(tmp_path_factory.mktemp("harmony"))
    parts = build_engine(EngineConfig.from_kwargs(
        model=str(model_dir), reasoning_parser="gpt_oss", dtype="float32", max_num_seqs=4,
        max_num_batched_tokens=256, token_buckets=(256,), request_buckets=(4,), max_model_len=256,
        num_pages=128, page_size=8, compilation_cache_dir=compile_cache_dir, show_progress=False))
    server = LiveServer(build_app(AsyncEngineClient.in_thread(parts), app_config(
        served_model_name=("tiny",), tool_call_parser="openai", enable_auto_tool_choice=True)),
        free_port())
    server.start()
    yield openai.OpenAI(base_url=server.base_url + "/v1", api_key="none", max_retries=0,
                        timeout=120)
    server.stop()


ASK = [{"role": "user", "content": "w40"}]
CALL_BIAS = {"logit_bias": {str(FINAL_BRANCH): -100}}


def _chat(client, **kw):
    return client.chat.completions.create(model="tiny", messages=ASK, temperature=0,
                                          max_tokens=kw.pop("max_tokens", 32), **kw)


def _stream(client, **kw):
    out = {"reasoning": "", "content": "", "calls": {}, "finish": None, "deltas": []}
    for chunk in _chat(client, stream=True, **kw):
        for c in chunk.choices:
            r = getattr(c.delta, "reasoning_content", None)
            assert r == getattr(c.delta, "reasoning", None)
            out["reasoning"] += r or ""
            out["content"] += c.delta.content or ""
            out["deltas"] += [d for d in (r, c.delta.content) if d]
            for t in c.delta.tool_calls or []:
                entry = out["calls"].setdefault(t.index, ["", ""])
                entry[0] += t.function.name or ""
                entry[1] += t.function.arguments or ""
            out["finish"] = c.finish_reason or out["finish"]
    return out


def test_served_analysis_and_final(client):
    r = _chat(client, extra_body={"reasoning_effort": "high", "return_token_ids": True})
    m = r.choices[0]
    assert m.token_ids[-6:] == [CHANNEL, 9, MESSAGE, 30, 31, RETURN]  # the real final header
    assert (m.message.reasoning_content, m.message.reasoning) == (REASONING, REASONING)
    assert (m.message.content, m.message.tool_calls, m.finish_reason) == (CONTENT, [], "stop")
    s = _stream(client)
    assert (s["reasoning"], s["content"], s["calls"], s["finish"]) == (REASONING, CONTENT, {},
                                                                     "stop")
    assert not any("<|" in d or "|>" in d for d in s["deltas"])  # "<|sta" + "rt|>" held back


def test_served_tool_call(client):
    r = _chat(client, tools=TOOLS, extra_body=CALL_BIAS)
    m = r.choices[0]
    assert m.message.reasoning_content == REASONING and m.message.content is None
    assert [(c.function.name, c.function.arguments) for c in m.message.tool_calls] == [
        ("get_weather", '{"city": "Paris"}')]
    assert m.finish_reason == "tool_calls"
    s = _stream(client, tools=TOOLS, extra_body=CALL_BIAS)
    assert (s["reasoning"], s["content"], s["finish"]) == (REASONING, "", "tool_calls")
    assert s["calls"] == {0: ["get_weather", '{"city": "Paris"}']}
    # without tools to call, the call is no content either (tool_choice "none")
    r = _chat(client, tools=TOOLS, tool_choice="none", extra_body=CALL_BIAS)
    assert (r.choices[0].message.content, r.choices[0].message.tool_calls) == (None, [])


def test_served_structured_output_applies_to_the_final_channel(client):
    """The constraint waits for the final channel's header: the reasoning is the model's own."""
    choices = [" w40", "final"]  # (no shared first byte: this vocabulary has no lone space)
    schema = {"type": "json_schema", "json_schema": {"name": "pick", "schema": {
        "type": "string", "enum": choices}}}
    m = _chat(client, response_format=schema).choices[0]
    assert m.message.reasoning_content == REASONING and m.finish_reason == "stop"
    assert json.loads(m.message.content) in choices


def test_served_output_cut_in_the_reasoning(client):
    m = _chat(client, max_tokens=2).choices[0]
    assert (m.message.reasoning_content, m.message.content, m.finish_reason) == (" w20", None,
                                                                                 "length")


def test_served_responses_api(client):
    r = client.responses.create(model="tiny", input="w40", temperature=0, max_output_tokens=32)
    kinds = [item.type for item in r.output]
    assert kinds == ["reasoning", "message"]
    assert r.output[0].content[0].text == REASONING and r.output_text == CONTENT
    r = client.responses.create(model="tiny", input="w40", temperature=0, max_output_tokens=32,
                                tools=[{"type": "function", **TOOLS[0]["function"]}],
                                extra_body=CALL_BIAS)
    calls = [(i.name, i.arguments) for i in r.output if i.type == "function_call"]
    assert calls == [("get_weather", '{"city": "Paris"}')]
    with client.responses.stream(model="tiny", input="w40", temperature=0,
                                 max_output_tokens=32) as stream:
        events = list(stream)
        final = stream.get_final_response()
    deltas = {kind: "".join(e.delta for e in events if e.type == kind)
              for kind in ("response.reasoning_text.delta", "response.output_text.delta")}
    assert deltas == {"response.reasoning_text.delta": REASONING,
                      "response.output_text.delta": CONTENT}
    assert [i.type for i in final.output] == ["reasoning", "message"]
