"""Mixture-of-experts MLP: a router picks the top-k experts of each token, and a grouped
computation runs each expert only on the tokens routed to it.

The (token, expert) assignments are sorted by expert, so each expert's rows are one
contiguous group of the sorted rows; three grouped products (gate, up, down) then take each
group through its own expert's weights. Implementations of the grouped product (`MOE_IMPLS`):

- "ragged": `jax.lax.ragged_dot`, the native grouped matmul on TPU and GPU. XLA:CPU has none:
  JAX lowers it there to a dense product of every group with every row (masked), which is
  the dense computation again;
- "tiled": for the CPU: the sorted rows are cut into tiles of B rows, and each (tile, expert)
  pair whose rows overlap runs one [B, E] x [E, F] product with that expert's weights, in a
  loop (at most rows / B + experts - 1 pairs: the tiling of a grouped-matmul kernel);
- "dense": every expert on every token, combined with the routing weights (zero for experts
  not chosen): the baseline the grouped forms are measured against, and a reference;
- "tiled-or-dense": "tiled", except for small steps with experts that are not float32, which
  run "dense" (chosen per step, by its static token count): each (tile, expert) pair converts
  its expert's weights to float32 (XLA:CPU has no bfloat16 dot inside a loop), and that costs
  more than the dense form's extra products until those grow past `DENSE_MAX_EXTRA_ROWS`
  (tokens times the experts a token does not use).

gpt-oss's experts (`models/gpt_oss.py`) add what the functions take as arguments: a router
that soft-maxes over the k largest logits only (`route`'s `select_first`), biases on gate and
up (per expert and channel) and on down (added after the experts' partial sums are added up,
so once however the experts are split), and the clamped SwiGLU (`ClampedSwiGLU`, an `act`).

Stacked expert weights may be kept quantized (`QuantizedWeight`): int8 with a scale per expert
and output channel, or MXFP4 (gpt-oss's experts: packed e2m1 codes and an e8m0 exponent per 32
contracted values, `linear.mxfp4_weight`); each form dequantizes the experts it reads inside
the step ("tiled": one expert per (tile, expert) pair), so the device holds the packed bytes.

The model receives its implementation at construction (`moe_impl`); the engine's backend
picks it (`DevicePlan.moe_impl`: "ragged" on TPU/GPU, "tiled-or-dense" on the CPU).

Expert parallelism: when the `expert` logical axis is sharded over a mesh axis (the
EXPERT_PARALLEL_RULES preset), each device holds num_experts / n experts and computes, for
every token (the activations are replicated, as in the tensor-parallel layout), the
contributions of its own experts only; a psum adds them up. When instead the experts'
`mlp` dim is sharded (the default rules), each device computes every expert on its slice of
the intermediate dim and the down products' partial sums are added the same way.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P
from jaxserve.models.layers.linear import QuantizedWeight
from jaxserve.models.sharding import context_mesh

MOE_IMPLS = ("ragged", "tiled", "dense", "tiled-or-dense")
# `dense`-style specs of the stacked expert weights: they decide which dims hold the output
# channels of an int8 expert weight (one scale per expert and output channel).
EXPERT_SPECS = {"w_gate": "te,xef->txf", "w_up": "te,xef->txf", "w_down": "txf,xfe->txe"}


def route(logits: jax.Array, top_k: int, normalize: bool, expert_scale: jax.Array | None = None,
          select_first: bool = False) -> tuple[jax.Array, jax.Array]:
    """logits [T, X] -> (weights [T, k] float32, expert ids [T, k] int32): softmax over all
    experts, the k largest, renormalized to sum to one when `normalize` (Mixtral; Qwen3-MoE's
    norm_topk_prob), then times each chosen expert's `expert_scale` [X] when given (Gemma 4).
    `select_first` (gpt-oss): the k largest logits, then a softmax over those k."""
    if select_first:
        top, ids = jax.lax.top_k(logits.astype(jnp.float32), top_k)
        return jax.nn.softmax(top, axis=-1), ids.astype(jnp.int32)
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    weights, ids = jax.lax.top_k(probs, top_k)
    if normalize:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    if expert_scale is not None:
        weights = weights * expert_scale.astype(jnp.float32)[ids]
    return weights, ids.astype(jnp.int32)


# Where the dense form stops beating the tiles ("tiled-or-dense"), as tokens x (experts -
# top_k): the expert-rows it computes beyond the grouped form. Measured with
# benchmarks/moe_benchmark.py on a 2-core AVX-512 CPU (4 layers, hidden 1024, bfloat16,
# tiled / dense median step times): 8 experts top-2 (intermediate 1024): 0.5-0.6x at 32-128
# tokens, 0.74-0.99x at 256, 0.77-1.14x at 512, 1.02x at 1024, 2.24x at 2048 (crossover ~1024
# tokens: 6144 extra rows); 32 experts top-2 (intermediate 256): 0.78x at 32, 0.74x at 64,
# 0.99x at 128 (~3840). float32 experts (nothing converted): the tiles win from 32 tokens on
# (2.15x dense there, 1.62x at 128).
DENSE_MAX_EXTRA_ROWS = 4096


def check_impl(impl: str) -> str:
    """`impl`, when it is one of MOE_IMPLS; else ValueError."""
    if impl not in MOE_IMPLS:
        raise ValueError(f"moe impl must be one of {MOE_IMPLS}; got {impl!r}")
    return impl


def step_impl(impl: str, num_tokens: int, num_experts: int, top_k: int,
              float32_experts: bool = False) -> str:
    """The grouped-product form `impl` (one of MOE_IMPLS) runs as for a step of `num_tokens`
    tokens (static) over `num_experts` experts, `top_k` per token: "tiled-or-dense" decided,
    the others as they are."""
    if check_impl(impl) != "tiled-or-dense":
        return impl
    if not float32_experts and num_tokens * (num_experts - top_k) <= DENSE_MAX_EXTRA_ROWS:
        return "dense"
    return "tiled"


def _weight(w, g=None):
    """The float weights of expert(s) of a stacked weight (quantized ones dequantized: int8,
    MXFP4)."""
    if isinstance(w, QuantizedWeight):
        return (w if g is None else w.expert(g)).dequantize()
    return w if g is None else w[g]


def _dtype(w):
    return jnp.dtype(w.compute_dtype) if isinstance(w, QuantizedWeight) else w.dtype


# The experts' gate activations: act(gate) * up.
ACTIVATIONS = {"silu": jax.nn.silu, "gelu_tanh": lambda x: jax.nn.gelu(x, approximate=True),
               "gelu": lambda x: jax.nn.gelu(x, approximate=False)}


@dataclasses.dataclass(frozen=True)
class ClampedSwiGLU:
    """gpt-oss's experts' activation of (gate, up): gate clamped to at most `limit`, up to
    [-limit, limit]; gate * sigmoid(alpha * gate) * (up + 1)."""

    limit: float
    alpha: float

    def __call__(self, gate: jax.Array, up: jax.Array) -> jax.Array:
        gate = jnp.minimum(gate, self.limit)
        up = jnp.clip(up, -self.limit, self.limit)
        return gate * jax.nn.sigmoid(gate * self.alpha) * (up + 1)


def _act(gate: jax.Array, up: jax.Array, act: str | ClampedSwiGLU = "silu") -> jax.Array:
    if isinstance(act, ClampedSwiGLU):
        return act(gate, up)
    return ACTIVATIONS[act](gate) * up


def _bias(b, rows):
    """The gate's or up's bias of each row's expert (b [Xl, F]; rows: expert ids), or 0."""
    return 0.0 if b is None else b.astype(jnp.float32)[rows]


