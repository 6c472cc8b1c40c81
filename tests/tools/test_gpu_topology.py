"""Compiles for NVIDIA H100 and H200 on this CPU host (JAX's CUDA plugin with XLA's target
description of each chip; no GPU, no CUDA runtime): both GPU attention kernels under a
shard_map (the Mosaic GPU op's two kernels, decode and prefill; fp8 pages too), kernel
configurations the compilers refuse, and whole steps (SmolLM2-shaped, and a small Llama with
head dim 128) whose attention is the kernel `jaxserve serve` takes on these GPUs (`auto` on
compute capability 9.0: the Mosaic GPU one).
A kernel or step change that breaks the GPU compilers fails here. Skipped where the plugin is
not installed (make install-gpu-compile; the CI installs it)."""

from __future__ import annotations

import functools
import importlib.util

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("jax_cuda12_plugin") is None
    or importlib.util.find_spec("nvidia") is None
    or importlib.util.find_spec("nvidia.cuda_nvcc") is None,
    reason="JAX's CUDA plugin or ptxas is not installed (make install-gpu-compile)",
)

CHIPS = ("h100", "h200")
KERNEL_TARGETS = {"gpu": "__gpu$xla.gpu.triton", "gpu-mosaic": "mosaic_gpu_v2"}
KERNEL_NAMES = {  # the GPU kernels one call of the op launches
    "gpu": ["ragged_paged_attention_gpu"],
    "gpu-mosaic": ["ragged_paged_attention_gpu_mosaic_decode",
                   "ragged_paged_attention_gpu_mosaic_prefill"],
}
TINY_LLAMA = dict(
    architectures=["LlamaForCausalLM"],
    vocab_size=512,
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=2,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=128,
    max_position_embeddings=2048,
    tie_word_embeddings=False,
)


@functools.cache
def _devices(chip: str):
    from jaxserve.tools.plan_worker import target_devices

    return target_devices({"kind": "gpu", "chip": chip, "hosts": 1, "gpus_per_host": 4})


def _kernel_program(devices, impl: str, *, page_size: int = 16, head_dim: int = 128,
                    cache_dtype=jnp.bfloat16, sinks: bool = False, **knobs):
    """Attention kernel `impl` in a shard_map over KV heads on 4 GPUs, compiled for them
    (`sinks`: with attention sinks, [Hq] split like the query heads)."""
    from jaxserve.pallas_kernels import AttentionMetadata, ragged_paged_attention
    from jaxserve.pallas_kernels.ragged_paged_attention import gpu

    mesh = Mesh(np.array(devices[:4]).reshape(1, 4), ("data", "model"))
    T, R, Hq, Hkv, D, N, Pg = 64, 8, 16, 8, head_dim, 256, 16
    heads, cache = P(None, "model", None), P(None, None, "model")  # cache [N, ps, Hkv * D]

    def sd(shape, dtype, spec=None):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, spec or P()))

    md = AttentionMetadata(
        block_tables=sd((R, Pg), jnp.int32),
        kv_lens=sd((R,), jnp.int32),
        query_start_loc=sd((R + 1,), jnp.int32),
        num_seqs=sd((), jnp.int32),
        slot_mapping=sd((T,), jnp.int32),
    )

    def local(q, kc, vc, md, *sink):
        if knobs:  # the Triton kernel's own knobs
            return gpu.ragged_paged_attention_gpu(q, kc, vc, md, sm_scale=0.1, **knobs)
        return ragged_paged_attention(
            q, kc, vc, md, sm_scale=0.1, sliding_window=128, soft_cap=30.0, impl=impl,
            sinks=sink[0] if sink else None,
        )

    def f(q, kc, vc, md, *sink):
        return jax.shard_map(
            local,
            mesh=mesh,
            in_specs=(heads, cache, cache, jax.tree.map(lambda _: P(), md),
                      *((P("model"),) if sinks else ())),
            out_specs=heads,
            check_vma=False,
        )(q, kc, vc, md, *sink)

    args = (
        sd((T, Hq, D), jnp.bfloat16, heads),
        sd((N, page_size, Hkv * D), cache_dtype, cache),
        sd((N, page_size, Hkv * D), cache_dtype, cache),
        md,
    ) + ((sd((Hq,), jnp.float32, P("model")),) if sinks else ())
    return jax.jit(f).lower(*args).compile()


