"""Build a model with its parameters placed on a mesh: from a checkpoint or at random.

The model is first created abstractly (`nnx.eval_shape`, no memory), each parameter's target
sharding is derived from its logical axes, and every tensor is then read from the checkpoint,
converted, and placed straight into that sharding (each device receives only its shard).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh
from jaxserve.models.arch_config import ArchConfig
from jaxserve.models.layers.linear import (
    INPUT_SCALE_SUFFIX,
    MXFP4_PARTS,
    PERM_SUFFIX,
    QUANTIZATIONS,
    SCALE_SUFFIX,
    ZERO_SUFFIX,
    QuantizedParam,
    block_scales,
    contracted_axes,
    quantize_int8,
    scale_shape,
)
from jaxserve.models.layers.quant import (
    pack_int4,
    quantize_fp8_blocks,
    quantize_int4_blocks,
    quantize_int8_blocks,
    weight_format,
)
from jaxserve.models.weight_format import WeightFormat
from jaxserve.models.loader import BLOCK_SCALE_SUFFIX, load_checkpoint
from jaxserve.models.quant_checkpoint import FormatTensors, UnquantizedTensor
from jaxserve.models.placement import put_sharded
from jaxserve.models.registry import get_model_class
from jaxserve.models.sharding import (
    DEFAULT_RULES,
    named_sharding,
    single_device_mesh,
    state_shardings,
)

logger = logging.getLogger(__name__)


def _is_var(x) -> bool:
    return isinstance(x, nnx.Variable)


def _path_key(path) -> str:
    return ".".join(str(getattr(p, "key", getattr(p, "name", p))) for p in path)


def create_model(
    cfg: ArchConfig,
    *,
    dtype=jnp.float32,
    mesh: Mesh | None = None,
    attention_impl: str = "auto",
    get_tensor: Callable[[str], np.ndarray] | None = None,
    seed: int = 0,
    quantization: str | None = None,
    rules: Mapping[str, str | None] | None = None,
    moe_impl: str = "ragged",
):
    """A model of cfg.architecture; weights from `get_tensor` (HF names) or random (seeded).

    quantization: None, or "int8" (weight-only, per output channel; every matmul weight and
    the embedding are quantized as they are placed: a float checkpoint is never held on the
    device). A checkpoint storing int8 blocks (`cfg.int8_block_size`: a GGUF Q8_0 file) is
    dequantized for a float model; with "int8" its blocks are placed as they are, one scale
    per block. rules: the logical-axis rules (models/sharding.py; default DEFAULT_RULES).
    moe_impl: the grouped products of MoE layers (layers/moe.py's MOE_IMPLS; the engine passes
    its backend's `DevicePlan.moe_impl`).
    """
    cls = get_model_class(cfg.architecture)
    mesh = mesh or single_device_mesh()
    rules = DEFAULT_RULES if rules is None else rules

    def build(rngs: nnx.Rngs):
        return cls(cfg, dtype=dtype, rngs=rngs, mesh=mesh, attention_impl=attention_impl,
                   quantization=quantization, rules=rules, moe_impl=moe_impl)

    graphdef, abs_state, shardings = abstract_model(cfg, dtype=dtype, mesh=mesh, attention_impl=attention_impl,
                                                    quantization=quantization, rules=rules,
                                                    moe_impl=moe_impl)

    if get_tensor is None:
        # Random weights (tests, benchmarks): initialise under jit straight into the shardings.
        out_shardings = jax.tree.map(lambda v: v, shardings)
        init = jax.jit(lambda: nnx.split(build(nnx.Rngs(seed)))[1], out_shardings=out_shardings)
        return nnx.merge(graphdef, init())

    # The checkpoint's tensors are mapped as it stores them; heads appended for lane-dense KV
    # pages (`ArchConfig.with_kv_heads`) are zeros added after the mapping (`pad_heads`).
    weight_map = cls.hf_weight_map(cfg.checkpoint_config())
    block = cfg.int8_block_size
    fmt = weight_format(cfg, quantization)
    stored = None if cfg.weight_format is None else FormatTensors(get_tensor, cfg.weight_format,
                                                                  _has(get_tensor))
    get_float = get_tensor if block is None else dequantizing(get_tensor, block)
    if stored is not None:
        get_float = stored.dequantized
    flat_shardings = {
        _path_key(p): s for p, s in jax.tree_util.tree_leaves_with_path(shardings)
    }

    abstract_vars = {
        _path_key(p): v for p, v in jax.tree_util.tree_leaves_with_path(abs_state, is_leaf=_is_var)
    }
    pending: dict[str, tuple] = {}  # quantized weight -> (its parts, accesses left)

    def host_tensor(key: str, get=get_float):
        if key not in weight_map:
            raise ValueError(f"no checkpoint mapping for parameter {key!r} of {cfg.architecture}")
        var = abstract_vars.get(key)
        axes = None if var is None else var.get_metadata().get("logical_axes")
        return pad_heads(weight_map[key](get), axes, cfg)

    def quantized(key: str) -> tuple:
        """Values and scales (zeros, input order, input scale) of quantized weight `key`,
        kept until each of its parameters has taken its part: the checkpoint's own blocks
        when it stores them, else quantized here."""
        if key in pending:
            parts, left = pending[key]
            if left <= 1:
                del pending[key]
            else:
                pending[key] = (parts, left - 1)
            return parts
        var = abstract_vars[key]
        spec = var.get_metadata()["spec"]
        uses = sum(key + suffix in abstract_vars for suffix in
                   (SCALE_SUFFIX, ZERO_SUFFIX, PERM_SUFFIX, INPUT_SCALE_SUFFIX))
        if var.get_metadata().get("mxfp4"):  # the checkpoint's MXFP4 codes and exponents
            codes, exponents = host_tensor(key + MXFP4_PARTS, get_tensor)
            _check_shape(key, codes.shape, var.get_value().shape)
            parts = (codes, exponents, None, None, None)
        elif fmt is not None:
            parts = format_weight(key, var)
        else:
            parts = None if block is None else stored_int8(key, spec)
            if parts is None:
                host = host_tensor(key)
                _check_shape(key, host.shape, var.get_value().shape)
                parts = quantize_int8(np.asarray(host, np.float32), spec, block)
            _check_shape(key, parts[0].shape, var.get_value().shape)
        pending[key] = (parts, uses)
        return parts

    def stored_int8(key: str, spec: str) -> tuple[np.ndarray, np.ndarray] | None:
        """The checkpoint's int8 blocks of weight `key`, laid out as the parameter (None when a
        source tensor is float). The weight map moves values and scales alike: the scales go
        through it repeated over their blocks, then one per block is kept."""
        try:
            q = host_tensor(key, _int8_only(get_tensor))
        except _FloatTensor:
            return None
        expanded = host_tensor(key, lambda name: np.repeat(get_tensor(name + BLOCK_SCALE_SUFFIX), block, axis=-1))
        return q, block_scales(expanded, scale_shape(q.shape, spec, block)).astype(np.float32)

    def format_weight(key: str, var) -> tuple:
        """Weight `key` in format `fmt`: the checkpoint's own values and scales (and zeros)
        laid out as the parameter, or (a float tensor) quantized here; then the order of its
        contracted inputs (act-order) and its static activation scale, or None."""
        meta = var.get_metadata()
        spec, axis = meta["spec"], meta.get("packed_axis")
        shape = list(var.get_value().shape)
        if axis is not None:
            shape[axis] *= 2
        sshape = scale_shape(shape, spec, fmt.in_block, fmt.out_block)
        perm = input_scale = None
        try:
            if stored is None:
                raise UnquantizedTensor(key)
            sources: list[str] = []

            def values(name):
                sources.append(name)
                return stored.values(name)

            q = host_tensor(key, values)
            _check_shape(key, q.shape, shape)
            scale = block_scales(host_tensor(key, stored.scales), sshape).astype(np.float32)
            zero = block_scales(host_tensor(key, stored.zeros), sshape) if fmt.has_zeros else None
            if fmt.act_order:
                perm = input_order(key, spec, shape)
            scales = [s for s in map(stored.input_scale, sources) if s is not None]
            input_scale = max(scales, key=lambda a: float(a[0])) if scales else None
        except UnquantizedTensor:
            host = np.asarray(host_tensor(key), np.float32)
            _check_shape(key, host.shape, shape)
            q, scale, zero = quantize_format(host, sshape, fmt)
        if axis is not None:
            q = pack_int4(q, axis)
        if fmt.act_order and perm is None:
            perm = np.arange(math.prod(shape[a] for a in contracted_axes(spec)), dtype=np.int32)
        if fmt.static_activations and input_scale is None:
            input_scale = np.zeros((1,), np.float32)  # none stored: scaled per token
        return q, scale, zero, perm, input_scale

    def input_order(key: str, spec: str, shape) -> np.ndarray | None:
        """The activations' gather order for act-order weight `key`, whose stored inputs
        `stored.perm` reordered, in the parameter's flattened contracted dims (None when in
        order). The weight map moves each HF input column's index (and the index its stored
        column holds) as it moves the values."""
        def columns(order):
            def get(name):
                out, inn = stored._shape(_base_name(name))
                idx = order(name, inn)
                return np.broadcast_to(np.asarray(idx, np.float32)[None, :], (out, inn))
            return get

        natural = host_tensor(key, columns(lambda name, n: np.arange(n)))
        held = host_tensor(key, columns(
            lambda name, n: np.arange(n) if stored.perm(name) is None else stored.perm(name)))
        if np.array_equal(natural, held):
            return None
        axes = list(contracted_axes(spec))
        rest = [a for a in range(len(shape)) if a not in axes]
        flat = lambda a: np.transpose(a, axes + rest).reshape(-1, max(1, math.prod(  # noqa: E731
            shape[r] for r in rest)))[:, 0].astype(np.int64)
        c, p = flat(natural), flat(held)
        inverse = np.empty_like(c)
        inverse[c] = np.arange(len(c))
        return inverse[p].astype(np.int32)

    def load(path, var):
        key = _path_key(path)
        for suffix, index in ((SCALE_SUFFIX, 1), (ZERO_SUFFIX, 2), (PERM_SUFFIX, 3),
                              (INPUT_SCALE_SUFFIX, 4)):
            base = key.removesuffix(suffix)
            if base != key and isinstance(abstract_vars.get(base), QuantizedParam):
                part = quantized(base)[index]
                axes = var.get_metadata()["logical_axes"]
                sharding = named_sharding(axes, part.shape, mesh, rules)
                return var.replace(put_sharded(part, sharding, var.get_value().dtype))
        if isinstance(var, QuantizedParam):
            q = quantized(key)[0]
            return var.replace(put_sharded(q, flat_shardings[key], var.get_value().dtype))
        host = host_tensor(key)
        _check_shape(key, host.shape, var.get_value().shape)
        return var.replace(put_sharded(host, flat_shardings[key], var.get_value().dtype))

    state = jax.tree_util.tree_map_with_path(load, abs_state, is_leaf=_is_var)
    return nnx.merge(graphdef, state)


def pad_heads(tensor: np.ndarray, axes, cfg: ArchConfig) -> np.ndarray:
    """`tensor`, a parameter of logical `axes` as the checkpoint holds it, with the zero heads
    `cfg` appends (`ArchConfig.with_kv_heads`) added at the end of its query-head and KV-head
    axes: zero rows of the q/k/v projections and their biases, zero input rows of the output
    projection, zero attention-sink logits. Unchanged for a model served as stored."""
    if cfg.checkpoint_heads is None or not axes:
        return tensor
    from jaxserve.models import sharding as ax

    stored = dict(zip((ax.Q_HEADS, ax.KV_HEADS), cfg.checkpoint_heads))
    served = {ax.Q_HEADS: cfg.num_heads, ax.KV_HEADS: cfg.num_kv_heads}
    widths = [(0, 0)] * tensor.ndim
    for i, name in enumerate(axes):
        if name in stored and tensor.shape[i] == stored[name]:
            widths[i] = (0, served[name] - stored[name])
    if all(w == (0, 0) for w in widths):
        return tensor
    return np.pad(np.asarray(tensor), widths)


def abstract_model(
    cfg: ArchConfig,
    *,
    dtype=jnp.float32,
    mesh: Mesh | None = None,
    attention_impl: str = "auto",
    quantization: str | None = None,
    rules: Mapping[str, str | None] | None = None,
    moe_impl: str = "ragged",
):
    """The model of `create_model` without any memory: (graphdef, abstract state of
    ShapeDtypeStructs, the state's NamedShardings from the rules).

    Built without an `nnx.Rngs` (parameters would be zeros; only shapes are computed): the
    same graph and state structure, while each random draw under `eval_shape` made flax ask
    the tracer for its sharding, and JAX prints the whole trace so far into that error
    message: ~1 s for a 30-layer model, quadratic in depth."""
    if quantization is not None and quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {QUANTIZATIONS} or None; got {quantization!r}")
    cls = get_model_class(cfg.architecture)
    mesh = mesh or single_device_mesh()
    rules = DEFAULT_RULES if rules is None else rules
    abstract = nnx.eval_shape(lambda: cls(cfg, dtype=dtype, rngs=None, mesh=mesh,
                                          attention_impl=attention_impl, quantization=quantization,
                                          rules=rules, moe_impl=moe_impl))
    graphdef, abs_state = nnx.split(abstract)
    return graphdef, abs_state, state_shardings(abs_state, mesh, rules)


def sharded_abstract_model(
    cfg: ArchConfig,
    *,
    dtype=jnp.float32,
    mesh: Mesh | None = None,
    attention_impl: str = "auto",
    rules: Mapping[str, str | None] | None = None,
    moe_impl: str = "ragged",
    quantization: str | None = None,
):
    """The model `create_model` builds from a checkpoint (its weight format, or `quantization`
    at load), with ShapeDtypeStructs carrying the shardings `create_model` places each weight
    (and each quantized weight's scales) in for values: no memory."""
    mesh = mesh or single_device_mesh()
    graphdef, abs_state, shardings = abstract_model(cfg, dtype=dtype, mesh=mesh, attention_impl=attention_impl,
                                                    quantization=quantization, rules=rules, moe_impl=moe_impl)
    flat = {_path_key(p): s for p, s in jax.tree_util.tree_leaves_with_path(shardings)}

    def sharded(path, var):
        value = var.get_value()
        return var.replace(jax.ShapeDtypeStruct(value.shape, value.dtype, sharding=flat[_path_key(path)]))

    return nnx.merge(graphdef, jax.tree_util.tree_map_with_path(sharded, abs_state, is_leaf=_is_var))


def quantize_format(w32: np.ndarray, sshape, fmt: WeightFormat):
    """(values, scales, zeros or None) of float32 `w32` in format `fmt`, scales of `sshape`."""
    split = [x for n, m in zip(w32.shape, sshape) for x in (m, n // m)]
    if fmt.kind == "fp8":
        return (*quantize_fp8_blocks(w32, split), None)
    if fmt.kind == "int8":
        return quantize_int8_blocks(w32, split, fmt.asymmetric)
    return quantize_int4_blocks(w32, split)


def _base_name(name: str) -> str:
    return name.removesuffix(".weight")


def _has(get_tensor: Callable[[str], np.ndarray]) -> Callable[[str], bool]:
    def has(name: str) -> bool:
        try:
            get_tensor(name)
        except KeyError:
            return False
        return True

    return has


class _FloatTensor(Exception):
    """A checkpoint tensor asked for as int8 blocks is stored as floats."""


def _int8_only(get_tensor: Callable[[str], np.ndarray]) -> Callable[[str], np.ndarray]:
    def get(name: str) -> np.ndarray:
        w = get_tensor(name)
        if w.dtype != np.int8:
            raise _FloatTensor(name)
        return w

    return get


def dequantizing(get_tensor: Callable[[str], np.ndarray], block: int) -> Callable[[str], np.ndarray]:
    """`get_tensor` with a checkpoint's int8 blocks (scales in `<name>` + BLOCK_SCALE_SUFFIX, one
    per `block` values of the last dim) turned into float32 values q * scale."""

    def get(name: str) -> np.ndarray:
        w = get_tensor(name)
        if w.dtype != np.int8:
            return w
        scale = np.asarray(get_tensor(name + BLOCK_SCALE_SUFFIX), np.float32)
        values = w.reshape(*w.shape[:-1], -1, block).astype(np.float32) * scale[..., None]
        return values.reshape(w.shape)

    return get


def _check_shape(key: str, got, expected) -> None:
    if tuple(got) != tuple(expected):
        raise ValueError(f"checkpoint tensor for {key} has shape {tuple(got)}, expected {tuple(expected)}")


def load_model(path, *, dtype=jnp.float32, mesh: Mesh | None = None, attention_impl: str = "auto",
               quantization: str | None = None, rules: Mapping[str, str | None] | None = None,
               moe_impl: str = "ragged"):
    """The model in the HF directory `path` (see loader.resolve_model), weights on `mesh`."""
    ckpt = load_checkpoint(path)
    cfg = ArchConfig.from_hf(ckpt.config)
    return create_model(
        cfg, dtype=dtype, mesh=mesh, attention_impl=attention_impl, get_tensor=ckpt.get_tensor,
        quantization=quantization, rules=rules, moe_impl=moe_impl,
    )
