"""The scales of a quantized KV cache (fp8, int8), one pair (k, v) per layer, set on each
layer as a `KVCacheScale` array ([2, n] float32: K's row, V's row; models/layers/attention.py):
a replicated input of the compiled step beside the weights, so the step's program depends on
the cache's dtype only and one compiled step (a `jaxserve compile` directory) serves any scales.
A model whose scales were never set gets ones (1.0) when its step program is built
(`kv_scale_inputs`).

- From the checkpoint when it has them (vLLM's names: `model.layers.N.self_attn.k_scale` /
  `v_scale`, as llm-compressor writes them with a compressed-tensors `kv_cache_scheme`, or
  `k_proj.output_scale` / `v_proj.output_scale`, or one `kv_scale` for both), a value per
  tensor or per KV head. They are calibrated for fp8 (the largest value becomes 448), or for
  int8 where the `kv_cache_scheme` says so (127); a cache of the other dtype maps the same
  largest value to its own largest.
- Otherwise they are measured: one float32 forward of the model (on its mesh) over
  `CALIBRATION_TEXT` (about 150 tokens) followed by 64 token ids spread evenly over the
  vocabulary; each layer's and KV head's largest |k| and |v| over it times the dtype's
  `HEADROOM` becomes the dtype's largest value (int8 127, fp8 448). Values beyond it are
  clipped. fp8 is measured too, not 1.0 as in vLLM: the default model's layer-0 values have a
  median of 0.017 and 40 % of them lie below e4m3's smallest normal (2^-6), where its
  precision falls.

A multi-head latent attention model (DeepSeek V3: one latent row per token, no V array) has
two scales per layer, `k` = (the latent columns', the roped columns'), measured apart (the
latent is RMS-normed, the rope part is not), and `v` = (the latent's,): the value is the
row's latent columns (models/layers/mla.py). A checkpoint's per-tensor `k_scale` serves both
parts (vLLM's one scale for the latent cache).
"""

from __future__ import annotations

import contextlib
import logging
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxserve.models.layers.attention import KVCacheScale
from jaxserve.models.sharding import single_device_mesh
from jaxserve.pallas_kernels.kv_quant import (
    FP8_DTYPE,
    INT8_DTYPE,
    QUANT_MAX,
    head_scales,
    is_quantized,
)
from jaxserve.runner.kv_cache import abstract_kv_cache
from jaxserve.runner.step_inputs import StepRequest, pack_step

logger = logging.getLogger(__name__)

# The measured range per cache dtype: the calibration's largest value times this becomes the
# dtype's largest (QUANT_MAX). int8's rounding step grows with it, so its margin is small; e4m3
# keeps 3 mantissa bits over 2^-6..448, so a wide margin costs nothing: at 16 the calibration's
# largest value becomes 28, values 16x past it still fit, and values down to 1/1792 of it stay
# normal (measured on the default model: benchmarks/kv_fp8_drift.py, docs/DESIGN.md §9).
HEADROOM = {INT8_DTYPE: 1.25, FP8_DTYPE: 16.0}
INT8_HEADROOM = HEADROOM[INT8_DTYPE]
FP8_HEADROOM = HEADROOM[FP8_DTYPE]
CALIBRATION_SPREAD = 64  # tokens spread evenly over the vocabulary after the text
CALIBRATION_TEXT = (
    "The committee met on a rainy Tuesday in March to review the budget for the new library. "
    "Maria, who had run the numbers twice, explained that the roof repairs would cost about "
    "$14,500, while the children's reading room needed 320 new books and six tables. "
    "def mean(xs):\n    return sum(xs) / len(xs) if xs else 0.0\n"
    "Photosynthesis converts light energy into chemical energy: plants take in carbon dioxide "
    "and water and release oxygen. In 1969, Apollo 11 landed on the Moon; Neil Armstrong's "
    "first words were broadcast around the world. Translate to French: 'Where is the station?' "
    "-> 'Où est la gare ?' Q: What is 17 times 23? A: 391. The quick brown fox jumps over the "
    "lazy dog, and then everyone went home for dinner."
)
_SCALE_NAMES = (("self_attn.k_scale", "self_attn.v_scale"),
                ("self_attn.k_proj.output_scale", "self_attn.v_proj.output_scale"),
                ("self_attn.kv_scale", "self_attn.kv_scale"))

