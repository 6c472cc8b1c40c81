"""Regenerate the LoRA parity fixtures in tests/data/lora/ (needs torch, transformers, peft).

For the tiny random llama, qwen3 and gemma3 models of tests/data/arch/ this makes three random
PEFT LoRA adapters each (different ranks, targets, alpha; one rsLoRA), saves them as PEFT
adapter directories, and records, with the adapter merged into the model (float32), the logits
of a fixed token sequence and the greedy continuation of it (expected.safetensors in each
adapter's directory). The test suite compares jaxserve's prompt log-probs and greedy tokens with
these files and needs no torch.

    pip install torch==2.13.0 'transformers>=5.20,<6' peft safetensors
    python scripts/make_lora_fixtures.py
"""

from __future__ import annotations

import math
import pathlib
import zlib

import numpy as np
import torch
from peft import LoraConfig, get_peft_model
from safetensors.numpy import save_file
from transformers import AutoModelForCausalLM

ROOT = pathlib.Path(__file__).resolve().parent.parent / "tests" / "data"
ARCHS = ("llama", "qwen3", "gemma3")
ADAPTERS = {
    "a": dict(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]),
    "b": dict(
        r=8,
        lora_alpha=16,
        use_rslora=True,
        target_modules=["q_proj", "v_proj", "gate_proj", "up_proj", "down_proj"],
    ),
    "c": dict(
        r=2,
        lora_alpha=32,
        target_modules=[
            "q_proj",
            "k_proj",
            "v_proj",
            "o_proj",
            "gate_proj",
            "up_proj",
            "down_proj",
        ],
    ),
}
SEQUENCE = [1, 17, 45, 3, 99, 100, 7, 7, 64, 12, 120, 5]
GREEDY_TOKENS = 8


def main() -> None:
    for arch in ARCHS:
        for name, conf in ADAPTERS.items():
            base = AutoModelForCausalLM.from_pretrained(
                ROOT / "arch" / arch, dtype=torch.float32
            ).eval()
            base.config._attn_implementation = "eager"
            model = get_peft_model(base, LoraConfig(lora_dropout=0.0, **conf))
            gen = torch.Generator().manual_seed(zlib.crc32(f"{arch}/{name}".encode()))
            # lora_B starts at zero: both random, sized so that the update B A * scale is about
            # half the size of the base weights (0.08): it changes the outputs, as a fine-tune's
            r = conf["r"]
            scale = conf["lora_alpha"] / (math.sqrt(r) if conf.get("use_rslora") else r)
            std = math.sqrt(0.04 / (math.sqrt(r) * scale))
            with torch.no_grad():
                for pname, p in model.named_parameters():
                    if "lora_" in pname:
                        p.copy_(std * torch.randn(p.shape, generator=gen))
            out = ROOT / "lora" / arch / name
            model.save_pretrained(out)
            merged = model.merge_and_unload().eval()
            with torch.no_grad():
                logits = merged(input_ids=torch.tensor([SEQUENCE])).logits[0].float().numpy()
                greedy = merged.generate(
                    torch.tensor([SEQUENCE]),
                    max_new_tokens=GREEDY_TOKENS,
                    do_sample=False,
                    min_new_tokens=GREEDY_TOKENS,
                )[0, len(SEQUENCE) :]
            save_file(
                {
                    "logits": np.ascontiguousarray(logits),
                    "tokens": np.asarray(SEQUENCE, np.int32),
                    "greedy": greedy.numpy().astype(np.int32),
                },
                str(out / "expected.safetensors"),
            )
            (out / "README.md").unlink(missing_ok=True)
            print(arch, name, logits.shape, greedy.tolist())


if __name__ == "__main__":
    main()
