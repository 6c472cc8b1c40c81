"""Speculative decoding keeps the target's output distribution at temperature > 0 (vLLM's
semantics), checked statistically through the real engine: n-gram drafts (point masses) fed and
verified in the compiled step, the emitted tokens compared with softmax(logits / T) of the model's
own forward over each request's tokens, computed here (and top-k / top-p applied here).

Many seeded requests share one prompt whose n-gram continuation gives most requests one or two
drafts after their first token (k = 2, max_tokens 4): the verifying step emits the 2nd token (whose draft
is kept or not), then the 3rd (the verifying step's next row after a kept draft, the next step's
first after a rejected one) and the 4th. For each of these positions the samples are grouped by
the tokens emitted before it, and a chi-square statistic summed over the groups (expected counts
under the target's conditional distribution, rare tokens pooled) must be plausible. The target's
logits are scaled (the LM head x4) so that its distributions are peaked enough for a fifth to a
third of the drafts to be accepted and for the test to have power: a verifier that keeps drafts
unconditionally, or one that emits the wrong row's sample after a rejection, fails it by far
(checked below). Seeds are fixed, so the outcome is deterministic."""

from __future__ import annotations

import json
import pathlib
from collections import Counter, defaultdict

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file
from scipy import stats

from jaxserve import LLM, SamplingParams
from jaxserve.models.arch_config import ArchConfig
from jaxserve.models.sharding import single_device_mesh
from jaxserve.models.weights import create_model
from jaxserve.runner import model_runner
from jaxserve.runner.kv_cache import allocate_kv_cache
from jaxserve.runner.step_inputs import StepRequest, pack_step
from jaxserve.spec_decode import NgramProposer
from tests.model_dirs import write_model_dir
from tests.models.model_utils import make_forward

PROMPT = [9, 10, 11, 9, 10, 11, 9, 50, 50, 53, 18, 91, 18, 91, 18]
MAX_TOKENS = 4  # the first token, then a verifying step with two drafts
WAVE = 32  # requests given to the engine at once: each has 3 sampling rows to itself
SPEC = {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
N = 4096  # requests per check
MIN_GROUP = 30  # samples a conditioning prefix needs for its group to enter the statistic


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    dst = write_model_dir(tmp_path_factory.mktemp("peaked"))
    tensors = load_file(str(dst / "model.safetensors"))
    tensors["lm_head.weight"] = tensors["lm_head.weight"] * 4.0
    save_file(tensors, str(dst / "model.safetensors"))
    return dst


@pytest.fixture(scope="module")
def llm(model_dir, compile_cache_dir):
    return LLM(str(model_dir), speculative_config=SPEC, dtype="float32", max_num_seqs=3 * WAVE,
               max_num_batched_tokens=512, token_buckets=(128, 512), request_buckets=(3 * WAVE,),
               compilation_cache_dir=compile_cache_dir, show_progress=False, seed=0)


@pytest.fixture(scope="module")
def target(model_dir):
    """The model's next-token logits after a sequence: its forward (the paged path, one
    sequence at a time), not the engine's step."""
    cfg = ArchConfig.from_hf(json.loads((pathlib.Path(model_dir) / "config.json").read_text()))
    tensors = load_file(str(pathlib.Path(model_dir) / "model.safetensors"))
    forward = make_forward(create_model(cfg, dtype=jnp.float32, get_tensor=tensors.__getitem__))
    kv = allocate_kv_cache(cfg, 6, 4, jnp.float32, single_device_mesh())
    cache = {}

    def logits(seq: tuple[int, ...]) -> np.ndarray:
        if seq not in cache:
            inputs = pack_step([StepRequest(list(seq), 0, [1, 2, 3, 4, 5])], num_tokens=20, num_reqs=2,
                               pages_per_req=5, page_size=4)
            cache[seq] = np.asarray(forward(kv, jax.tree.map(jnp.asarray, inputs))[0])[len(seq) - 1]
        return cache[seq]

    return logits


def target_probs(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """The distribution a sampled token follows without speculation, in vLLM's order:
    temperature, top_k (the k largest), top_p (the shortest most-probable prefix whose
    renormalised mass reaches top_p)."""
    x = logits.astype(np.float64) / params.temperature
    if params.top_k > 0:
        x[x < np.sort(x)[-params.top_k]] = -np.inf
    p = np.exp(x - x.max())
    p /= p.sum()
    if params.top_p < 1.0:
        order = np.argsort(-p, kind="stable")
        before = np.cumsum(p[order]) - p[order]  # the mass ahead of each token
        p[order[before >= params.top_p]] = 0.0
        p /= p.sum()
    return p


def sample(llm, params: SamplingParams, n: int) -> np.ndarray:
    """[n, MAX_TOKENS] tokens of n seeded requests (seeds 0..n-1), a wave at a time: drafts
    take the sampling rows no other request needs."""
    out = []
    for lo in range(0, n, WAVE):
        batch = [SamplingParams(temperature=params.temperature, top_k=params.top_k, top_p=params.top_p,
                                max_tokens=MAX_TOKENS, ignore_eos=True, seed=s) for s in range(lo, lo + WAVE)]
        out += [o.outputs[0].token_ids for o in llm.generate([PROMPT] * WAVE, batch, use_tqdm=False)]
    return np.asarray(out)


def groups_of(tokens: np.ndarray, j: int) -> dict[tuple[int, ...], list[int]]:
    """The samples' tokens[j], grouped by tokens[:j], for the groups of at least MIN_GROUP."""
    groups = defaultdict(list)
    for row in tokens:
        groups[tuple(row[:j].tolist())].append(int(row[j]))
    return {prefix: seen for prefix, seen in groups.items() if len(seen) >= MIN_GROUP}


def conditional_pvalues(tokens: np.ndarray, target, params: SamplingParams) -> dict[int, float]:
    """Per output position j: the p-value of a chi-square statistic summed over the groups of
    samples sharing tokens[:j] (groups of at least MIN_GROUP), each group's counts of tokens[j]
    against the target's distribution after PROMPT + tokens[:j]; tokens with expected counts
    under 5 are pooled into one cell. A token the target cannot sample gives p = 0."""
    pvalues = {}
    for j in range(tokens.shape[1]):
        chi2, dof = 0.0, 0
        for prefix, seen in groups_of(tokens, j).items():
            p = target_probs(target(tuple(PROMPT) + prefix), params)
            counts = Counter(seen)
            if any(p[t] == 0.0 for t in counts):
                return {**pvalues, j: 0.0}
            expected = len(seen) * p
            big = np.flatnonzero(expected >= 5)
            observed = np.array([counts.get(int(t), 0) for t in big], float)
            cells_o = np.append(observed, len(seen) - observed.sum())
            cells_e = np.append(expected[big], len(seen) - expected[big].sum())
            if cells_e[-1] < 1e-9:
                cells_o, cells_e = cells_o[:-1], cells_e[:-1]
            chi2 += float(((cells_o - cells_e) ** 2 / cells_e).sum())
            dof += len(cells_e) - 1
        assert dof > 0, f"position {j}: no group of {MIN_GROUP} samples"
        pvalues[j] = float(stats.chi2.sf(chi2, dof))
    return pvalues


def spec_counts(llm) -> np.ndarray:
    s = llm.engine.scheduler.make_stats()
    return np.array([s.spec_num_drafts, s.spec_num_draft_tokens, s.spec_num_accepted_tokens])


@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0),
                                    SamplingParams(temperature=1.0, top_k=6, top_p=0.8)],
                         ids=["t1", "t1-topk-topp"])
