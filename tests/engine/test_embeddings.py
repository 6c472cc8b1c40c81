"""Embeddings (--runner pooling) of tiny random decoder models against transformers'.

transformers' last hidden state (after the final norm) is recovered exactly from the arch
fixtures' float32 logits, which scripts/make_arch_fixtures.py recorded with transformers' own
model: logits = h @ W.T for the output matrix W ([V, E], V > E, full column rank), so
h = lstsq(W, logits). No torch is needed here.
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from jaxserve import LLM
from jaxserve.config import ModelConfig
from jaxserve.engine.pooling_core import PoolingCore
from jaxserve.models.pooling_config import PoolingConfig, load_pooling_config
from tests.model_dirs import DATA, write_model_dir

OPTIONS = dict(runner="pooling", dtype="float32", max_model_len=32, max_num_seqs=4,
               token_buckets=(16, 32), request_buckets=(4,), show_progress=False)


def transformers_hidden(fixture: str) -> list[np.ndarray]:
    """transformers' last hidden states ([L, E] per recorded sequence) of an arch fixture."""
    weights = load_file(str(DATA / fixture / "model.safetensors"))
    w = weights.get("lm_head.weight", weights["model.embed_tokens.weight"]).astype(np.float64)
    expected = load_file(str(DATA / fixture / "expected.safetensors"))
    logits = [expected[f"logits_{i}"].T.astype(np.float64) for i in range(2)]
    return [np.linalg.lstsq(w, x, rcond=None)[0].T for x in logits]


def fixture_tokens(fixture: str) -> list[list[int]]:
    expected = load_file(str(DATA / fixture / "expected.safetensors"))
    return [expected[f"tokens_{i}"].tolist() for i in range(2)]


def sentence_transformers_files(model_dir, pooling_key: str, normalize: bool) -> None:
    st = "sentence_transformers.models."
    modules = [{"idx": 0, "name": "0", "path": "", "type": st + "Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": st + "Pooling"}]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": st + "Normalize"})
    (model_dir / "modules.json").write_text(json.dumps(modules))
    (model_dir / "1_Pooling").mkdir()
    names = ("cls_token", "mean_tokens", "max_tokens", "mean_sqrt_len_tokens", "lasttoken")
    modes = {f"pooling_mode_{k}": False for k in names}
    config = {"word_embedding_dimension": 64, **modes, f"pooling_mode_{pooling_key}": True}
    (model_dir / "1_Pooling" / "config.json").write_text(json.dumps(config))


