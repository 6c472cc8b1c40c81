"""The LoRA term of one adapted product, three ways (and a variant of two of them): a one-hot
over all slots (what models/layers/lora.py computes), a per-token gather of the adapter's
weights, and an expert-style grouping of the tokens by slot.

The LoRA term is the only part of a step that differs between them: y += x @ A[slot] @ B[slot]
per token, with the slots' weights stacked A [S, in, R], B [S, R, out] (bfloat16, float32
accumulation, as `models/layers/lora.py`). Each implementation is split into what a step
computes once from the tokens' slots (`prepare`, shared by every adapted product of every
layer) and what each product computes (`delta`, what is timed and analysed):

- "onehot": x @ A for every slot ([T, S, R]), masked by the token's one-hot row, contracted
  with B over the two dims (slot, rank): S * R * (in + out) multiply-adds per token. The form
  `lora_delta` had until this benchmark measured "onehot-flat"; XLA:CPU lowers it with a copy
  of the whole B stack into (rank, slot) order on every call;
- "onehot-flat" (`lora_delta` now): the same, with the B contraction written over one dim of
  S * R (x @ A reshaped to [T, S * R], B to [S * R, out]: free reshapes);
- "gather": A[slot_t] and B[slot_t] gathered per token ([T, in, R], [T, R, out]), then
  x[t] @ A_t @ B_t: R * (in + out) per token, but T copies of the weights are read and written;
- "grouped": the tokens sorted by slot (base-model tokens last), `jax.lax.ragged_dot` with the
  slots' group sizes (as layers/moe.py's "ragged"), the rows put back in token order:
  R * (in + out) per token, each slot's weights read once, plus the two row permutations.
  XLA:CPU has no grouped matmul: JAX lowers `ragged_dot` there to every group against every
  row (masked), so on the CPU it is measured for completeness, not as grouping;
- "segments": the same sorted rows taken in tiles, one (tile, slot) pair at a time in a loop
  (layers/moe.py's "tiled", the CPU's form of grouping; float32 inside the loop, which
  XLA:CPU needs). Measured on the CPU only: XLA's cost analysis counts a loop's body once,
  not per trip, so its compile-only figures would mean nothing;
- "grouped-presorted": "grouped" for tokens that already come in slot order (a batch the
  scheduler ordered by adapter): the two `ragged_dot`s without the row permutations, the
  bound on what grouping could cost. Compile-only (on XLA:CPU it is "grouped"'s dense form).

For each case (layer in x out, S slots, T tokens, the tokens' slots at random over the S
slots or all on slot 1) the implementations' results are first checked against each other
(allclose, with every fifth token on the base model); then (a) the wall time of the jitted
`delta` on this CPU (the implementations alternating, median of --reps calls after a warm-up)
and (b) XLA's cost analysis (flops, bytes accessed, and XLA's own time estimate
"optimal_seconds") of `delta` compiled for one TPU v6e chip (libtpu's compile-only topology;
no TPU needed). A roofline time, max(flops / peak, bytes / HBM bandwidth) with v6e's figures
from jaxserve/tools/chips.py, is a prediction, not a measurement, and it flatters the
gathered and grouped forms: their products are 16 wide (R) on a 256-wide MXU. JAX's CUDA
compile-only path (benchmarks/gpu_kernel_compile.py's) compiles these functions for an H100,
but its executables give no cost analysis (`cost_analysis()` is None with jax 0.10.2), so no
GPU figures are taken. One JSON line per (target, case, implementation) goes to
benchmarks/results/lora_product.jsonl.

    ALLOW_MULTIPLE_LIBTPU_LOAD=1 nice python benchmarks/lora_product.py [--targets cpu v6e]
        [--tokens 8 256 2048] [--slots 1 4 8] [--outs 4096 14336] [--reps 7]

The TPU target is compiled in a child process (libtpu is loaded there only).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import statistics
import subprocess
import sys
import time

from results_log import append_results

HERE = pathlib.Path(__file__).resolve().parent
RESULTS = HERE / "results" / "lora_product.jsonl"
# what each target measures: "segments" is a loop (XLA's cost analysis counts its body once);
# "grouped-presorted" groups as "grouped" does on XLA:CPU (every group against every row)
CPU_IMPLS = ("onehot", "onehot-flat", "gather", "grouped", "segments")
COMPILED_IMPLS = ("onehot", "onehot-flat", "gather", "grouped", "grouped-presorted")
ALL_IMPLS = CPU_IMPLS + ("grouped-presorted",)
IN, RANK = 4096, 16
TARGETS = ("v6e",)  # compile-only targets (jaxserve/tools/chips.py's names)


# ------------------------------------------------------------------------------ implementations
def prepare(impl: str, slots, S: int):
    """What a step computes once from its tokens' slots ([T] int32, 0 = no adapter, s = the
    stack's entry s - 1), for implementation `impl`."""
    import jax
    import jax.numpy as jnp

    if impl in ("onehot", "onehot-flat"):
        return jax.nn.one_hot(slots - 1, S, dtype=jnp.float32)
    if impl == "gather":
        return slots
    key = jnp.where(slots > 0, slots - 1, S)  # base-model tokens sort last, in no group
    sizes = jnp.zeros((S + 1,), jnp.int32).at[key].add(1)[:S]
    if impl == "grouped-presorted":  # the tokens come in slot order (`in_slot_order`)
        return sizes, slots > 0
    order = jnp.argsort(key, stable=True).astype(jnp.int32)  # "grouped", "segments"
    back = jnp.argsort(order).astype(jnp.int32)  # sorted row of each token
    return order, sizes, back, slots > 0


