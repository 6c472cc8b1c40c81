"""LoRA adapters served by the engine on a tiny random Llama equal transformers + peft
(the adapter merged, float32): prompt log-probs and greedy tokens, for each adapter alone and
for a batch mixing three adapters and the base model over two slots (so adapters are evicted
and loaded again while others run), without recompiling.

The adapters and the expected outputs come from scripts/make_lora_fixtures.py (tests/data/
lora/<arch>/<adapter>); this test needs no torch.
"""

from __future__ import annotations

import shutil

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from jaxserve import LLM, LoRARequest, SamplingParams
from tests.model_dirs import write_model_dir

# The engine of these tests and of tests/server/test_lora_server.py (its steps are shared through
# the compilation cache).
LORA_OPTIONS = dict(dtype="float32", enable_lora=True, max_loras=2, max_lora_rank=8, max_num_seqs=4,
                    max_model_len=64, token_buckets=(32,), request_buckets=(4,), show_progress=False)

ADAPTERS = ("a", "b", "c")


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def _prompt_lps(out, tokens) -> np.ndarray:
    return np.array([out.prompt_logprobs[i][t].logprob for i, t in enumerate(tokens) if i > 0])


def test_adapters_match_peft_alone_and_mixed(data_dir, tmp_path, compile_cache_dir):
    arch = "llama"  # Qwen3 and Gemma 3: tests/models/test_lora_parity.py
    model = write_model_dir(tmp_path / arch, arch)
    llm = LLM(str(model), compilation_cache_dir=compile_cache_dir, **LORA_OPTIONS)
    loras = {
        n: LoRARequest(f"{arch}-{n}", i + 1, str(data_dir / "lora" / arch / n))
        for i, n in enumerate(ADAPTERS)
    }
    params = SamplingParams(temperature=0.0, max_tokens=8, min_tokens=8, prompt_logprobs=0)
    alone = {}
    for n, lora in [*loras.items(), ("base", None)]:
        (out,) = llm.generate(_tokens(data_dir, arch), params, use_tqdm=False, lora_request=lora)
        alone[n] = out
    base_logits = load_file(str(data_dir / "arch" / arch / "expected.safetensors"))["logits_0"]
    for n in (*ADAPTERS, "base"):
        if n == "base":
            tokens, logits, greedy = _tokens(data_dir, arch), base_logits[:12], None
        else:
            exp = load_file(str(data_dir / "lora" / arch / n / "expected.safetensors"))
            tokens, logits, greedy = exp["tokens"].tolist(), exp["logits"], exp["greedy"].tolist()
        want = _log_softmax(logits)[np.arange(len(tokens) - 1), tokens[1:]]
        np.testing.assert_allclose(
            _prompt_lps(alone[n], tokens), want, atol=1e-4, rtol=0, err_msg=f"{arch} {n}"
        )
        if greedy is not None:
            assert alone[n].outputs[0].token_ids == greedy, (arch, n)
    # The adapters differ from the base model and from each other (the test can fail).
    assert len({tuple(o.outputs[0].token_ids) for o in alone.values()}) == 4
    order = ["a", "base", "b", "c", "a", "c"]
    mixed = llm.generate(
        [_tokens(data_dir, arch)] * len(order),
        params,
        use_tqdm=False,
        lora_request=[loras.get(n) for n in order],
    )
    for n, out in zip(order, mixed):
        assert out.outputs[0].token_ids == alone[n].outputs[0].token_ids, (arch, n)
        np.testing.assert_allclose(
            _prompt_lps(out, _tokens(data_dir, arch)),
            _prompt_lps(alone[n], _tokens(data_dir, arch)),
            atol=1e-4,
            rtol=0,
        )
    # An adapter whose weights do not fit the model fails its requests alone, naming why; its
    # slot is not trusted afterwards, and the others still serve their own outputs.
    broken = tmp_path / "broken"
    shutil.copytree(data_dir / "lora" / arch / "b", broken)
    tensors = load_file(str(broken / "adapter_model.safetensors"))
    save_file(
        {k.replace("layers.1.", "layers.7."): v for k, v in tensors.items()},
        str(broken / "adapter_model.safetensors"),
    )
    with pytest.raises(ValueError, match="layer 7 does not exist"):
        llm.generate(
            _tokens(data_dir, arch),
            params,
            use_tqdm=False,
            lora_request=LoRARequest("broken", 9, str(broken)),
        )
    again = llm.generate(
        [_tokens(data_dir, arch)] * 2, params, use_tqdm=False, lora_request=[loras["b"], loras["a"]]
    )
    assert [o.outputs[0].token_ids for o in again] == [
        alone["b"].outputs[0].token_ids,
        alone["a"].outputs[0].token_ids,
    ]
    assert llm.engine.num_compiles_after_warmup == 0