def cosine(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(a @ b / np.linalg.norm(a) / np.linalg.norm(b))


@pytest.fixture(scope="module")
def qwen3_last(tmp_path_factory, compile_cache_dir):
    d = write_model_dir(tmp_path_factory.mktemp("qwen3"), "qwen3")
    return LLM(str(d), compilation_cache_dir=compile_cache_dir, **OPTIONS)


@pytest.fixture(scope="module")
def qwen3_mean(tmp_path_factory, compile_cache_dir):
    d = write_model_dir(tmp_path_factory.mktemp("qwen3-mean"), "qwen3")
    sentence_transformers_files(d, "mean_tokens", normalize=False)
    return LLM(str(d), compilation_cache_dir=compile_cache_dir, **OPTIONS)


def test_last_token_matches_transformers(qwen3_last):
    ref = transformers_hidden("qwen3")
    outs = qwen3_last.embed(fixture_tokens("qwen3"))
    for out, h in zip(outs, ref):
        emb = np.asarray(out.outputs.embedding)
        assert emb.shape == (64,)
        assert cosine(emb, h[-1]) >= 0.9999
        assert np.linalg.norm(emb) == pytest.approx(1.0, abs=1e-5)  # default: normalized
    assert outs[0].prompt_token_ids == fixture_tokens("qwen3")[0]


def test_mean_pooling_matches_transformers(qwen3_mean):
    want = PoolingConfig("mean", False, "1_Pooling/config.json")
    assert qwen3_mean.engine.core.runner.pooling == want
    ref = transformers_hidden("qwen3")
    outs = qwen3_mean.embed(fixture_tokens("qwen3"))
    for out, h in zip(outs, ref):
        emb = np.asarray(out.outputs.embedding)
        assert cosine(emb, h.mean(axis=0)) >= 0.9999
        # not normalized: the mean's own length
        np.testing.assert_allclose(np.linalg.norm(emb), np.linalg.norm(h.mean(axis=0)), rtol=1e-4)


def as_base_model(model_dir) -> None:
    """Rewrite a causal LM's directory as its base model's (e.g. LlamaModel): tensors without
    the `model.` prefix and no lm_head, as many embedding checkpoints are saved."""
    tensors = load_file(str(model_dir / "model.safetensors"))
    base = {k.removeprefix("model."): v for k, v in tensors.items() if not k.startswith("lm_head.")}
    save_file(base, str(model_dir / "model.safetensors"))
    config = json.loads((model_dir / "config.json").read_text())
    arch = config["architectures"][0].replace("ForCausalLM", "Model")
    (model_dir / "config.json").write_text(json.dumps({**config, "architectures": [arch]}))


@pytest.mark.parametrize("base_model", [False, True])
def test_llama_last_token_matches_transformers(tmp_path, compile_cache_dir, base_model):
    """A base model's checkpoint loads as its causal LM, and runner "auto" embeds with it."""
    d = write_model_dir(tmp_path, "llama")  # untied: its own lm_head
    if base_model:
        as_base_model(d)
    options = {**OPTIONS, "runner": "auto"} if base_model else OPTIONS
    llm = LLM(str(d), compilation_cache_dir=compile_cache_dir, **options)
    assert llm.engine.info.runner == "pooling"
    for out, h in zip(llm.embed(fixture_tokens("llama")), transformers_hidden("llama")):
        assert cosine(out.outputs.embedding, h[-1]) >= 0.9999


@pytest.mark.parametrize("engine", ["qwen3_last", "qwen3_mean"])
def test_a_batch_equals_each_prompt_alone(engine, request):
    llm = request.getfixturevalue(engine)
    rng = np.random.default_rng(0)
    # 9 prompts of 1 to 32 tokens: more than one batch (4 prompts, 32 tokens at most each)
    prompts = [rng.integers(3, 128, size=n).tolist() for n in (1, 32, 5, 17, 2, 9, 31, 3, 16)]
    together = np.asarray([o.outputs.embedding for o in llm.embed(prompts)])
    alone = np.asarray([llm.embed([p])[0].outputs.embedding for p in prompts])
    np.testing.assert_allclose(together, alone, atol=2e-6)
    assert llm.engine.num_compiles_after_warmup == 0


def test_strings_are_tokenized(qwen3_last):
    by_text = qwen3_last.embed("w5 w6 w7")[0]
    by_ids = qwen3_last.embed([by_text.prompt_token_ids])[0]
    assert by_text.prompt_token_ids[-3:] == [5, 6, 7]
    assert by_text.outputs.embedding == by_ids.outputs.embedding


def test_dimensions_truncate_and_renormalize(qwen3_last):
    full = np.asarray(qwen3_last.embed([[5, 6, 7]])[0].outputs.embedding)
    short = np.asarray(qwen3_last.embed([[5, 6, 7]], dimensions=16)[0].outputs.embedding)
    np.testing.assert_allclose(short, full[:16] / np.linalg.norm(full[:16]), rtol=1e-5)
    with pytest.raises(ValueError, match="hidden size 64"):
        qwen3_last.embed([[5]], dimensions=65)


@pytest.mark.parametrize("prompt, message", [([], "empty"), ([5] * 33, "context length"),
                                             ([128], "outside the vocabulary")])
def test_bad_inputs_are_refused(qwen3_last, prompt, message):
    with pytest.raises(ValueError, match=message):
        qwen3_last.embed([[5, 6], prompt])


def test_a_pooling_engine_does_not_generate(qwen3_last):
    with pytest.raises(ValueError, match="--runner pooling"):
        qwen3_last.generate(["w5 w6"], use_tqdm=False)


def test_the_pooling_core_runs_no_steps(qwen3_last):
    """Embeddings only: no scheduler, no steps; generation and sleep mode refused by the core
    itself too (the frontend refuses generation first)."""
    core = qwen3_last.engine.core
    assert isinstance(core, PoolingCore) and not hasattr(core, "scheduler")
    with pytest.raises(ValueError, match="--runner pooling"):
        core.add_request(None)
    with pytest.raises(RuntimeError, match="sleep mode"):
        core.sleep()
    qwen3_last.embed([[5, 6, 7]])
    stats = core.stats()
    assert (core.has_work(), core.step(), stats.num_steps, stats.scheduler.num_running) == (
        False, [], 0, 0)
    assert (stats.num_compiles, stats.recompiles) == (core.runner.counter.num_compiles, 0)
    assert core.reset_prefix_cache() is True


def test_encoders_are_refused_by_name(tmp_path):
    d = write_model_dir(tmp_path, "qwen3")
    config = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**config, "architectures": ["BertModel"]}))
    with pytest.raises(ValueError, match="BertModel is a bidirectional encoder"):
        LLM(str(d), **OPTIONS)