def in_slot_order(slots):
    """The slots sorted as "grouped-presorted" expects its tokens (base-model tokens last)."""
    import numpy as np

    slots = np.asarray(slots)
    return slots[np.argsort(np.where(slots > 0, slots, np.iinfo(np.int32).max), kind="stable")]


def delta(impl: str, x, a, b, prep):
    """The adapters' term for x [T, in] with stacks a [S, in, R], b [S, R, out]: float32 [T, out]."""
    import jax
    import jax.numpy as jnp
    from jaxserve.models.layers.lora import lora_delta

    f32 = jnp.float32
    if impl == "onehot-flat":
        return lora_delta("te,ef->tf", x, a, b, prep)
    if impl == "onehot":  # the B contraction over the two dims (slot, rank)
        xa = jnp.einsum("te,ser->tsr", x.astype(a.dtype), a, preferred_element_type=f32)
        xa = (xa * prep[:, :, None]).astype(b.dtype)
        return jnp.einsum("tsr,srf->tf", xa, b, preferred_element_type=f32)
    if impl == "grouped-presorted":
        sizes, adapted = prep
        xa = jax.lax.ragged_dot(x.astype(a.dtype), a, sizes, preferred_element_type=f32)
        y = jax.lax.ragged_dot(xa.astype(b.dtype), b, sizes, preferred_element_type=f32)
        return jnp.where(adapted[:, None], y, 0.0)
    if impl == "gather":
        slots = prep
        idx = jnp.maximum(slots - 1, 0)
        xa = jnp.einsum("te,ter->tr", x.astype(a.dtype), a[idx], preferred_element_type=f32)
        xa = jnp.where((slots > 0)[:, None], xa, 0.0).astype(b.dtype)
        return jnp.einsum("tr,trf->tf", xa, b[idx], preferred_element_type=f32)
    order, sizes, back, adapted = prep
    xs = x.astype(a.dtype)[order]
    if impl == "grouped":
        xa = jax.lax.ragged_dot(xs, a, sizes, preferred_element_type=f32).astype(b.dtype)
        y = jax.lax.ragged_dot(xa, b, sizes, preferred_element_type=f32)
    elif impl == "segments":
        y = _segments(xs, a, b, sizes)
    else:
        raise ValueError(impl)
    return jnp.where(adapted[:, None], y[back], 0.0)  # rows past the groups: base tokens


