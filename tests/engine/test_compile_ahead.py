"""`jaxserve compile` (jaxserve/tools/compile_ahead.py) and the directories it writes
(jaxserve/runner/prebuilt.py): compiled for this host's CPU and served from there, an engine
loads every executable and compiles nothing, with the same tokens; a directory whose manifest
disagrees with the engine (a version, the recipe) is named in one log line and the engine
compiles as without it. The same with an EAGLE-3 draft head (`--speculative-config`): its step is
compiled ahead, and a directory compiled without the head is named and not used; and with a
draft model: its step and its cache's maker compiled ahead, nothing compiled at start. With an
fp8 KV cache the directory serves any scales (they are step inputs): measured at start or from
the checkpoint, loaded, nothing compiled: the measuring forward (the calibration) is compiled ahead
too, for the tokenizer's token count (another count is named and compiled). "Nothing compiled" is
counted over the whole process (tests/engine/all_compiles.py). For TPU slices and GPU hosts:
tests/tools/test_compile_targets.py."""

from __future__ import annotations

import dataclasses
import json
import logging
import pathlib
import shutil

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from jaxserve import LLM, SamplingParams
from jaxserve.runner import prebuilt
from jaxserve.runner.kv_scales import CALIBRATION_TEXT, calibration_ids, calibration_name
from jaxserve.server.cli import main as cli
from tests.engine.all_compiles import all_compiles
from tests.model_dirs import write_model_dir

# With multi-step decode's blocks of 2 steps: the directory holds the decode block too.
OPTIONS = dict(dtype="float32", max_num_seqs=8, max_num_batched_tokens=16, token_buckets=(8, 16),
               request_buckets=(8,), show_progress=False, enable_compilation_cache=False, num_decode_steps=2)
FLAGS = ["--dtype", "float32", "--max-num-seqs", "8", "--max-num-batched-tokens", "16", "--token-buckets", "8", "16",
         "--request-buckets", "8", "--num-decode-steps", "2"]
PROMPTS = [[5, 6, 7, 8, 9], [10, 11, 12], [13, 14, 15, 16, 17, 18, 19]]
PREBUILT_LOG = "jaxserve.runner.prebuilt"
HEAD = pathlib.Path(__file__).resolve().parent.parent / "data" / "arch" / "eagle3_llama"
SPEC = {"method": "eagle3", "model": str(HEAD), "num_speculative_tokens": 2}
EAGLE3_OPTIONS = {**OPTIONS, "num_decode_steps": 1}  # a head drafts after each step
# An fp8 KV cache: one token bucket, no decode blocks (fewer entries to compile).
FP8_OPTIONS = {**OPTIONS, "token_buckets": (16,), "num_decode_steps": 1, "kv_cache_dtype": "fp8"}
FP8_FLAGS = FLAGS[: FLAGS.index("--token-buckets")] + ["--token-buckets", "16", "--request-buckets", "8",
                                                      "--kv-cache-dtype", "fp8"]


SPEC_FLAGS = FLAGS[: FLAGS.index("--num-decode-steps")]  # drafting runs one decode step a call


