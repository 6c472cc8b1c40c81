"""The executable cache (jaxserve/runner/executable_cache.py): a second engine of the same
configuration loads its steps instead of tracing them and serves the same tokens; any change
of what the steps depend on misses; broken entries are compiled again."""

from __future__ import annotations

import dataclasses
import os
import pathlib
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve import LLM, SamplingParams
from jaxserve.runner import executable_cache as ec
from jaxserve.runner.compile import EXECUTABLES_SUBDIR
from tests.model_dirs import write_model_dir

# Besides the steps: the KV cache's zeros, the sampling state's initial value, the sampler's row writer.
HELPERS = 3
PROMPTS = [[5, 6, 7, 8, 9], [10, 11, 12], [13, 14, 15, 16, 17, 18, 19]]
OPTIONS = dict(dtype="float32", max_num_seqs=8, max_num_batched_tokens=16, token_buckets=(8, 16),
               request_buckets=(8,), show_progress=False, enable_executable_cache=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> pathlib.Path:
    return write_model_dir(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def filled_cache(model_dir, tmp_path_factory) -> pathlib.Path:
    """A cache folder that an engine of OPTIONS filled (compiled once for the module's tests)."""
    path = tmp_path_factory.mktemp("filled")
    _llm(model_dir, path)
    return path


@pytest.fixture
def cache_dir(filled_cache, tmp_path) -> pathlib.Path:
    """This test's copy of `filled_cache`: as if an engine of OPTIONS had just run there."""
    shutil.copytree(filled_cache, tmp_path, dirs_exist_ok=True)
    return tmp_path


def _llm(model_dir, cache_dir, **overrides) -> LLM:
    return LLM(str(model_dir), **{**OPTIONS, "compilation_cache_dir": str(cache_dir), **overrides})


def _outputs(llm: LLM):
    params = [SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=2),
              SamplingParams(max_tokens=6, temperature=0.9, top_p=0.8, seed=7, ignore_eos=True),
              SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, prompt_logprobs=1)]
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    return [(o.outputs[0].token_ids, [sorted(d.items()) for d in o.outputs[0].logprobs or []],
             o.prompt_logprobs) for o in outs]


def _runner(llm: LLM):
    return llm.engine.core.runner


def test_a_second_engine_loads_its_steps_and_serves_the_same_tokens(model_dir, tmp_path):
    first = _llm(model_dir, tmp_path)
    r1 = _runner(first)
    n = r1.num_buckets + HELPERS
    assert (r1.executables_loaded, r1.executables_compiled) == (0, n)
    assert len(list((tmp_path / EXECUTABLES_SUBDIR).glob("*.jexe"))) == n
    expected = _outputs(first)

    second = _llm(model_dir, tmp_path)
    r2 = _runner(second)
    assert (r2.executables_loaded, r2.executables_compiled) == (n, 0)
    assert r2.counter.num_compiles == 0  # nothing traced, nothing compiled
    assert _outputs(second) == expected
    assert r2.counter.recompiles == 0  # and nothing compiled while serving
    del first


@pytest.mark.parametrize("change", [
    {"dtype": "bfloat16"},
    {"token_buckets": (16,)},  # one bucket fewer: the others are still found
    {"max_model_len": 64},  # block tables of another width
    {"max_logprobs": 5},  # the sampler's sizes
    {"num_pages": 40},
])
def test_a_changed_setting_misses_and_a_shared_bucket_hits(model_dir, cache_dir, change):
    runner = _runner(_llm(model_dir, cache_dir, **change))
    if change == {"token_buckets": (16,)}:  # a grid's buckets are keyed one by one
        assert (runner.executables_loaded, runner.executables_compiled) == (1 + HELPERS, 0)
    else:
        assert runner.executables_loaded == 0 and runner.executables_compiled == runner.num_buckets + HELPERS


def test_another_model_and_changed_code_miss(model_dir, cache_dir, tmp_path_factory, monkeypatch):
    other = write_model_dir(tmp_path_factory.mktemp("other") / "qwen3", "qwen3")
    assert _runner(_llm(other, cache_dir)).executables_loaded == 0
    original = ec.code_fingerprint
    monkeypatch.setattr(ec, "code_fingerprint", lambda: "an edited source file")
    assert _runner(_llm(model_dir, cache_dir)).executables_loaded == 0
    monkeypatch.setattr(ec, "code_fingerprint", original)
    assert _runner(_llm(model_dir, cache_dir)).executables_loaded > 0
    monkeypatch.setenv("XLA_FLAGS", os.environ.get("XLA_FLAGS", "") + " --xla_cpu_enable_fast_math=false")
    assert _runner(_llm(model_dir, cache_dir)).executables_loaded == 0


