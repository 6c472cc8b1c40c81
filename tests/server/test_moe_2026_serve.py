"""`jaxserve serve` on the gpt-oss MXFP4 fixture (tests/data/arch/gpt_oss_mxfp4: the experts
stored as blocks and scales, kept packed by the engine; the CPU backend runs the model's own
layer since the fused one has no sinks) and on the DeepSeek V3 fixture (tests/data/arch/
deepseek_v3: multi-head latent attention over a cache of latent rows, grouped routing), in
float32: the prompt log-probs are transformers' (on the decoded weights), the greedy tokens its
`generate`'s, the same whether the two prompts come in one request or one at a time."""

from __future__ import annotations

import pytest
from safetensors.numpy import load_file
from starlette.testclient import TestClient

from tests.model_dirs import write_model_dir
from tests.server.conftest import app_config
from tests.server.test_gemma4_serve import _complete, _log_softmax


@pytest.fixture(scope="module", params=["gpt_oss_mxfp4", "deepseek_v3"])
def served(request, tmp_path_factory, compile_cache_dir):
    from jaxserve.config import EngineConfig
    from jaxserve.engine.async_client import AsyncEngineClient
    from jaxserve.engine.setup import build_engine
    from jaxserve.server.app import build_app

    name = request.param
    model = write_model_dir(tmp_path_factory.mktemp(name), name)
    parts = build_engine(EngineConfig.from_kwargs(
        model=str(model), dtype="float32", max_num_seqs=8, max_num_batched_tokens=32,
        token_buckets=(32,), request_buckets=(8,), max_model_len=32, num_pages=16, page_size=8,
        compilation_cache_dir=compile_cache_dir, show_progress=False))
    app = build_app(AsyncEngineClient.in_thread(parts), app_config(served_model_name=(name,)))
    with TestClient(app) as c:
        yield name, c


def test_prompt_logprobs_and_greedy_tokens_match_transformers(served, data_dir):
    name, client = served
    expected = load_file(str(data_dir / "arch" / name / "expected.safetensors"))
    prompts = [expected[f"tokens_{i}"].tolist() for i in range(2)]
    together = _complete(client, name, prompts)
    for i, (ids, choice) in enumerate(zip(prompts, together)):
        want = _log_softmax(expected[f"logits_{i}"])
        plp = choice["prompt_logprobs"]
        assert plp[0] is None and len(plp) == len(ids)
        for j in range(1, len(ids)):
            assert plp[j][str(ids[j])]["logprob"] == pytest.approx(want[j - 1, ids[j]], abs=1e-4)
        assert choice["token_ids"] == expected[f"greedy_{i}"].tolist(), i
    for ids, choice in zip(prompts, together):  # one at a time: the same tokens
        (alone,) = _complete(client, name, [ids])
        assert alone["token_ids"] == choice["token_ids"]