@pytest.mark.parametrize("chip", CHIPS)
@pytest.mark.parametrize("impl", list(KERNEL_TARGETS))
def test_attention_kernels_compile_for_gpu(chip, impl):
    from jaxserve.tools import hlo_ops

    devices, kind, memory = _devices(chip)
    assert kind.startswith("NVIDIA " + chip.upper()) and memory > 70 << 30
    compiled = _kernel_program(devices, impl)
    _, kernels = hlo_ops.parse(compiled.as_text())
    assert sorted((k.target, k.name) for k in kernels) == [
        (KERNEL_TARGETS[impl], name) for name in KERNEL_NAMES[impl]
    ], kernels
    assert compiled.memory_analysis().argument_size_in_bytes > 0


@pytest.mark.parametrize("impl", list(KERNEL_TARGETS))
def test_attention_kernels_compile_for_h100_with_sinks(impl):
    """Attention sinks (gpt-oss; [Hq] split like the query heads) join the splits' combine:
    the same GPU kernels compile for H100, with the sliding window."""
    from jaxserve.tools import hlo_ops

    devices, _, _ = _devices("h100")
    compiled = _kernel_program(devices, impl, sinks=True)
    _, kernels = hlo_ops.parse(compiled.as_text())
    assert sorted((k.target, k.name) for k in kernels) == [
        (KERNEL_TARGETS[impl], name) for name in KERNEL_NAMES[impl]
    ], kernels


@pytest.mark.parametrize("impl", list(KERNEL_TARGETS))
def test_kernels_compile_for_h200_with_fp8_pages(impl):
    """fp8 (e4m3) pages read as they are: Triton gathers them and widens them in registers;
    Mosaic GPU copies them by TMA and widens them in shared memory (through float16: Hopper
    converts e4m3 to f16 only) for its wgmmas. Both compile for sm_90a."""
    from jaxserve.tools import hlo_ops

    devices, _, _ = _devices("h200")
    compiled = _kernel_program(devices, impl, cache_dtype=jnp.float8_e4m3fn)
    _, kernels = hlo_ops.parse(compiled.as_text())
    assert sorted((k.target, k.name) for k in kernels) == [
        (KERNEL_TARGETS[impl], name) for name in KERNEL_NAMES[impl]
    ], kernels


def test_the_compilers_refuse_broken_kernel_configurations():
    """Triton with 1,024 keys a chunk in 4 stages asks for more shared memory than an H100 has
    (827,392 bytes of 232,448): XLA's GPU compiler refuses it, and the shard-plan does not take
    that for a device-memory verdict. The Mosaic GPU kernel refuses head dim 512 (past 128 it
    spills registers) before compiling, and the kernels' shape checks refuse what `auto` would
    then send to the Triton kernel or the reference."""
    from jaxserve.pallas_kernels.ragged_paged_attention import gpu, gpu_mosaic

    from jaxserve.tools.plan_compile import does_not_fit_record

    devices, _, memory = _devices("h100")
    assert (
        "__gpu$xla.gpu.triton"
        in _kernel_program(devices, "gpu", chunk_pages=4, num_stages=2).as_text()
    )
    with pytest.raises(Exception, match="Shared memory size limit exceeded") as refused:
        _kernel_program(devices, "gpu", chunk_pages=64, num_stages=4)
    assert does_not_fit_record(refused.value, memory) is None
    with pytest.raises(ValueError, match=r"head dims \(64, 128\)"):
        _kernel_program(devices, "gpu-mosaic", head_dim=512)
    cache = jax.ShapeDtypeStruct((4, 16, 2 * 96), jnp.bfloat16)
    with pytest.raises(ValueError, match="power-of-two head dim"):
        gpu.supports(jax.ShapeDtypeStruct((1, 4, 96), jnp.bfloat16), cache)
    with pytest.raises(ValueError, match="bfloat16, float16, fp8 or int8"):
        gpu_mosaic.supports(
            jax.ShapeDtypeStruct((1, 4, 128), jnp.float32),
            jax.ShapeDtypeStruct((4, 16, 2 * 128), jnp.float32),
        )


def _plan(chip: str, arch: dict):
    from jaxserve.parallel.mesh import make_mesh
    from jaxserve.tools.plan_compile import PlanSettings, plan_one

    devices, kind, memory = _devices(chip)
    settings = PlanSettings(
        arch=arch, platform="gpu", max_model_len=1024, max_num_seqs=8, device_memory=memory
    )
    return plan_one(settings, make_mesh(1, 4, devices=devices), "tp", (16, 8), kind)


