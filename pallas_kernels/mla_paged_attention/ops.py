"""Paged multi-head latent attention's entry points: `write_latent` (this step's latent rows
into one layer's cache), `mla_paged_attention` (attend over it) and `write_latent_and_attend`
(both; what models/layers/mla.py calls).

The cache: one array per layer, `[N, page_size, W]` with W = kv_lora_rank + qk_rope_head_dim,
one row per token (`reference.py`), the same layout as a GQA cache with one KV head of width W
(`runner/kv_cache.py`: `ArchConfig.kv_cache_heads` is 1 and `kv_cache_head_dim` W for an MLA
model, and there is no V array). So the attention is multi-query attention over that one
head, the value being the rows' first `value_dim` columns: the reference is the GQA
reference reading the values from the key rows (`reference.py`), and every other
implementation of `ragged_paged_attention` computes it when handed the latent array as both
caches: `impl` names one of them ("auto", "reference", "tpu", "gpu", their "-interpret" variants,
"cpu"), dispatched with its shape checks (a row width the TPU kernel's lanes or the GPU
kernel's power-of-two dims cannot take runs the reference under "auto"; DeepSeek V3's 576 is
such a width for the TPU kernel).

On GPUs MLA has a kernel of its own (`gpu.py`, Pallas Triton): it reads each chunk of rows once,
as the latent and the roped column slices, and sums only the `value_dim` value columns, at any
row width whose two parts are powers of two (V3's 512 + 64). The GPU implementation names
("gpu", "gpu-mosaic", "auto" on a GPU, and their "-interpret" variants) run it where it takes
the shapes, the GQA kernels' dispatch otherwise. On TPUs likewise (`tpu.py`, Pallas Mosaic:
each page DMA'd once), by the name "tpu" for a latent width that is a multiple of 128; "auto"
takes it only for lane-dense rows (a row width that is a multiple of 128, which V3's 576 is
not: there "auto" runs the reference, see `tpu.py`).

For the split prefill (models/layers/mla.py, `expanded.py`) the op also reads the cached
context only and returns each row's log-sum-exp (`context_only`, `return_lse`): the
reference, MLA's own GPU and TPU kernels and the native CPU kernel compute them; a call with
either on a GQA kernel runs the reference.
"""

from __future__ import annotations

import functools

import jax
from jax import lax
from jaxserve.pallas_kernels.kv_cache_update.reference import scatter_indices
from jaxserve.pallas_kernels.ragged_paged_attention.metadata import AttentionMetadata
from jaxserve.pallas_kernels.ragged_paged_attention.ops import (
    auto_candidates,
    dispatch_name,
    implementation,
    ragged_paged_attention,
)

_GPU_NAMES = ("gpu", "gpu-mosaic")
_TPU_NAMES = ("tpu",)

_ROW_SCATTER = lax.ScatterDimensionNumbers(
    update_window_dims=(1,), inserted_window_dims=(0, 1), scatter_dims_to_operand_dims=(0, 1))


def _check(q, latent_cache, value_dim: int) -> None:
    if getattr(latent_cache, "ndim", None) != 3:
        raise ValueError(f"the latent cache must be [N, page_size, W] (one layer); got "
                         f"{getattr(latent_cache, 'shape', None)}")
    if getattr(q, "ndim", None) != 3 or q.shape[2] != latent_cache.shape[2]:
        raise ValueError(f"q must be [T, H, W={latent_cache.shape[2]}] (the cache's rows); got "
                         f"{getattr(q, 'shape', None)}")
    if not 0 < value_dim < latent_cache.shape[2]:
        raise ValueError(f"value_dim must be in (0, W={latent_cache.shape[2]}); got {value_dim}")


def write_latent(latent_cache: jax.Array, latent: jax.Array, slot_mapping: jax.Array) -> jax.Array:
    """Scatter this step's rows `latent` [T, W] into `latent_cache` [N, page_size, W] at
    `slot_mapping` (cast to the cache's dtype; slots outside the cache are dropped; padding
    tokens share the null page's slots, which nobody reads)."""
    _, page_size, width = latent_cache.shape
    if latent.shape != (slot_mapping.shape[0], width):
        raise ValueError(f"latent must be [T={slot_mapping.shape[0]}, W={width}]; got "
                         f"{latent.shape}")
    return lax.scatter(latent_cache, scatter_indices(slot_mapping, page_size),
                       latent.astype(latent_cache.dtype), _ROW_SCATTER, indices_are_sorted=False,
                       unique_indices=False, mode=lax.GatherScatterMode.FILL_OR_DROP)


