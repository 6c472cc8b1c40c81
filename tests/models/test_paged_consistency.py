"""One full prefill, random-size chunked prefill and token-by-token decode give the same logits,
with shuffled non-contiguous block tables, several sequences in one batch, page sizes 8 and 16."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.models.arch_config import ArchConfig
from jaxserve.models.weights import create_model
from tests.models.model_utils import PagedRunner

TINY = dict(
    architectures=["LlamaForCausalLM"], vocab_size=96, hidden_size=64, intermediate_size=128,
    num_hidden_layers=3, num_attention_heads=6, num_key_value_heads=2, rope_theta=10000.0,
    tie_word_embeddings=True,
)


# Sliding-window layers (window 5, their own RoPE base) between global ones (scaled RoPE):
# Gemma 3's layout, in 4 layers.
TINY_MIXED = dict(
    architectures=["Gemma3ForCausalLM"], vocab_size=96, hidden_size=64, intermediate_size=128,
    num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=5,
    layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
    rope_parameters={"full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6},
                     "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}},
    query_pre_attn_scalar=16, hidden_activation="gelu_pytorch_tanh",
)


def run_modes(model, seqs, page_size, seed):
    rng = np.random.default_rng(seed)
    max_pages = 8
    # 1) every sequence prefilled in one step
    full = PagedRunner(model, page_size=page_size, num_pages=64, seed=seed)
    full_out = full.step([(i, s, 0) for i, s in enumerate(seqs)], num_tokens=128, num_reqs=4, pages_per_req=max_pages)
    # 2) random chunk sizes, the sequences' chunks mixed in the same steps
    chunked = PagedRunner(model, page_size=page_size, num_pages=64, seed=seed + 1)
    pos = [0] * len(seqs)
    chunk_out = [[] for _ in seqs]
    while any(p < len(s) for p, s in zip(pos, seqs)):
        chunks = []
        for i, s in enumerate(seqs):
            if pos[i] < len(s):
                n = int(rng.integers(1, 12))
                chunks.append((i, s[pos[i] : pos[i] + n], pos[i]))
                pos[i] += len(chunks[-1][1])
        for (i, _, _), out in zip(chunks, chunked.step(chunks, num_tokens=64, num_reqs=4, pages_per_req=max_pages)):
            chunk_out[i].append(out)
    # 3) one token per sequence per step (decode)
    dec = PagedRunner(model, page_size=page_size, num_pages=64, seed=seed + 2)
    dec_out = [[] for _ in seqs]
    for t in range(max(len(s) for s in seqs)):
        chunks = [(i, [s[t]], t) for i, s in enumerate(seqs) if t < len(s)]
        for (i, _, _), out in zip(chunks, dec.step(chunks, num_tokens=16, num_reqs=4, pages_per_req=max_pages)):
            dec_out[i].append(out)
    return full_out, [np.concatenate(c) for c in chunk_out], [np.concatenate(d) for d in dec_out]


# Each config at one page size (both sizes covered): the windowed layers at the smaller pages,
# where their windows cross more page boundaries.
@pytest.mark.parametrize("config, page_size", [(TINY, 16), (TINY_MIXED, 8)],
                         ids=["llama-16", "sliding_global_mix-8"])
def test_tiny_model_paged_consistency(page_size, config):
    cfg = ArchConfig.from_hf(config)
    model = create_model(cfg, dtype=jnp.float32, seed=3)
    rng = np.random.default_rng(page_size)
    seqs = [rng.integers(0, cfg.vocab_size, size=n).tolist() for n in (37, 16, 9)]
    full, chunked, dec = run_modes(model, seqs, page_size, seed=page_size)
    for f, c, d in zip(full, chunked, dec):
        assert np.abs(f).max() > 0.1  # real, non-trivial logits
        np.testing.assert_allclose(c, f, atol=1e-4, rtol=0)
        np.testing.assert_allclose(d, f, atol=1e-4, rtol=0)
