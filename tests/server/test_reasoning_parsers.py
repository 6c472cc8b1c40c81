"""The reasoning parsers (jaxserve/reasoning/): the registry, the markers' ids from a real
tokenizer (added, non-special tokens), the split of a whole output, the streamed split (equal to
the whole one in every chunking, a partial marker held back), and whether a prompt closed
reasoning, on prompts rendered by Qwen3-style and R1-style chat templates."""

from __future__ import annotations

import itertools

import pytest

from jaxserve.reasoning import (
    REASONING_PARSER_NAMES,
    REASONING_PARSERS,
    ReasoningParser,
    ReasoningStream,
    get_reasoning_parser,
)
from tests.model_dirs import R1_TEMPLATE, reasoning_tokenizer, word_tokenizer

NAMES = ["deepseek_r1", "qwen3"]  # the <think> parsers (gpt_oss's Harmony: test_harmony.py)
UNKNOWN = ("unknown reasoning parser 'r1'; available: deepseek_r1, gpt_oss, openai_gptoss, "
           "qwen3")


@pytest.fixture(scope="module")
def hf():
    return reasoning_tokenizer()


@pytest.fixture(scope="module", params=NAMES)
def parser(request, hf) -> ReasoningParser:
    return get_reasoning_parser(request.param)(hf)


def test_registry_names_and_unknown_names():
    assert sorted(REASONING_PARSERS) == sorted([*NAMES, "gpt_oss", "openai_gptoss"])
    assert list(REASONING_PARSER_NAMES) == sorted(REASONING_PARSERS)
    for name in NAMES:
        cls = get_reasoning_parser(name)
        assert issubclass(cls, ReasoningParser) and cls.name == name
        assert (cls.start_marker, cls.end_marker) == ("<think>", "</think>")
    with pytest.raises(ValueError, match=UNKNOWN):
        get_reasoning_parser("r1")


def test_marker_ids_from_the_engine_tokenizer_and_an_hf_one(hf):
    from jaxserve.engine.tokenizer import Tokenizer

    for tok in (hf, Tokenizer(hf)):
        p = get_reasoning_parser("qwen3")(tok)
        assert (p.start_token_id, p.end_token_id) == (126, 127)
    # the markers survive decoding without special tokens, as in the real checkpoints
    decoded = Tokenizer(hf).decode([20, 126, 21, 127, 30], skip_special_tokens=True)
    assert decoded == " w20<think> w21</think> w30"


def test_a_tokenizer_without_the_markers_is_refused():
    with pytest.raises(ValueError, match=r"needs the tokens <think> and </think> in the model's"):
        get_reasoning_parser("deepseek_r1")(word_tokenizer())


CASES = [  # output -> (reasoning, content)
    ("w5 w6 </think> w7", ("w5 w6 ", " w7")),  # R1 / new templates: <think> is in the prompt
    ("<think>\nw5\n</think>\n\nw7 w8", ("\nw5\n", "\n\nw7 w8")),  # the newlines stay, as in vLLM
    ("w5 w6", ("w5 w6", None)),  # no end marker: all reasoning (cut by max_tokens)
    ("<think>w5", ("w5", None)),
    ("", (None, None)),
    ("</think>", (None, None)),
    ("</think>w7", (None, "w7")),
    ("w5</think>", ("w5", None)),
    ("x<think>w5</think>w7", ("xw5", "w7")),
    ("w5</think>w6<think>w7</think>w8", ("w5", "w6<think>w7</think>w8")),  # after it: all content
    ("<think>w5<think>w6</think>", ("w5<think>w6", None)),
    ("w5 </thin w6", ("w5 </thin w6", None)),  # not a marker
    ("w5 <think", ("w5 <think", None)),
]


@pytest.mark.parametrize("text, expected", CASES)
def test_extract(parser, text, expected):
    assert parser.extract(text) == expected


def _streamed(stream: ReasoningStream, chunks: list[str]) -> tuple[str | None, str | None]:
    reasoning = content = ""
    for i, chunk in enumerate(chunks):
        r, c = stream.update(chunk, final=i == len(chunks) - 1)
        reasoning, content = reasoning + r, content + c
    return reasoning or None, content or None


def _chunkings(text: str):
    yield [text]
    yield list(text) or [""]
    for i, j in itertools.combinations(range(len(text) + 1), 2):
        yield [text[:i], text[i:j], text[j:]]


@pytest.mark.parametrize("text", [t for t, _ in CASES])
def test_the_streamed_split_equals_the_whole_one_in_every_chunking(parser, text):
    for chunks in _chunkings(text):
        assert _streamed(parser.streamer(), chunks) == parser.extract(text), chunks


def test_a_partial_marker_is_held_back_until_it_resolves(parser):
    s = parser.streamer()
    assert s.update("w5 </thi") == ("w5 ", "")
    assert s.update("nk>") == ("", "") and s.ended
    assert s.update(" w7") == ("", " w7")
    s = parser.streamer()
    assert s.update("w5 <") == ("w5 ", "")
    assert s.update("thinking") == ("<thinking", "")  # resolved: not a marker
    assert s.update("</") == ("", "")
    assert s.update("think", final=True) == ("</think", "")  # the end: what was held is given out
    s = parser.streamer()
    assert s.update("<thi") == ("", "")
    assert s.update("nk>w5 <th") == ("w5 <th", "")  # once <think> was seen, only </think> is held
    assert s.update("ink> </") == ("ink> ", "")


def _prompt(hf, template=None, **kwargs) -> list[int]:
    messages = kwargs.pop("messages", [{"role": "user", "content": "w10 w11"}])
    text = hf.apply_chat_template(messages, tokenize=False, chat_template=template, **kwargs)
    return hf(text, add_special_tokens=False)["input_ids"]


def test_whether_the_prompt_closed_reasoning(parser, hf):
    assert not parser.reasoning_ended(_prompt(hf, add_generation_prompt=True))  # Qwen3, thinking on
    closed = _prompt(hf, add_generation_prompt=True, enable_thinking=False)
    assert closed[-4:] == [126, 4, 127, 4]  # "<think>\n\n</think>\n\n"
    assert parser.reasoning_ended(closed)
    opened = _prompt(hf, R1_TEMPLATE, add_generation_prompt=True)
    assert opened[-2:] == [126, 3] and not parser.reasoning_ended(opened)  # "<think>\n"
    # an assistant turn continued after its reasoning: the continuation is the answer
    prefill = [{"role": "user", "content": "w10"},
               {"role": "assistant", "content": "w12", "reasoning_content": "w40"}]
    assert parser.reasoning_ended(_prompt(hf, messages=prefill, continue_final_message=True))
    assert not parser.reasoning_ended([]) and not parser.reasoning_ended([127, 5, 126, 6])


def test_the_engine_option_and_its_flag():
    from jaxserve.config import EngineConfig
    from jaxserve.server.cli import build_parser, engine_options

    config = EngineConfig.from_kwargs(reasoning_parser="qwen3")  # LLM(reasoning_parser=...)'s path
    assert config.model.reasoning_parser == "qwen3"
    assert EngineConfig.from_kwargs().model.reasoning_parser is None
    with pytest.raises(ValueError, match=UNKNOWN):
        EngineConfig.from_kwargs(reasoning_parser="r1")
    args = build_parser().parse_args(["serve", "--reasoning-parser", "deepseek_r1"])
    assert engine_options(args) == {"reasoning_parser": "deepseek_r1"}
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--reasoning-parser", "r1"])
