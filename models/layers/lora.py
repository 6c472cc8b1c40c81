"""The LoRA products of a step: each token adds x @ A[slot] @ B[slot] (B carries the scale) for
its adapter's slot, every slot's adapter in one pair of einsums.

The slots' weights are stacked per target, [S, in..., R] and [S, R, out...] (S = max_loras,
R = max_lora_rank, zero-padded), and each token picks its slot with a one-hot row ([T, S]; a
token of the base model, slot 0, has an all-zero row): x @ A for all slots ([T, S, R]), masked
to the token's own, then contracted with B over (slot, rank). Its cost is S * R * (in + out)
per token and target whatever the batch mixes; with S * R small beside a weight's width (8
slots of rank 16 against a 4096-wide layer: ~6 %) that is cheaper than gathering per-token
copies of A and B or grouping the tokens by slot (benchmarks/lora_product.py measures the
three), and it shards like the base weight (A over its input dims, B over its output dims;
XLA reduces the partial sums). A step in which no token has an adapter skips the
products (one `lax.cond` per product on a batch-wide flag).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxserve.models.sharding import same_on_every_rank


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LoRABatch:
    """One step's adapters: per layer, target -> (A, B) stacks; each token's one-hot slot row
    [T, S] (slot s of the host's numbering is column s - 1; 0 = none); and whether any token
    has an adapter (a step of the base model alone skips the LoRA products)."""

    layers: tuple[dict[str, tuple[jax.Array, jax.Array]], ...]
    onehot: jax.Array
    active: jax.Array  # bool scalar

    @classmethod
    def of(cls, layers, slots: jax.Array) -> LoRABatch:
        S = next(iter(layers[0].values()))[0].shape[0]
        return cls(tuple(layers), jax.nn.one_hot(slots - 1, S, dtype=jnp.float32),
                   same_on_every_rank(jnp.any(slots > 0)))


def lora_delta(spec: str, x: jax.Array, a: jax.Array, b: jax.Array, onehot: jax.Array) -> jax.Array:
    """The adapters' term of product `spec` (a `dense` spec "xs,ws->ys" with the token dim t
    first) for input x: float32, shaped like the product's output."""
    xs, rest = spec.split(",")
    ws, ys = rest.split("->")
    ins = "".join(c for c in ws if c in xs)
    outs = "".join(c for c in ws if c not in xs)
    xa = jnp.einsum(f"{xs},s{ins}r->tsr", x.astype(a.dtype), a, preferred_element_type=jnp.float32)
    T, S, R = xa.shape
    # (slot, rank) contracted as one dim of S * R (free reshapes of both operands): written as
    # two dims, XLA:CPU copies the whole B stack into (rank, slot) order on every call
    xa = (xa * onehot[:, :, None]).astype(b.dtype).reshape(T, S * R)
    b = b.reshape(S * R, *b.shape[2:])
    return jnp.einsum(f"tk,k{outs}->{ys}", xa, b, preferred_element_type=jnp.float32)


def add_lora(p: dict, name: str, spec: str, x: jax.Array, y: jax.Array) -> jax.Array:
    """y plus the adapters' term of weight `name` when the layer's weights `p` carry LoRA
    stacks ("lora": (targets, onehot, active)), computed only in a step where some token has
    an adapter; y itself otherwise (the LoRA path off)."""
    lora = p.get("lora")
    if lora is None or name not in lora[0]:
        return y
    (a, b), onehot, active = lora[0][name], lora[1], lora[2]
    return jax.lax.cond(active, lambda: y + lora_delta(spec, x, a, b, onehot).astype(y.dtype),
                        lambda: y)
