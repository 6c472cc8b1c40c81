"""MLA prefill, absorbed vs split (models/layers/mla.py): predicted and measured cost of a
2-layer cut of DeepSeek V3's attention (per layer: the up-projections, the latent write and
the attention; the q / kv down-projections and o_proj are the same in both forms and left
out) for one request's chunk of T tokens with `--context` cached tokens before it.

For each T and form:

- `predicted_flops`: 2 x the cost model's multiply-adds on the step's own rows
  (`own_rows_macs`, what decides the form) x heads x layers. Everything else (the queries'
  absorption, W_UV on the output, the cached context) is the same in both forms.
- `predicted_flops_common`: what both forms spend outside the own rows here, the queries'
  absorption (W_UK) and W_UV on the output (no cached context by default).
- `xla_flops`: XLA's cost analysis of the compiled program (CPU; abstract inputs, nothing
  runs), V3's 128 heads. XLA counts a while loop's body once: the absorbed attention's paged
  loops (the reference's, traced trip counts) are undercounted, so this figure is exact only
  for loop-free parts. `xla_flops_expanded`: the split's expanded part alone (the rows' key
  and value up-projections and `expanded_step_attention`: no loop), exact, against its own
  prediction `predicted_flops_expanded`.
- `ms` (with `--time`): wall time on this CPU of the jitted program with `--time-heads` heads
  (16: one device's share of 128 under 8-way tensor parallelism), impl "auto" (the native CPU
  kernel for the absorbed attention), median of `--repeats`.

    .venv/bin/python benchmarks/mla_prefill_cost.py --time
"""

from __future__ import annotations

import argparse
import os
import pathlib
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

HERE = pathlib.Path(__file__).parent
sys.path.insert(0, str(HERE))
from results_log import append_results  # noqa: E402

RESULTS = HERE / "results" / "mla_prefill_cost.jsonl"
# DeepSeek V3's attention dimensions (config.json of deepseek-ai/DeepSeek-V3)
V3 = dict(heads=128, latent=512, nope=128, rope=64, value=128)
LAYERS = 2
PAGE_SIZE = 16


