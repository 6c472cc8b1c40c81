"""The default model's tokenizer (built from its GGUF metadata) against the golden data, and the
incremental detokenizer."""

from __future__ import annotations

import json
import random

import pytest

from jaxserve.engine.tokenizer import IncrementalDetokenizer, StreamDetokenizer, Tokenizer
from jaxserve.models import gguf_loader, gguf_tokenizer, loader

MULTIBYTE = "Grüße 👋🏽 from 東京 — naïve café, emoji 🎉🧪 and 한국어 ✓"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """The default model's tokenizer files (and config.json), as the GGUF conversion writes them."""
    out = tmp_path_factory.mktemp("smollm2-tokenizer")
    reader = gguf_loader.open_gguf(loader.default_gguf_path())
    config = gguf_loader.config_from_gguf(reader)
    gguf_tokenizer.save_tokenizer(reader, out, config)
    (out / "config.json").write_text(json.dumps(config))
    return out


@pytest.fixture(scope="module")
def tok(model_dir) -> Tokenizer:
    return Tokenizer.from_pretrained(model_dir)


def _cases(golden, chat_only=False):
    return [c for c in golden["cases"] if not chat_only or "messages" in c]


def test_golden_prompt_token_ids(tok, golden):
    # the golden ids were produced with add_special_tokens=True; this tokenizer adds no BOS
    # (tokenizer.ggml.add_bos_token is false), so both settings give the same ids
    for case in _cases(golden):
        assert tok.encode(case["text"], add_special_tokens=True) == case["prompt_token_ids"], case[
            "name"
        ]
        assert tok.encode(case["text"], add_special_tokens=False) == case["prompt_token_ids"], case[
            "name"
        ]
        assert tok.hf_tokenizer(case["text"])["input_ids"] == case["prompt_token_ids"]


def test_golden_chat_template(tok, golden):
    cases = _cases(golden, chat_only=True)
    assert cases
    for case in cases:
        assert tok.apply_chat_template(case["messages"], add_generation_prompt=True) == case["text"]
        assert (
            tok.hf_tokenizer.apply_chat_template(
                case["messages"], tokenize=False, add_generation_prompt=True
            )
            == case["text"]
        )


def test_golden_decode(tok, golden):
    for case in _cases(golden):
        assert tok.decode(case["completion_token_ids"]) == case["completion_text"], case["name"]
        assert tok.decode(case["prompt_token_ids"]) == case["text"], case["name"]


@pytest.mark.parametrize(
    "text",
    [
        "",
        "hello",
        "  leading and trailing  ",
        "line\nbreaks\r\n\ttabs",
        "def f(x):\n    return x**2\n",
        "numbers 1234567 3.14159 2024-11-29",
        MULTIBYTE,
        "<|im_start|>user\nhi<|im_end|>\n",
    ],
)
def test_round_trip(tok, text):
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == text


def test_special_tokens(tok):
    assert tok.eos_token_id == 2 and tok.bos_token_id == 1 and tok.pad_token_id == 2
    assert tok.vocab_size == 49152
    assert {0, 1, 2} <= set(tok.all_special_ids) and 17 not in tok.all_special_ids
    assert set(tok.all_special_ids) == set(range(17))  # every CONTROL token of the file
    ids = tok.encode("<|im_start|>assistant\nHi<|im_end|><repo_name>", add_special_tokens=False)
    assert ids[0] == 1 and ids[-2:] == [2, 3]
    assert tok.decode(ids, skip_special_tokens=True) == "assistant\nHi"
    assert tok.convert_ids_to_tokens([1, 2, 28, 365]) == ["<|im_start|>", "<|im_end|>", ",", "Ġ("]
    assert tok.convert_ids_to_tokens([1, 28], skip_special_tokens=True) == [","]
    # digits are never merged (as with the original tokenizer's Digits pre-tokenizer)
    assert tok.convert_ids_to_tokens(tok.encode("in 2024")) == ["in", "Ġ", "2", "0", "2", "4"]


