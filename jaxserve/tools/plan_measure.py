"""`jaxserve shard-plan --measure`: the compiled step timed on the devices at hand.

Random weights (`create_model` without a checkpoint) and a zeroed KV cache in the plan's
shardings, then two synthetic steps through the very executable the plan compiled: decode (R
requests, one token each, at context C) and a prefill chunk (one request, T tokens); with data
parallelism every rank runs those rows (R capped by the rank's share of max_num_seqs). Each is
run once to warm up, then `steps` times; the median is reported.
"""

from __future__ import annotations

import dataclasses
import statistics
import time

import jax
import numpy as np

from jaxserve.config import jax_dtype
from jaxserve.models.weights import create_model
from jaxserve.runner.kv_cache import allocate_kv_cache
from jaxserve.runner.step_inputs import TokenInfo, pack_rows
from jaxserve.sampling.metadata import SamplingMetadataBuilder
from jaxserve.sampling.state import init_sampling_state, sampling_state_shardings


def _buffers(layout, sampler_config, page_size, pages_per_req, T, R, lens, starts, vocab):
    n = len(lens)
    tables = np.zeros((n, pages_per_req), np.int32)
    next_page = 1  # page 0 is the null page
    for i in range(n):
        need = -(-(starts[i] + lens[i]) // page_size)
        tables[i, :need] = np.arange(next_page, next_page + need)
        next_page += need
    rng = np.random.default_rng(0)
    tokens = rng.integers(3, vocab, size=int(sum(lens)), dtype=np.int32)
    inputs = pack_rows(tokens, np.asarray(starts, np.int64), np.asarray(lens, np.int64), tables,
                       num_tokens=T, num_reqs=R, page_size=page_size)
    total = int(sum(lens))
    slots = np.zeros(T, np.int32)
    slots[:total] = np.repeat(np.arange(n, dtype=np.int32), lens)
    valid = np.zeros(T, np.bool_)
    valid[:total] = True
    sample_slots = np.full(R, sampler_config.max_num_seqs, np.int32)
    sample_slots[:n] = np.arange(n)
    tok = TokenInfo(slots=slots, is_prompt=np.zeros(T, np.bool_), valid=valid,
                    next_prompt_token=np.full(T, -1, np.int32), sample_slots=sample_slots)
    meta = SamplingMetadataBuilder(sampler_config).build(np.arange(n), np.zeros(n, np.int64), R)
    return layout.pack((inputs, meta, tok)), next_page


def measure_step(settings, cfg, mesh, rules, plan, compiled, layout, sampler_config, num_pages, pages_per_req,
                 bucket) -> dict:
    T, R = bucket
    ps = settings.page_size
    model = create_model(cfg, dtype=jax_dtype(plan["dtype"]), mesh=mesh, attention_impl=plan["attention_impl"],
                         quantization=settings.quantization, rules=rules)
    from flax import nnx

    params = jax.tree.leaves(nnx.split(model)[1])
    del model
    D = mesh.shape["data"]  # with data parallelism every rank runs the same synthetic rows
    kv = allocate_kv_cache(cfg, num_pages, ps, jax_dtype(plan["kv_dtype"]), mesh, rules)
    sstate = jax.device_put(init_sampling_state(sampler_config),
                            sampling_state_shardings(sampler_config, mesh, rules, D > 1))
    rank_pages = num_pages // D
    # A rank's rows name its own slots and pages (the sentinel slot is the rank's slot count).
    rank_config = dataclasses.replace(sampler_config, max_num_seqs=sampler_config.max_num_seqs // D)
    context = settings.context or min(settings.max_model_len, 1024)
    n = min(R, rank_config.max_num_seqs)  # decoding requests per rank
    context = max(1, min(context, pages_per_req * ps, (rank_pages - 1) // n * ps))
    out = {"context": context, "decode_requests": n * D}
    cases = {"decode": ([1] * n, [context - 1] * n), "prefill": ([T], [0])}
    for name, (lens, starts) in cases.items():
        buffers, used = _buffers(layout, rank_config, ps, pages_per_req, T, R, lens, starts, cfg.vocab_size)
        if used > rank_pages:
            out[f"{name}_ms"] = None
            continue
        if D > 1:
            buffers = tuple(np.stack([b] * D) for b in buffers)
        times = []
        for i in range(settings.steps + 1):
            t0 = time.perf_counter()
            kv, sstate, res, _ = compiled(params, kv, sstate, *buffers)
            jax.block_until_ready(res.token_ids)
            if i:
                times.append(time.perf_counter() - t0)
        out[f"{name}_ms"] = round(1000 * statistics.median(times), 2)
    out["steps"] = settings.steps
    return out
