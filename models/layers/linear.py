"""Matrix products with a float32 accumulator whatever the weight dtype.

On XLA:CPU a bfloat16 product with `preferred_element_type=float32` is about twice as fast as
float32 (with >= 8 rows), while a bfloat16 output is much slower; on TPU/GPU this is the
standard mixed-precision pattern. Activations are cast to the weight dtype at the product.

A backend may instead pack weights once at load time into the layout of a native product
kernel (the CPU backend: `jaxserve/backends/cpu/packing.py`, from the model's
`product_specs`). A packed weight lives in a `PackedParam` (an `nnx.Param` whose value is the
packed array, with the logical output shapes and the name of its product kernel as metadata),
and the model reads it through `weight_value`, which hands `dense` a `PackedWeight`; `dense`
calls the product the backend registered under that name (`register_packed_product`). The
model never decides whether or how its weights are packed.

Weight-only int8 (`quantize_int8`, `QuantizedParam`): symmetric, per output channel by default
(or per block along the contracted dims, as GGUF's Q8_0 stores them). The int8 values stay int8
in device memory; `dense` converts them inside the product (XLA fuses the convert into the dot
on TPU/GPU, so a step reads half the bytes of bfloat16 weights) and multiplies the float32
result by the channel scales. A quantized weight `w` has its scales in the float32 parameter
`w_qscale` beside it (same rank, contracted dims of size 1 or the number of blocks);
`module_weights` pairs them into a `QuantizedWeight`. The CPU backend does not pack them.

Checkpoint formats (`layers/quant.py`'s `WeightFormat`): the same type holds float8_e4m3fn
values (FP8 checkpoints: scales per channel, per tensor or per 128x128 block) and packed 4-bit
values with a zero per group (`w` + ZERO_SUFFIX; AWQ, GPTQ): the product dequantizes them
inside the compiled step, so only the quantized bytes live in device memory. XLA's TPU
compiler dequantizes such a weight in a fusion of its own before a small-row dot (writing it
to HBM at full width); a backend whose plan has a quantized product kernel
(`DevicePlan.quant_matmul_impl`: the Pallas TPU kernel of `pallas_kernels/quant_matmul`)
marks these weights with it (`prepare_quantized_products`, a `QuantizedProduct` in the
weight's metadata) and `dense` then calls the kernel on every shard of the weight, inside a
`shard_map` over the mesh the weight is placed on.

MXFP4 (gpt-oss's experts; `layers/quant.py`): the same type with `mxfp4` set holds e2m1 codes
packed two to a byte (uint8, `packed_axis` the last contracted dim) and their e8m0 exponents
as the scales (uint8, one per 32 contracted values); the product decodes them in the step
(exactly: each weight is an e2m1 value times a power of two) and multiplies in the compute
dtype, so the device holds 4.25 bits per weight. `mxfp4_weight` builds one from a checkpoint's
`*_blocks` / `*_scales` pair.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, PartitionSpec as P

from jaxserve.models import sharding as ax
from jaxserve.models.layers.quant import MXFP4_BLOCK, decode_e2m1, scale_by_e8m0, unpack_int4
from jaxserve.pallas_kernels.quant_matmul.ops import quant_matmul


class PackedParam(nnx.Param):
    """Matmul weights in a backend's product kernel layout, one or several sharing an input
    (q/k/v, gate/up) concatenated along the output; metadata `out_shapes`: each one's output
    dims, `kernel`: the registered product that reads them."""


@dataclasses.dataclass(frozen=True)
class PackedWeight:
    blocks: jax.Array  # the kernel's layout (the CPU's: tiles or strips, N blocks leading)
    out_shapes: tuple[tuple[int, ...], ...]
    kernel: str  # the product registered under this name (`register_packed_product`)


# Products on packed weights by name: fn(x [M, K], blocks) -> float32 [M, N]. A backend
# registers its own when it loads (the CPU backend: "cpu").
_PACKED_PRODUCTS: dict[str, Callable[[jax.Array, jax.Array], jax.Array]] = {}


def register_packed_product(name: str, fn: Callable[[jax.Array, jax.Array], jax.Array]) -> None:
    _PACKED_PRODUCTS[name] = fn


class QuantizedParam(nnx.Param):
    """Quantized matmul weights (int8, float8_e4m3fn, or int4 packed in uint8); metadata
    `spec` (the `dense` spec that decides which dims are contracted), `compute_dtype` (what
    the values become inside the product) and for int4 `packed_axis` (the dim holding two
    values per byte). Its scales are the float32 parameter named `<name>` + SCALE_SUFFIX of
    the same module, its zeros (int4) `<name>` + ZERO_SUFFIX."""


@dataclasses.dataclass(frozen=True)
class QuantizedProduct:
    """A quantized weight's product kernel (metadata `product` of its `QuantizedParam`, set by
    `prepare_quantized_products`): the kernel's name in `pallas_kernels/quant_matmul`, and the
    mesh and partition specs its values, scales and zeros are placed with (None: one device)."""

    impl: str
    mesh: Mesh | None = None
    specs: tuple[P, P] | None = None  # (values, scales and zeros)


SCALE_SUFFIX = "_qscale"
ZERO_SUFFIX = "_qzero"
# Act-order weights: the order of the contracted inputs their rows are stored in (int32, over
# the contracted dims flattened); `dense` gathers the activations in that order.
PERM_SUFFIX = "_qperm"
# A checkpoint's static activation scale (float32 [1]; 0 where the weight has none: per token).
INPUT_SCALE_SUFFIX = "_qinput"
AUX_SUFFIXES = (SCALE_SUFFIX, ZERO_SUFFIX, PERM_SUFFIX, INPUT_SCALE_SUFFIX)
# A model's weight map holds, for an MXFP4 weight kept packed, the builder of its (codes,
# exponents) under the weight's name + MXFP4_PARTS (the weight's own name: its float values,
# for a model that upcasts them).
MXFP4_PARTS = "#mxfp4"
QUANTIZATIONS = ("int8", "fp8", "int4")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QuantizedWeight:
    q: jax.Array  # int8 or float8_e4m3fn, the weight's shape; int4: uint8, packed_axis halved
    scale: jax.Array  # float32, same rank; each entry covers a block of q (size-1 dims: whole)
    compute_dtype: str = dataclasses.field(metadata=dict(static=True), default="float32")
    zero: jax.Array | None = None  # int4: the zero point of each scale's block (float32)
    packed_axis: int | None = dataclasses.field(metadata=dict(static=True), default=None)
    # The product kernel `dense` calls (None: XLA's product on the dequantized values).
    product: QuantizedProduct | None = dataclasses.field(metadata=dict(static=True), default=None)
    perm: jax.Array | None = None  # act-order: the stored rows' inputs (flat contracted index)
    input_scale: jax.Array | None = None  # a static activation scale ([1]; 0: per token)
    # MXFP4: q holds e2m1 codes (packed as int4), scale uint8 e8m0 exponents (2^(e - 127)).
    mxfp4: bool = dataclasses.field(metadata=dict(static=True), default=False)

    @property
    def shape(self) -> tuple[int, ...]:
        if self.packed_axis is None:
            return self.q.shape
        return tuple(n * 2 if i == self.packed_axis else n for i, n in enumerate(self.q.shape))

    @property
    def per_channel(self) -> bool:
        """True when every scale covers whole contracted dims (one per output channel) and the
        values need no unpacking or zeros: the scales then apply to the product's result."""
        return self.zero is None and self.packed_axis is None and self.perm is None and all(
            m == 1 or m == n for n, m in zip(self.q.shape, self.scale.shape))

    def values(self) -> jax.Array:
        """The quantized values unpacked (int4, MXFP4's codes: 0..15 as uint8), in the
        weight's shape."""
        return self.q if self.packed_axis is None else unpack_int4(self.q, self.packed_axis)

    def dequantize(self, dtype=None) -> jax.Array:
        dtype = dtype or self.compute_dtype
        if self.mxfp4:
            return dequantize_mxfp4(self.values(), self.scale, dtype)
        return dequantize(self.values(), self.scale, dtype, self.zero)

    def expert(self, g) -> QuantizedWeight:
        """Entry `g` of the leading dim (a stacked expert weight's expert g)."""
        def take(a):
            return None if a is None else a[g]

        axis = None if self.packed_axis is None else self.packed_axis - 1
        return dataclasses.replace(self, q=self.q[g], scale=self.scale[g], zero=take(self.zero),
                                   perm=take(self.perm), packed_axis=axis)


