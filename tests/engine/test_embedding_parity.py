"""Embeddings (--runner pooling) equal sentence-transformers' on tiny random checkpoints.

tests/data/embed/ holds two complete sentence-transformers checkpoints (~100 KB each) and the
embeddings sentence-transformers computed for a few texts in one padded batch; made by
scripts/make_embedding_fixtures.py (torch, transformers, sentence-transformers: none needed
here). jaxserve reads the pooling from the checkpoint's own files, tokenizes the texts itself
and embeds them in float32.

- qwen3_embedding: laid out as Qwen3-Embedding publishes it (Qwen3ForCausalLM naming a base
  model's tensors, legacy `pooling_mode_lasttoken`, Normalize, an end-of-text token appended
  by the tokenizer, left padding in the reference batch, a query instruction in front of two
  texts);
- llama_mean: as sentence-transformers 6 saves a Llama base model (`LlamaModel`, the one-key
  `pooling_mode: "mean"`, no Normalize; right padding), served with runner "auto".
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from safetensors.numpy import load_file

from jaxserve import LLM
from jaxserve.models.pooling_config import PoolingConfig
from tests.model_dirs import DATA

EMBED = DATA.parent / "embed"
OPTIONS = dict(dtype="float32", max_model_len=32, max_num_seqs=4, token_buckets=(64,),
               request_buckets=(4,), show_progress=False)
CASES = {"qwen3_embedding": ("pooling", PoolingConfig("last", True, "1_Pooling/config.json")),
         "llama_mean": ("auto", PoolingConfig("mean", False, "1_Pooling/config.json"))}


def cosine(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(a @ b / np.linalg.norm(a) / np.linalg.norm(b))


@pytest.mark.parametrize("name", sorted(CASES))
def test_embeddings_equal_sentence_transformers(name, tmp_path, compile_cache_dir):
    runner, pooling = CASES[name]
    d = shutil.copytree(EMBED / name, tmp_path / name)
    llm = LLM(str(d), runner=runner, compilation_cache_dir=compile_cache_dir, **OPTIONS)
    assert llm.engine.info.runner == "pooling"
    assert llm.engine.core.runner.pooling == pooling
    texts = json.loads((d / "texts.json").read_text())
    expected = load_file(str(d / "expected.safetensors"))
    outs = llm.embed(texts)  # the texts in one call: one batch, no padding inside it
    assert len(outs) == len(texts) == 4
    for i, out in enumerate(outs):
        assert out.prompt_token_ids == expected[f"tokens_{i}"].tolist()  # tokenized alike
        emb, ref = np.asarray(out.outputs.embedding), expected[f"embedding_{i}"]
        assert emb.shape == ref.shape == (32,)
        assert cosine(emb, ref) >= 0.9999
        np.testing.assert_allclose(emb, ref, rtol=1e-4, atol=1e-5)  # the length too
    if pooling.normalize:
        assert np.allclose(np.linalg.norm(expected["embedding_0"]), 1.0, atol=1e-6)
    else:  # the mean's own length, far from 1: normalizing would have failed the check above
        assert abs(np.linalg.norm(expected["embedding_0"]) - 1.0) > 0.1