Scales = list[tuple[tuple[float, ...], tuple[float, ...]]]  # per layer: (k, v)


def kv_cache_scheme(config: dict) -> dict | None:
    """A compressed-tensors checkpoint's `kv_cache_scheme` (config.json's quantization_config),
    None when it has none; ValueError for schemes the cache cannot hold (8-bit static symmetric
    float or int, a scale per tensor or per KV head: strategy "tensor" or "attn_head")."""
    qc = config.get("quantization_config") if isinstance(config, dict) else None
    scheme = qc.get("kv_cache_scheme") if isinstance(qc, dict) else None
    if scheme is None:
        return None
    what = (f"kv_cache_scheme {{type {scheme.get('type')!r}, num_bits {scheme.get('num_bits')}, "
            f"strategy {scheme.get('strategy')!r}, dynamic {scheme.get('dynamic')}, symmetric "
            f"{scheme.get('symmetric')}}}")
    if (scheme.get("type") not in ("float", "int") or int(scheme.get("num_bits") or 0) != 8
            or scheme.get("strategy", "tensor") not in ("tensor", "attn_head")
            or scheme.get("dynamic") not in (None, False) or scheme.get("symmetric") is False):
        raise ValueError(f"the checkpoint's {what} is not supported: a quantized KV cache takes "
                         "static symmetric 8-bit scales (type float or int) per tensor or per "
                         "KV head (strategy tensor or attn_head)")
    return scheme


def checkpoint_scales(ckpt, num_layers: int, num_kv_heads: int) -> Scales | None:
    """Each layer's (k, v) scales from the checkpoint, as stored (None when it has none); a
    checkpoint with scales for some layers only, or a `kv_cache_scheme` without them, is
    refused (ValueError), as is a `kv_cache_scheme` the cache cannot hold."""
    scheme = kv_cache_scheme(getattr(ckpt, "config", None) or {})
    names = set(ckpt.tensor_names())
    for k_name, v_name in _SCALE_NAMES:
        found = [f"model.layers.{i}.{k_name}" in names for i in range(num_layers)]
        if not any(found):
            continue
        if not all(found):
            raise ValueError(f"the checkpoint has {k_name} for {sum(found)} of {num_layers} layers")
        out = []
        for i in range(num_layers):
            k, v = (ckpt.get_tensor(f"model.layers.{i}.{n}", np.float32) for n in (k_name, v_name))
            out.append((_values(k, num_kv_heads), _values(v, num_kv_heads)))
        return out
    if scheme is not None:
        raise ValueError("the checkpoint's quantization_config has a kv_cache_scheme but no "
                         "model.layers.N.self_attn.k_scale / v_scale tensors")
    return None


def _values(x: np.ndarray, num_kv_heads: int) -> tuple[float, ...]:
    x = np.asarray(x, np.float32).reshape(-1)
    head_scales(x, num_kv_heads)  # one value or one per KV head, else ValueError
    if not np.all(np.isfinite(x)) or np.any(x <= 0):
        raise ValueError(f"a KV cache scale must be finite and positive; got {x.tolist()}")
    return tuple(float(v) for v in x)


def for_cache_dtype(scales: Scales, calibrated_for, kv_dtype) -> Scales:
    """Scales calibrated for a cache of `calibrated_for` (its largest value is the calibration's
    largest) as the scales of a `kv_dtype` cache mapping that same value to its own largest."""
    ratio = QUANT_MAX[jnp.dtype(calibrated_for)] / QUANT_MAX[jnp.dtype(kv_dtype)]
    if ratio == 1.0:
        return scales
    return [(tuple(x * ratio for x in k), tuple(x * ratio for x in v)) for k, v in scales]


def calibration_ids(vocab_size: int, tokenize) -> list[int]:
    """The calibration's token ids: `tokenize()` (the text's ids), then CALIBRATION_SPREAD ids
    spread evenly over the vocabulary (rare tokens, other scripts)."""
    spread = np.linspace(0, vocab_size - 1, CALIBRATION_SPREAD).astype(int).tolist()
    return list(tokenize()) + spread


