"""Damaged caches are never served: each kind of damage to each persistent cache (the GGUF
conversion, the laid-out weights, the compiled executables) is found, logged naming the file,
and rebuilt from the source, and the engine answers exactly as an undamaged one does."""

from __future__ import annotations

import logging
import os
import pathlib
import shutil

import numpy as np
import pytest

from jaxserve import LLM, SamplingParams
from jaxserve.runner.compile import EXECUTABLES_SUBDIR, WEIGHTS_SUBDIR
from tests.models.gguf_fixtures import write_fixture_gguf

OPTIONS = dict(dtype="float32", max_num_seqs=8, max_num_batched_tokens=16, token_buckets=(16,),
               request_buckets=(8,), num_pages=64, show_progress=False)
DAMAGES = ["truncated", "bytes_flipped", "header_rewritten", "zero_length", "another_models"]
KINDS = ["conversion", "weights", "executables"]


def _build(gguf: pathlib.Path, caches: pathlib.Path) -> LLM:
    return LLM(str(gguf), model_cache_dir=str(caches), compilation_cache_dir=str(caches / "xla"),
               **OPTIONS)


def _outputs(llm: LLM) -> list:
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=2, prompt_logprobs=1)
    outs = llm.generate([[5, 6, 7, 8, 9], [9, 10, 3]], params, use_tqdm=False)
    return [(o.outputs[0].token_ids,
             [{t: lp.logprob for t, lp in d.items()} for d in o.outputs[0].logprobs],
             [None if d is None else {t: lp.logprob for t, lp in d.items()} for d in o.prompt_logprobs])
            for o in outs]


def _cached(caches: pathlib.Path, kind: str) -> list[pathlib.Path]:
    """The files of one cache that hold the model (for the conversion: its directory)."""
    if kind == "conversion":
        return sorted((caches / "models").glob("q-*"))
    sub, pattern = (WEIGHTS_SUBDIR, "*.weights") if kind == "weights" else (EXECUTABLES_SUBDIR, "*.jexe")
    return sorted((caches / "xla" / sub).glob(pattern))


@pytest.fixture(scope="module")
def pristine(tmp_path_factory, data_dir):
    """A tiny Qwen3 GGUF, its three caches as an engine leaves them, and its outputs; and the
    caches of another model (Qwen2), for files renamed into place."""
    root = tmp_path_factory.mktemp("damaged-caches")
    gguf = write_fixture_gguf(data_dir, "qwen3", root / "q.gguf")
    llm = _build(gguf, root / "caches")
    if llm.engine.parts.plan.matmul_impl == "xla":
        pytest.skip("no native product kernel here: no weights are laid out, none cached")
    expected = _outputs(llm)
    _build(write_fixture_gguf(data_dir, "qwen2", root / "q-other.gguf"), root / "other")
    for kind in KINDS:
        assert _cached(root / "caches", kind), kind
    return gguf, root / "caches", root / "other", expected


def _damage(files: list[pathlib.Path], how: str, kind: str, other: pathlib.Path) -> list[pathlib.Path]:
    """Damage the cache's files (a conversion: its weights, or its directory); returns what was damaged."""
    if kind == "conversion":
        (directory,) = files
        if how == "another_models":
            (theirs,) = _cached(other, kind)
            shutil.rmtree(directory)
            shutil.copytree(theirs, directory)
            return [directory]
        files = [directory / "model.safetensors"]
    elif how == "another_models":
        theirs = _cached(other, kind)
        for i, f in enumerate(files):
            shutil.copyfile(theirs[i % len(theirs)], f)
        return files
    rng = np.random.default_rng(0)
    for f in files:
        data = bytearray(f.read_bytes())
        if how == "truncated":
            data = data[: len(data) // 2]
        elif how == "zero_length":
            data = bytearray()
        elif how == "bytes_flipped":  # up to 4 MiB of random bytes over the middle
            n = min(4 << 20, len(data) // 4)
            mid = len(data) // 2 - n // 2
            data[mid: mid + n] = rng.integers(0, 256, n, dtype=np.uint8).tobytes()
        elif how == "header_rewritten":  # a digit of the JSON header (a shape, an offset) changed
            start = data.index(b"{")
            at = next(i for i in range(start + 1, start + 4096) if data[i: i + 1].isdigit())
            data[at] = ord("7") if data[at] != ord("7") else ord("3")
        f.write_bytes(bytes(data))
    return files


@pytest.mark.parametrize("how", DAMAGES)
@pytest.mark.parametrize("kind", KINDS)
def test_a_damaged_cache_is_rebuilt_not_served(pristine, tmp_path, caplog, kind, how):
    gguf, caches, other, expected = pristine
    mine = tmp_path / "caches"
    shutil.copytree(caches, mine)
    damaged = _damage(_cached(mine, kind), how, kind, other)
    with caplog.at_level(logging.WARNING):
        llm = _build(gguf, mine)
    assert _outputs(llm) == expected
    warned = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    names = {d.name for d in damaged}
    assert any(any(n in w for n in names) for w in warned), (names, warned)
    # Rebuilt: the next engine finds every cache whole (no warning) and serves the same.
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        again = _build(gguf, mine)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text
    runner = again.engine.core.runner
    assert runner.executables_compiled == 0
    assert _outputs(again) == expected
    for kind_ in KINDS:
        assert _cached(mine, kind_), kind_


def test_the_conversion_records_a_checksum_of_every_file(pristine):
    import json

    _, caches, _, _ = pristine
    (conversion,) = _cached(caches, "conversion")
    marker = json.loads((conversion / "jaxserve_conversion.json").read_text())
    assert {"config.json", "model.safetensors"} <= marker["files"].keys()
    assert all(len(v["xxh3_128"]) == 32 and v["size"] == os.path.getsize(conversion / k)
               for k, v in marker["files"].items())