def kernel_name(impl: str, q, latent_cache, value_dim: int, *, interpret: bool = False,
                backend: str | None = None) -> str:
    """What `impl` runs for these shapes: "mla-gpu" or "mla-tpu" (their "-interpret"
    variants in interpret mode), MLA's own kernels, where a GPU or TPU implementation is asked
    for (or "auto" picks one) and the kernel takes the shapes; else the name the GQA op
    dispatches to (`dispatch_name`)."""
    from jaxserve.pallas_kernels.mla_paged_attention import gpu as mla_gpu
    from jaxserve.pallas_kernels.mla_paged_attention import tpu as mla_tpu

    auto = impl == "auto"
    if auto:
        names = set(auto_candidates(backend))
    else:
        names = {impl.removesuffix("-interpret")}
        interpret = interpret or impl.endswith("-interpret")
    for own, family, supports in (("mla-gpu", _GPU_NAMES, mla_gpu.supports),
                                  ("mla-tpu", _TPU_NAMES, functools.partial(mla_tpu.supports,
                                                                            auto=auto))):
        if names & set(family):
            try:
                supports(q, latent_cache, value_dim)
                return f"{own}-interpret" if interpret else own
            except ValueError:
                pass
    return dispatch_name(impl, q, latent_cache, interpret=interpret, backend=backend)


def mla_paged_attention(
    q: jax.Array,
    latent_cache: jax.Array,
    md: AttentionMetadata,
    *,
    sm_scale: float,
    value_dim: int,
    impl: str = "auto",
    interpret: bool = False,
    context_only: bool = False,
    return_lse: bool = False,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """Absorbed-form MLA of q [T, H, W] over one layer's latent cache [N, page_size, W] that
    already holds this step's rows -> [T, H, value_dim] in q.dtype (semantics:
    `reference.py`).

    `context_only`: each query reads its request's cached context only (the positions before
    this step's first token of the request), not this step's rows: the absorbed half of the
    split prefill (models/layers/mla.py). `return_lse`: also each row's log-sum-exp of its
    scaled scores, [T, H] float32 (-inf for a row that read no key), to merge with another
    part of the keys (`expanded.merge_by_lse`). Both are computed by the reference, MLA's
    GPU and TPU kernels and the native CPU kernel; the GQA kernels handed the latent array
    have neither, and such a call runs the reference.
    """
    _check(q, latent_cache, value_dim)
    name = kernel_name(impl, q, latent_cache, value_dim, interpret=interpret)
    if (context_only or return_lse) and not name.startswith(("mla-gpu", "mla-tpu", "cpu")):
        name = "reference"
    extra = dict(context_only=context_only, return_lse=return_lse)
    if name.startswith("mla-gpu"):
        from jaxserve.pallas_kernels.mla_paged_attention.gpu import mla_paged_attention_gpu

        return mla_paged_attention_gpu(q, latent_cache, md, sm_scale=sm_scale,
                                       value_dim=value_dim, interpret=name.endswith("interpret"),
                                       **extra)
    if name.startswith("mla-tpu"):
        from jaxserve.pallas_kernels.mla_paged_attention.tpu import mla_paged_attention_tpu

        return mla_paged_attention_tpu(q, latent_cache, md, sm_scale=sm_scale,
                                       value_dim=value_dim, interpret=name.endswith("interpret"),
                                       **extra)
    if name == "reference":
        from jaxserve.pallas_kernels.mla_paged_attention.reference import (
            mla_paged_attention_reference,
        )
        return mla_paged_attention_reference(q, latent_cache, md, sm_scale=sm_scale,
                                             value_dim=value_dim, **extra)
    if name == "cpu" and (context_only or return_lse):  # the native kernel's LSE entry point
        out = implementation("cpu")(q, latent_cache, latent_cache, md, sm_scale=sm_scale,
                                    **extra)
        return (out[0][..., :value_dim], out[1]) if return_lse else out[..., :value_dim]
    out = ragged_paged_attention(q, latent_cache, latent_cache, md, sm_scale=sm_scale, impl=impl,
                                 interpret=interpret)
    return out[..., :value_dim]


def write_latent_and_attend(
    q: jax.Array,
    latent: jax.Array,
    latent_cache: jax.Array,
    md: AttentionMetadata,
    *,
    sm_scale: float,
    value_dim: int,
    impl: str = "auto",
    context_only: bool = False,
) -> tuple[jax.Array, ...]:
    """`write_latent` then `mla_paged_attention`: (out [T, H, value_dim], latent_cache); with
    `context_only` (out over the cached context, its log-sum-exp [T, H], latent_cache)."""
    latent_cache = write_latent(latent_cache, latent, md.slot_mapping)
    out = mla_paged_attention(q, latent_cache, md, sm_scale=sm_scale, value_dim=value_dim,
                              impl=impl, context_only=context_only, return_lse=context_only)
    return (*out, latent_cache) if context_only else (out, latent_cache)


__all__ = ["mla_paged_attention", "write_latent", "write_latent_and_attend"]
