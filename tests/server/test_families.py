"""`jaxserve serve` on each new family's tiny fixture answers a chat completion: the fixture's
weights, a small word-level tokenizer built here (sized to the fixture's vocabulary) with a
plain chat template, an engine with two token buckets, the app in-process."""

from __future__ import annotations

import json
import shutil

import pytest
from starlette.testclient import TestClient

FAMILIES = ["gemma2", "gemma3", "phi3", "qwen2_sliding", "mixtral", "qwen3_moe"]
CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} {% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def _model_dir(src, dst, vocab_size: int):
    """The fixture's config and weights, plus a word-level tokenizer of `vocab_size` tokens."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    dst.mkdir()
    for name in ("config.json", "model.safetensors", "generation_config.json"):
        if (src / name).is_file():
            shutil.copy(src / name, dst / name)
    specials = ["<unk>", "<bos>", "<eos>", "<|user|>", "<|assistant|>", "<|system|>"]
    words = ["hello", "world", "the", "a", "is", "what", "of", "and", "to", "in"]
    vocab = specials + words + [f"w{i}" for i in range(vocab_size - len(specials) - len(words))]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(vocab)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<bos>",
                                   eos_token="<eos>", additional_special_tokens=specials[3:])
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(dst)
    return dst


@pytest.mark.parametrize("family", FAMILIES)
def test_family_serves_a_chat_completion(family, data_dir, tmp_path, compile_cache_dir):
    from jaxserve.server.app import build_app
    from jaxserve.server.async_engine import AsyncEngine

    from jaxserve.config import EngineConfig
    from jaxserve.engine.llm_engine import LLMEngine

    src = data_dir / "arch" / family
    vocab = json.loads((src / "config.json").read_text())["vocab_size"]
    model = _model_dir(src, tmp_path / family, vocab)
    engine = LLMEngine(EngineConfig.from_kwargs(
        model=str(model), dtype="float32", max_num_seqs=8, max_num_batched_tokens=64, token_buckets=(16, 64),
        request_buckets=(8,), max_model_len=32, num_pages=32, page_size=8,
        compilation_cache_dir=compile_cache_dir, show_progress=False))
    app = build_app(AsyncEngine(engine), served_model_names=[family], shutdown_grace_seconds=1)
    with TestClient(app) as client:
        r = client.post("/v1/chat/completions", json={
            "model": family, "max_tokens": 5, "temperature": 0,
            "messages": [{"role": "user", "content": "hello world what is the a"}]})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["choices"][0]["message"]["role"] == "assistant"
        assert body["usage"]["completion_tokens"] >= 1
        assert body["usage"]["prompt_tokens"] >= 4  # (transformers may pick the family's tokenizer class)
