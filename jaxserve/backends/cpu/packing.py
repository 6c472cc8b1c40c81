"""The CPU backend's weight packing: a model's matmul weights laid out once, at load time, for
the native product kernel (`kernels/matmul.py`: bfloat16 on AMX, float32 or bfloat16 with
AVX-512 or AVX2 FMAs), from the products the model declares (`product_specs`: each weight's
`dense` spec, the fused groups, the LM head). Each packed weight becomes a `PackedParam` naming
the product `dense` calls for it ("cpu", registered here)."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.backends.cpu.kernels.matmul import (
    pack_weight, packable, packed_matmul, packed_weight_shape,
)
from jaxserve.models.layers.linear import PackedParam, parse_spec, register_packed_product

KERNEL = "cpu"
register_packed_product(KERNEL, packed_matmul)


def _pack_geometry(spec: str, shape: tuple[int, ...]):
    """(permutation to [contracted..., output...], K, N, output dims) of a weight of `shape` used
    as `dense(spec, x, w)`, or None when the product does not fit the kernel."""
    xs, ws, out, contract = parse_spec(spec)
    w_out = "".join(c for c in out if c in ws)
    if not xs.endswith(contract) or out != xs[: len(xs) - len(contract)] + w_out:
        return None
    perm = [ws.index(c) for c in contract + w_out]
    out_shape = tuple(shape[ws.index(c)] for c in w_out)
    k, n = math.prod(shape[ws.index(c)] for c in contract), math.prod(out_shape)
    if not packable(k, n):
        return None
    return perm, k, n, out_shape


def pack_for_spec(spec: str, w: np.ndarray, tiles: bool
                  ) -> tuple[np.ndarray, tuple[int, ...]] | None:
    """The product kernel's layout of weight `w` as used by `dense(spec, x, w)` (AMX `tiles` or
    strips, see `pack_weight`), and its output dims; None when the product does not fit the
    kernel (K or N not a multiple of 32, or the contracted dims not trailing in x)."""
    geometry = _pack_geometry(spec, w.shape)
    if geometry is None:
        return None
    perm, k, n, out_shape = geometry
    return pack_weight(np.transpose(w, perm).reshape(k, n), tiles), out_shape


def packed_layout_for_spec(spec: str, w: jax.ShapeDtypeStruct, tiles: bool
                           ) -> tuple[jax.ShapeDtypeStruct, tuple[int, ...]] | None:
    """`pack_for_spec` on shapes only: the packed weight as a ShapeDtypeStruct (with `w`'s
    sharding), and its output dims."""
    geometry = _pack_geometry(spec, w.shape)
    if geometry is None:
        return None
    _, k, n, out_shape = geometry
    shape = packed_weight_shape(k, n, tiles)
    return jax.ShapeDtypeStruct(shape, w.dtype, sharding=w.sharding), out_shape


def pack_linear_weights(model, specs: dict[str, str], groups: dict[str, tuple[str, ...]],
                        head_specs: tuple[str, str], tiles: bool, abstract: bool = False) -> int:
    """Replace `model`'s bfloat16 or float32 matmul weights by packed ones (the CPU product
    kernel's layout), in place; returns how many products a step now runs on the kernel per
    layer stack (fused groups count once).

    specs: decoder-layer weight name -> its `dense` spec. groups: fused name -> weights that
    share one input (e.g. "wqkv": ("wq", "wk", "wv")), packed together when all of them pack;
    the fused weight replaces them. head_specs: the LM head's spec with a separate `lm_head`
    [E, V] and with the tied embedding [V, E]; a tied model gets a packed `lm_head` (the
    embedding stays, for the lookup). tiles: bfloat16 weights in AMX tile order, else strips
    (`pack_weight`).

    abstract: `model`'s values are ShapeDtypeStructs (with shardings), and so are the packed
    ones: the structure packing gives, without the work (for weights packed earlier and kept,
    see runner/weight_cache.py).
    """
    count = 0

    def packed(spec: str, value: jax.Array):
        if value.dtype not in (jnp.bfloat16, jnp.float32):
            return None
        if abstract:
            return packed_layout_for_spec(spec, value, tiles)
        return pack_for_spec(spec, np.asarray(value), tiles)

    def param(value: jax.Array, parts) -> PackedParam:
        out_shapes = tuple(s for _, s in parts)
        if abstract:
            first = parts[0][0]
            shape = (sum(b.shape[0] for b, _ in parts), *first.shape[1:])  # N blocks lead
            return PackedParam(jax.ShapeDtypeStruct(shape, first.dtype, sharding=value.sharding),
                               out_shapes=out_shapes, kernel=KERNEL)
        blocks = np.concatenate([b for b, _ in parts], axis=0)  # N blocks lead: concatenation
        return PackedParam(jax.device_put(blocks, value.sharding), out_shapes=out_shapes,
                           kernel=KERNEL)

    for layer in model.layers:
        grouped = set()
        for fused, names in groups.items():
            vars_ = [getattr(layer, n, None) for n in names]
            if any(v is None or isinstance(v, PackedParam) for v in vars_):
                continue
            parts = [packed(specs[n], v.get_value()) for n, v in zip(names, vars_)]
            if all(p is not None for p in parts):
                setattr(layer, fused, param(vars_[0].get_value(), parts))
                for n in names:
                    delattr(layer, n)
                grouped.update(names)
                count += 1
        for name, spec in specs.items():
            var = getattr(layer, name, None)
            if name in grouped or var is None or isinstance(var, PackedParam):
                continue
            res = packed(spec, var.get_value())
            if res is not None:
                setattr(layer, name, param(var.get_value(), [res]))
                count += 1
    head = getattr(model, "lm_head", None)
    if not isinstance(head, PackedParam):
        value = head.get_value() if head is not None else model.embed.get_value()
        res = packed(head_specs[0] if head is not None else head_specs[1], value)
        if res is not None:
            model.lm_head = param(value, [res])
            count += 1
    return count