def calibration_name(num_tokens: int) -> str:
    """The executable's name of the calibration forward over `num_tokens` tokens (its only
    shape: a tokenizer that reads the text as more or fewer tokens needs another program)."""
    return f"kv-calibration-{num_tokens}"


CALIBRATION_PAGE_SIZE = 16


def calibration_program(model, num_tokens: int, page_size: int = CALIBRATION_PAGE_SIZE):
    """(compile, abstract arguments) of the calibration forward over `num_tokens` tokens of
    `model` (real or abstract weights, its scales not yet set): (weights state, packed inputs)
    -> per layer and KV head (or latent part) the largest |k| and |v|, from a float32 cache
    made zero inside the program. On the model's mesh, laid out by its rules (a tensor- or
    data-parallel engine's weights are there); the inputs replicated. `jaxserve compile`
    compiles it ahead from the abstract model (runner/prebuilt.py)."""
    cfg = model.config
    pages = math.ceil(num_tokens / page_size)
    mesh = getattr(model, "mesh", None) or single_device_mesh()
    rules = dict(model.rules) if getattr(model, "rules", None) else None
    kv_like = abstract_kv_cache(cfg, pages + 1, page_size, jnp.float32, mesh, rules)
    graphdef, state = nnx.split(model)
    replicated = NamedSharding(mesh, P())

    def amax(state, inputs):
        kv = jax.tree.map(
            lambda a: jax.lax.with_sharding_constraint(jnp.zeros(a.shape, a.dtype), a.sharding), kv_like)
        _, kv = nnx.merge(graphdef, state)(inputs.input_ids, inputs.positions, kv, inputs.md)

        def per_head(c):  # [N, page_size, Hkv * D] -> [Hkv]
            return jnp.max(jnp.abs(c.reshape(*c.shape[:2], cfg.kv_cache_heads, -1)), axis=(0, 1, 3))

        def per_part(c):  # a latent cache [N, page_size, C + Dr] -> [latent's, rope's]
            a = jnp.abs(c)
            return jnp.stack([a[..., :cfg.kv_lora_rank].max(), a[..., cfg.kv_lora_rank:].max()])

        if cfg.is_mla:
            return [per_part(c) for c in kv.k], [per_part(c)[:1] for c in kv.k]
        return [per_head(c) for c in kv.k], [per_head(c) for c in kv.v]

    shaped = lambda x, sharding=None: jax.ShapeDtypeStruct(  # noqa: E731
        x.shape, x.dtype, sharding=sharding or x.sharding)
    inputs = jax.tree.map(lambda x: shaped(x, replicated),
                          calibration_inputs(num_tokens, page_size))
    args = (jax.tree.map(shaped, state), inputs)
    device = mesh.devices.flat[0]

    def compile_fn():
        # For another platform's devices (a compile-only TPU slice) Pallas reads the chip from
        # the default device, as for the steps (`StepProgram.lower`).
        other = device.platform != jax.default_backend()
        with jax.default_device(device) if other else contextlib.nullcontext():
            return jax.jit(amax, out_shardings=replicated).lower(*args).compile()

    return compile_fn, args


def calibration_inputs(token_ids: list[int] | int, page_size: int = CALIBRATION_PAGE_SIZE):
    """The calibration's packed inputs (host arrays): one request from position 0 on pages 1,
    2, ... (page 0 is the null page); an int: as many zero ids."""
    ids = [0] * token_ids if isinstance(token_ids, int) else list(token_ids)
    pages = math.ceil(len(ids) / page_size)
    return pack_step([StepRequest(ids, 0, list(range(1, pages + 1)))], num_tokens=len(ids),
                     num_reqs=1, pages_per_req=pages, page_size=page_size)