def test_pooling_config_files(tmp_path):
    # no modules.json: last token, normalized
    assert load_pooling_config(tmp_path) == PoolingConfig()
    sentence_transformers_files(tmp_path, "lasttoken", normalize=True)
    cfg = load_pooling_config(tmp_path)
    assert (cfg.pooling, cfg.normalize) == ("last", True)
    # sentence-transformers >= 5.4 names its modules by their new place
    new = "sentence_transformers.base.modules.transformer.Transformer"
    pooling = "sentence_transformers.sentence_transformer.modules.pooling.Pooling"
    (tmp_path / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": new},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": pooling}]))
    pooling_file = tmp_path / "1_Pooling" / "config.json"
    pooling_file.write_text(json.dumps({"pooling_mode_mean_tokens": True}))
    cfg = load_pooling_config(tmp_path)
    assert (cfg.pooling, cfg.normalize) == ("mean", False)
    pooling_file.write_text(json.dumps({"pooling_mode_mean_tokens": True, "include_prompt": False}))
    with pytest.raises(ValueError, match="include_prompt"):
        load_pooling_config(tmp_path)
    shutil.rmtree(tmp_path / "1_Pooling")
    (tmp_path / "1_Pooling").mkdir()
    cls = {"pooling_mode_cls_token": True}
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps(cls))
    with pytest.raises(ValueError, match="pooling cls is not supported"):
        load_pooling_config(tmp_path)
    # sentence-transformers >= 5.4 writes one key; no mode at all is its default, mean
    for written, want in (({"pooling_mode": "lasttoken"}, "last"), ({"pooling_mode": ["mean"]}, "mean"),
                          ({"embedding_dimension": 64}, "mean")):
        (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps(written))
        assert load_pooling_config(tmp_path).pooling == want
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode": ["mean", "max"]}))
    with pytest.raises(ValueError, match="pooling mean, max is not supported"):
        load_pooling_config(tmp_path)


def test_task_embed_is_runner_pooling():
    assert ModelConfig(task="embed").runner == "pooling"
    assert ModelConfig(task="generate").runner == "generate"
    with pytest.raises(ValueError, match="contradicts"):
        ModelConfig(task="embed", runner="generate")


def test_tensor_parallel_embeddings_equal_one_device(qwen3_last, tmp_path, compile_cache_dir):
    d = write_model_dir(tmp_path, "qwen3")
    llm = LLM(str(d), compilation_cache_dir=compile_cache_dir, tensor_parallel_size=2, **OPTIONS)
    prompts = [[5, 6, 7], list(range(3, 30))]
    np.testing.assert_allclose([o.outputs.embedding for o in llm.embed(prompts)],
                               [o.outputs.embedding for o in qwen3_last.embed(prompts)], atol=1e-5)


def test_executables_come_from_the_cache(tmp_path, compile_cache_dir):
    """A second pooling engine of the same model and buckets loads every executable."""
    d = write_model_dir(tmp_path, "qwen3")
    first = LLM(str(d), compilation_cache_dir=str(tmp_path / "cache"), **OPTIONS)
    second = LLM(str(d), compilation_cache_dir=str(tmp_path / "cache"), **OPTIONS)
    runner = second.engine.core.runner
    assert first.engine.core.runner.executables_compiled > 0
    assert (runner.executables_loaded, runner.executables_compiled) == (runner.num_buckets + 1, 0)
    prompts = [[5, 6, 7], [9] * 20]
    assert [o.outputs.embedding for o in first.embed(prompts)] == [o.outputs.embedding
                                                                   for o in second.embed(prompts)]