def compile_cpu(model_dir, out: pathlib.Path, flags, *more: str) -> pathlib.Path:
    """`jaxserve compile MODEL --topology cpu --out OUT FLAGS MORE`, asserted to succeed."""
    assert cli(["compile", str(model_dir), "--topology", "cpu", "--out", str(out), "--log-level", "warning",
                *flags, *more]) == 0
    return out


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> pathlib.Path:
    return write_model_dir(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def cpu_dir(model_dir, tmp_path_factory) -> pathlib.Path:
    """`jaxserve compile MODEL --topology cpu` of OPTIONS' engine."""
    return compile_cpu(model_dir, tmp_path_factory.mktemp("exe") / "cpu", FLAGS)


@pytest.fixture(scope="module")
def eagle3_dir(model_dir, tmp_path_factory) -> pathlib.Path:
    """`jaxserve compile MODEL --topology cpu --speculative-config <EAGLE-3 head>`."""
    return compile_cpu(model_dir, tmp_path_factory.mktemp("exe") / "eagle3", SPEC_FLAGS,
                       "--speculative-config", json.dumps(SPEC))


@pytest.fixture(scope="module")
def draft_model_dir(model_dir, tmp_path_factory) -> pathlib.Path:
    """`jaxserve compile MODEL --topology cpu --speculative-config <a draft model>` (the tiny
    qwen2, method inferred as vLLM does)."""
    draft = write_model_dir(tmp_path_factory.mktemp("draft"), "qwen2")
    spec = {"model": str(draft), "num_speculative_tokens": 2}
    out = compile_cpu(model_dir, tmp_path_factory.mktemp("exe") / "draft_model", SPEC_FLAGS,
                      "--speculative-config", json.dumps(spec))
    return out, spec


@pytest.fixture(scope="module")
def fp8_dir(model_dir, tmp_path_factory) -> pathlib.Path:
    """`jaxserve compile MODEL --topology cpu --kv-cache-dtype fp8`: no scales known."""
    return compile_cpu(model_dir, tmp_path_factory.mktemp("exe") / "fp8", FP8_FLAGS)


@pytest.fixture(scope="module")
def scaled_dir(model_dir, tmp_path_factory) -> pathlib.Path:
    """The same model with vLLM's k_scale / v_scale in its checkpoint (per tensor, per layer)."""
    d = tmp_path_factory.mktemp("scaled")
    shutil.copytree(model_dir, d, dirs_exist_ok=True)
    tensors = load_file(str(d / "model.safetensors"))
    layers = json.loads((d / "config.json").read_text())["num_hidden_layers"]
    for i in range(layers):
        tensors[f"model.layers.{i}.self_attn.k_scale"] = np.asarray(0.03125 * (i + 1), np.float32)
        tensors[f"model.layers.{i}.self_attn.v_scale"] = np.asarray(0.015625, np.float32)
    save_file(tensors, str(d / "model.safetensors"))
    return d


def _prompt_logprobs(llm: LLM) -> np.ndarray:
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
    return np.asarray([lp[t].logprob for o, p in zip(llm.generate(PROMPTS, params, use_tqdm=False), PROMPTS)
                       for lp, t in zip(o.prompt_logprobs[1:], p[1:])])


def _outputs(llm: LLM):
    params = [SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=2),
              SamplingParams(max_tokens=6, temperature=0.9, top_p=0.8, seed=7, ignore_eos=True),
              SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)]
    return [(o.outputs[0].token_ids, [sorted(d) for d in o.outputs[0].logprobs or []])
            for o in llm.generate(PROMPTS, params, use_tqdm=False)]


def _messages(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == PREBUILT_LOG and r.levelno >= logging.WARNING]


def test_served_from_the_directory_nothing_compiles_and_the_tokens_are_the_same(model_dir, cpu_dir, caplog):
    manifest = prebuilt.read_manifest(cpu_dir)
    assert manifest["topology"] == "cpu" and manifest["buckets"] == [[8, 8], [16, 8]]
    assert manifest["entries"] == ["kv-zeros", "sampling-state", "step-8x8", "step-16x8", "decode-8x2",
                                   "write-slot-rows"]
    files = sorted((p.name, p.stat().st_mtime_ns) for p in cpu_dir.iterdir())

    # An engine whose recipe differs (the sampler's top-logprobs width): named, compiled as today.
    with caplog.at_level(logging.WARNING, logger=PREBUILT_LOG):
        compiled = LLM(str(model_dir), executables=str(cpu_dir), max_logprobs=5, **OPTIONS)
    (line,) = _messages(caplog)
    assert "recipe.sampler_config.max_logprobs: 20 in the directory, 5 here" in line, line
    runner = compiled.engine.core.runner
    assert (runner.executables_loaded, runner.executables_compiled) == (0, len(manifest["entries"]))
    expected = _outputs(compiled)

    caplog.clear()
    with caplog.at_level(logging.INFO, logger=PREBUILT_LOG), all_compiles() as compiled_names:
        loaded = LLM(str(model_dir), executables=str(cpu_dir), **OPTIONS)
        blocks = loaded.engine.core.num_blocks
        outputs = _outputs(loaded)
    assert compiled_names == []  # nothing compiled in the process: at start, eager ops included, nor serving
    assert _messages(caplog) == []
    runner = loaded.engine.core.runner
    assert (runner.executables_loaded, runner.executables_compiled) == (len(manifest["entries"]), 0)
    assert runner.counter.num_compiles == 0  # nothing traced or compiled at start
    assert outputs == expected
    assert loaded.engine.core.num_blocks > blocks  # the decode block loaded from the directory ran
    assert runner.counter.recompiles == 0
    assert sorted((p.name, p.stat().st_mtime_ns) for p in cpu_dir.iterdir()) == files  # read, never written


