"""Random sampling of the CPU serving path (`sample.cc`): temperature, min_p, top_k, top_p and
the inverse-CDF draw of jaxserve/sampling/sampler.py (steps 5-7), one row per core at a time;
and the raw logprobs (`raw_logprobs`: log_softmax at a token, its rank, the top k).

XLA:CPU has no fast selection: the JAX sampler keeps an exact top-64 candidate list and, for a
row whose top-p nucleus is wider (common at temperature 0.8-1 with top_p 0.9-0.95), bisects
on the value with one pass over [R, V] per probe: 25-30 ms at 32 rows of 49152 logits. The
kernel finds the nucleus boundary from a histogram of the values in a few passes per row
(well under 1 ms for the batch).

The kept set is the sampler's; the draw walks the kept tokens in id order (the JAX sampler's
candidate path walks them by probability), so a seeded request draws from the same
distribution, with the same reproducibility, but not necessarily the same token as on an
accelerator.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxserve.backends.cpu import kernels as cpu
from jaxserve.sampling import native

TARGET = "jaxserve_sample_rows"


def sample_rows(x, temperature, top_k, top_p, min_p, u, active, with_mask: bool = False,
                target: str | None = None):
    """x [R, V] processed logits; [R] temperature, top_k, top_p, min_p, uniform u in [0, 1),
    active (rows to sample; the others get token 0) -> tokens [R] int32, and with `with_mask`
    the kept set [R, V] bool (else None). Runs on the CPU backend only; `target`: the kernel
    build (`cpu.BUILD_TARGETS`; None: the process's)."""
    name = cpu.ffi_target(TARGET, target)
    R, V = x.shape
    f32 = jnp.float32
    mask_shape = (R, V) if with_mask else (0,)
    tok, mask = jax.ffi.ffi_call(
        name,
        (jax.ShapeDtypeStruct((R,), jnp.int32), jax.ShapeDtypeStruct(mask_shape, jnp.bool_)),
    )(x.astype(f32), temperature.astype(f32), top_k.astype(jnp.int32), top_p.astype(f32),
      min_p.astype(f32), u.astype(f32), active.astype(jnp.bool_))
    return tok, (mask if with_mask else None)


TARGET_LOGPROBS = "jaxserve_raw_logprobs"


def raw_logprobs(raw, tok, k: int, target: str | None = None):
    """raw [N, V] float32 logits, tok [N] -> (log_softmax(raw)[tok] [N], the k largest logits'
    ids [N, k] (ties: lower id first) and logprobs [N, k], rank of tok [N] (#{raw >= raw[tok]},
    1-based)). k static, 0 <= k <= V. Runs on the CPU backend only; `target` as for
    `sample_rows`."""
    name = cpu.ffi_target(TARGET_LOGPROBS, target)
    N, V = raw.shape
    return jax.ffi.ffi_call(
        name,
        (jax.ShapeDtypeStruct((N,), jnp.float32), jax.ShapeDtypeStruct((N, k), jnp.int32),
         jax.ShapeDtypeStruct((N, k), jnp.float32), jax.ShapeDtypeStruct((N,), jnp.int32)),
    )(raw.astype(jnp.float32), tok.astype(jnp.int32))


native.register("cpu", sample_rows, raw_logprobs)  # the sampler's SamplerConfig.native="cpu"