def test_broken_entries_are_compiled_again(model_dir, cache_dir, caplog):
    expected = _outputs(_llm(model_dir, cache_dir))
    files = sorted((cache_dir / EXECUTABLES_SUBDIR).glob("*.jexe"))
    files[0].write_bytes(b"not an executable")
    # An entry under another entry's name: its stored key differs from the name's.
    files[2].write_bytes(files[1].read_bytes())
    llm = _llm(model_dir, cache_dir)
    runner = _runner(llm)
    assert (runner.executables_loaded, runner.executables_compiled) == (len(files) - 2, 2)
    assert "discarding the cached executable" in caplog.text
    assert _outputs(llm) == expected
    assert _runner(_llm(model_dir, cache_dir)).executables_loaded == len(files)  # stored again


def test_no_compilation_cache_stores_nothing(model_dir, tmp_path):
    one_bucket = dict(token_buckets=(16,))  # what is stored does not depend on the grid
    runner = _runner(_llm(model_dir, tmp_path, enable_compilation_cache=False, **one_bucket))
    assert runner.executables_loaded == 0 and not (tmp_path / EXECUTABLES_SUBDIR).exists()
    runner = _runner(_llm(model_dir, tmp_path, enable_executable_cache=False, **one_bucket))
    assert runner.executables_loaded == 0 and not (tmp_path / EXECUTABLES_SUBDIR).exists()


def _add(x, y):
    return {"sum": x + y["b"]}


def test_a_loaded_executable_must_take_the_same_arguments(tmp_path):
    cache = ec.ExecutableCache(tmp_path)
    a = jax.ShapeDtypeStruct((4,), jnp.float32)
    args = (a, {"b": a})
    compiled = jax.jit(_add).lower(*args).compile()
    cache.store("k", "add", compiled)
    assert cache.load("k", "add", args) is not None
    x = np.arange(4, dtype=np.float32)
    np.testing.assert_array_equal(cache.load("k", "add", args)(x, {"b": x})["sum"], 2 * x)
    cache.store("k", "add", compiled)
    for other in [(jax.ShapeDtypeStruct((5,), jnp.float32), {"b": a}),  # a shape
                  (a, {"b": jax.ShapeDtypeStruct((4,), jnp.int32)}),  # a dtype
                  (a, {"c": a})]:  # the tree
        assert cache.load("k", "add", other) is None
        cache.store("k", "add", compiled)
    assert cache.load("another key", "add", args) is None


def test_an_executable_from_jaxs_persistent_cache_is_not_stored(tmp_path):
    """One that JAX loaded from its own cache (if something enabled it) would serialize without
    some of its kernels on XLA:CPU; the scope stores only what was compiled in its process."""
    a = jax.ShapeDtypeStruct((4,), jnp.float32)
    scope = ec.ExecutableCache(tmp_path).scope(jax.devices()[:1], what="test")

    def from_jax_cache():
        jax.monitoring.record_event("/jax/compilation_cache/cache_hits")
        return jax.jit(_add).lower(a, {"b": a}).compile()

    scope.get("add", (a, {"b": a}), from_jax_cache)
    assert not list(tmp_path.glob("*.jexe"))
    scope.get("add", (a, {"b": a}), lambda: jax.jit(_add).lower(a, {"b": a}).compile())
    assert len(list(tmp_path.glob("*.jexe"))) == 1


def test_least_recently_used_entries_go_past_the_limit(tmp_path):
    a = jax.ShapeDtypeStruct((4,), jnp.float32)
    compiled = jax.jit(_add).lower(a, {"b": a}).compile()
    cache = ec.ExecutableCache(tmp_path)
    cache.store("k1", "add", compiled)
    size = next(tmp_path.glob("*.jexe")).stat().st_size
    cache.max_bytes = 2 * size
    os.utime(next(tmp_path.glob("*.jexe")), (1, 1))  # long unused
    cache.store("k2", "add", compiled)
    cache.store("k3", "add", compiled)
    assert cache.load("k1", "add", (a, {"b": a})) is None
    assert cache.load("k3", "add", (a, {"b": a})) is not None


@dataclasses.dataclass(frozen=True)
class _Spec:
    features: frozenset
    names: tuple


def test_canonical_descriptions_do_not_depend_on_string_hashing():
    code = ("from jaxserve.runner.executable_cache import canonical; import tests.engine.test_executable_cache as t; "
            "print(canonical(t._Spec(frozenset({'rope', 'gqa', 'silu_glu', 'rms_norm', 'qk_norm'}), ('a', 'b'))))")
    procs = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONHASHSEED": str(seed)})
             for seed in (1, 2, 3, 4)]
    outs = [p.communicate(timeout=300)[0] for p in procs]  # the four start at once
    assert [p.returncode for p in procs] == [0] * 4
    assert len(set(outs)) == 1
    assert ec.canonical(frozenset({"b", "a"})) == ec.canonical(frozenset({"a", "b"})) == "{'a','b'}"
    assert ec.canonical({"y": 1, "x": (2, 3)}) == ec.canonical({"x": (2, 3), "y": 1})
