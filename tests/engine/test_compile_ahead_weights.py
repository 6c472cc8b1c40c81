"""`jaxserve compile --weights` (jaxserve/tools/compile_ahead.py, runner/prebuilt.py): the
weights prepared as the target's start prepares them (here: quantized to int8 at load), written
beside the executables, are what
an engine served from the directory loads: nothing read from the checkpoint, converted or laid
out (the loader's `create_model` never runs), the tokens of an engine that prepared them. A
checkpoint changed since, or another quantization, dtype, plan, rules or model, is named in one
log line, and the engine prepares its weights as without the directory (its executables still
load)."""

from __future__ import annotations

import json
import logging
import pathlib
import shutil

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from jaxserve import LLM, SamplingParams
from jaxserve.engine import model_weights
from jaxserve.runner import prebuilt
from jaxserve.server.cli import main as cli
from tests.model_dirs import write_model_dir

# Quantized at load (int8), where preparing ahead pays most; one token bucket, no decode blocks:
# the fewest executables to compile.
OPTIONS = dict(dtype="float32", quantization="int8", max_num_seqs=8, max_num_batched_tokens=16, token_buckets=(16,),
               request_buckets=(8,), show_progress=False, enable_compilation_cache=False, num_decode_steps=1)
FLAGS = ["--dtype", "float32", "--quantization", "int8", "--max-num-seqs", "8", "--max-num-batched-tokens", "16",
         "--token-buckets", "16", "--request-buckets", "8", "--num-decode-steps", "1"]
PROMPTS = [[5, 6, 7, 8, 9], [10, 11, 12]]
PREBUILT_LOG = "jaxserve.runner.prebuilt"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> pathlib.Path:
    return write_model_dir(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def weights_dir(model_dir, tmp_path_factory) -> pathlib.Path:
    """`jaxserve compile MODEL --topology cpu --quantization int8 --weights`."""
    out = tmp_path_factory.mktemp("exe") / "cpu"
    assert cli(["compile", str(model_dir), "--topology", "cpu", "--out", str(out), "--log-level", "warning",
                "--weights", *FLAGS]) == 0
    return out


@pytest.fixture(scope="module")
def without_weights(weights_dir, tmp_path_factory) -> pathlib.Path:
    """The same directory with its manifest's weights removed (as compiled without --weights)."""
    out = tmp_path_factory.mktemp("exe") / "plain"
    shutil.copytree(weights_dir, out)
    manifest = json.loads((out / prebuilt.MANIFEST).read_text())
    del manifest["weights"]
    (out / prebuilt.MANIFEST).write_text(json.dumps(manifest))
    shutil.rmtree(out / prebuilt.WEIGHTS_SUBDIR)
    return out


@pytest.fixture
def prepared(monkeypatch) -> list[str]:
    """Each architecture the loader built a model of from a checkpoint, in order."""
    calls: list[str] = []
    real = model_weights.create_model

    def counted(cfg, **kw):
        calls.append(cfg.architecture)
        return real(cfg, **kw)

    monkeypatch.setattr(model_weights, "create_model", counted)
    return calls


def _outputs(llm: LLM):
    params = [SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True, logprobs=2),
              SamplingParams(max_tokens=5, temperature=0.9, top_p=0.8, seed=7, ignore_eos=True)]
    return [(o.outputs[0].token_ids, [sorted(d) for d in o.outputs[0].logprobs or []])
            for o in llm.generate(PROMPTS, params, use_tqdm=False)]


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == PREBUILT_LOG and r.levelno >= logging.WARNING]


def test_weights_are_loaded_from_the_directory_not_prepared(model_dir, weights_dir, without_weights, prepared,
                                                            caplog):
    manifest = prebuilt.read_manifest(weights_dir)
    entries = list((weights_dir / prebuilt.WEIGHTS_SUBDIR).iterdir())
    assert len(entries) == 1 and manifest["weights"]["bytes"] > 0
    assert manifest["weights"]["material"]["weights.quantization"] == "int8"
    files = sorted((p.name, p.stat().st_mtime_ns) for p in weights_dir.rglob("*"))

    reference = LLM(str(model_dir), executables=str(without_weights), **OPTIONS)
    assert prepared == ["LlamaForCausalLM"]  # without weights in the directory: prepared as today
    expected = _outputs(reference)
    del reference

    prepared.clear()
    with caplog.at_level(logging.INFO, logger=PREBUILT_LOG):
        llm = LLM(str(model_dir), executables=str(weights_dir), **OPTIONS)
    assert prepared == []  # nothing read from the checkpoint, converted or laid out
    assert any("weights prepared ahead" in r.getMessage() for r in caplog.records), caplog.text
    assert _warnings(caplog) == []
    runner = llm.engine.core.runner
    assert runner.executables_compiled == 0
    assert _outputs(llm) == expected
    assert sorted((p.name, p.stat().st_mtime_ns) for p in weights_dir.rglob("*")) == files  # never written


def test_a_changed_checkpoint_is_named_and_its_weights_prepared(model_dir, weights_dir, prepared, caplog,
                                                                 tmp_path):
    changed = tmp_path / "changed"
    shutil.copytree(model_dir, changed)
    tensors = load_file(str(changed / "model.safetensors"))
    name = "model.layers.0.mlp.down_proj.weight"
    tensors[name] = (np.asarray(tensors[name]) * 2).astype(tensors[name].dtype)  # same size, other bytes
    save_file(tensors, str(changed / "model.safetensors"))

    with caplog.at_level(logging.WARNING, logger=PREBUILT_LOG):
        llm = LLM(str(changed), executables=str(weights_dir), **OPTIONS)
    (line,) = _warnings(caplog)  # the executables still match: only the weights are named
    assert "weights in" in line and "weights.checkpoint differs" in line, line
    assert "preparing them from the checkpoint" in line, line
    assert prepared == ["LlamaForCausalLM"]
    assert llm.engine.core.runner.executables_compiled == 0


def test_another_quantization_dtype_or_model_is_named(weights_dir, caplog):
    stored = prebuilt.read_manifest(weights_dir)["weights"]["material"]
    here = {**stored, "weights.quantization": "fp8", "weights.dtype": "bfloat16"}
    with caplog.at_level(logging.WARNING, logger=PREBUILT_LOG):
        assert prebuilt.prebuilt_weights(weights_dir, here, abstract_model=None) is None
    (line,) = _warnings(caplog)
    assert "weights.quantization: int8 in the directory, fp8 here" in line, line
    assert "weights.dtype: float32 in the directory, bfloat16 here" in line, line
    assert prebuilt.differences(stored, {**stored, "weights.arch": "sha256:0"}) == ["weights.arch differs"]
