"""The weight cache (jaxserve/runner/weight_cache.py): a second engine of the same checkpoint
reads the weights as the CPU backend packed them instead of reading, converting and packing
the checkpoint, bit for bit the same; a changed checkpoint or setting misses; a broken entry is
ignored."""

from __future__ import annotations

import logging
import os
import pathlib

import numpy as np
import pytest

from jaxserve import LLM, SamplingParams
from jaxserve.runner.compile import WEIGHTS_SUBDIR
from tests.model_dirs import write_model_dir

OPTIONS = dict(dtype="float32", max_num_seqs=8, max_num_batched_tokens=16, token_buckets=(16,),
               request_buckets=(8,), show_progress=False)
FROM_CACHE = "laid out, from the weight cache"


@pytest.fixture
def model_dir(tmp_path) -> pathlib.Path:
    return write_model_dir(tmp_path / "m")


def _build(model_dir, cache_dir, caplog, **overrides) -> tuple[LLM, bool]:
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="jaxserve.engine.setup"):
        llm = LLM(str(model_dir), **{**OPTIONS, "compilation_cache_dir": str(cache_dir), **overrides})
    if llm.engine.parts.plan.matmul_impl == "xla":
        pytest.skip("no native product kernel here: nothing is packed, nothing cached")
    return llm, FROM_CACHE in caplog.text


def _weights(llm: LLM) -> list[np.ndarray]:
    return [np.asarray(x) for x in llm.engine.core.runner.params]


def _tokens(llm: LLM):
    outs = llm.generate([[5, 6, 7, 8], [9, 10]], SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True),
                        use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def test_a_second_engine_reads_the_packed_weights(model_dir, tmp_path, caplog):
    first, hit = _build(model_dir, tmp_path / "c", caplog)
    assert not hit and len(list((tmp_path / "c" / WEIGHTS_SUBDIR).glob("*.weights"))) == 1
    second, hit = _build(model_dir, tmp_path / "c", caplog)
    assert hit
    a, b = _weights(first), _weights(second)
    assert [(x.shape, x.dtype) for x in a] == [(x.shape, x.dtype) for x in b]
    assert all(np.array_equal(x.view(np.uint8), y.view(np.uint8)) for x, y in zip(a, b))
    assert _tokens(second) == _tokens(first)
    runner = second.engine.core.runner
    assert runner.executables_compiled == 0  # the same shardings: the same executables
    assert runner.program.function.layer_impl is not None  # still the fused layer over packed weights


def test_a_changed_checkpoint_or_dtype_misses(model_dir, tmp_path, caplog):
    _build(model_dir, tmp_path / "c", caplog)
    weights = model_dir / "model.safetensors"
    st = weights.stat()
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))  # rewritten, say
    assert not _build(model_dir, tmp_path / "c", caplog)[1]
    assert _build(model_dir, tmp_path / "c", caplog)[1]
    config = model_dir / "config.json"
    text = config.read_text()
    assert '"rms_norm_eps": 1e-05' in text
    config.write_text(text.replace('"rms_norm_eps": 1e-05', '"rms_norm_eps": 1e-06'))
    assert not _build(model_dir, tmp_path / "c", caplog)[1]
    llm, hit = _build(model_dir, tmp_path / "c", caplog, dtype="bfloat16")
    assert not hit or llm.engine.parts.plan.matmul_impl == "xla"


def test_a_broken_entry_is_ignored(model_dir, tmp_path, caplog):
    expected = _weights(_build(model_dir, tmp_path / "c", caplog)[0])
    entry = next((tmp_path / "c" / WEIGHTS_SUBDIR).glob("*.weights"))
    entry.write_bytes(entry.read_bytes()[: entry.stat().st_size // 2])
    llm, hit = _build(model_dir, tmp_path / "c", caplog)
    assert not hit and "are damaged" in caplog.text and entry.name in caplog.text
    assert all(np.array_equal(x.view(np.uint8), y.view(np.uint8)) for x, y in zip(expected, _weights(llm)))


def test_no_compilation_cache_keeps_no_weights(model_dir, tmp_path, caplog):
    _build(model_dir, tmp_path / "c", caplog, enable_compilation_cache=False)
    assert not (tmp_path / "c").exists()