def test_a_whole_step_compiles_for_four_h200s():
    """The runner's step (model, paged attention, sampler) for 4 H200s, tensor parallel: a
    small Llama with head dim 128. Attention is the kernel `serve` takes on these GPUs (`auto`
    on compute capability 9.0: the Mosaic GPU op, its decode and prefill kernels once per layer
    each in the compiled program). (H100 is the same sm_90 target with less memory: one-GPU
    steps compile for it in test_step_anatomy.py and test_compile_targets.py; heads that cannot
    split over the devices, attention replicated, are checked on TPU in test_tpu_topology.py:
    the plan's rule is the same.)"""
    from jaxserve.pallas_kernels.ragged_paged_attention.ops import resolve_impl

    devices, _, _ = _devices("h200")
    served = resolve_impl("auto", "gpu", devices)
    assert served == "gpu-mosaic"
    rec = _plan("h200", TINY_LLAMA)
    assert rec["attention_impl"] == served and rec["attention_note"] is None, rec
    assert rec["kernels"] == {
        f"{kernel} ({KERNEL_TARGETS[served]})": 2 for kernel in KERNEL_NAMES[served]
    }, rec["kernels"]
    assert rec["memory"]["fits"] is True, rec["memory"]
    assert rec["collectives"]["per_layer"].get("all-reduce-start", {}).get("count", 0) >= 1, rec
    assert rec["cost"]["source"] == "hlo dots" and rec["cost"]["flops"] > 0
    assert rec["kv"]["dtype"] == "bfloat16" and rec["dtype"] == "bfloat16"


@pytest.mark.parametrize("fp8_products", [True, False])
def test_fp8_weights_multiply_in_fp8_on_h200(fp8_products):
    """An FP8 weight with per-channel scales, its compute dtype set as a backend whose plan has
    FP8 products sets it (H100/H200): compiled for an H200, the product is an FP8 GEMM
    (cuBLASLt's f8 matmul on float8_e4m3fn operands); left in bfloat16 (TPU v5e/v6e, the CPU)
    the FP8 values are converted for a bfloat16 dot instead."""
    from jaxserve.models.layers.linear import QuantizedWeight, dense

    devices, _, _ = _devices("h200")
    sharding = NamedSharding(Mesh(np.array(devices[:1]).reshape(1, 1), ("data", "model")), P())
    cdt = "float8_e4m3fn" if fp8_products else "bfloat16"

    def f(x, q, s):
        return dense("te,ef->tf", x, QuantizedWeight(q, s, cdt))

    args = (jax.ShapeDtypeStruct((64, 512), jnp.bfloat16, sharding=sharding),
            jax.ShapeDtypeStruct((512, 1024), jnp.float8_e4m3fn, sharding=sharding),
            jax.ShapeDtypeStruct((1, 1024), jnp.float32, sharding=sharding))
    hlo = jax.jit(f).lower(*args).compile().as_text()
    want = ("f8e4m3fn", "f8e4m3fn") if fp8_products else ("bf16", "bf16")
    assert _dot_operand_types(hlo) == [want]


@pytest.mark.parametrize("static", [False, True])
def test_w8a8_int8_weights_multiply_in_int8_on_h200(static):
    """A W8A8 int8 weight marked as a backend whose plan has int8 products marks it (compute
    dtype int8): compiled for an H200, the product takes two s8 operands (the activations
    quantized per token, or by a static input scale, inside the step)."""
    from jaxserve.models.layers.linear import QuantizedWeight, dense

    devices, _, _ = _devices("h200")
    sharding = NamedSharding(Mesh(np.array(devices[:1]).reshape(1, 1), ("data", "model")), P())

    def f(x, q, s, *inp):
        return dense("te,ef->tf", x, QuantizedWeight(q, s, "int8", input_scale=inp[0] if inp else None))

    sd = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)  # noqa: E731
    args = (sd((64, 512), jnp.bfloat16), sd((512, 1024), jnp.int8), sd((1, 1024), jnp.float32))
    if static:
        args += (sd((1,), jnp.float32),)
    hlo = jax.jit(f).lower(*args).compile().as_text()
    assert _dot_operand_types(hlo) == [("s8", "s8")]


def _dot_operand_types(hlo: str) -> list[tuple[str, str]]:
    """The element types of each dot's two operands in a compiled HLO text (inside fusions
    too: XLA's GPU compiler emits the product as a Triton GEMM fusion or a cuBLAS call)."""
    import re

    types, out = {}, []
    for line in hlo.splitlines():
        m = re.match(r"\s*(?:ROOT )?%([\w.-]+) = (\w+)\[", line)
        if m:
            types[m.group(1)] = m.group(2)
        signature = line.split("->")[0] if "->" in line else ""
        for name, t in re.findall(r"%?([\w.-]+): (\w+)\[", signature):
            types[name] = t
        d = re.search(r" dot\(%([\w.-]+), %([\w.-]+)\)", line)
        if d:
            out.append((types[d.group(1)], types[d.group(2)]))
        if "__cublas$lt$matmul" in line:
            out.append(("cublas", line))
    return out