def mxfp4_weight(codes: jax.Array, exponents: jax.Array,
                 compute_dtype: str = "bfloat16") -> QuantizedWeight:
    """An MXFP4 weight [..., K, N] (contracted over K) from packed e2m1 codes uint8
    [..., K / 2, N] and e8m0 exponents uint8 [..., K / 32, N]: `quant.mxfp4_device_layout`'s
    result for a checkpoint's `*_blocks` / `*_scales` pair."""
    if codes.dtype != jnp.uint8 or exponents.dtype != jnp.uint8:
        raise ValueError(f"MXFP4 codes and exponents are uint8; got {codes.dtype}, "
                         f"{exponents.dtype}")
    K = codes.shape[-2] * 2
    if exponents.shape != (*codes.shape[:-2], K // MXFP4_BLOCK, codes.shape[-1]) or K % MXFP4_BLOCK:
        raise ValueError(f"MXFP4 exponents {tuple(exponents.shape)} do not match codes "
                         f"{tuple(codes.shape)}: one per 32 values along the second-last dim")
    return QuantizedWeight(codes, exponents, compute_dtype, packed_axis=codes.ndim - 2,
                           mxfp4=True)


def weight_value(var: nnx.Variable) -> jax.Array | PackedWeight:
    """What `dense` takes for weight variable `var` (not a quantized one: see `module_weights`)."""
    if isinstance(var, PackedParam):
        meta = var.get_metadata()
        return PackedWeight(var[...], tuple(tuple(s) for s in meta["out_shapes"]), meta["kernel"])
    return var[...]


def param_weight(module: nnx.Module, name: str):
    """`dense`'s weight for parameter `name` of `module`: an array, a PackedWeight or a
    QuantizedWeight (int8 values with their scales); None when absent."""
    var = getattr(module, name, None)
    if var is None:
        return None
    if isinstance(var, QuantizedParam):
        scale = getattr(module, name + SCALE_SUFFIX)
        aux = {suffix: getattr(module, name + suffix, None)
               for suffix in (ZERO_SUFFIX, PERM_SUFFIX, INPUT_SCALE_SUFFIX)}
        aux = {k: None if v is None else v[...] for k, v in aux.items()}
        meta = var.get_metadata()
        return QuantizedWeight(var[...], scale[...], meta.get("compute_dtype", "float32"),
                               aux[ZERO_SUFFIX], meta.get("packed_axis"), meta.get("product"),
                               aux[PERM_SUFFIX], aux[INPUT_SCALE_SUFFIX],
                               bool(meta.get("mxfp4", False)))
    return weight_value(var)


def module_weights(module: nnx.Module) -> dict:
    """Every parameter of `module` by name, as `dense` takes it (scales folded into their
    quantized weights)."""
    out = {}
    for name, var in vars(module).items():
        if not isinstance(var, nnx.Param) or name.endswith(AUX_SUFFIXES):
            continue
        out[name] = param_weight(module, name)
    return out


def contracted_axes(spec: str) -> tuple[int, ...]:
    """The weight dims a `dense` spec contracts (those of x that the output lacks)."""
    _, ws, _, contract = parse_spec(spec)
    return tuple(ws.index(c) for c in contract)


def scale_shape(shape, spec: str, block: int | None = None,
                out_block: int | None = 1) -> tuple[int, ...]:
    """The shape of the scales of a weight of `shape` used by `dense(spec, ...)`: one per
    output channel (`block` None: size 1 on every contracted dim), or one per `block`
    consecutive values of the contracted dims taken together in the weight's axis order (a
    checkpoint row's blocks, GGUF Q8_0's layout: [E, H, D] with blocks of 32 along E -> [E/32,
    H, D]; [H, D, E] with D = 16 -> [H/2, 1, E], a block spanning two heads). `out_block`
    tiles the output dims the same way (1: every channel; None: one scale for all; FP8's
    128x128 blocks: 128)."""
    out = list(shape)
    axes = sorted(contracted_axes(spec))
    _tile(out, shape, axes, block, spec)
    _tile(out, shape, [a for a in range(len(shape)) if a not in axes], out_block, spec)
    return tuple(out)


def _tile(out: list[int], shape, axes: list[int], block: int | None, spec: str) -> None:
    """Set out[a] for `axes` to the number of `block`-value blocks along them (in order)."""
    if block is None:
        for a in axes:
            out[a] = 1
        return
    if not axes or block == 1:
        return
    if axes != list(range(axes[0], axes[-1] + 1)):
        raise ValueError(f"quantization blocks need adjacent dims; spec {spec!r}")
    left = block
    for a in reversed(axes):
        n = shape[a]
        if left == 1:
            break
        if left >= n and left % n == 0:
            out[a], left = 1, left // n
        elif left < n and n % left == 0:
            out[a], left = n // left, 1
        else:
            raise ValueError(f"blocks of {block} do not tile dims {axes} of {tuple(shape)}")
    if left != 1:
        raise ValueError(f"blocks of {block} are longer than dims {axes} of {tuple(shape)}")


def quantize_int8(w, spec: str, block: int | None = None):
    """Symmetric int8 of `w` (numpy or jax) with one float32 scale per output channel
    (`block`=None) or per `block` consecutive values of the contracted dims (see `scale_shape`).
    Returns (q int8, scale float32 of the same rank). Works on numpy arrays (at load) and jax
    arrays (random init)."""
    xp = np if isinstance(w, np.ndarray) else jnp
    w32 = w.astype(xp.float32)
    sshape = scale_shape(w32.shape, spec, block)
    split = [x for n, m in zip(w32.shape, sshape) for x in (m, n // m)]
    amax = xp.max(xp.abs(w32.reshape(split)), axis=tuple(range(1, len(split), 2)))  # each block's
    scale = (amax / 127.0).astype(xp.float32)
    safe = xp.where(scale == 0, xp.float32(1.0), scale)
    q = xp.clip(xp.round(w32 / _expand(xp, safe, w32.shape)), -127, 127).astype(xp.int8)
    return q, scale


def block_scales(expanded: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """Scales given per value (each repeated over its block) -> one per block of `shape`
    (`scale_shape`'s result). Raises ValueError when a block's values disagree."""
    split = [x for n, m in zip(expanded.shape, shape) for x in (m, n // m)]
    blocks = expanded.reshape(split)
    first = blocks[tuple(slice(None) if i % 2 == 0 else slice(0, 1) for i in range(len(split)))]
    if not np.array_equal(np.broadcast_to(first, blocks.shape), blocks):
        raise ValueError(f"scales of shape {expanded.shape} are not constant over blocks {shape}")
    return first.reshape(shape)


def _expand(xp, scale, shape):
    """`scale` repeated over the blocks it covers, to `shape`."""
    for axis, (n, m) in enumerate(zip(shape, scale.shape)):
        if m not in (1, n):
            scale = xp.repeat(scale, n // m, axis=axis)
    return scale


def dequantize(q: jax.Array, scale: jax.Array, dtype, zero: jax.Array | None = None) -> jax.Array:
    """(q - zero) * scale (each scale and zero over its block), in `dtype`."""
    shape, sshape = [], []
    for n, m in zip(q.shape, scale.shape):
        shape += [m, n // m]
        sshape += [m, 1]
    w = q.reshape(shape).astype(jnp.float32)
    if zero is not None:
        w = w - zero.astype(jnp.float32).reshape(sshape)
    w = w * scale.astype(jnp.float32).reshape(sshape)
    return w.reshape(q.shape).astype(dtype)


def dequantize_mxfp4(codes: jax.Array, exponents: jax.Array, dtype) -> jax.Array:
    """e2m1 codes (unpacked, 0..15) times 2^(e - 127) of each code's block of the e8m0
    exponents (same rank, blocks along the dims where they are fewer), in `dtype`; exact
    (`quant.scale_by_e8m0`) before the cast."""
    shape, eshape = [], []
    for n, m in zip(codes.shape, exponents.shape):
        shape += [m, n // m]
        eshape += [m, 1]
    w = scale_by_e8m0(decode_e2m1(codes.reshape(shape)), exponents.reshape(eshape))
    return w.reshape(codes.shape).astype(dtype)


def embedding_lookup(table, ids: jax.Array) -> jax.Array:
    """Rows `ids` of an embedding table (array or per-row QuantizedWeight) as float32 [N, E]."""
    if isinstance(table, QuantizedWeight):
        rows = table.q[ids].astype(jnp.float32)  # [N, E]
        scale = table.scale[ids].astype(jnp.float32)  # [N, 1] or [N, E / block]
        if scale.shape[-1] not in (1, rows.shape[-1]):
            g = rows.shape[-1] // scale.shape[-1]
            return (rows.reshape(*rows.shape[:-1], -1, g) * scale[..., None]).reshape(rows.shape)
        return rows * scale
    return table[ids].astype(jnp.float32)


def parse_spec(spec: str) -> tuple[str, str, str, str]:
    """'te,ehd->thd' -> (x letters, w letters, output letters, contracted letters)."""
    inputs, out = spec.split("->")
    xs, ws = inputs.split(",")
    contract = "".join(c for c in xs if c in ws and c not in out)
    return xs, ws, out, contract


def dense(spec: str, x: jax.Array, w: jax.Array | PackedWeight | QuantizedWeight) -> jax.Array:
    """einsum(spec, x, w) with x cast to w's dtype and a float32 result (a one-row product
    on a GPU: see `_two_rows_on_gpu`)."""
    if isinstance(w, PackedWeight):
        (y,) = dense_group(spec, x, w)
        return y
    if isinstance(w, QuantizedWeight) and w.product is not None:
        return _dense_quantized(spec, x, w)
    row = _single_row_axes(spec, x, w.shape)
    if row is not None:
        return _two_rows_on_gpu(x, lambda x: _dense_xla(spec, x, w), *row)
    return _dense_xla(spec, x, w)


def _dense_xla(spec: str, x: jax.Array, w: jax.Array | QuantizedWeight) -> jax.Array:
    """`dense`'s product written for XLA (a quantized weight's: `_dense_quantized`)."""
    if isinstance(w, QuantizedWeight):
        return _dense_quantized(spec, x, w)
    return jnp.einsum(spec, x.astype(w.dtype), w, preferred_element_type=jnp.float32)


def _single_row_axes(spec: str, x: jax.Array, w_shape) -> tuple[int, int] | None:
    """(x's axis, the output's axis) of the first dim x keeps, where every dim x keeps has
    size 1 (a one-token step's product: a vector times the weight) and the weight is one that
    XLA:GPU would multiply as a reduction (see `_two_rows_on_gpu`); else None."""
    xs, ws, out, contract = parse_spec(spec)
    kept = [i for i, c in enumerate(xs) if c not in contract]
    if not kept or xs[kept[0]] not in out or any(x.shape[i] != 1 for i in kept):
        return None
    k = math.prod(n for c, n in zip(ws, w_shape) if c in contract)
    if (1 + math.prod(w_shape) // k) * k >= XLA_GPU_STRENGTH_REDUCED:
        return None
    return kept[0], out.index(xs[kept[0]])


# XLA:GPU rewrites a vector times a matrix as a multiply and a reduction when its (rows +
# columns) x contracted size is under this ("dot strength reduction", its
# backends/gpu/transforms/dot_strength_reduction.cc); a larger one is a GEMM kernel already.
XLA_GPU_STRENGTH_REDUCED = 10_000_000


def _two_rows_on_gpu(x: jax.Array, product: Callable[[jax.Array], jax.Array],
                     x_axis: int, out_axis: int) -> jax.Array:
    """product(x) of a one-row x; on a GPU computed on two rows (x and a zero row) and the
    first row kept.

    XLA:GPU drops a product's size-1 dims, and rewrites a vector times a matrix whose
    (rows + columns) x contracted size is under 10 million (`XLA_GPU_STRENGTH_REDUCED`: every
    decoder-layer weight of a small model, SmolLM2-135M's 576 x 1,536 gives 0.9 million;
    Llama-3-8B's K and V) as a broadcast multiply and a reduction ("dot strength
    reduction"); its fusion pass leaves most of those multiplies
    outside their reductions, so one kernel writes the float32 product of every weight
    element and a second reads it back to sum it (10 bytes moved a bfloat16 weight element
    instead of 2: a one-token SmolLM2 step's products moved its weights 3.3 times). Two rows
    are a matrix: the product is a GEMM kernel that reads the weight once. Other platforms
    keep the one-row product (their programs are unchanged)."""

    def two_rows(x):
        y = product(jnp.concatenate([x, jnp.zeros_like(x)], axis=x_axis))
        return jax.lax.slice_in_dim(y, 0, 1, axis=out_axis)

    return jax.lax.platform_dependent(x, cuda=two_rows, rocm=two_rows, default=product)


def _dense_quantized(spec: str, x: jax.Array, w: QuantizedWeight) -> jax.Array:
    """The product on quantized values converted in the dot (per channel: scales applied to
    the float32 result; per block, or with zeros: dequantized in the step first). A compute
    dtype of float8_e4m3fn or int8 (a chip with such products: `prepare_fp8_products`,
    `prepare_int8_products`) multiplies the stored values as they are: the activations are
    quantized per token, or by the checkpoint's static scale (`quantize_activations`), and the
    dot takes both in FP8 (int8, accumulating in int32). An act-order weight (`perm`) first
    gathers the activations in the order of its stored rows."""
    if w.perm is not None:
        x = permute_inputs(spec, x, w.perm)
        w = dataclasses.replace(w, perm=None)
    if w.product is not None:
        return _dense_kernel(spec, x, w)
    cdt = jnp.dtype(w.compute_dtype)
    if not w.per_channel or any(w.scale.shape[a] != 1 for a in contracted_axes(spec)):
        if cdt in (FP8, INT8):  # block scales or zeros: no such product here, upcast
            cdt = jnp.dtype(jnp.bfloat16)
        return jnp.einsum(spec, x.astype(cdt), w.dequantize(cdt), preferred_element_type=jnp.float32)
    if cdt in (FP8, INT8):
        xs, _, out, contract = parse_spec(spec)
        xq, sx = quantize_activations(x, tuple(xs.index(c) for c in contract), cdt, w.input_scale)
        acc = jnp.int32 if cdt == INT8 else jnp.float32
        y = jnp.einsum(spec, xq, w.q, preferred_element_type=acc).astype(jnp.float32)
        rows = [c for c in xs if c not in contract]  # x's kept dims, in y's order
        y = y * sx.reshape([sx.shape[xs.index(c)] if c in rows else 1 for c in out])
    else:
        y = jnp.einsum(spec, x.astype(cdt), w.q.astype(cdt), preferred_element_type=jnp.float32)
    _, ws, out, _ = parse_spec(spec)
    # the scale's output dims, laid out as y's (size 1 where y has a dim the weight lacks)
    keep = [i for i, c in enumerate(ws) if c in out]
    scale = w.scale.reshape([w.scale.shape[i] for i in keep])
    w_out = [ws[i] for i in keep]
    order = sorted(range(len(w_out)), key=lambda j: out.index(w_out[j]))
    scale = jnp.transpose(scale, order)
    shape = [scale.shape[[w_out[j] for j in order].index(c)] if c in w_out else 1 for c in out]
    return y * scale.reshape(shape)


FP8 = jnp.dtype(jnp.float8_e4m3fn)
INT8 = jnp.dtype(jnp.int8)
# The largest magnitude each activation dtype takes (e4m3's 448; int8's 127, as vLLM's
# per-token int8 quantization scales amax to 127 and clamps to [-128, 127]).
_ACT_MAX = {FP8: 448.0, INT8: 127.0}


def quantize_activations(x: jax.Array, axes: tuple[int, ...], dtype, input_scale=None):
    """x scaled into `dtype` (float8_e4m3fn or int8) per token: (values, float32 scales with
    x's rank, size 1 on `axes`). The scale is the checkpoint's static one where `input_scale`
    is given and positive, else amax / max over `axes` (each token's own: dynamic). int8
    values are rounded to nearest even and clamped to [-128, 127], e4m3 ones clipped to
    +-448 and converted (round to nearest even)."""
    dtype = jnp.dtype(dtype)
    top = _ACT_MAX[dtype]
    x32 = x.astype(jnp.float32)
    amax = jnp.max(jnp.abs(x32), axis=axes, keepdims=True)
    sx = jnp.maximum(amax, 1e-12) / top
    if input_scale is not None:
        static = input_scale.astype(jnp.float32).reshape(())
        sx = jnp.where(static > 0, jnp.broadcast_to(static, sx.shape), sx)
    if dtype == INT8:
        return jnp.clip(jnp.round(x32 / sx), -128, 127).astype(INT8), sx
    return jnp.clip(x32 / sx, -top, top).astype(FP8), sx


def permute_inputs(spec: str, x: jax.Array, perm: jax.Array) -> jax.Array:
    """x with its contracted dims (flattened) gathered in the order `perm`: the order an
    act-order weight's rows are stored in."""
    xs, _, _, contract = parse_spec(spec)
    axes = [xs.index(c) for c in contract]
    if axes != list(range(x.ndim - len(axes), x.ndim)):
        raise ValueError(f"act-order weights need the contracted dims last; spec {spec!r}")
    lead = x.shape[: x.ndim - len(axes)]
    flat = x.reshape(*lead, -1)
    return jnp.take(flat, perm.reshape(-1), axis=-1).reshape(x.shape)


def quantized_params(model: nnx.Module):
    """(module, attribute name, QuantizedParam) of every quantized weight of `model`."""
    for _, module in nnx.iter_graph(model):
        if not isinstance(module, nnx.Module):
            continue
        for name, var in list(vars(module).items()):
            if isinstance(var, QuantizedParam):
                yield module, name, var


def prepare_fp8_products(model: nnx.Module) -> int:
    """Mark `model`'s FP8 weights with per-channel or per-tensor scales to be multiplied as FP8
    (their compute dtype becomes float8_e4m3fn; see `_dense_quantized`); the backend calls
    this on chips with FP8 products (H100/H200). Block-scaled weights keep their upcast.
    Returns how many weights were marked."""
    count = 0
    for module, name, var in quantized_params(model):
        if jnp.dtype(var.get_value().dtype) == FP8:
            scale = getattr(module, name + SCALE_SUFFIX).get_value().shape
            if all(scale[a] == 1 for a in contracted_axes(var.get_metadata()["spec"])):
                var.set_metadata("compute_dtype", FP8.name)
                count += 1
    return count


def prepare_int8_products(model: nnx.Module) -> tuple[int, int]:
    """Mark `model`'s int8 weights whose checkpoint quantizes the activations to int8 too
    (W8A8: metadata `activations` "int8-dynamic" or "int8-static") for an int8 x int8 product
    with an int32 accumulator (compute dtype int8; see `_dense_quantized`); the backend calls
    this on chips with int8 products. Only symmetric weights with one scale per output
    channel (or tensor) and inputs in order multiply so; the others keep their floats.
    Returns (weights marked, W8A8 weights left weight-only)."""
    marked = left = 0
    for module, name, var in quantized_params(model):
        meta = var.get_metadata()
        if not str(meta.get("activations") or "").startswith("int8"):
            continue
        scale = getattr(module, name + SCALE_SUFFIX).get_value().shape
        if (jnp.dtype(var.get_value().dtype) == INT8
                and getattr(module, name + ZERO_SUFFIX, None) is None
                and getattr(module, name + PERM_SUFFIX, None) is None
                and all(scale[a] == 1 for a in contracted_axes(meta["spec"]))):
            var.set_metadata("compute_dtype", INT8.name)
            marked += 1
        else:
            left += 1
    return marked, left


def activation_products(model: nnx.Module) -> dict[str, int]:
    """How many quantized weights multiply with quantized activations, by compute dtype
    (float8_e4m3fn, int8), and how many have an activation scheme but multiply weight-only
    ("weight-only"): what start-up reports."""
    out: dict[str, int] = {}
    for _, _, var in quantized_params(model):
        meta = var.get_metadata()
        cdt = jnp.dtype(meta.get("compute_dtype", "float32"))
        key = cdt.name if cdt in (FP8, INT8) else "weight-only" if meta.get("activations") else None
        if key is not None:
            out[key] = out.get(key, 0) + 1
    return out


def product_form(spec: str) -> bool:
    """Whether `dense(spec, ...)` is one 2-D product x [M, K] @ w [K, N]: x's contracted dims
    last, the weight's first and in the same order, the output x's kept dims then the
    weight's (every decoder layer's weight; not the stacked experts)."""
    xs, ws, out, contract = parse_spec(spec)
    kept_x = "".join(c for c in xs if c not in contract)
    kept_w = "".join(c for c in ws if c not in contract)
    return xs == kept_x + contract and ws == contract + kept_w and out == kept_x + kept_w


def _mesh_axes(entry) -> tuple[str, ...]:
    return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def _scale_spec(q_spec: P, s_shape, mesh: Mesh) -> P | None:
    """The spec that gives each shard of the values the scales of its own blocks: the values'
    mesh axes on every dim the scales block (size > 1), none where one scale spans the dim;
    None when a split does not divide the scales' blocks."""
    out = []
    for i, m in enumerate(s_shape):
        axes = _mesh_axes(q_spec[i] if i < len(q_spec) else None)
        if not axes or m == 1:
            out.append(None)
        elif m % ax.mesh_axes_size(mesh, axes):
            return None
        else:
            out.append(q_spec[i])
    return P(*out)


def prepare_quantized_products(model: nnx.Module, impl: str) -> int:
    """Mark `model`'s FP8 and packed int4 weights whose `dense` is one 2-D product to multiply
    through the quantized product kernel `impl` (`pallas_kernels/quant_matmul`), recording the
    mesh and specs they are placed with (the model's `mesh` and `rules`); the backend calls
    this when its plan names a kernel. A weight whose split the scales' blocks do not follow
    keeps XLA's product. Returns how many weights were marked (MXFP4 ones too: the kernel
    decodes their codes as it converts int4's)."""
    mesh = getattr(model, "mesh", None)
    mesh = mesh if mesh is not None and mesh.size > 1 else None
    rules = dict(getattr(model, "rules", ())) or ax.DEFAULT_RULES
    count = 0
    for module, name, var in quantized_params(model):
        value, meta = var.get_value(), var.get_metadata()
        spec, packed_axis = meta["spec"], meta.get("packed_axis")
        nc = len(parse_spec(spec)[3])
        if (jnp.dtype(value.dtype) not in (FP8, jnp.dtype(jnp.uint8))
                or jnp.dtype(meta.get("compute_dtype", "float32")) in (FP8, INT8)
                or not product_form(spec) or packed_axis not in (None, nc - 1)):
            continue
        specs = None
        if mesh is not None:
            q_spec = ax.logical_to_spec(meta["logical_axes"], value.shape, mesh, rules)
            scale = getattr(module, name + SCALE_SUFFIX).get_value()
            s_spec = _scale_spec(q_spec, scale.shape, mesh)
            if s_spec is None:
                continue
            specs = (q_spec, s_spec)
        var.set_metadata("product", QuantizedProduct(impl, mesh, specs))
        count += 1
    return count


def _rows_of_groups(a: jax.Array, nc: int, out_shape) -> jax.Array:
    """Scales (or zeros) [contracted blocks..., output blocks...] -> [G, N]: repeated over the
    output channels each one covers."""
    for i, n in enumerate(out_shape):
        m = a.shape[nc + i]
        if m not in (1, n):
            a = jnp.repeat(a, n // m, axis=nc + i)
    a = jnp.broadcast_to(a, (*a.shape[:nc], *out_shape))
    return a.reshape(math.prod(a.shape[:nc]), -1)


def _dense_kernel(spec: str, x: jax.Array, w: QuantizedWeight) -> jax.Array:
    """`dense` through the weight's product kernel: x as [M, K], the values as [K (/2 packed),
    N], scales and zeros as [G, N]. On a split weight, each shard's product runs inside a
    `shard_map` (Mosaic kernels do not partition); a split contracted dim gives partial
    products, summed over its mesh axes."""
    nc = len(parse_spec(spec)[3])
    kept = x.ndim - nc
    product = w.product

    def local(x, q, scale, *zero):
        lead, out_shape = x.shape[:kept], q.shape[nc:]
        y = quant_matmul(x.reshape(math.prod(lead), -1), q.reshape(-1, math.prod(out_shape)),
                         _rows_of_groups(scale, nc, out_shape),
                         _rows_of_groups(zero[0], nc, out_shape) if zero else None,
                         packed=w.packed_axis is not None, compute_dtype=w.compute_dtype,
                         impl=product.impl, mxfp4=w.mxfp4)
        y = y.reshape(*lead, *out_shape)
        return jax.lax.psum(y, split) if split else y

    args = (x, w.q, w.scale) + (() if w.zero is None else (w.zero,))
    if product.mesh is None:
        split = ()
        return local(*args)
    mesh, manual = ax.context_mesh(product.mesh)  # in the data-parallel step "data" is manual
    q_spec, s_spec = (ax.without_axes(s, manual) for s in product.specs)
    q_entries = list(q_spec) + [None] * (w.q.ndim - len(q_spec))
    split = tuple(a for e in q_entries[:nc] for a in _mesh_axes(e))
    x_spec = P(*[None] * kept, *q_entries[:nc])
    out_spec = P(*[None] * kept, *q_entries[nc:])
    return jax.shard_map(local, mesh=mesh, in_specs=(x_spec, q_spec) + (s_spec,) * (len(args) - 2),
                         out_specs=out_spec, check_vma=False)(*args)


def dense_group(spec: str, x: jax.Array, w: PackedWeight) -> list[jax.Array]:
    """`dense(spec, x, w_i)` for each weight w_i packed together in `w`, in one product."""
    nc = len(parse_spec(spec)[3])
    lead = x.shape[: x.ndim - nc]
    y = _PACKED_PRODUCTS[w.kernel](x.reshape(math.prod(lead), -1), w.blocks)
    sizes = [math.prod(s) for s in w.out_shapes]
    parts = jnp.split(y, list(np.cumsum(sizes)[:-1]), axis=-1) if len(sizes) > 1 else [y]
    return [p.reshape(*lead, *s) for p, s in zip(parts, w.out_shapes)]
