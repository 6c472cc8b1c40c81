"""Compiles for real TPU generations on this CPU host (compile-only topologies from libtpu):
the Mosaic attention kernel under a shard_map, a tiling Mosaic rejects, and whole steps
(SmolLM2, and a small Llama whose attention runs the kernel) for v5e and v6e. A kernel change
that breaks Mosaic fails here. Skipped where libtpu is not installed (pip install
'jaxserve[tpu]'; the CI installs it)."""

from __future__ import annotations

import functools
import importlib.util

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

pytestmark = pytest.mark.skipif(importlib.util.find_spec("libtpu") is None,
                                reason="libtpu is not installed (pip install 'jaxserve[tpu]'): no TPU compiles")

TOPOLOGIES = ("v5e:2x2", "v6e:2x2")


@functools.cache
def _devices(topology: str):
    from jaxserve.tools.plan_worker import target_devices

    return target_devices({"kind": "tpu", "topology": topology})


def _kernel_program(devices, *, page_size: int, cache_dtype=jnp.bfloat16, sinks: bool = False):
    """The TPU kernel in a shard_map over KV heads on a 4-chip mesh, lowered for the chips
    (`sinks`: with attention sinks, [Hq] split like the query heads)."""
    from jaxserve.pallas_kernels import AttentionMetadata
    from jaxserve.pallas_kernels.ragged_paged_attention import tpu

    mesh = Mesh(np.array(devices[:4]).reshape(1, 4), ("data", "model"))
    T, R, Hq, Hkv, D, N, Pg = 64, 8, 16, 8, 128, 256, 16
    heads, cache = P(None, "model", None), P(None, None, "model")  # cache [N, ps, Hkv * D]
    sd = lambda shape, dtype, spec=P(): jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, spec))  # noqa: E731
    md = AttentionMetadata(block_tables=sd((R, Pg), jnp.int32), kv_lens=sd((R,), jnp.int32),
                           query_start_loc=sd((R + 1,), jnp.int32), num_seqs=sd((), jnp.int32),
                           slot_mapping=sd((T,), jnp.int32))

    def local(q, kc, vc, md, *sink):
        return tpu.ragged_paged_attention_tpu(q, kc, vc, md, sm_scale=0.1, sliding_window=128, soft_cap=30.0,
                                              sinks=sink[0] if sink else None)

    sink_specs = (P("model"),) if sinks else ()

    def f(q, kc, vc, md, *sink):
        return jax.shard_map(local, mesh=mesh,
                             in_specs=(heads, cache, cache, jax.tree.map(lambda _: P(), md), *sink_specs),
                             out_specs=heads, check_vma=False)(q, kc, vc, md, *sink)

    args = (sd((T, Hq, D), jnp.bfloat16, heads), sd((N, page_size, Hkv * D), cache_dtype, cache),
            sd((N, page_size, Hkv * D), cache_dtype, cache), md)
    if sinks:
        args += (sd((Hq,), jnp.float32, P("model")),)
    return jax.jit(f).lower(*args).compile()


@pytest.mark.parametrize("topology", TOPOLOGIES)
def test_attention_kernel_compiles_for_tpu(topology):
    devices, kind, hbm = _devices(topology)
    assert kind.startswith("TPU v") and hbm is not None
    compiled = _kernel_program(devices, page_size=16)
    assert "tpu_custom_call" in compiled.as_text()
    assert compiled.memory_analysis().argument_size_in_bytes > 0


def test_attention_kernel_compiles_for_v6e_with_sinks():
    """Attention sinks (gpt-oss: a [Hq] input split like the query heads, each row's softmax
    starting from its head's sink): Mosaic compiles the kernel for v6e, sliding window included."""
    devices, _, _ = _devices("v6e:2x2")
    compiled = _kernel_program(devices, page_size=16, sinks=True)
    assert "tpu_custom_call" in compiled.as_text()