def test_each_token_follows_the_targets_distribution(llm, target, params):
    before = spec_counts(llm)
    tokens = sample(llm, params, N)
    drafts, draft_tokens, accepted = spec_counts(llm) - before
    # Most requests had drafts; some were kept, most not.
    assert drafts > N // 2 and 0.1 * draft_tokens < accepted < 0.9 * draft_tokens
    # The 3rd token is tested after kept drafts and after rejected ones (groups of both kinds).
    first_draft = NgramProposer(2, SPEC["prompt_lookup_min"], SPEC["prompt_lookup_max"]).propose
    kept = {t2 == (first_draft(np.asarray(PROMPT + [t1])) or [-1])[0] for t1, t2 in groups_of(tokens, 2)}
    assert kept == {True, False}
    pvalues = conditional_pvalues(tokens, target, params)
    assert min(pvalues.values()) > 1e-4, pvalues
    assert llm.engine.runner.counter.recompiles == 0


def keep_every_draft(sampled, drafts):
    return list(drafts) + [sampled[len(drafts)]]


def next_row_after_a_rejection(sampled, drafts):
    out = []
    for j, tok in enumerate(sampled):
        if j < len(drafts) and tok != drafts[j]:
            return out + [sampled[j + 1]]  # the sample after the draft: the wrong context's
        out.append(tok)
        if j == len(drafts):
            break
    return out


@pytest.mark.parametrize("verifier", [keep_every_draft, next_row_after_a_rejection])
def test_a_wrong_verifier_fails_the_check(llm, target, monkeypatch, verifier):
    """The check's power: the same run with the runner's acceptance rule replaced."""
    monkeypatch.setattr(model_runner, "accept_drafts", verifier)
    params = SamplingParams(temperature=1.0)
    pvalues = conditional_pvalues(sample(llm, params, N // 8), target, params)
    assert min(pvalues.values()) < 1e-6, pvalues