def experts_dense(x, weights, ids, w_gate, w_up, w_down, expert_offset=0,
                  act: str | ClampedSwiGLU = "silu", b_gate=None, b_up=None) -> jax.Array:
    """Every local expert on every token. x [T, E]; weights, ids [T, k]; w_gate/w_up
    [Xl, E, F], w_down [Xl, F, E] (the experts expert_offset .. + Xl) -> [T, E] float32.
    `act`: the gate's activation (one of ACTIVATIONS, or a ClampedSwiGLU); `b_gate`, `b_up`:
    the gate's and up's biases [Xl, F] (gpt-oss), or None."""
    T = x.shape[0]
    Xl = w_gate.shape[0]
    local = ids - expert_offset
    combine = jnp.zeros((T, Xl + 1), jnp.float32)
    combine = combine.at[jnp.arange(T)[:, None], jnp.where((local >= 0) & (local < Xl), local, Xl)].add(weights)
    dt = _dtype(w_gate)
    xc = x.astype(dt)
    # expert-major layouts: XLA:CPU has no bfloat16 batched dot with the batch dim in the middle
    gate = jnp.einsum("te,xef->xtf", xc, _weight(w_gate), preferred_element_type=jnp.float32)
    up = jnp.einsum("te,xef->xtf", xc, _weight(w_up), preferred_element_type=jnp.float32)
    experts = jnp.arange(Xl)[:, None]  # [Xl, 1]: each row of gate's and up's experts
    gate, up = gate + _bias(b_gate, experts), up + _bias(b_up, experts)
    y = jnp.einsum("xtf,xfe->xte", _act(gate, up, act).astype(dt), _weight(w_down),
                   preferred_element_type=jnp.float32)
    return jnp.einsum("xte,tx->te", y, combine[:, :Xl])