def measure_kv_scales(model, token_ids: list[int], kv_dtype, page_size: int = CALIBRATION_PAGE_SIZE,
                      scope=None) -> Scales:
    """Per layer and KV head: (largest |k|, largest |v|) over one float32 forward of
    `token_ids`, times the dtype's HEADROOM, / the dtype's largest value (QUANT_MAX). `scope`
    (an ExecutableScope): where the forward is loaded from (compiled ahead, or cached) or
    compiled and stored; None: compiled."""
    compile_fn, abstract = calibration_program(model, len(token_ids), page_size)
    name = calibration_name(len(token_ids))
    if scope is None:
        amax = compile_fn()
    else:
        if scope.prebuilt is not None and not scope.prebuilt.has(name):
            logger.warning("executables in %s: no %s (the calibration forward over this "
                           "tokenizer's %d tokens); compiling it", scope.prebuilt.cache.directory,
                           name, len(token_ids))
        amax = scope.get(name, abstract, compile_fn)
    _, state = nnx.split(model)
    inputs = jax.device_put(calibration_inputs(token_ids, page_size),
                            jax.tree.map(lambda a: a.sharding, abstract[1]))
    ks, vs = jax.device_get(amax(state, inputs))
    kv_dtype = jnp.dtype(kv_dtype)
    factor = HEADROOM[kv_dtype] / QUANT_MAX[kv_dtype]

    def scale(a):
        return tuple(float(max(x, 1e-6) * factor) for x in np.asarray(a))

    return [(scale(k), scale(v)) for k, v in zip(ks, vs)]


def latent_scales(scales: Scales) -> Scales:
    """A checkpoint's scales (one k per layer) as a latent cache's: k for both parts, and as
    the value's (the latent columns are the value)."""
    out = []
    for k, _ in scales:
        if len(k) != 1:
            raise ValueError(f"a latent cache takes one k_scale per layer; got {list(k)}")
        out.append(((k[0], k[0]), (k[0],)))
    return out


def resolve_kv_scales(kv_dtype, ckpt, model, tokenize, scope=None) -> tuple[Scales | None, str]:
    """(scales per layer or None for 1.0, where they come from) for a cache of `kv_dtype`;
    `tokenize()` gives the calibration text's token ids (called only to measure; the forward
    through `scope`, see `measure_kv_scales`). A dtype without a HEADROOM is not measured (1.0)."""
    cfg = model.config
    kv_dtype = jnp.dtype(kv_dtype)
    scales, source = _resolve_kv_scales(kv_dtype, ckpt, model, tokenize, scope)
    return padded_head_scales(scales, cfg), source


def padded_head_scales(scales: Scales | None, cfg) -> Scales | None:
    """Per-KV-head scales of a model served with zero KV heads appended
    (`ArchConfig.with_kv_heads`): the checkpoint's heads' scales, then 1.0 for each zero head
    (its keys and values are zeros; a checkpoint's per-head scales name only its own heads)."""
    if scales is None or cfg.checkpoint_heads is None:
        return scales
    stored = cfg.checkpoint_heads[1]
    pad = (1.0,) * (cfg.num_kv_heads - stored)

    def per_head(x):
        return x if len(x) == 1 else tuple(x[:stored]) + pad

    return [(per_head(k), per_head(v)) for k, v in scales]


def measures_kv_scales(kv_dtype, ckpt, model) -> bool:
    """Whether a `kv_dtype` cache's scales are measured at start (the calibration forward
    runs): a quantized cache of a model that holds one, with no scales in the checkpoint."""
    kv_dtype = jnp.dtype(kv_dtype)
    if not is_quantized(kv_dtype) or kv_dtype not in HEADROOM:
        return False
    if not getattr(model, "supports_quantized_kv_cache", True):
        return False
    cfg = model.config
    return checkpoint_scales(ckpt, cfg.num_layers, cfg.checkpoint_config().num_kv_heads) is None


def _resolve_kv_scales(kv_dtype, ckpt, model, tokenize, scope) -> tuple[Scales | None, str]:
    cfg = model.config
    scales = checkpoint_scales(ckpt, cfg.num_layers, cfg.checkpoint_config().num_kv_heads)
    if scales is not None:
        scheme = kv_cache_scheme(getattr(ckpt, "config", None) or {})
        calibrated_for = INT8_DTYPE if scheme and scheme["type"] == "int" else FP8_DTYPE
        source = "from the checkpoint" + (
            f" (kv_cache_scheme: {scheme['type']} 8-bit, {scheme.get('strategy', 'tensor')})"
            if scheme else "")
        if calibrated_for != kv_dtype:
            source += f", calibrated for {calibrated_for.name}"
        if cfg.is_mla:
            scales = latent_scales(scales)
        return for_cache_dtype(scales, calibrated_for, kv_dtype), source
    if kv_dtype in HEADROOM:
        ids = calibration_ids(cfg.vocab_size, tokenize)
        return (measure_kv_scales(model, ids, kv_dtype, scope=scope),
                f"measured on {len(ids)} calibration tokens (headroom {HEADROOM[kv_dtype]:g})")
    return None, "1.0 (the checkpoint has none)"