def test_attention_kernel_compiles_for_v6e_with_fp8_pages():
    """fp8 (e4m3) pages, DMA'd as they are and widened in VMEM: Mosaic compiles it for v6e
    (pages of 32 tokens: the 8-bit sublane tile)."""
    devices, _, _ = _devices("v6e:2x2")
    compiled = _kernel_program(devices, page_size=32, cache_dtype=jnp.float8_e4m3fn)
    assert "tpu_custom_call" in compiled.as_text()
    # One byte a value: the arguments (both caches, q, metadata) take less than bfloat16
    # caches alone would (256 pages x 32 tokens x 2 of the 8 KV heads x 128 x 2 bytes, twice).
    assert compiled.memory_analysis().argument_size_in_bytes < 2 * 256 * 32 * 2 * 128 * 2


def _copy_kernel(devices, block):
    """A Pallas copy kernel with `block`-shaped blocks over a [16, 256] float32 array, compiled
    for the chips (inside a shard_map, as Mosaic kernels on a multi-device mesh must be)."""
    from jax.experimental import pallas as pl

    mesh = Mesh(np.array(devices[:4]).reshape(1, 4), ("data", "model"))

    def copy(x_ref, o_ref):
        o_ref[...] = x_ref[...]

    def local(x):
        spec = pl.BlockSpec(block, lambda i, j: (i, j))
        return pl.pallas_call(copy, grid=(16 // block[0], 256 // block[1]), in_specs=[spec], out_specs=spec,
                              out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype))(x)

    f = jax.shard_map(local, mesh=mesh, in_specs=P(), out_specs=P(), check_vma=False)
    x = jax.ShapeDtypeStruct((16, 256), jnp.float32, sharding=NamedSharding(mesh, P()))
    return jax.jit(f).lower(x).compile()


def test_mosaic_rejects_a_broken_tiling():
    """The compile is Mosaic's own: (8, 128) float32 blocks compile, (4, 64) ones break its
    tiling and are refused; and the attention kernel's shape check refuses bfloat16 pages of
    8 rows before Mosaic sees them."""
    devices, _, _ = _devices("v5e:2x2")
    assert "tpu_custom_call" in _copy_kernel(devices, (8, 128)).as_text()
    with pytest.raises(Exception, match="(?i)block|tile|divisible|shape"):
        _copy_kernel(devices, (4, 64))
    with pytest.raises(ValueError, match="multiple of 16"):
        _kernel_program(devices, page_size=8)