def _inputs(T: int, context: int, heads: int, dtype):
    """Abstract (or, with `real`, random) arguments of the 2-layer cut, and its metadata."""
    from jaxserve.models.interface import AttentionMetadata

    C, Dn, Dr, Dv = V3["latent"], V3["nope"], V3["rope"], V3["value"]
    kv = context + T
    pages = -(-kv // PAGE_SIZE)
    md = AttentionMetadata(
        block_tables=jnp.arange(1, pages + 1, dtype=jnp.int32)[None],
        kv_lens=jnp.asarray([kv], jnp.int32),
        query_start_loc=jnp.asarray([0, T], jnp.int32),
        num_seqs=jnp.asarray(1, jnp.int32),
        slot_mapping=jnp.arange(PAGE_SIZE + context, PAGE_SIZE + kv, dtype=jnp.int32))
    shapes = dict(q_nope=(T, heads, Dn), q_rope=(T, heads, Dr), latent=(T, C), k_rope=(T, Dr),
                  w_uk=(LAYERS, heads, Dn, C), w_uv=(LAYERS, heads, C, Dv),
                  caches=(LAYERS, pages + 1, PAGE_SIZE, C + Dr))
    return shapes, md


def _program(impl: str):
    from jaxserve.models.layers.attention import AttentionSpec
    from jaxserve.models.layers.mla import mla_attention

    spec = AttentionSpec(sm_scale=0.1, impl=impl)

    def cut(a, md):
        outs, caches = [], []
        for i in range(LAYERS):
            out, cache = mla_attention(a["q_nope"], a["q_rope"], a["latent"], a["k_rope"],
                                       a["caches"][i], md, spec, a["w_uk"][i], a["w_uv"][i],
                                       mesh=None)
            outs.append(out)
            caches.append(cache)
        return outs, caches

    return jax.jit(cut)


def _expanded_program():
    from jaxserve.models.layers.mla import EXPAND_SPECS
    from jaxserve.models.layers.linear import dense
    from jaxserve.pallas_kernels.mla_paged_attention.expanded import expanded_step_attention

    def part(a, md):
        outs = []
        for i in range(LAYERS):
            dtype = a["latent"].dtype
            k_nope = dense(EXPAND_SPECS["w_uk"], a["latent"], a["w_uk"][i]).astype(dtype)
            v = dense(EXPAND_SPECS["w_uv"], a["latent"], a["w_uv"][i]).astype(dtype)
            outs.append(expanded_step_attention(a["q_nope"], a["q_rope"], k_nope, a["k_rope"], v,
                                                md, sm_scale=0.1))
        return outs

    return jax.jit(part)


def _flops(fn, shapes, md, dtype) -> float:
    args = {k: jax.ShapeDtypeStruct(s, dtype) for k, s in shapes.items()}
    cost = fn.lower(args, md).compile().cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    return float(cost.get("flops", 0.0))


def main() -> None:
    from jaxserve.models.layers.mla import PREFILL_FORM_ENV, own_rows_macs
    from jaxserve.pallas_kernels.mla_paged_attention.expanded import expanded_pairs

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", default="128,256,512,1024,2048")
    ap.add_argument("--context", type=int, default=0)
    ap.add_argument("--time", action="store_true", help="also run them on this CPU")
    ap.add_argument("--time-heads", type=int, default=16)
    ap.add_argument("--time-max-tokens", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    import jaxserve.backends.cpu  # noqa: F401  (registers the native CPU attention kernel)

    dims = {k: V3[k] for k in ("latent", "nope", "rope", "value")}
    dtype = jnp.bfloat16
    records = []
    for T in (int(t) for t in args.tokens.split(",")):
        macs = own_rows_macs(T, 1, **dims)
        exp_macs = (V3["latent"] * (V3["nope"] + V3["value"]) * T
                    + (V3["nope"] + V3["rope"] + V3["value"]) * expanded_pairs(T))
        shapes, md = _inputs(T, args.context, V3["heads"], dtype)
        rec = dict(bench="mla_prefill_cost", model="DeepSeek-V3 attention, 2-layer cut",
                   tokens=T, context=args.context, heads=V3["heads"], dtype="bfloat16",
                   predicted_flops_common=2 * T * V3["heads"] * V3["latent"]
                   * (V3["nope"] + V3["value"]) * LAYERS,
                   predicted_flops_expanded=2 * exp_macs * V3["heads"] * LAYERS,
                   xla_flops_expanded=_flops(_expanded_program(), shapes, md, dtype))
        for form in ("absorbed", "split"):
            os.environ[PREFILL_FORM_ENV] = form
            rec[f"predicted_flops_{form}"] = 2 * macs[form] * V3["heads"] * LAYERS
            rec[f"xla_flops_{form}"] = _flops(_program("reference"), shapes, md, dtype)
            if args.time and T <= args.time_max_tokens:
                rec[f"ms_{form}"] = _time(T, args, form)
        os.environ.pop(PREFILL_FORM_ENV, None)
        print({k: (f"{v:.3e}" if isinstance(v, float) else v) for k, v in rec.items()},
              flush=True)
        records.append(rec)
    if not args.no_write:
        append_results(RESULTS, records)


def _time(T: int, args, form: str) -> float:
    heads = args.time_heads
    shapes, md = _inputs(T, args.context, heads, jnp.bfloat16)
    rng = np.random.default_rng(0)
    real = {k: jnp.asarray(rng.standard_normal(s, np.float32) * 0.1, jnp.bfloat16)
            for k, s in shapes.items()}
    fn = _program("auto")
    jax.block_until_ready(fn(real, md))
    times = []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(real, md))
        times.append((time.perf_counter() - t0) * 1e3)
    return round(statistics.median(times), 2)


if __name__ == "__main__":
    main()
