"""`jaxserve shard-plan --measure`: the compiled step timed on the devices at hand.

Random weights and a zeroed KV cache in the plan's shardings, then two synthetic steps through
the very executable the plan compiled: decode (R requests, one token each, at context C) and a
prefill chunk (one request, T tokens); with data parallelism every rank runs those rows (R
capped by the rank's share of max_num_seqs). Each is run once to warm up, then `steps` times;
the median is reported. With a profile directory (`--profile`), one more decode step runs
under `jax.profiler` (its trace in `<dir>/decode_<T>x<R>/`, benchmarks/trace_kernels.py
reduces it to a per-kernel table).

The weights are made on the devices, each straight into its sharding, by one small compiled
maker per distinct (shape, dtype, sharding) that takes the seed and the weight's index as
arguments: a Llama-3-8B is ~10 small compiles reused over its 32 layers, and no random value is
ever a compile-time constant. (The model's own initializer is one program of every weight's
random draw, ~300 for an 8B model, with the seed a constant; compiled anew for every bucket, it
kept the 64- and 256-sequence cells of the first H200 run from running in time.) The values: norms ones,
quantization scales 1e-3, other floating weights 0.02 x N(0, 1), integer ones (quantized
values, zero points, act-order indices) uniform in [0, 16). The weights and the KV cache are
kept for the next bucket of the same mesh and plan, so a bucket costs its compile and its
steps only.
"""

from __future__ import annotations

import dataclasses
import pathlib
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxserve.config import jax_dtype
from jaxserve.models.layers.linear import INPUT_SCALE_SUFFIX, SCALE_SUFFIX
from jaxserve.runner.kv_cache import allocate_kv_cache
from jaxserve.runner.step_inputs import TokenInfo, pack_rows
from jaxserve.sampling.metadata import SamplingMetadataBuilder
from jaxserve.sampling.state import init_sampling_state

# The arrays a worker holds between buckets: {"key": what they were made for, "params", "kv"}.
_HELD: dict = {}
_MAKERS: dict = {}  # (fill, shape, dtype, sharding) -> its compiled maker


def _fill(name: str, dtype) -> str:
    """How weight `name` of `dtype` is filled (the policy of the module docstring)."""
    if not jnp.issubdtype(dtype, jnp.floating):
        return "small_ints"
    if "norm" in name:
        return "ones"
    if name.endswith((SCALE_SUFFIX, INPUT_SCALE_SUFFIX)):
        return "scale"
    return "normal"


def _maker(fill: str, shape: tuple, dtype, sharding):
    key = (fill, shape, jnp.dtype(dtype).name, sharding)
    if key not in _MAKERS:

        def make(seed, index):
            rng = jax.random.fold_in(jax.random.key(seed), index)
            if fill == "small_ints":
                return jax.random.randint(rng, shape, 0, 16).astype(dtype)
            if fill == "ones":
                return jnp.ones(shape, dtype)
            if fill == "scale":
                return jnp.full(shape, 1e-3, dtype)
            return (0.02 * jax.random.normal(rng, shape, jnp.float32)).astype(dtype)

        _MAKERS[key] = jax.jit(make, out_shardings=sharding)
    return _MAKERS[key]


def _leaf_name(path) -> str:
    """The weight's own name in a state leaf's path (`layers.3.w_up.value` -> `w_up`)."""
    for entry in reversed(path):
        key = getattr(entry, "key", getattr(entry, "name", None))
        if isinstance(key, str) and key not in ("value", "raw_value"):
            return key
    return ""


def random_params(model, params: list, seed: int = 0) -> list[jax.Array]:
    """Random values for the step's weights: `params` (ShapeDtypeStructs with shardings, the
    order of `nnx.split(model)`'s state leaves, as the step takes them) made on the devices."""
    names = [_leaf_name(p) for p, _ in jax.tree_util.tree_leaves_with_path(nnx.split(model)[1])]
    assert len(names) == len(params), (len(names), len(params))
    makers = [_maker(_fill(name, a.dtype), tuple(a.shape), a.dtype, a.sharding)
              for name, a in zip(names, params)]
    return [make(np.uint32(seed), np.int32(i)) for i, make in enumerate(makers)]


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


