"""Damaged caches are never served: each kind of damage to each persistent cache (the GGUF
conversion, the laid-out weights, the compiled executables, the native CPU kernel library, the
measured dtype choice) is found, logged naming the file, and rebuilt from the source, and the
engine answers exactly as an undamaged one does."""

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
    laid_out = llm.engine.parts.plan.matmul_impl != "xla"  # weights are cached for a native product
    expected = _outputs(llm)
    _build(write_fixture_gguf(data_dir, "qwen2", root / "q-other.gguf"), root / "other")
    for kind in KINDS:
        assert bool(_cached(root / "caches", kind)) == (kind != "weights" or laid_out), kind
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
    if not _cached(caches, kind):
        pytest.skip("no native product kernel here: no weights are laid out, none cached")
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
        assert bool(_cached(mine, kind_)) == bool(_cached(caches, kind_)), kind_


def test_the_conversion_records_a_checksum_of_every_file(pristine):
    import json

    _, caches, _, _ = pristine
    (conversion,) = _cached(caches, "conversion")
    marker = json.loads((conversion / "jaxserve_conversion.json").read_text())
    assert {"config.json", "model.safetensors"} <= marker["files"].keys()
    assert all(len(v["xxh3_128"]) == 32 and v["size"] == os.path.getsize(conversion / k)
               for k, v in marker["files"].items())


# ---------------------------------------------------------------------------- the CPU kernels' caches
LIBRARY_DAMAGES = ["truncated", "bytes_flipped", "zero_length", "no_checksum", "another_targets"]


@pytest.fixture
def kernel_cache(tmp_path, monkeypatch):
    """The kernel library's cache in a folder of the test's, with a stand-in compiler that
    writes a library of known bytes (a real build takes a minute); returns (cache folder, the
    compiler's calls)."""
    from jaxserve.backends.cpu import kernels

    calls = []

    def compile_(cmd, **_):
        out = pathlib.Path(cmd[cmd.index("-o") + 1])
        out.write_bytes(b"\x7fELF" + bytes(range(256)) * 64 + " ".join(cmd[: cmd.index("-o")]).encode())
        calls.append(out)
        import subprocess

        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(kernels, "_cache_dir", lambda: tmp_path)
    monkeypatch.setattr(kernels.shutil, "which", lambda cxx: "/usr/bin/" + cxx)
    monkeypatch.setattr(kernels.subprocess, "run", compile_)
    return tmp_path, calls


@pytest.mark.parametrize("how", LIBRARY_DAMAGES)
def test_a_damaged_kernel_library_is_rebuilt_not_loaded(kernel_cache, caplog, how):
    from jaxserve.backends.cpu import kernels

    folder, calls = kernel_cache
    lib = kernels.library_path("x86-64")
    assert len(calls) == 1 and (folder / (lib.name + ".xxh3")).exists()
    whole = lib.read_bytes()
    assert kernels.library_path("x86-64") == lib and len(calls) == 1  # cached: not built again
    if how == "truncated":
        lib.write_bytes(whole[: len(whole) // 2])
    elif how == "bytes_flipped":
        lib.write_bytes(whole[:100] + bytes(b ^ 0xFF for b in whole[100:110]) + whole[110:])
    elif how == "zero_length":
        lib.write_bytes(b"")
    elif how == "no_checksum":  # a library cached before checksums, or its checksum lost
        (folder / (lib.name + ".xxh3")).unlink()
    else:  # another build target's library renamed into place
        lib.write_bytes(kernels.library_path("haswell").read_bytes())
        calls.pop()
    with caplog.at_level(logging.WARNING):
        assert kernels.library_path("x86-64") == lib
    assert len(calls) == 2, "the damaged library was not rebuilt"
    assert lib.read_bytes() == whole
    assert any(lib.name in r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING)
    caplog.clear()
    assert kernels.library_path("x86-64") == lib and len(calls) == 2  # whole again: loaded as is
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


@pytest.mark.parametrize("how", ["truncated", "dtype_rewritten", "not_json", "no_checksum"])
def test_a_damaged_dtype_choice_is_measured_again(tmp_path, monkeypatch, caplog, how):
    import json

    from jaxserve.backends.cpu import dtype

    measured = []

    def measure(impls):
        measured.append(impls)
        return {"bfloat16": 1.0, "float32": 2.0}

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(dtype, "measure", measure)
    impls = {"bfloat16": "strips", "float32": "strips"}
    assert dtype.fastest_dtype(impls, "cpu-key") == "bfloat16" and len(measured) == 1
    assert dtype.fastest_dtype(impls, "cpu-key") == "bfloat16" and len(measured) == 1  # cached
    (path,) = (tmp_path / "jaxserve" / "dtype").glob("*.json")
    text = path.read_text()
    if how == "truncated":
        path.write_text(text[: len(text) // 2])
    elif how == "dtype_rewritten":
        path.write_text(text.replace('"bfloat16"', '"float16"', 1))
    elif how == "not_json":
        path.write_bytes(b"\x00\x01")
    else:
        data = json.loads(text)
        del data["checksum"]
        path.write_text(json.dumps(data))
    with caplog.at_level(logging.WARNING):
        assert dtype.fastest_dtype(impls, "cpu-key") == "bfloat16"
    assert len(measured) == 2
    assert any(path.name in r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING)
