"""Tiny servable model directories for engine and server tests: a random architecture fixture
(tests/data/arch/<name>) with a word-level tokenizer over its 128-token vocabulary ("w3" …
"w127", plus <unk>=0, <s>=1, </s>=2) and a plain chat template, so that the real engine loads
and compiles it in seconds."""

from __future__ import annotations

import json
import pathlib
import shutil

DATA = pathlib.Path(__file__).parent / "data" / "arch"
CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }} {% endfor %}"


def word_tokenizer(vocab_size: int = 128):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, vocab_size)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with spaces
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    fast.chat_template = CHAT_TEMPLATE
    return fast


def write_model_dir(dst: pathlib.Path, fixture: str = "llama", *,
                    generation_config: dict | None = None) -> pathlib.Path:
    """A model directory in `dst` from the fixture, with a tokenizer; `generation_config`
    replaces the fixture's generation_config.json."""
    dst.mkdir(parents=True, exist_ok=True)
    src = DATA / fixture
    for name in ("model.safetensors", "generation_config.json"):
        shutil.copy(src / name, dst / name)
    # Without model_type: transformers would load the family's own tokenizer class (e.g.
    # Qwen2's BPE) over the word-level tokenizer; the engine reads `architectures`.
    config = json.loads((src / "config.json").read_text())
    config.pop("model_type", None)
    (dst / "config.json").write_text(json.dumps(config))
    if generation_config is not None:
        (dst / "generation_config.json").write_text(json.dumps(generation_config))
    word_tokenizer(json.loads((src / "config.json").read_text())["vocab_size"]).save_pretrained(dst)
    return dst