def test_a_changed_version_or_recipe_is_named_and_nothing_is_loaded(cpu_dir, caplog):
    stored = prebuilt.read_manifest(cpu_dir)["material"]
    devices = []  # never reached: a mismatch opens nothing
    assert prebuilt.prebuilt_scope(cpu_dir, stored, devices) is not None
    jax_version = next(v for v in stored["versions"].split() if v.startswith("jax="))
    here = {**stored, "versions": stored["versions"].replace(jax_version, "jax=0.0.1"),
            "recipe.num_pages": "999"}
    with caplog.at_level(logging.WARNING, logger=PREBUILT_LOG):
        assert prebuilt.prebuilt_scope(cpu_dir, here, devices) is None
    (line,) = _messages(caplog)
    assert f"recipe.num_pages: {stored['recipe.num_pages']} in the directory, 999 here" in line, line
    assert f"versions: {stored['versions']} in the directory" in line and "jax=0.0.1" in line, line
    assert prebuilt.differences(stored, {**stored, "code": "sha256:0"}) == ["code differs"]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger=PREBUILT_LOG):
        assert prebuilt.prebuilt_scope(cpu_dir / "absent", stored, devices) is None
    assert "no readable manifest.json" in _messages(caplog)[0]


def test_the_material_is_the_recipe_field_by_field_without_its_grid(cpu_dir):
    from jaxserve.runner.recipe import StepRecipe

    # Without the grid nor the decode blocks' K: each step and block is an entry of its own name.
    names = {f.name for f in dataclasses.fields(StepRecipe)} - {"target", "token_buckets", "request_buckets",
                                                               "num_decode_steps"}
    material = prebuilt.read_manifest(cpu_dir)["material"]
    assert {k.split(".")[1] for k in material if k.startswith("recipe.")} == names
    assert material["recipe.arch.num_hidden_layers"] == "2" and material["recipe.plan.dtype"] == "'float32'"
    assert {"code", "versions", "platform", "devices", "backend", "xla_flags", "jax_config"} <= set(material)
    assert prebuilt.read_manifest(cpu_dir)["key"] == prebuilt.material_key(material)


def test_a_draft_heads_step_is_compiled_ahead_and_served_from_the_directory(model_dir, cpu_dir, eagle3_dir,
                                                                             tmp_path, caplog):
    manifest = prebuilt.read_manifest(eagle3_dir)
    assert manifest["entries"] == ["kv-zeros", "draft-kv-zeros", "sampling-state", "step-8x8", "step-16x8",
                                   "write-slot-rows"]
    head = manifest["material"]["recipe.draft_model"]
    assert head.startswith("a drafter whose config.json hashes to ")
    assert manifest["material"]["recipe.num_speculative_tokens"] == "2"
    # The head from another directory: the same head to the programs (named by its config).
    shutil.copytree(HEAD, tmp_path / "head")
    spec = {**SPEC, "model": str(tmp_path / "head")}

    # A directory compiled without the head (cpu_dir; its decode blocks' K is no part of the
    # key): named, not used, everything compiled with the head as without a directory.
    with caplog.at_level(logging.WARNING, logger=PREBUILT_LOG):
        compiled = LLM(str(model_dir), executables=str(cpu_dir), speculative_config=spec, **EAGLE3_OPTIONS)
    (line,) = _messages(caplog)
    assert f"recipe.draft_model: none in the directory, {head} here" in line, line
    assert "recipe.num_speculative_tokens: 0 in the directory, 2 here" in line, line
    runner = compiled.engine.core.runner
    assert runner.drafting
    assert (runner.executables_loaded, runner.executables_compiled) == (0, len(manifest["entries"]))
    expected = _outputs(compiled)

    caplog.clear()
    with caplog.at_level(logging.WARNING, logger=PREBUILT_LOG):
        loaded = LLM(str(model_dir), executables=str(eagle3_dir), speculative_config=spec, **EAGLE3_OPTIONS)
    assert _messages(caplog) == []
    runner = loaded.engine.core.runner
    assert runner.drafting
    assert (runner.executables_loaded, runner.executables_compiled) == (len(manifest["entries"]), 0)
    assert runner.counter.num_compiles == 0  # nothing traced or compiled at start, the head's pages included
    assert _outputs(loaded) == expected
    stats = loaded.engine.scheduler.make_stats()
    assert stats.spec_num_draft_tokens > 0  # the head's drafts were fed and verified
    assert runner.counter.recompiles == 0


def test_a_draft_models_step_and_cache_are_compiled_ahead(model_dir, cpu_dir, draft_model_dir, caplog):
    """With a draft model the directory holds its step and its cache's maker (draft-kv-zeros):
    an engine from it compiles nothing (its cache allocated through the loaded maker), drafts,
    and gives the tokens of a plain engine (greedy and seeded)."""
    out, spec = draft_model_dir
    manifest = prebuilt.read_manifest(out)
    assert manifest["entries"] == ["kv-zeros", "draft-kv-zeros", "sampling-state", "step-8x8", "step-16x8",
                                   "write-slot-rows"]
    assert manifest["material"]["recipe.draft_method"] == "'draft_model'"
    with caplog.at_level(logging.WARNING, logger=PREBUILT_LOG):
        loaded = LLM(str(model_dir), executables=str(out), speculative_config=spec, **EAGLE3_OPTIONS)
    assert _messages(caplog) == []
    runner = loaded.engine.core.runner
    assert runner.drafting and len(runner.kv.draft.k) == 2  # the draft model's two layers of pages
    assert (runner.executables_loaded, runner.executables_compiled) == (len(manifest["entries"]), 0)
    assert runner.counter.num_compiles == 0
    plain = LLM(str(model_dir), executables=str(cpu_dir), **OPTIONS)
    assert plain.engine.core.runner.counter.num_compiles == 0
    assert _outputs(loaded) == _outputs(plain)
    assert loaded.engine.scheduler.make_stats().spec_num_draft_tokens > 0


