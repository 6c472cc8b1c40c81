"""Matrix products with a float32 accumulator whatever the weight dtype.

On XLA:CPU a bfloat16 product with `preferred_element_type=float32` is about twice as fast as
float32 (with >= 8 rows), while a bfloat16 output is much slower; on TPU/GPU this is the
standard mixed-precision pattern. Activations are cast to the weight dtype at the product.

On the CPU, weights can instead be packed once at load time (`pack_linear_weights`) into the
layout of the native product kernel (`pallas_kernels/cpu/matmul.py`: bfloat16 on AMX, float32
with AVX-512); `dense` then calls that kernel. A packed weight lives in a `PackedParam` (an
`nnx.Param` whose value is the packed array, with the logical output shape as metadata), and
the model reads it through `weight_value`, which hands `dense` a `PackedWeight`.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx


class PackedParam(nnx.Param):
    """Matmul weights in the CPU product kernel's layout, one or several sharing an input
    (q/k/v, gate/up) concatenated along the output; metadata `out_shapes`: each one's output
    dims."""


@dataclasses.dataclass(frozen=True)
class PackedWeight:
    blocks: jax.Array  # `pack_weight`'s layout: bfloat16 [N/16, K/32, 16, 32], float32 [N/32, K, 32]
    out_shapes: tuple[tuple[int, ...], ...]


def weight_value(var: nnx.Variable) -> jax.Array | PackedWeight:
    """What `dense` takes for weight variable `var`."""
    if isinstance(var, PackedParam):
        return PackedWeight(var[...], tuple(tuple(s) for s in var.get_metadata()["out_shapes"]))
    return var[...]


def _parse(spec: str) -> tuple[str, str, str, str]:
    """'te,ehd->thd' -> (x letters, w letters, output letters, contracted letters)."""
    inputs, out = spec.split("->")
    xs, ws = inputs.split(",")
    contract = "".join(c for c in xs if c in ws and c not in out)
    return xs, ws, out, contract


def dense(spec: str, x: jax.Array, w: jax.Array | PackedWeight) -> jax.Array:
    """einsum(spec, x, w) with x cast to w's dtype and a float32 result."""
    if isinstance(w, PackedWeight):
        (y,) = dense_group(spec, x, w)
        return y
    return jnp.einsum(spec, x.astype(w.dtype), w, preferred_element_type=jnp.float32)


def dense_group(spec: str, x: jax.Array, w: PackedWeight) -> list[jax.Array]:
    """`dense(spec, x, w_i)` for each weight w_i packed together in `w`, in one product."""
    from jaxserve.pallas_kernels.cpu.matmul import packed_matmul

    nc = len(_parse(spec)[3])
    lead = x.shape[: x.ndim - nc]
    y = packed_matmul(x.reshape(math.prod(lead), -1), w.blocks)
    sizes = [math.prod(s) for s in w.out_shapes]
    parts = jnp.split(y, list(np.cumsum(sizes)[:-1]), axis=-1) if len(sizes) > 1 else [y]
    return [p.reshape(*lead, *s) for p, s in zip(parts, w.out_shapes)]


def pack_for_spec(spec: str, w: np.ndarray) -> tuple[np.ndarray, tuple[int, ...]] | None:
    """The product kernel's layout of weight `w` as used by `dense(spec, x, w)`, and its output dims;
    None when the product does not fit the kernel (K or N not a multiple of 32, or the
    contracted dims not trailing in x)."""
    from jaxserve.pallas_kernels.cpu.matmul import pack_weight, packable

    xs, ws, out, contract = _parse(spec)
    w_out = "".join(c for c in out if c in ws)
    if not xs.endswith(contract) or out != xs[: len(xs) - len(contract)] + w_out:
        return None
    perm = [ws.index(c) for c in contract + w_out]
    out_shape = tuple(w.shape[ws.index(c)] for c in w_out)
    k, n = math.prod(w.shape[ws.index(c)] for c in contract), math.prod(out_shape)
    if not packable(k, n):
        return None
    return pack_weight(np.transpose(w, perm).reshape(k, n)), out_shape


def pack_linear_weights(model, specs: dict[str, str], groups: dict[str, tuple[str, ...]],
                        head_specs: tuple[str, str]) -> int:
    """Replace `model`'s bfloat16 or float32 matmul weights by packed ones (the CPU product
    kernel's layout), in place; returns how many products a step now runs on the kernel per
    layer stack (fused groups count once).

    specs: decoder-layer weight name -> its `dense` spec. groups: fused name -> weights that
    share one input (e.g. "wqkv": ("wq", "wk", "wv")), packed together when all of them pack;
    the fused weight replaces them. head_specs: the LM head's spec with a separate `lm_head`
    [E, V] and with the tied embedding [V, E]; a tied model gets a packed `lm_head` (the
    embedding stays, for the lookup).
    """
    count = 0

    def packed(spec: str, value: jax.Array):
        if value.dtype not in (jnp.bfloat16, jnp.float32):
            return None
        return pack_for_spec(spec, np.asarray(value))

    def param(value: jax.Array, parts) -> PackedParam:
        blocks = np.concatenate([b for b, _ in parts], axis=0)  # N blocks lead: concatenation
        return PackedParam(jax.device_put(blocks, value.sharding),
                           out_shapes=tuple(s for _, s in parts))

    for layer in model.layers:
        grouped = set()
        for fused, names in groups.items():
            vars_ = [getattr(layer, n, None) for n in names]
            if any(v is None or isinstance(v, PackedParam) for v in vars_):
                continue
            parts = [packed(specs[n], v[...]) for n, v in zip(names, vars_)]
            if all(p is not None for p in parts):
                setattr(layer, fused, param(vars_[0][...], parts))
                for n in names:
                    delattr(layer, n)
                grouped.update(names)
                count += 1
        for name, spec in specs.items():
            var = getattr(layer, name, None)
            if name in grouped or var is None or isinstance(var, PackedParam):
                continue
            res = packed(spec, var[...])
            if res is not None:
                setattr(layer, name, param(var[...], [res]))
                count += 1
    head = getattr(model, "lm_head", None)
    if not isinstance(head, PackedParam):
        value = head[...] if head is not None else model.embed[...]
        res = packed(head_specs[0] if head is not None else head_specs[1], value)
        if res is not None:
            model.lm_head = param(value, [res])
            count += 1
    return count
