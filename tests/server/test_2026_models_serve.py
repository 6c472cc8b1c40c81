"""`jaxserve serve` on the Gemma 4 fixtures (tests/data/arch/gemma4, gemma4_moe), gpt-oss's
MXFP4 one (gpt_oss_mxfp4: the experts stored as blocks and scales, kept packed by the engine;
the CPU runs the model's own layer since the fused one has no sinks) and DeepSeek V3's
(deepseek_v3: multi-head latent attention over a cache of latent rows, grouped routing), in
float32 on the CPU backend: the prompt log-probs are transformers' (on the decoded weights),
the greedy tokens are transformers' `generate` (through its own KV cache), the same whether the two
prompts come in one request or one at a time, and a chat completion answers. An architecture
the registry does not serve is refused by name, with every one it does."""

from __future__ import annotations

import json

import numpy as np
import pytest
from safetensors.numpy import load_file
from starlette.testclient import TestClient

from jaxserve.models.registry import supported_architectures
from tests.model_dirs import write_model_dir
from tests.server.conftest import app_config

CASES = ["gemma4", "gemma4_moe", "gpt_oss_mxfp4", "deepseek_v3"]
GREEDY_TOKENS = 8  # scripts/make_arch_fixtures.py: the continuation transformers recorded


@pytest.fixture(scope="module", params=CASES)
def served(request, data_dir, tmp_path_factory, compile_cache_dir):
    """(fixture name, its expected.safetensors, a client of its app)."""
    from jaxserve.config import EngineConfig
    from jaxserve.engine.async_client import AsyncEngineClient
    from jaxserve.engine.setup import build_engine
    from jaxserve.server.app import build_app

    name = request.param
    model = write_model_dir(tmp_path_factory.mktemp(name), name)
    parts = build_engine(
        EngineConfig.from_kwargs(
            model=str(model),
            dtype="float32",
            max_num_seqs=8,
            max_num_batched_tokens=32,
            token_buckets=(32,),
            request_buckets=(8,),
            max_model_len=32,
            num_pages=16,
            page_size=8,
            compilation_cache_dir=compile_cache_dir,
            show_progress=False,
        )
    )
    app = build_app(AsyncEngineClient.in_thread(parts), app_config(served_model_name=(name,)))
    with TestClient(app) as client:
        yield name, load_file(str(data_dir / "arch" / name / "expected.safetensors")), client


def _complete(client, name, prompt) -> list[dict]:
    r = client.post(
        "/v1/completions",
        json={
            "model": name,
            "prompt": prompt,
            "max_tokens": GREEDY_TOKENS,
            "temperature": 0,
            "ignore_eos": True,
            "logprobs": 1,
            "prompt_logprobs": 0,
            "return_token_ids": True,
        },
    )
    assert r.status_code == 200, r.text
    return sorted(r.json()["choices"], key=lambda c: c["index"])


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


def test_prompt_logprobs_and_greedy_tokens_match_transformers(served):
    name, expected, client = served
    prompts = [expected[f"tokens_{i}"].tolist() for i in range(2)]
    together = _complete(client, name, prompts)
    for i, (ids, choice) in enumerate(zip(prompts, together)):
        want = _log_softmax(expected[f"logits_{i}"])
        plp = choice["prompt_logprobs"]
        assert plp[0] is None and len(plp) == len(ids)
        for j in range(1, len(ids)):
            assert plp[j][str(ids[j])]["logprob"] == pytest.approx(want[j - 1, ids[j]], abs=1e-4), (
                i,
                j,
            )
        assert choice["token_ids"] == expected[f"greedy_{i}"].tolist(), i
        assert choice["finish_reason"] == "length"
    # one at a time: the same tokens and log-probs as beside the other prompt
    for ids, choice in zip(prompts, together):
        (alone,) = _complete(client, name, [ids])
        assert alone["token_ids"] == choice["token_ids"]
        np.testing.assert_allclose(
            alone["logprobs"]["token_logprobs"], choice["logprobs"]["token_logprobs"], atol=1e-5
        )


def test_chat_completion_answers(served):
    name, _, client = served
    r = client.post(
        "/v1/chat/completions",
        json={
            "model": name,
            "max_tokens": 4,
            "temperature": 0,
            "messages": [{"role": "user", "content": "w5 w6 w7 w8 w9 w10"}],
        },
    )
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["choices"][0]["message"]["role"] == "assistant"
    assert body["usage"]["completion_tokens"] >= 1 and body["usage"]["prompt_tokens"] >= 4


def test_an_unserved_architecture_is_refused_with_every_served_one(tmp_path, capsys):
    from jaxserve.server.cli import main

    model = write_model_dir(tmp_path / "m")
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(
        json.dumps({**config, "architectures": ["DeepseekV2ForCausalLM"]})
    )
    assert main(["serve", str(model)]) != 0
    err = capsys.readouterr().err
    assert "'DeepseekV2ForCausalLM' is not supported" in err and "Traceback" not in err
    listed = err.split("Supported architectures: ")[1].split(".")[0].split(", ")
    assert sorted(listed) == supported_architectures() and "Gemma4ForCausalLM" in listed