def _sort(ids: jax.Array, Xl: int, expert_offset):
    """Assignments sorted by local expert (others last): (order [M], group sizes [Xl])."""
    local = ids.reshape(-1) - expert_offset  # [M]
    key = jnp.where((local >= 0) & (local < Xl), local, Xl)
    order = jnp.argsort(key, stable=True).astype(jnp.int32)
    sizes = jnp.zeros((Xl + 1,), jnp.int32).at[key].add(1)[:Xl]
    return order, sizes


def experts_grouped(x, weights, ids, w_gate, w_up, w_down, *, impl: str, expert_offset=0,
                    tile: int | None = None, act: str | ClampedSwiGLU = "silu", b_gate=None,
                    b_up=None) -> jax.Array:
    """The local experts on the tokens routed to them only (impl "ragged" or "tiled"); same
    arguments and result as `experts_dense`."""
    T, k = ids.shape
    M = T * k
    Xl = w_gate.shape[0]
    order, sizes = _sort(ids, Xl, expert_offset)
    token = order // k  # [M] the token of each sorted row
    dt = _dtype(w_gate)
    xs = x.astype(dt)[token]  # [M, E]
    if impl == "ragged":
        def gmm(a, w):
            return jax.lax.ragged_dot(a.astype(dt), _weight(w), sizes, preferred_element_type=jnp.float32)

        # each sorted row's local expert (rows of other devices' experts, last, compute nothing)
        row_expert = jnp.clip(ids.reshape(-1)[order] - expert_offset, 0, Xl - 1)
        gate = gmm(xs, w_gate) + _bias(b_gate, row_expert)
        up = gmm(xs, w_up) + _bias(b_up, row_expert)
        y = gmm(_act(gate, up, act), w_down)  # [M, E]
    elif impl == "tiled":
        y = _tiled_mlp(xs, sizes, w_gate, w_up, w_down, tile, act, b_gate, b_up)
    else:
        raise ValueError(f"not a grouped moe impl: {impl!r}")
    rows = jnp.arange(M) < jnp.sum(sizes)  # rows of local experts (the rest sort last)
    w_rows = jnp.where(rows, weights.reshape(-1)[order], 0.0)
    return jnp.zeros((T, x.shape[1]), jnp.float32).at[token].add(y * w_rows[:, None])


def tile_rows(num_rows: int, num_groups: int) -> int:
    """Rows per tile: about the rows an expert gets when routing is even, 8 to 128."""
    per_group = max(1, math.ceil(num_rows / num_groups))
    return int(min(128, max(8, 1 << (per_group - 1).bit_length())))