def test_a_quantized_cache_is_served_from_the_directory_with_any_scales(model_dir, scaled_dir, fp8_dir,
                                                                       caplog):
    """The directory compiled without scales serves the checkpoint's and measured ones: each
    engine loads every entry and compiles nothing, the measuring forward included (compiled
    ahead for the tokenizer's calibration tokens); with the checkpoint's scales it gives the
    tokens and log-probs of an engine that compiled its own steps, with measured ones the
    scales and tokens of an engine that measured them compiling everything."""
    manifest = prebuilt.read_manifest(fp8_dir)
    entries, calibration = manifest["entries"], calibration_name(len(_calibration_ids(model_dir)))
    assert entries == ["kv-zeros", "sampling-state", "step-16x8", "write-slot-rows", calibration]
    steps = entries[:-1]  # the runner's; the calibration runs before it
    compiled = LLM(str(scaled_dir), **FP8_OPTIONS)
    runner = compiled.engine.core.runner
    assert runner.executables_compiled == len(steps) and runner.counter.num_compiles > 0
    expected, expected_scores = _outputs(compiled), _prompt_logprobs(compiled)

    served, outputs = {}, {}
    for name, d in (("checkpoint", scaled_dir), ("measured", model_dir)):
        caplog.clear()
        with caplog.at_level(logging.WARNING), all_compiles() as compiled_names:
            served[name] = llm = LLM(str(d), executables=str(fp8_dir), **FP8_OPTIONS)
            outputs[name] = _outputs(llm)
        assert compiled_names == []  # measured: the calibration forward loaded, not compiled
        assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []
        runner = llm.engine.core.runner
        assert (runner.executables_loaded, runner.executables_compiled) == (len(steps), 0)
        assert runner.counter.num_compiles == 0
    checkpoint, measured = (served[n].engine.core.runner.kv_scales for n in ("checkpoint", "measured"))
    assert checkpoint == (((0.03125,), (0.015625,)), ((0.0625,), (0.015625,))) != measured
    assert all(len(k) == 2 for k, _ in measured)  # per KV head
    assert outputs["checkpoint"] == expected
    np.testing.assert_array_equal(_prompt_logprobs(served["checkpoint"]), expected_scores)
    # The same executables, other scales: other values (the scales are read as inputs).
    assert not np.array_equal(_prompt_logprobs(served["measured"]), expected_scores)
    assert served["measured"].engine.core.runner.counter.recompiles == 0
    # An engine that measured its scales compiling everything: the same scales and tokens.
    reference = LLM(str(model_dir), **FP8_OPTIONS)
    assert reference.engine.core.runner.kv_scales == measured
    assert _outputs(reference) == outputs["measured"]


def test_a_calibration_of_another_token_count_is_named_and_compiled(model_dir, fp8_dir, monkeypatch, caplog):
    """A tokenizer that reads the calibration text as another number of tokens needs another
    forward: it is not in the directory, the log line names it, and it is compiled (never a
    program of another shape); the steps still load."""
    from jaxserve.engine import setup

    monkeypatch.setattr(setup, "CALIBRATION_TEXT", "w5 w6 w7")  # 3 tokens, then the vocabulary's spread
    n = len(_calibration_ids(model_dir, "w5 w6 w7"))
    with caplog.at_level(logging.WARNING), all_compiles() as compiled_names:
        llm = LLM(str(model_dir), executables=str(fp8_dir), **FP8_OPTIONS)
    (line,) = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert f"no {calibration_name(n)} (the calibration forward over this tokenizer's {n} tokens)" in line, line
    assert str(fp8_dir) in line, line
    assert "jit(amax)" in compiled_names, compiled_names
    runner = llm.engine.core.runner
    assert (runner.executables_loaded, runner.executables_compiled) == (4, 0)


def _calibration_ids(model_dir, text: str = CALIBRATION_TEXT) -> list[int]:
    from jaxserve.engine.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_pretrained(model_dir)
    vocab = json.loads((pathlib.Path(model_dir) / "config.json").read_text())["vocab_size"]
    return calibration_ids(vocab, lambda: tokenizer.encode(text))
