"""Regenerate the embedding-parity fixtures in tests/data/embed/ (needs torch, transformers and
sentence-transformers; the tests need none of them).

Two tiny random decoders (hidden 32, 2 layers, a 128-word vocabulary), each a complete
sentence-transformers checkpoint, and the embeddings sentence-transformers computes for a few
texts in one padded batch (expected.safetensors: `tokens_i`, `embedding_i`):

- qwen3_embedding: laid out as Qwen/Qwen3-Embedding-* publish it: config.json naming
  `Qwen3ForCausalLM`, the base model's tensors (no `model.` prefix, no lm_head), modules.json
  with the `sentence_transformers.models.*` names (Transformer, Pooling, Normalize),
  1_Pooling/config.json with every `pooling_mode_*` key (lasttoken true) and include_prompt, a
  tokenizer that appends the end-of-text token and pads on the left, and
  config_sentence_transformers.json with the query instruction. Written here file by file,
  then loaded by SentenceTransformer(dir) for the reference.
- llama_mean: a Llama base model with mean pooling and no Normalize, as sentence-transformers'
  own `save` writes it (v5.4+ module names, `pooling_mode: "mean"`, `LlamaModel`; the model
  card left out).

    pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu
    pip install 'transformers>=5.20,<6' sentence-transformers safetensors
    python scripts/make_embedding_fixtures.py
"""

from __future__ import annotations

import json
import pathlib
import shutil
import sys
import tempfile

import numpy as np
import torch
import transformers
from safetensors.numpy import save_file
from sentence_transformers import SentenceTransformer
from sentence_transformers.base.modules.transformer import Transformer
from sentence_transformers.sentence_transformer.modules.pooling import Pooling
from tokenizers import processors

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from tests.model_dirs import word_tokenizer  # noqa: E402

OUT = ROOT / "tests" / "data" / "embed"
SHAPE = dict(vocab_size=128, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
             num_attention_heads=2, num_key_value_heads=1, head_dim=16,
             max_position_embeddings=256, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2)
QUERY = "w100 w101 w102 "  # the "instruction" of the query prompt (a few words of the vocabulary)
TEXTS = ["w5", "w10 w11 w12 w13 w14 w15 w16", "w127 w3 w64 w64 w64 w9 w9 w8 w7 w6 w5 w4 w3 w30 "
         "w31 w32 w33 w34 w35 w36 w37", "w42 w43"]


def save_tokenizer(dst: pathlib.Path, append_eos: bool, padding_side: str) -> None:
    tok = word_tokenizer(SHAPE["vocab_size"])
    if append_eos:  # as Qwen3-Embedding's tokenizer: every text ends with the end-of-text token
        tok.backend_tokenizer.post_processor = processors.TemplateProcessing(
            single="$A </s>", pair="$A </s> $B </s>", special_tokens=[("</s>", 2)])
    tok.pad_token = "<unk>"
    tok.save_pretrained(dst)
    config = json.loads((dst / "tokenizer_config.json").read_text())
    (dst / "tokenizer_config.json").write_text(json.dumps(
        {**config, "padding_side": padding_side}, indent=2))


def qwen3_embedding(dst: pathlib.Path) -> SentenceTransformer:
    config = transformers.Qwen3Config(**SHAPE, tie_word_embeddings=True, rope_theta=1e6)
    transformers.Qwen3ForCausalLM(config).model.float().save_pretrained(dst)
    cfg = json.loads((dst / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**cfg, "architectures": ["Qwen3ForCausalLM"]},
                                                indent=2))
    save_tokenizer(dst, append_eos=True, padding_side="left")
    st = "sentence_transformers.models."
    modules = [{"idx": 0, "name": "0", "path": "", "type": st + "Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": st + "Pooling"},
               {"idx": 2, "name": "2", "path": "2_Normalize", "type": st + "Normalize"}]
    (dst / "modules.json").write_text(json.dumps(modules, indent=2))
    modes = ("cls_token", "mean_tokens", "max_tokens", "mean_sqrt_len_tokens",
             "weightedmean_tokens", "lasttoken")
    pooling = {"word_embedding_dimension": SHAPE["hidden_size"],
               **{f"pooling_mode_{m}": m == "lasttoken" for m in modes}, "include_prompt": True}
    (dst / "1_Pooling").mkdir()
    (dst / "1_Pooling" / "config.json").write_text(json.dumps(pooling, indent=2))
    (dst / "2_Normalize").mkdir()
    (dst / "sentence_bert_config.json").write_text(json.dumps(
        {"max_seq_length": 64, "do_lower_case": False}, indent=2))
    (dst / "config_sentence_transformers.json").write_text(json.dumps(
        {"prompts": {"query": QUERY, "document": ""}, "default_prompt_name": None,
         "similarity_fn_name": "cosine"}, indent=2))
    return SentenceTransformer(str(dst), device="cpu")


def llama_mean(dst: pathlib.Path) -> SentenceTransformer:
    with tempfile.TemporaryDirectory() as tmp:
        config = transformers.LlamaConfig(**SHAPE, tie_word_embeddings=False, rope_theta=1e4)
        transformers.LlamaForCausalLM(config).float().save_pretrained(tmp)
        save_tokenizer(pathlib.Path(tmp), append_eos=False, padding_side="right")
        modules = [Transformer(tmp), Pooling(SHAPE["hidden_size"], pooling_mode="mean")]
        SentenceTransformer(modules=modules, device="cpu").save(str(dst))
    (dst / "README.md").unlink()  # the generated model card: nothing the loaders read
    return SentenceTransformer(str(dst), device="cpu")


def main() -> None:
    for name, make in (("qwen3_embedding", qwen3_embedding), ("llama_mean", llama_mean)):
        torch.manual_seed(0)
        dst = OUT / name
        shutil.rmtree(dst, ignore_errors=True)
        dst.mkdir(parents=True)
        st = make(dst).eval()
        assert st.tokenizer.padding_side == ("left" if name == "qwen3_embedding" else "right")
        expected = {}
        # one padded batch, as sentence-transformers is used; the query prompt on the first two
        # texts where the model has one (the prompt's tokens are part of the pooled input)
        prompt = QUERY if name == "qwen3_embedding" else ""
        inputs = [prompt + t for t in TEXTS[:2]] + TEXTS[2:]
        emb = st.encode(inputs, batch_size=len(inputs), convert_to_numpy=True)
        for i, text in enumerate(inputs):
            expected[f"tokens_{i}"] = np.asarray(st.tokenizer(text)["input_ids"], np.int32)
            expected[f"embedding_{i}"] = emb[i].astype(np.float32)
        save_file(expected, str(dst / "expected.safetensors"))
        (dst / "texts.json").write_text(json.dumps(inputs, indent=2))
        print(name, sorted(str(p.relative_to(dst)) for p in dst.rglob("*") if p.is_file()))


if __name__ == "__main__":
    main()
