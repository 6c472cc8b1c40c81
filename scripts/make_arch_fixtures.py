"""Regenerate the architecture-parity fixtures in tests/data/arch/ (needs torch + transformers).

For each registered architecture this builds a tiny random Hugging Face model, saves it as an HF
directory (config.json + model.safetensors) and records transformers' own float32 logits for
a few fixed token sequences (expected.safetensors). The test suite compares jaxserve's logits
with these files and needs no torch.

    pip install torch==2.13.0 'transformers>=5.20,<6' safetensors
    python scripts/make_arch_fixtures.py
"""

from __future__ import annotations

import json
import zlib
import pathlib

import numpy as np
import torch
from safetensors.numpy import save_file
from transformers import AutoConfig, AutoModelForCausalLM

OUT = pathlib.Path(__file__).resolve().parent.parent / "tests" / "data" / "arch"

BASE = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
    bos_token_id=1,
    eos_token_id=2,
)

CASES: dict[str, dict] = {
    "llama": dict(model_type="llama", architectures=["LlamaForCausalLM"], tie_word_embeddings=False,
                  rope_theta=500000.0,
                  rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                                    high_freq_factor=4.0, original_max_position_embeddings=16)),
    "llama_tied": dict(model_type="llama", architectures=["LlamaForCausalLM"], tie_word_embeddings=True,
                       rope_theta=100000.0, num_key_value_heads=1),
    "qwen2": dict(model_type="qwen2", architectures=["Qwen2ForCausalLM"], tie_word_embeddings=False,
                  rope_theta=1000000.0),
    "qwen3": dict(model_type="qwen3", architectures=["Qwen3ForCausalLM"], tie_word_embeddings=True,
                  head_dim=32, rope_theta=1000000.0),
    "mistral": dict(model_type="mistral", architectures=["MistralForCausalLM"], tie_word_embeddings=False,
                    sliding_window=5, rope_theta=10000.0, head_dim=16),
}

# Two token sequences of different lengths (the test feeds them as one ragged batch).
SEQUENCES = [[1, 17, 45, 3, 99, 100, 7, 7, 64, 12, 120, 5, 33], [1, 8, 9, 127, 44, 2, 60]]


def main() -> None:
    torch.manual_seed(0)
    for name, extra in CASES.items():
        cfg_dict = {**BASE, **extra}
        model_type = cfg_dict.pop("model_type")
        config = AutoConfig.for_model(model_type, **cfg_dict)
        config._attn_implementation = "eager"
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
        gen = torch.Generator().manual_seed(zlib.crc32(name.encode()))
        with torch.no_grad():
            for pname, p in model.named_parameters():
                if "norm" in pname:
                    p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
                else:
                    p.copy_(0.08 * torch.randn(p.shape, generator=gen))
        out_dir = OUT / name
        out_dir.mkdir(parents=True, exist_ok=True)
        model.save_pretrained(out_dir, safe_serialization=True)
        expected = {}
        with torch.no_grad():
            for i, seq in enumerate(SEQUENCES):
                ids = torch.tensor([seq])
                logits = model(input_ids=ids).logits[0].float().numpy()
                expected[f"logits_{i}"] = np.ascontiguousarray(logits)
                expected[f"tokens_{i}"] = np.asarray(seq, dtype=np.int32)
        save_file(expected, str(out_dir / "expected.safetensors"))
        cfg = json.loads((out_dir / "config.json").read_text())
        print(name, cfg["architectures"], {k: v.shape for k, v in expected.items()})


if __name__ == "__main__":
    main()
