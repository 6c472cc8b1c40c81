"""Reasoning output (--reasoning-parser) end to end: the real engine serving a tiny reasoning
model (tests/model_dirs.py: weights that make greedy decoding follow known token chains, a
byte-level tokenizer with `<think>`/`</think>` as added non-special tokens, Qwen3's and R1's chat
templates in miniature) through the real app on a live port, read with the openai SDK.

The expected split is derived from the raw token ids of the same greedy request (return_token_ids)
and from /v1/completions of the rendered prompt, not written down: reasoning is the text of the
ids before `</think>`, content the text of the ids after it. Covered: qwen3 and deepseek_r1,
whole and streamed (equal), enable_thinking false and reasoning_effort "none" (no reasoning),
tool calls parsed from the answer only, structured output applied after the reasoning (and from
the first token when the prompt closed it), max_tokens=1, output cut inside the reasoning, the
end marker split over two deltas, n=2, reasoning_content in the history, and no reasoning key at
all without a parser."""

from __future__ import annotations

import json

import openai
import pytest

from tests.live_server import LiveServer, free_port
from tests.model_dirs import END_THINK, TOOL_CALLS, reasoning_tokenizer, write_reasoning_model_dir
from tests.server.conftest import app_config

ASK = [{"role": "user", "content": "w40 w41"}]
# (no shared first byte: llguidance forces a prefix the alternatives share through the token of
# those bytes, and this vocabulary has no token for a lone space)
ENUM = [" w40", "ink>"]
SCHEMA = {"type": "json_schema",
          "json_schema": {"name": "pick", "schema": {"type": "string", "enum": ENUM}}}
