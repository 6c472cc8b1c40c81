"""`jaxserve compile` for chips this host does not have (jaxserve/tools/compile_ahead.py): a TPU
slice through libtpu's compile-only topology, an H100 host through JAX's CUDA plugin and XLA's
description of the chip, from a model's config.json alone (a small Llama with head dim 128,
whose TPU attention kernel reads the chip's generation while it lowers). Every executable a
runner holds is compiled and serialized with a manifest naming the platform's plugin; loading
them needs the chip (docs/DESIGN.md, "Executables compiled ahead"). Skipped where the
compile-only plugin is not installed."""

from __future__ import annotations

import importlib.util
import json
import pathlib

import pytest

from jaxserve.runner import prebuilt
from jaxserve.server.cli import main as cli

TINY_LLAMA = dict(architectures=["LlamaForCausalLM"], vocab_size=512, hidden_size=256, intermediate_size=512,
                  num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=4, head_dim=128,
                  max_position_embeddings=2048, tie_word_embeddings=False, rms_norm_eps=1e-5, rope_theta=10000.0)


@pytest.fixture(scope="module")
def model_config(tmp_path_factory) -> pathlib.Path:
    path = tmp_path_factory.mktemp("tiny") / "config.json"
    path.write_text(json.dumps(TINY_LLAMA))
    return path


def _has(*modules: str) -> bool:
    return all(importlib.util.find_spec(m) is not None for m in modules)


@pytest.mark.parametrize(("topology", "platform", "kind", "plugin"), [
    pytest.param("v6e:1x1", "tpu", "TPU v6 lite", "libtpu=", marks=pytest.mark.skipif(
        not _has("libtpu"), reason="libtpu is not installed")),
    pytest.param("h100:1x1", "gpu", "NVIDIA H100 80GB HBM3", "jax-cuda12-plugin=", marks=pytest.mark.skipif(
        not _has("jax_cuda12_plugin", "nvidia.cuda_nvcc"), reason="JAX's CUDA plugin is not installed")),
])
def test_compiled_for_a_chip_this_host_does_not_have(model_config, tmp_path, topology, platform, kind, plugin,
                                                     capsys):
    out = tmp_path / "exe"
    args = ["compile", str(model_config), "--topology", topology, "--out", str(out), "--log-level", "warning",
            "--max-num-seqs", "8", "--token-buckets", "16", "--request-buckets", "8", "--max-model-len", "64",
            # Without multi-step decode's block (TPU/GPU's default K = 4): it doubles the compile
            # time; it compiles for both targets (docs/DESIGN.md §4, multi-step decode).
            "--num-decode-steps", "1"]
    assert cli(args) == 2  # the KV cache's size is what the real devices have free: it must be given
    assert "--kv-cache-memory" in capsys.readouterr().out
    assert cli([*args, "--kv-cache-memory", "64MiB"]) == 0
    manifest = json.loads((out / prebuilt.MANIFEST).read_text())
    assert manifest["topology"] == topology and manifest["devices"] == [kind]
    assert manifest["material"]["platform"] == manifest["platform"] == platform
    assert plugin in manifest["material"]["versions"]
    assert manifest["buckets"] == [[16, 8]] and manifest["recipe"]["num_pages"] > 0
    assert len(list(out.glob("*.jexe"))) == len(manifest["entries"]) == 4, manifest["entries"]  # one step, three helpers