def _int4_down_projection():
    """`dense` on an int4 weight (groups of 64) split over 4 v6e chips along its contracted dim
    (a down projection), marked for the product kernel, compiled."""
    from jaxserve.models.layers.linear import QuantizedProduct, QuantizedWeight, dense

    devices, _, _ = _devices("v6e:2x2")
    mesh = Mesh(np.array(devices[:4]).reshape(1, 4), ("data", "model"))
    T, F, E, group = 8, 2048, 512, 64
    spec = P("model", None)
    kernel = QuantizedProduct("tpu", mesh, (spec, spec))
    sd = lambda shape, dtype, s=P(): jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, s))  # noqa: E731

    def down(x, q, scale, zero):
        return dense("tf,fe->te", x, QuantizedWeight(q, scale, "bfloat16", zero, 0, kernel))

    return jax.jit(down).lower(
        sd((T, F), jnp.bfloat16), sd((F // 2, E), jnp.uint8, spec),
        sd((F // group, E), jnp.float32, spec), sd((F // group, E), jnp.float32, spec)).compile()


def test_int4_product_kernel_compiles_for_v6e_inside_the_tensor_parallel_split():
    """Mosaic compiles the int4 product kernel per shard inside the shard_map: the kernel
    takes the chip's packed bytes as they are stored (uint8 [F / 2 / 4, E]: no unpacking or
    dequantizing before it), and the partial products are summed over the chips."""
    text = _int4_down_projection().as_text()
    calls = [line for line in text.splitlines() if 'custom_call_target="tpu_custom_call"' in line]
    assert len(calls) == 1 and "u8[256,512]" in calls[0]
    assert "all-reduce" in text


def _plan(topology: str, arch: dict, name: str):
    from jaxserve.parallel.mesh import make_mesh
    from jaxserve.tools.plan_compile import PlanSettings, plan_one

    devices, kind, hbm = _devices(topology)
    settings = PlanSettings(arch=arch, platform="tpu", max_model_len=1024, max_num_seqs=8, device_memory=hbm)
    return name, topology, plan_one(settings, make_mesh(1, 4, devices=devices), "tp", (16, 8), kind)


def test_a_whole_step_compiles_for_four_v5e_chips():
    """A whole step on 4 v5e chips: SmolLM2's, served as serving would with 8 KV heads (its 3 of
    64 and 5 zero heads: 2 a chip, rows of 128 lanes for the TPU kernel; DESIGN §9, "Lane-dense
    KV pages"), so the kernel runs in the tensor-parallel step and the attention weights split
    (24 query heads, 8 KV heads over 4 chips), with 2 of its 30 layers (the
    layers are unrolled alike: the whole model is 15 times the compile for nothing more to
    check). The TPU kernel inside a tensor-parallel step compiles in
    tests/backends/test_accelerator_memory.py (a Llama-3-8B layer on v5e:2x2) and on one v6e
    chip in tests/tools/test_step_anatomy.py."""
    from jaxserve.tools.shard_plan import model_config

    _, smollm2 = model_config("smollm2-135m")
    smollm2 = {**smollm2, "num_hidden_layers": 2}
    name, topology, rec = _plan(TOPOLOGIES[0], smollm2, "smollm2")
    assert rec["memory"]["fits"] is True, (name, topology, rec["memory"])
    per_layer = rec["collectives"]["per_layer"]
    assert per_layer.get("all-reduce", {}).get("count", 0) >= 1, (name, topology, rec["collectives"])
    assert rec["attention_impl"] == "tpu" and rec["kv_heads"] == 8
    assert rec["kv_heads_note"] == "KV heads padded 3 -> 8 for lane-dense TPU pages (+167 % KV bytes)"
    assert not [n for n in rec["params"]["replicated"] if n.startswith("attention")], rec["params"]["replicated"]
    assert rec["kv"]["dtype"] == "bfloat16" and rec["dtype"] == "bfloat16"


def test_w8a8_int8_weights_multiply_in_int8_on_v6e():
    """A W8A8 int8 weight marked for int8 products (v6e's MXU takes int8): compiled for the
    chip, the product is one int8 x int8 convolution accumulating in s32 (the activations
    quantized per token in the step)."""
    import re

    from jaxserve.models.layers.linear import QuantizedWeight, dense

    devices, _, _ = _devices("v6e:2x2")
    sharding = NamedSharding(Mesh(np.array(devices[:1]).reshape(1, 1), ("data", "model")), P())
    sd = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)  # noqa: E731

    def f(x, q, s):
        return dense("te,ef->tf", x, QuantizedWeight(q, s, "int8"))

    text = jax.jit(f).lower(sd((64, 512), jnp.bfloat16), sd((512, 1024), jnp.int8),
                            sd((1, 1024), jnp.float32)).compile().as_text()
    types = {m.group(1): m.group(2) for m in re.finditer(r"%([\w.-]+) = (\w+)\[", text)}
    products = re.findall(r"= (\w+)\[[^=]*? (?:convolution|dot)\(%([\w.-]+), %([\w.-]+)\)", text)
    assert [(out, types[a], types[b]) for out, a, b in products] == [("s32", "s8", "s8")]


def test_mxfp4_product_kernel_compiles_for_v6e():
    """Mosaic compiles the product kernel on MXFP4 operands (packed e2m1 codes decoded with
    selects in the tile, uint8 exponents turned into float32 scales before the call), in both
    of its grouped modes: one kernel call on the stored bytes."""
    from jaxserve.pallas_kernels.quant_matmul import tpu

    devices, _, _ = _devices("v6e:2x2")
    mesh = Mesh(np.array(devices[:1]).reshape(1, 1), ("data", "model"))
    sd = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, P()))  # noqa: E731
    for M, mode in ((8, tpu.GROUP_SUMS), (64, tpu.DEQUANTIZE)):
        product = jax.jit(functools.partial(tpu.quant_matmul_tpu, packed=True, mxfp4=True,
                                            compute_dtype=jnp.bfloat16, mode=mode))
        text = product.lower(sd((M, 2048), jnp.bfloat16), sd((1024, 1024), jnp.uint8),
                             sd((64, 1024), jnp.uint8)).compile().as_text()
        calls = [line for line in text.splitlines() if 'custom_call_target="tpu_custom_call"' in line]
        assert len(calls) == 1 and "u8[1024,1024]" in calls[0], mode