TOOLS = [{"type": "function", "function": {"name": name, "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
    for name in ("get_weather", "get_time")]
WEATHER, TIME = TOOL_CALLS[8], TOOL_CALLS[9]  # the model's two tool-call tokens (as text)


def _server(model_dir, compile_cache_dir, reasoning_parser):
    from jaxserve.config import EngineConfig
    from jaxserve.engine.async_client import AsyncEngineClient
    from jaxserve.engine.setup import build_engine
    from jaxserve.server.app import build_app

    parts = build_engine(EngineConfig.from_kwargs(
        model=str(model_dir), reasoning_parser=reasoning_parser, dtype="float32", max_num_seqs=8,
        max_num_batched_tokens=32, token_buckets=(32,), request_buckets=(8,), max_model_len=256,
        num_pages=256, page_size=8, compilation_cache_dir=compile_cache_dir, show_progress=False))
    app = build_app(AsyncEngineClient.in_thread(parts),
                    app_config(served_model_name=("tiny",), tool_call_parser="hermes",
                               enable_auto_tool_choice=True))
    return LiveServer(app, free_port())


@pytest.fixture(scope="module")
def servers(tmp_path_factory, compile_cache_dir):
    """Three servers: the Qwen3-style model with the qwen3 parser and without a parser, the
    R1-style one with deepseek_r1."""
    root = tmp_path_factory.mktemp("reasoning")
    qwen3 = write_reasoning_model_dir(root / "qwen3", "qwen3")
    r1 = write_reasoning_model_dir(root / "r1", "deepseek_r1")
    out = {"qwen3": _server(qwen3, compile_cache_dir, "qwen3"),
           "deepseek_r1": _server(r1, compile_cache_dir, "deepseek_r1"),
           None: _server(qwen3, compile_cache_dir, None)}
    for s in out.values():
        s.start()
    yield out
    for s in out.values():
        s.stop()


@pytest.fixture(scope="module")
def clients(servers):
    return {k: openai.OpenAI(base_url=s.base_url + "/v1", api_key="none", max_retries=0,
                             timeout=120) for k, s in servers.items()}


@pytest.fixture(scope="module")
def qwen3(clients):
    return clients["qwen3"]


@pytest.fixture(scope="module")
def tok():
    return reasoning_tokenizer()


def chat(client, messages=ASK, **kw):
    extra = kw.pop("extra_body", {})
    return client.chat.completions.create(
        model="tiny", messages=messages, temperature=kw.pop("temperature", 0),
        max_tokens=kw.pop("max_tokens", 32), extra_body={"return_token_ids": True, **extra}, **kw)


def expected_split(tok, ids: list[int]) -> tuple[str | None, str | None]:
    """The split by the token ids: the text of the ids before the end marker, and after it."""
    ids = [t for t in ids if t != tok.eos_token_id]
    if END_THINK not in ids:
        return tok.decode(ids) or None, None
    at = ids.index(END_THINK)
    return tok.decode(ids[:at]) or None, tok.decode(ids[at + 1:]) or None


def streamed(client, messages=ASK, **kw) -> dict[int, dict]:
    """Each choice of a stream assembled: reasoning, content, tool calls, finish reason, and every
    delta's text (to look for leaked markers)."""
    extra = kw.pop("extra_body", {})
    stream = client.chat.completions.create(
        model="tiny", messages=messages, temperature=kw.pop("temperature", 0), stream=True,
        max_tokens=kw.pop("max_tokens", 32), extra_body=extra, **kw)
    out: dict[int, dict] = {}
    for chunk in stream:
        for c in chunk.choices:
            d = out.setdefault(c.index, {"reasoning": "", "content": "", "calls": {},
                                         "finish": None, "deltas": [], "token_ids": []})
            r = getattr(c.delta, "reasoning_content", None)
            assert r == getattr(c.delta, "reasoning", None)  # vLLM's current name: the same text
            d["reasoning"] += r or ""
            d["content"] += c.delta.content or ""
            d["deltas"] += [x for x in (r, c.delta.content) if x]
            d["token_ids"].append(getattr(c, "token_ids", None))
            for tc in c.delta.tool_calls or []:
                call = d["calls"].setdefault(tc.index, {"name": tc.function.name, "arguments": ""})
                call["arguments"] += tc.function.arguments or ""
            d["finish"] = c.finish_reason or d["finish"]
    for d in out.values():
        d["reasoning"], d["content"] = d["reasoning"] or None, d["content"] or None
    return out


# ---------------------------------------------------------------------------- the split
@pytest.mark.parametrize("name", ["qwen3", "deepseek_r1"])
def test_reasoning_and_content_split_exactly_whole_and_streamed(clients, servers, tok, name):
    import httpx

    r = chat(clients[name])
    c = r.choices[0]
    ids = c.token_ids
    # the fixture's chain: reasoning, </think>, the answer, EOS
    assert END_THINK in ids and ids[-1] == tok.eos_token_id and c.finish_reason == "stop"
    reasoning, content = expected_split(tok, ids)
    assert (c.message.reasoning_content, c.message.content) == (reasoning, content)
    assert c.message.reasoning == reasoning
    assert reasoning.strip() and content.startswith("\n\n")  # the newlines after </think> stay
    # the same greedy request as a completion of the rendered prompt: the raw text, marker and all
    raw = httpx.post(servers[name].base_url + "/v1/completions", json={
        "model": "tiny", "prompt": r.prompt_token_ids, "max_tokens": 32, "temperature": 0}).json()
    assert raw["choices"][0]["text"] == reasoning + "</think>" + content
    s = streamed(clients[name])[0]
    assert (s["reasoning"], s["content"], s["finish"]) == (reasoning, content, "stop")
    assert not any("think>" in d for d in s["deltas"])


def test_enable_thinking_false_has_no_reasoning(qwen3, tok):
    r = chat(qwen3, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    c = r.choices[0]
    assert r.prompt_token_ids[-4:] == [END_THINK - 1, 4, END_THINK, 4]  # "<think>\n\n</think>\n\n"
    assert c.message.reasoning_content is None and "reasoning_content" in c.message.model_dump()
    assert c.message.content == tok.decode(c.token_ids, skip_special_tokens=True)
    assert END_THINK not in c.token_ids
    s = streamed(qwen3, extra_body={"chat_template_kwargs": {"enable_thinking": False}})[0]
    assert (s["reasoning"], s["content"]) == (None, c.message.content)
    # reasoning_effort "none" turns thinking off in the template, as in vLLM
    r2 = chat(qwen3, reasoning_effort="none")
    assert r2.prompt_token_ids == r.prompt_token_ids
    assert r2.choices[0].message.reasoning_content is None
    assert chat(qwen3, reasoning_effort="high").choices[0].message.reasoning_content
    with pytest.raises(openai.BadRequestError, match="reasoning_effort"):
        chat(qwen3, reasoning_effort="extreme")


def test_without_a_parser_there_is_no_reasoning_key(clients, servers, tok):
    import httpx

    body = {"model": "tiny", "messages": ASK, "max_tokens": 32, "temperature": 0}
    url = servers[None].base_url + "/v1/chat/completions"
    msg = httpx.post(url, json=body).json()["choices"][0]["message"]
    assert set(msg) == {"role", "content", "tool_calls"} and "</think>" in msg["content"]
    events = httpx.post(url, json={**body, "stream": True}).text
    assert "reasoning" not in events and "think>" in events


# ---------------------------------------------------------------------------- tools, constraints
def test_tool_calls_come_from_the_answer_only(clients):
    for stream in (False, True):
        if stream:
            s = streamed(clients["qwen3"], tools=TOOLS)[0]
            reasoning, content, finish = s["reasoning"], s["content"], s["finish"]
            calls = [(c["name"], json.loads(c["arguments"])) for c in s["calls"].values()]
        else:
            c = chat(clients["qwen3"], tools=TOOLS).choices[0]
            reasoning, content = c.message.reasoning_content, c.message.content
            finish = c.finish_reason
            calls = [(t.function.name, json.loads(t.function.arguments))
                     for t in c.message.tool_calls]
        assert calls == [("get_time", {"city": "Tokyo"})] and finish == "tool_calls"
        assert WEATHER in reasoning and TIME not in reasoning and content == "\n\n w30"
    # without a reasoning parser the call written while reasoning is taken too
    c = chat(clients[None], tools=TOOLS).choices[0]
    assert [t.function.name for t in c.message.tool_calls] == ["get_weather", "get_time"]


@pytest.mark.parametrize("name", ["qwen3", "deepseek_r1"])
def test_structured_output_applies_to_the_answer(clients, tok, name):
    free = chat(clients[name]).choices[0]
    c = chat(clients[name], response_format=SCHEMA).choices[0]
    # the reasoning is the model's own (unconstrained), then the answer satisfies the schema
    assert c.message.reasoning_content == free.message.reasoning_content
    assert json.loads(c.message.content) in ENUM and c.finish_reason == "stop"
    assert (c.message.reasoning_content, c.message.content) == expected_split(tok, c.token_ids)
    s = streamed(clients[name], response_format=SCHEMA)[0]
    assert (s["reasoning"], s["content"]) == (c.message.reasoning_content, c.message.content)


def test_structured_output_is_constrained_from_the_first_token_when_the_prompt_closed_it(qwen3):
    off = {"chat_template_kwargs": {"enable_thinking": False}}
    c = chat(qwen3, response_format=SCHEMA, extra_body=off).choices[0]
    assert c.message.reasoning_content is None and json.loads(c.message.content) in ENUM
    assert c.token_ids[0] == 5  # '"': the free model would have written " w30"
    assert chat(qwen3, extra_body=off).choices[0].token_ids[0] == 30


# ---------------------------------------------------------------------------- edge cases
def test_max_tokens_1_and_output_cut_inside_the_reasoning(qwen3, tok):
    for max_tokens in (1, 3):
        c = chat(qwen3, max_tokens=max_tokens).choices[0]
        assert len(c.token_ids) == max_tokens and END_THINK not in c.token_ids
        assert c.finish_reason == "length"
        assert (c.message.reasoning_content, c.message.content) == (tok.decode(c.token_ids), None)
        s = streamed(qwen3, max_tokens=max_tokens)[0]
        assert (s["reasoning"], s["content"]) == (tok.decode(c.token_ids), None)
        assert s["finish"] == "length"


def test_an_end_marker_split_over_two_deltas(qwen3, tok):
    """Continuing an assistant turn " w55", the model writes "</think>" as two tokens ("</th",
    "ink>"): the stream holds the first back until it resolves."""
    cont = [ASK[0], {"role": "assistant", "content": "w55"}]
    extra = {"continue_final_message": True, "add_generation_prompt": False}
    c = chat(qwen3, cont, extra_body=extra).choices[0]
    text = tok.decode(c.token_ids, skip_special_tokens=True)
    assert END_THINK not in c.token_ids and "</think>" in text
    reasoning, _, content = text.partition("</think>")
    assert (c.message.reasoning_content, c.message.content) == (reasoning, content)
    s = streamed(qwen3, cont, extra_body={**extra, "return_token_ids": True})[0]
    assert (s["reasoning"], s["content"]) == (reasoning, content)
    assert len(s["deltas"]) == 2 and not any("</th" in d for d in s["deltas"])
    # each token came in a chunk of its own ("</th" held back, its id still sent)
    assert [ids for ids in s["token_ids"] if ids] == [[t] for t in c.token_ids]


def test_two_choices_are_split_each(qwen3, tok):
    r = chat(qwen3, n=2, temperature=1.0, seed=7)
    assert [c.index for c in r.choices] == [0, 1]
    for c in r.choices:
        assert END_THINK in c.token_ids
        assert (c.message.reasoning_content, c.message.content) == expected_split(tok, c.token_ids)
    s = streamed(qwen3, n=2, temperature=1.0, seed=7)
    assert sorted(s) == [0, 1]
    for i, c in enumerate(r.choices):
        assert (s[i]["reasoning"], s[i]["content"]) == (c.message.reasoning_content,
                                                        c.message.content)


def test_reasoning_in_the_history_reaches_the_template(qwen3):
    """An assistant turn's reasoning_content (or reasoning: vLLM's name) is the template's; the
    miniature Qwen3 template shows it, which closes reasoning in the prompt: the continuation is
    all content."""
    for key in ("reasoning_content", "reasoning"):
        cont = [ASK[0], {"role": "assistant", "content": "w55", key: "w60 w61"}]
        r = chat(qwen3, cont, extra_body={"continue_final_message": True,
                                          "add_generation_prompt": False})
        assert r.prompt_token_ids[-6:] == [41, END_THINK - 1, 60, 61, END_THINK, 55]
        message = r.choices[0].message
        assert message.reasoning_content is None and "</think>" in message.content