def _tiled_mlp(xs, sizes, w_gate, w_up, w_down, tile: int | None, act="silu", b_gate=None,
               b_up=None) -> jax.Array:
    """The expert MLP of each group of sorted rows xs [M, E] (groups of `sizes`), one
    (tile, expert) pair at a time -> [M, E] float32 (zero past the groups)."""
    M, E = xs.shape
    G = sizes.shape[0]
    B = tile or tile_rows(M, G)
    num_blocks = -(-M // B)
    Mp = num_blocks * B
    xs = jnp.pad(xs, ((0, Mp - M), (0, 0)))
    ends = jnp.cumsum(sizes)
    starts = ends - sizes
    first = starts // B
    count = jnp.where(sizes > 0, (ends - 1) // B - first + 1, 0)  # blocks each group touches
    cum = jnp.cumsum(count)
    num_pairs = num_blocks + G - 1  # static bound on sum(count)
    # XLA:CPU's dot inside a loop (DotThunk) takes no bfloat16 x bfloat16 -> float32: the
    # tiles multiply in float32 (the expert's weights are converted as they are read)
    f32 = jnp.float32

    def body(t, out):
        g = jnp.minimum(jnp.searchsorted(cum, t, side="right"), G - 1).astype(jnp.int32)
        live = t < cum[-1]
        block = first[g] + t - (cum[g] - count[g])
        block = jnp.clip(block, 0, num_blocks - 1)
        r0 = block * B
        x_t = jax.lax.dynamic_slice_in_dim(xs, r0, B).astype(f32)  # [B, E]
        row = r0 + jnp.arange(B)
        mask = (row >= starts[g]) & (row < ends[g]) & live  # [B]
        gate = jnp.dot(x_t, _weight(w_gate, g).astype(f32)) + _bias(b_gate, g)
        up = jnp.dot(x_t, _weight(w_up, g).astype(f32)) + _bias(b_up, g)
        y = jnp.dot(_act(gate, up, act).astype(xs.dtype).astype(f32),
                    _weight(w_down, g).astype(f32))
        cur = jax.lax.dynamic_slice_in_dim(out, r0, B)
        return jax.lax.dynamic_update_slice_in_dim(out, cur + jnp.where(mask[:, None], y, 0.0), r0, 0)

    out = jax.lax.fori_loop(0, num_pairs, body, jnp.zeros((Mp, E), jnp.float32))
    return out[:M]


def moe_mlp(x, router_logits, w_gate, w_up, w_down, *, top_k: int, normalize: bool, impl: str,
            mesh: Mesh | None, expert_axis: str | None, mlp_axis: str | None,
            expert_scale: jax.Array | None = None, act: str | ClampedSwiGLU = "silu",
            select_first: bool = False, b_gate=None, b_up=None, b_down=None,
            routing: tuple[jax.Array, jax.Array] | None = None) -> jax.Array:
    """The MoE block on x [T, E] (normed) -> [T, E] float32. `expert_axis` / `mlp_axis`: the
    mesh axes the stacked weights' expert and intermediate dims are sharded over (None:
    not sharded). `expert_scale`, `select_first`: see `route`; `act`, `b_gate`, `b_up`: see
    `experts_dense`; `b_down` [X, E]: the down products' biases, each chosen expert's added
    with its routing weight (after the partial sums are added up: once, however sharded).
    `routing`: the (weights [T, k], ids [T, k]) of a model's own router (DeepSeek V3's grouped
    routing), in place of `route` on `router_logits` (then unused)."""
    weights, ids = (route(router_logits, top_k, normalize, expert_scale, select_first)
                    if routing is None else routing)
    float32_experts = not isinstance(w_gate, QuantizedWeight) and w_gate.dtype == jnp.float32
    impl = step_impl(impl, num_tokens=x.shape[0], num_experts=w_gate.shape[0], top_k=top_k,
                     float32_experts=float32_experts)
    if mesh is not None:
        mesh, manual = context_mesh(mesh)  # inside the data-parallel step "data" is manual:
        expert_axis = None if expert_axis in manual else expert_axis  # the weights are whole there
        mlp_axis = None if mlp_axis in manual else mlp_axis

    def local(x, weights, ids, w_gate, w_up, w_down, b_gate, b_up):
        offset = 0
        if expert_axis is not None:
            offset = jax.lax.axis_index(expert_axis) * _num(w_gate)
        if impl == "dense":
            y = experts_dense(x, weights, ids, w_gate, w_up, w_down, offset, act, b_gate, b_up)
        else:
            y = experts_grouped(x, weights, ids, w_gate, w_up, w_down, impl=impl,
                                expert_offset=offset, act=act, b_gate=b_gate, b_up=b_up)
        axes = tuple(a for a in (expert_axis, mlp_axis) if a is not None)
        return jax.lax.psum(y, axes) if axes else y

    y = _sharded_experts(local, mesh, expert_axis, mlp_axis, x, weights, ids, w_gate, w_up,
                         w_down, b_gate, b_up)
    if b_down is not None:
        y = y + jnp.einsum("tk,tke->te", weights, b_down.astype(jnp.float32)[ids])
    return y


def _sharded_experts(local, mesh, expert_axis, mlp_axis, x, weights, ids, w_gate, w_up, w_down,
                     b_gate, b_up):
    """`local` on every device's experts (a shard_map over `mesh` when the experts are split)."""
    if mesh is None or (expert_axis is None and mlp_axis is None):
        return local(x, weights, ids, w_gate, w_up, w_down, b_gate, b_up)
    up_spec, down_spec = P(expert_axis, None, mlp_axis), P(expert_axis, mlp_axis, None)
    bias_spec = P(expert_axis, mlp_axis)

    def spec(w, s):
        if isinstance(w, QuantizedWeight):  # scales: size-1 contracted dim, replicated there
            return dataclasses.replace(
                w, q=s, scale=P(*(None if w.scale.shape[i] == 1 else a for i, a in enumerate(s))))
        return s

    return jax.shard_map(
        local, mesh=mesh,
        in_specs=(P(), P(), P(), spec(w_gate, up_spec), spec(w_up, up_spec), spec(w_down, down_spec),
                  None if b_gate is None else bias_spec, None if b_up is None else bias_spec),
        out_specs=P(), check_vma=False,
    )(x, weights, ids, w_gate, w_up, w_down, b_gate, b_up)


def _num(w) -> int:
    return w.shape[0]