def _segments(xs, a, b, sizes):
    """x @ A[g] @ B[g] for each group g of the sorted rows xs [T, in] (sizes [S]), one
    (tile of rows, group) pair at a time -> [T, out] float32 (zero past the groups)."""
    import jax
    import jax.numpy as jnp
    from jaxserve.models.layers.moe import tile_rows

    T, S = xs.shape[0], sizes.shape[0]
    B = tile_rows(T, S)
    blocks = -(-T // B)
    xs = jnp.pad(xs, ((0, blocks * B - T), (0, 0)))
    ends = jnp.cumsum(sizes)
    starts = ends - sizes
    first = starts // B
    count = jnp.where(sizes > 0, (ends - 1) // B - first + 1, 0)  # tiles each group touches
    cum = jnp.cumsum(count)
    f32 = jnp.float32

    def body(t, out):
        g = jnp.minimum(jnp.searchsorted(cum, t, side="right"), S - 1)
        block = jnp.clip(first[g] + t - (cum[g] - count[g]), 0, blocks - 1)
        r0 = block * B
        row = r0 + jnp.arange(B)
        live = (row >= starts[g]) & (row < ends[g]) & (t < cum[-1])
        xa = jax.lax.dynamic_slice_in_dim(xs, r0, B).astype(f32) @ a[g].astype(f32)
        y = xa.astype(b.dtype).astype(f32) @ b[g].astype(f32)
        cur = jax.lax.dynamic_slice_in_dim(out, r0, B)
        return jax.lax.dynamic_update_slice_in_dim(out, cur + jnp.where(live[:, None], y, 0.0), r0, 0)

    out = jnp.zeros((blocks * B, b.shape[-1]), f32)
    return jax.lax.fori_loop(0, blocks + S - 1, body, out)[:T]


# ------------------------------------------------------------------------------------- cases
def cases(args) -> list[dict]:
    out = []
    for o in args.outs:
        for S in args.slots:
            for T in args.tokens:
                for mix in ("random", "one"):
                    if S == 1 and mix == "one":
                        continue  # the same case as "random"
                    out.append(dict(inp=IN, out=o, S=S, R=RANK, T=T, mix=mix))
    return out


def slots_of(case: dict, seed: int = 0):
    import numpy as np

    rng = np.random.default_rng(seed)
    if case["mix"] == "one":
        return np.ones(case["T"], np.int32)
    return rng.integers(1, case["S"] + 1, size=case["T"]).astype(np.int32)


def arrays(case: dict, seed: int = 0):
    """x, a, b (bfloat16, random; B scaled like an adapter's) and the tokens' slots."""
    import jax
    import jax.numpy as jnp

    kx, ka, kb = jax.random.split(jax.random.key(seed), 3)
    bf = jnp.bfloat16
    x = jax.random.normal(kx, (case["T"], case["inp"]), bf)
    a = (jax.random.normal(ka, (case["S"], case["inp"], case["R"]), jnp.float32) / 64).astype(bf)
    b = (jax.random.normal(kb, (case["S"], case["R"], case["out"]), jnp.float32) / 4).astype(bf)
    return x, a, b, jnp.asarray(slots_of(case, seed))


def check_agree(case: dict, impls=ALL_IMPLS) -> float:
    """Every implementation's result on this case agrees with "onehot"'s on the same tokens
    (allclose; every fifth token on the base model, whose term must be zero; the tokens in slot
    order for "grouped-presorted"); returns the largest absolute difference. AssertionError
    otherwise."""
    import jax
    import numpy as np

    x, a, b, slots = arrays(case)
    slots = slots.at[::5].set(0)
    run = jax.jit(lambda impl, x, a, b, slots: delta(impl, x, a, b, prepare(impl, slots, case["S"])),
                  static_argnums=0)
    worst = 0.0
    for order in (slots, in_slot_order(slots)):
        ref = np.asarray(run("onehot", x, a, b, order))
        assert not np.any(ref[np.asarray(order) == 0]), "a base-model token got an adapter term"
        for impl in impls:
            if (impl == "grouped-presorted") != (order is not slots) or impl == "onehot":
                continue
            y = np.asarray(run(impl, x, a, b, order))
            np.testing.assert_allclose(y, ref, rtol=2e-2, atol=2e-2 * float(np.abs(ref).max()),
                                       err_msg=f"{impl} against onehot, {case}")
            worst = max(worst, float(np.abs(y - ref).max()))
    return worst


# --------------------------------------------------------------------------------- measuring
def cpu_times(case: dict, reps: int, impls=CPU_IMPLS) -> dict[str, dict]:
    """Median wall time of each implementation's jitted delta on the CPU, the implementations
    alternating within each repetition (the host may be shared)."""
    import jax

    x, a, b, slots = arrays(case)
    fns, preps = {}, {}
    for impl in impls:
        preps[impl] = jax.block_until_ready(jax.jit(prepare, static_argnums=(0, 2))(impl, slots, case["S"]))
        fns[impl] = jax.jit(lambda x, a, b, p, impl=impl: delta(impl, x, a, b, p))
        jax.block_until_ready(fns[impl](x, a, b, preps[impl]))  # compile + warm-up
        jax.block_until_ready(fns[impl](x, a, b, preps[impl]))
    times: dict[str, list[float]] = {impl: [] for impl in impls}
    for _ in range(reps):
        for impl in impls:
            t0 = time.perf_counter()
            jax.block_until_ready(fns[impl](x, a, b, preps[impl]))
            times[impl].append((time.perf_counter() - t0) * 1e3)
    return {impl: {"median_ms": statistics.median(t), "all_ms": [round(v, 3) for v in t]}
            for impl, t in times.items()}


def device_of(target: str):
    """One chip of a compile-only TPU topology (libtpu's smallest slice of one host)."""
    from jax.experimental import topologies

    return topologies.get_topology_desc(topology_name=f"{target}:2x2", platform="tpu").devices[0]


def cost(case: dict, impl: str, device) -> dict:
    """XLA's cost analysis of `delta` compiled for `device` (compile-only)."""
    assert impl in COMPILED_IMPLS, impl
    import jax
    import jax.numpy as jnp
    from jax.sharding import SingleDeviceSharding

    sh = SingleDeviceSharding(device)
    T, S, R, i, o = case["T"], case["S"], case["R"], case["inp"], case["out"]

    def sds(shape, dt):
        return jax.ShapeDtypeStruct(shape, dt, sharding=sh)

    bf = jnp.bfloat16
    prep = jax.eval_shape(lambda slots: prepare(impl, slots, S), sds((T,), jnp.int32))
    prep = jax.tree.map(lambda p: sds(p.shape, p.dtype), prep)
    fn = jax.jit(lambda x, a, b, p: delta(impl, x, a, b, p))
    t0 = time.perf_counter()
    compiled = fn.lower(sds((T, i), bf), sds((S, i, R), bf), sds((S, R, o), bf), prep).compile()
    ca = compiled.cost_analysis()
    ca = ca[0] if isinstance(ca, list) else ca
    return {"flops": ca.get("flops"), "bytes_accessed": ca.get("bytes accessed"),
            "optimal_seconds": ca.get("optimal_seconds"),
            "compile_s": round(time.perf_counter() - t0, 2)}


def roofline_us(chip: str, flops: float, nbytes: float) -> float:
    from jaxserve.tools.chips import CHIPS

    c = CHIPS[chip]
    return max(flops / c.peak_flops, nbytes / c.hbm_bandwidth) * 1e6


def environment() -> dict:
    import jax

    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=HERE, capture_output=True,
                             text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        sha = None
    model = ""
    try:
        model = next((ln.partition(":")[2].strip() for ln in subprocess.run(
            ["lscpu"], capture_output=True, text=True).stdout.splitlines()
            if ln.startswith("Model name")), "")
    except OSError:
        pass
    try:
        dirty = bool(subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                                    cwd=HERE, capture_output=True, text=True).stdout.strip())
    except OSError:
        dirty = None
    return {"git_sha": sha, "git_dirty": dirty, "jax": jax.__version__, "cpu": model,
            "cores": os.cpu_count()}


def run_target(target: str, args, env: dict) -> list[dict]:
    """The rows of one target: "cpu" (check, wall times) or a compile-only chip (costs)."""
    rows = []
    stamp = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    device = None if target == "cpu" else device_of(target)
    chosen = [i for i in (CPU_IMPLS if target == "cpu" else COMPILED_IMPLS) if i in (args.impls or ALL_IMPLS)]
    for case in cases(args):
        name = f"{case['inp']}x{case['out']} S={case['S']} T={case['T']} {case['mix']}"
        if target == "cpu":
            worst = check_agree(case, chosen)
            got = cpu_times(case, args.reps, chosen)
            load = os.getloadavg()
            for impl in chosen:
                rows.append({"benchmark": "lora_product", "target": "cpu", **case, "impl": impl,
                             **got[impl], "allclose": True, "max_abs_diff_any_impl": worst,
                             "load_avg": [round(v, 2) for v in load], **env, "timestamp": stamp})
            print(f"cpu  {name:36s} " + "  ".join(
                f"{i} {got[i]['median_ms']:7.2f}" for i in chosen) + " ms" + f"  (load {load[0]:.1f})",
                flush=True)
            continue
        line = []
        for impl in chosen:
            c = cost(case, impl, device)
            roof = roofline_us(target, c["flops"] or 0.0, c["bytes_accessed"] or 0.0)
            rows.append({"benchmark": "lora_product", "target": target, **case, "impl": impl, **c,
                         "roofline_us_predicted": round(roof, 3), **env, "timestamp": stamp})
            line.append(f"{impl} {c['flops'] / 1e6:.1f} MFLOP {c['bytes_accessed'] / 1e6:.1f} MB "
                        f"roofline {roof:.1f} us (XLA's estimate {1e6 * (c['optimal_seconds'] or 0):.1f} us)")
        print(f"{target} {name}:\n  " + "\n  ".join(line), flush=True)
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--targets", nargs="+", default=["cpu", "v6e"], choices=["cpu", *TARGETS])
    p.add_argument("--tokens", nargs="+", type=int, default=[8, 256, 2048])
    p.add_argument("--slots", nargs="+", type=int, default=[1, 4, 8])
    p.add_argument("--outs", nargs="+", type=int, default=[4096, 14336])
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--impls", nargs="+", choices=ALL_IMPLS, help="a subset (default: all)")
    p.add_argument("--results", type=pathlib.Path, default=RESULTS, help="the JSON lines' file")
    p.add_argument("--child", help=argparse.SUPPRESS)  # a compile-only target, in this process
    args = p.parse_args()
    if args.child:
        env = environment()
        for row in run_target(args.child, args, env):
            print("ROW " + json.dumps(row), flush=True)
        return 0
    rows = []
    for target in args.targets:
        if target == "cpu":
            import jax

            jax.config.update("jax_platforms", "cpu")
            rows += run_target("cpu", args, environment())
            continue
        cmd = [sys.executable, __file__, "--child", target, "--tokens", *map(str, args.tokens),
               "--slots", *map(str, args.slots), "--outs", *map(str, args.outs),
               *(["--impls", *args.impls] if args.impls else [])]
        child_env = {**os.environ, "JAX_PLATFORMS": "cpu", "ALLOW_MULTIPLE_LIBTPU_LOAD": "1"}
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=child_env)
        for line in proc.stdout:
            if line.startswith("ROW "):
                rows.append(json.loads(line[4:]))
            else:
                print(line, end="", flush=True)
        if proc.wait():
            print(f"{target}: the compile-only child failed (exit {proc.returncode})", file=sys.stderr)
    append_results(args.results, rows)
    print(f"{len(rows)} rows appended to {args.results}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
