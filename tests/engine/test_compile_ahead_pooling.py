"""`jaxserve compile` of an embedding model (`--runner pooling`): the pooling runner's
executables (its scratch cache's zeros, one pooling program per bucket) compiled ahead for this
host's CPU, keyed by the pooling (last token or mean, normalized or not); an engine from the
directory compiles nothing in the whole process and gives the embeddings of an engine that
compiled; one of another pooling is named in one log line and compiles as without it."""

from __future__ import annotations

import logging
import pathlib

import numpy as np
import pytest

from jaxserve import LLM
from jaxserve.runner import prebuilt
from jaxserve.server.cli import main as cli
from tests.engine.all_compiles import all_compiles
from tests.engine.test_embeddings import sentence_transformers_files
from tests.model_dirs import write_model_dir

OPTIONS = dict(runner="pooling", dtype="float32", max_model_len=32, max_num_seqs=4, token_buckets=(16, 32),
               request_buckets=(4,), show_progress=False, enable_compilation_cache=False)
FLAGS = ["--runner", "pooling", "--dtype", "float32", "--max-model-len", "32", "--max-num-seqs", "4",
         "--token-buckets", "16", "32", "--request-buckets", "4"]
PROMPTS = [[5, 6, 7], [8, 9, 10, 11, 12], list(range(3, 30))]  # the 27-token one takes the 32x4 bucket
PREBUILT_LOG = "jaxserve.runner.prebuilt"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> pathlib.Path:
    return write_model_dir(tmp_path_factory.mktemp("qwen3"), "qwen3")


@pytest.fixture(scope="module")
def pooling_dir(model_dir, tmp_path_factory) -> pathlib.Path:
    out = tmp_path_factory.mktemp("exe") / "pooling"
    assert cli(["compile", str(model_dir), "--topology", "cpu", "--out", str(out), "--log-level", "warning",
                *FLAGS]) == 0
    return out


def _embeddings(llm: LLM) -> np.ndarray:
    return np.stack([np.asarray(o.outputs.embedding) for o in llm.embed(PROMPTS)])


def test_an_embedding_model_is_served_from_the_directory_compiling_nothing(model_dir, pooling_dir, caplog):
    manifest = prebuilt.read_manifest(pooling_dir)
    assert manifest["runner"] == "pooling" and manifest["buckets"] == [[16, 4], [32, 4]]
    assert manifest["entries"] == ["kv-zeros", "pool-16-4", "pool-32-4"]
    assert manifest["material"]["runner"] == "pooling (last, normalize True)"
    with caplog.at_level(logging.WARNING), all_compiles() as compiled_names:
        loaded = LLM(str(model_dir), executables=str(pooling_dir), **OPTIONS)
        embeddings = _embeddings(loaded)
    assert compiled_names == []  # nothing compiled in the process, at start or embedding
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []
    runner = loaded.engine.core.runner
    assert (runner.executables_loaded, runner.executables_compiled) == (3, 0)

    compiled = LLM(str(model_dir), **OPTIONS)
    assert compiled.engine.core.runner.executables_compiled == 3
    np.testing.assert_array_equal(embeddings, _embeddings(compiled))


def test_another_pooling_is_named_and_compiled(model_dir, pooling_dir, tmp_path, caplog):
    """The same weights pooled by the mean (sentence-transformers' files): other programs; the
    directory of last-token pooling is named and not used."""
    mean_dir = write_model_dir(tmp_path / "mean", "qwen3")
    sentence_transformers_files(mean_dir, "mean_tokens", normalize=False)
    with caplog.at_level(logging.WARNING, logger=PREBUILT_LOG):
        llm = LLM(str(mean_dir), executables=str(pooling_dir), **OPTIONS)
    (line,) = [r.getMessage() for r in caplog.records if r.name == PREBUILT_LOG]
    assert ("runner: pooling (last, normalize True) in the directory, pooling (mean, normalize False) here"
            in line), line
    runner = llm.engine.core.runner
    assert (runner.executables_loaded, runner.executables_compiled) == (0, 3)
    norms = np.linalg.norm(_embeddings(llm), axis=-1)
    assert not np.allclose(norms, 1.0)  # mean pooling, not normalized: the engine's own programs