def test_no_chat_template(model_dir):
    tok = Tokenizer.from_pretrained(model_dir)
    tok.hf_tokenizer.chat_template = None
    with pytest.raises(ValueError, match="no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])


# ----------------------------------------------------------------------------- detokenizer


# Both streaming detokenizers: the tokenizers library's DecodeStream (what a fast tokenizer
# gets) and the window scheme over decode (any other tokenizer).
DETOKENIZERS = {
    "stream": lambda tok, **kw: tok.detokenizer(**kw),
    "window": lambda tok, **kw: IncrementalDetokenizer(tok, **kw),
}


@pytest.fixture(params=sorted(DETOKENIZERS))
def detokenizer(request):
    return DETOKENIZERS[request.param]


def test_a_fast_tokenizer_streams_with_decode_stream(tok):
    assert isinstance(tok.detokenizer(), StreamDetokenizer)


def _stream(
    tok: Tokenizer, ids: list[int], skip: bool, chunks: list[int] | None = None, make=None, **kw
) -> list[str]:
    detok = (make or DETOKENIZERS["stream"])(tok, skip_special_tokens=skip, **kw)
    deltas = []
    i = 0
    for size in chunks or [1] * len(ids):
        deltas.append(detok.add_tokens(ids[i : i + size]))
        i += size
    assert i >= len(ids)
    deltas.append(detok.flush())
    return deltas


@pytest.mark.parametrize("skip", [True, False])
def test_detokenize_golden_completions(tok, golden, skip, detokenizer):
    for case in _cases(golden):
        ids = case["completion_token_ids"]
        deltas = _stream(tok, ids, skip, make=detokenizer, prompt_token_ids=case["prompt_token_ids"])
        assert "".join(deltas) == tok.decode(ids, skip_special_tokens=skip), case["name"]
        if not skip:
            assert "".join(deltas) == case["completion_text"]
        assert deltas[-1] == ""  # nothing was held back at the end


def test_detokenize_multibyte_split_across_tokens(tok, detokenizer):
    ids = tok.encode(MULTIBYTE, add_special_tokens=False)
    # the test only means something if some characters really span several byte-level tokens
    partial = [i for i in ids if "\ufffd" in tok.decode([i])]
    assert len(partial) >= 4
    deltas = _stream(tok, ids, skip=True, make=detokenizer)
    assert "".join(deltas) == MULTIBYTE == tok.decode(ids)
    assert not any("\ufffd" in d for d in deltas)
    assert deltas.count("") >= 2  # some steps held their bytes back


def test_detokenize_random_chunks(tok, detokenizer):
    text = MULTIBYTE + "<|im_end|>" + " and more text 🎉 after the end"
    ids = tok.encode(text, add_special_tokens=False)
    rnd = random.Random(0)
    for _ in range(20):
        chunks, left = [], len(ids)
        while left:
            chunks.append(min(left, rnd.randint(1, 4)))
            left -= chunks[-1]
        for skip in (True, False):
            deltas = _stream(tok, ids, skip, chunks, make=detokenizer)
            assert "".join(deltas) == tok.decode(ids, skip_special_tokens=skip)
            assert not any("\ufffd" in d for d in deltas)


def test_detokenize_stream_ending_mid_character(tok, detokenizer):
    ids = tok.encode("ok 👋", add_special_tokens=False)
    cut = ids[:-1]  # the emoji's last byte never arrives
    assert tok.decode(cut).endswith("\ufffd")
    detok = detokenizer(tok)
    streamed = "".join(detok.add_tokens([i]) for i in cut)
    assert streamed.startswith("ok") and "\ufffd" not in streamed  # the partial emoji is held back
    tail = detok.flush()
    assert tail.endswith("\ufffd") and streamed + tail == tok.decode(cut)


def test_detokenize_with_prompt_context(tok, detokenizer):
    prompt = tok.encode("The capital of France", add_special_tokens=False)
    out = tok.encode(" is Paris.", add_special_tokens=False)
    detok = detokenizer(tok, prompt_token_ids=prompt)
    assert "".join(detok.add_tokens([i]) for i in out) == " is Paris."