def scale_width(cfg) -> int:
    """n of a layer's [2, n] scales: its KV heads, or a latent cache's two parts."""
    return 2 if cfg.is_mla else cfg.kv_cache_heads


def scale_array(cfg, k, v) -> np.ndarray:
    """[2, n] float32 of one layer's (k, v) scales (one value or one per head / part each)."""
    n = scale_width(cfg)
    return np.stack([head_scales(k, n), head_scales(v, n)])


def set_kv_scales(model, scales: Scales | None) -> None:
    """Each layer takes its (k, v) scales as its `KVCacheScale` array, replicated on the
    model's mesh (None: ones, 1.0)."""
    cfg = model.config
    if scales is None:
        scales = [((1.0,), (1.0,))] * len(model.layers)
    sharding = NamedSharding(getattr(model, "mesh", None) or single_device_mesh(), P())
    for layer, (k, v) in zip(model.layers, scales, strict=True):
        layer.kv_scale = KVCacheScale(jax.device_put(scale_array(cfg, k, v), sharding))


def kv_scale_inputs(model, kv_dtype) -> None:
    """Make sure a model served with a `kv_dtype` cache has the scales its step takes: ones
    where none were set (abstract ones on an abstract model, whose weights are shapes). Nothing
    for a float cache or a model that cannot have a quantized one (it refuses at start)."""
    if (not is_quantized(kv_dtype) or not getattr(model, "supports_quantized_kv_cache", True)
            or not model.layers or hasattr(model.layers[0], "kv_scale")):
        return
    leaf = jax.tree.leaves(nnx.state(model))[0]
    if not isinstance(leaf, jax.ShapeDtypeStruct):
        set_kv_scales(model, None)
        return
    replicated = NamedSharding(getattr(model, "mesh", None) or single_device_mesh(), P())
    shape = jax.ShapeDtypeStruct((2, scale_width(model.config)), jnp.float32, sharding=replicated)
    for layer in model.layers:
        layer.kv_scale = KVCacheScale(shape)


def kv_scales_of(model) -> tuple | None:
    """The scales set on `model`'s layers, per layer (k, v), each one value when every head
    (part) has the same, else one per head (part); None when none are set."""
    if not model.layers or not hasattr(model.layers[0], "kv_scale"):
        return None
    arrays = jax.device_get([layer.kv_scale[...] for layer in model.layers])

    def values(row):
        row = [float(x) for x in np.asarray(row)]
        return tuple(row[:1]) if len(set(row)) == 1 else tuple(row)

    return tuple((values(a[0]), values(a[1])) for a in arrays)


def prepare_kv_scales(model, kv_dtype, ckpt, tokenize, scope=None) -> None:
    """Resolve and set the scales of a quantized cache (nothing for a float one), and log them.
    `scope`: where a measuring forward is loaded from or compiled into (`measure_kv_scales`)."""
    if not is_quantized(kv_dtype):
        return
    if not getattr(model, "supports_quantized_kv_cache", True):
        raise ValueError(f"a {jnp.dtype(kv_dtype).name} KV cache is not supported for "
                         f"{model.config.architecture}; use --kv-cache-dtype auto")
    scales, source = resolve_kv_scales(kv_dtype, ckpt, model, tokenize, scope)
    set_kv_scales(model, scales)  # an input of the steps: ones for None
    if scales is None:
        logger.info("KV cache %s: scales %s", jnp.dtype(kv_dtype).name, source)
        return
    k = [x for ks, _ in scales for x in ks]
    v = [x for _, vs in scales for x in vs]
    logger.info("KV cache %s: scales %s (k %.3g-%.3g, v %.3g-%.3g)", jnp.dtype(kv_dtype).name,
                source, min(k), max(k), min(v), max(v))