def held_arrays(abstract, cfg, mesh, rules, plan, num_pages: int,
                page_size: int) -> tuple[list, object, float | None]:
    """(weights, KV cache, seconds spent making them or None when kept from the last bucket) for
    the step of `abstract` (compile_pool.AbstractStep): the arrays of the last bucket when they
    were made for the same weights, cache and mesh, else new ones (the old ones freed first)."""
    key = (tuple((tuple(a.shape), str(a.dtype), a.sharding) for a in abstract.params),
           tuple(d.id for d in mesh.devices.flat), num_pages, page_size, plan["kv_dtype"],
           repr(sorted(rules.items())))
    if _HELD.get("key") == key and "kv" in _HELD:
        return _HELD["params"], _HELD["kv"], None
    _HELD.clear()  # the previous plan's arrays go before the new ones are made
    t0 = time.perf_counter()
    params = random_params(abstract.model, abstract.params)
    kv = allocate_kv_cache(cfg, num_pages, page_size, jax_dtype(plan["kv_dtype"]), mesh, rules)
    jax.block_until_ready((params, kv))
    _HELD.update(key=key, params=params, kv=kv)
    return params, kv, time.perf_counter() - t0


def _traced_step(out: dict, profile_dir: str, bucket, compiled, params, kv, sstate, buffers):
    """One more decode step under `jax.profiler` (host events and the device's kernels; no
    Python frames, no HLO protos), its trace in `<profile_dir>/decode_<T>x<R>/`; a profiler
    that fails is recorded (`profile_error`), the step's timings stay."""
    where = pathlib.Path(profile_dir) / f"decode_{bucket[0]}x{bucket[1]}"
    options = jax.profiler.ProfileOptions()
    options.python_tracer_level = 0
    options.enable_hlo_proto = False
    try:
        jax.profiler.start_trace(str(where), profiler_options=options)
    except Exception as e:  # e.g. no CUPTI: the measurement is still worth having
        out["profile_error"] = f"{type(e).__name__}: {e}"[:500]
        return kv, sstate
    try:
        kv, sstate, res, _ = compiled(params, kv, sstate, *buffers)
        jax.block_until_ready(res.token_ids)
    finally:
        try:
            jax.profiler.stop_trace()
            out["profile"] = str(where)
        except Exception as e:
            out["profile_error"] = f"{type(e).__name__}: {e}"[:500]
    return kv, sstate


def measure_step(settings, cfg, mesh, rules, plan, compiled, abstract, sampler_config, num_pages,
                 pages_per_req, bucket) -> dict:
    T, R = bucket
    ps = settings.page_size
    layout = abstract.program.layout(T, R)
    params, kv, made_s = held_arrays(abstract, cfg, mesh, rules, plan, num_pages, ps)
    _HELD.pop("kv")  # donated to the steps below; put back once they returned it
    D = mesh.shape["data"]  # with data parallelism every rank runs the same synthetic rows
    # the sampling state where the step's program keeps it (sampling/state.py's shardings)
    sstate = jax.device_put(init_sampling_state(sampler_config), abstract.program.state_sharding)
    rank_pages = num_pages // D
    # A rank's rows name its own slots and pages (the sentinel slot is the rank's slot count).
    rank_config = dataclasses.replace(sampler_config, max_num_seqs=sampler_config.max_num_seqs // D)
    context = settings.context or min(settings.max_model_len, 1024)
    n = min(R, rank_config.max_num_seqs)  # decoding requests per rank
    context = max(1, min(context, pages_per_req * ps, (rank_pages - 1) // n * ps))
    out = {"context": context, "decode_requests": n * D,
           "weights_s": None if made_s is None else round(made_s, 2)}
    cases = {"decode": ([1] * n, [context - 1] * n), "prefill": ([T], [0])}
    profile = settings.profile_dir is not None and (
        settings.profile_buckets is None or [T, R] in [list(b) for b in settings.profile_buckets])
    for name, (lens, starts) in cases.items():
        buffers, used = _buffers(layout, rank_config, ps, pages_per_req, T, R, lens, starts,
                                 cfg.vocab_size)
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
        if name == "decode" and profile:
            kv, sstate = _traced_step(out, settings.profile_dir, bucket, compiled, params, kv, sstate,
                                      buffers)
    _HELD["kv"] = kv
    out["steps"] = settings.steps
    return out