def test_adapters_over_two_data_parallel_ranks(data_dir, tmp_path, compile_cache_dir):
    """Data parallelism: the ranks share the step's slots (one table: at most max_loras adapters
    in a step over both ranks). Three adapters and the base over two slots, the requests spread
    over both ranks (prompts of different lengths, no prefix cache to pin them to one): each gets
    transformers + peft's prompt log-probs, and the full prompts their greedy tokens."""
    arch = "llama"
    model = write_model_dir(tmp_path / arch, arch)
    options = {**LORA_OPTIONS, "request_buckets": (2,), "max_num_batched_tokens": 64, "enable_prefix_caching": False}
    llm = LLM(str(model), data_parallel_size=2, compilation_cache_dir=compile_cache_dir, **options)
    assert llm.engine.runner.mesh.shape["data"] == 2
    loras = {n: LoRARequest(f"{arch}-{n}", i + 1, str(data_dir / "lora" / arch / n)) for i, n in enumerate(ADAPTERS)}
    params = SamplingParams(temperature=0.0, max_tokens=8, min_tokens=8, prompt_logprobs=0)
    order = ["a", "base", "b", "c", "a", "c", "b", "base"]
    tokens = _tokens(data_dir, arch)
    prompts = [tokens[: len(tokens) - i // 2] for i in range(len(order))]  # pairs of lengths
    sched, ranks = llm.engine.scheduler, []
    assign = sched._assign
    sched._assign = lambda request: ranks.append(assign(request)) or ranks[-1]  # noqa: E731
    mixed = llm.generate(prompts, params, use_tqdm=False, lora_request=[loras.get(n) for n in order])
    base_logits = load_file(str(data_dir / "arch" / arch / "expected.safetensors"))["logits_0"]
    for n, prompt, out in zip(order, prompts, mixed):
        if n == "base":
            logits, greedy = base_logits, None
        else:
            exp = load_file(str(data_dir / "lora" / arch / n / "expected.safetensors"))
            logits, greedy = exp["logits"], exp["greedy"].tolist()
        want = _log_softmax(logits[: len(prompt)])[np.arange(len(prompt) - 1), prompt[1:]]
        np.testing.assert_allclose(_prompt_lps(out, prompt), want, atol=1e-4, rtol=0, err_msg=n)
        if greedy is not None and prompt == tokens:
            assert out.outputs[0].token_ids == greedy, n
    assert sorted(set(ranks)) == [0, 1], ranks
    assert llm.engine.num_compiles_after_warmup == 0


def _tokens(data_dir, arch) -> list[int]:
    return load_file(str(data_dir / "lora" / arch / "a" / "expected.safetensors"))[
        "tokens"
    ].tolist()


def test_lora_off_changes_no_step_input():
    """Without LoRA a step packs exactly what it packed before LoRA existed; with it, one int32
    slot per token more."""
    from jaxserve.runner.step_fn import step_layout
    from jaxserve.sampling.config import SamplerConfig

    sampler = SamplerConfig(max_num_seqs=4, vocab_size=128)
    off = step_layout(16, 4, pages_per_req=4, page_size=4, sampler_config=sampler)
    on = step_layout(16, 4, pages_per_req=4, page_size=4, sampler_config=sampler, lora=True)
    assert len(on.leaves) == len(off.leaves) + 1
    assert on.sizes == (off.sizes[0] + 16, *off.sizes[1:])
