"""The CPU backend's fused decoder layer: five native kernel calls instead of about twenty ops.

With every product of a layer packed (`packing.pack_linear_weights`), the RMSNorms run in the
product kernel's prologue, the residual adds and silu(gate) * up in its epilogue, and the rotary
embedding, casts and cache write inside the attention call. Each small XLA:CPU op costs 20-60
us and a step had about 250 of them; fusing them took a 32-request SmolLM2 step from 71-76 ms
to 60-67 ms in alternating runs.

It computes exactly the layer of a model whose layer features (models/interface.py) are a
subset of `FEATURES`: pre-norm RMSNorm, rotary embedding, grouped-query attention (optionally
within a sliding window) and a SiLU-gated MLP, with no biases, no q/k norms and no attention
sinks (a model with sinks declares `attention_sinks` and keeps its own layer, whose attention
call passes them). The backend checks that before using it (`CpuBackend.layer_impl`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxserve.models import interface as features
from jaxserve.models.layers.linear import PackedWeight
from jaxserve.backends.cpu.kernels.matmul import packed_matmul
from jaxserve.pallas_kernels.kv_quant import is_quantized, quantize, scale_output, scale_query
from jaxserve.pallas_kernels.ragged_paged_attention.metadata import AttentionMetadata, num_kv_heads
from jaxserve.pallas_kernels.ragged_paged_attention.ops import fused_rope_kernel, write_kv_and_attend
from jaxserve.models.layers.rotary import apply_rotary

FEATURES = frozenset({
    features.RMS_NORM, features.ROPE, features.GQA, features.SILU_GLU, features.SLIDING_WINDOW,
})
# The layer's products, each packed (q/k/v and gate/up fused into one product each).
PACKED = ("wqkv", "wo", "w_gate_up", "w_down")


def dense_fused(x: jax.Array, w: PackedWeight, *, norm: jax.Array | None = None,
                eps: float = 0.0, residual: jax.Array | None = None, glu: bool = False,
                live: jax.Array | None = None) -> jax.Array:
    """The packed product of x [T, K] with the ops around it done inside the kernel (see
    `packed_matmul`): RMSNorm(x) * norm first; + residual, or silu(gate) * up of a packed
    [gate | up], after; only the first `live` rows when given. Returns float32 [T, N]
    ([T, N / 2] with glu)."""
    return packed_matmul(x, w.blocks, norm=norm, eps=eps, residual=residual, glu=glu, live=live)


def fused_layer(model, p, h, rope, k_cache, v_cache, md: AttentionMetadata):
    """One decoder layer of `model` on packed weights `p` (name -> PackedWeight or array);
    h: [T, E] float32; rope: cos, sin [T, 1, D/2]. Returns (h, k_cache, v_cache)."""
    cfg = model.config
    T, eps = h.shape[0], cfg.rms_norm_eps
    # The step's real tokens come first; the products skip the bucket's padding after them.
    live = md.query_start_loc[jnp.reshape(md.num_seqs, ())]
    with jax.named_scope("attention"):
        qkv = dense_fused(h, p["wqkv"], norm=p["input_norm"], eps=eps, live=live)
        attn, k_cache, v_cache = attention_qkv(qkv, rope, k_cache, v_cache, md, model.attn_spec,
                                               cfg.num_heads, cfg.head_dim, p.get("kv_scale"))
        h = dense_fused(attn.reshape(T, -1), p["wo"], residual=h, live=live)
    with jax.named_scope("mlp"):
        act = dense_fused(h, p["w_gate_up"], norm=p["post_norm"], eps=eps, glu=True, live=live)
        h = dense_fused(act, p["w_down"], residual=h, live=live)
    return h, k_cache, v_cache


def attention_qkv(qkv, rope, k_cache, v_cache, md, spec, num_heads: int, head_dim: int,
                  kv_scale: jax.Array | None = None):
    """Rotary on q and k, write K/V, attend (one device): one kernel call where the attention
    kernel takes the whole block (the CPU kernel), else the composed ops. qkv: [T, (Hq + 2 Hkv)
    * D] float32; `kv_scale`: a quantized cache's [2, Hkv] scales (the layer's, a step input),
    or None for the spec's. Returns (out [T, Hq, D], k_cache, v_cache)."""
    T = qkv.shape[0]
    d = head_dim
    hkv = num_kv_heads(k_cache, d)
    x = qkv.reshape(T, num_heads + 2 * hkv, d)
    q, k, v = x[:, :num_heads], x[:, num_heads:num_heads + hkv], x[:, num_heads + hkv:]
    kernel = None if is_quantized(k_cache.dtype) else fused_rope_kernel(spec.impl, q, k_cache)
    if kernel is not None:
        cos, sin = (t.reshape(T, d // 2) for t in rope)
        return kernel(qkv, cos, sin, k_cache, v_cache, md, num_heads=num_heads,
                      sm_scale=spec.sm_scale, sliding_window=spec.sliding_window,
                      soft_cap=spec.soft_cap)
    dt = k_cache.dtype
    if is_quantized(dt):
        k_scale, v_scale = (spec.k_scale, spec.v_scale) if kv_scale is None else kv_scale
        q = scale_query(apply_rotary(q, *rope), k_scale, hkv, jnp.float32)
        out, k_cache, v_cache = write_kv_and_attend(
            q, quantize(apply_rotary(k, *rope), k_scale, dt), quantize(v, v_scale, dt),
            k_cache, v_cache, md, sm_scale=spec.sm_scale, sliding_window=spec.sliding_window,
            soft_cap=spec.soft_cap, impl=spec.impl)
        return scale_output(out, v_scale, hkv), k_cache, v_cache
    return write_kv_and_attend(apply_rotary(q, *rope).astype(dt), apply_rotary(k, *rope).astype(dt),
                               v.astype(dt), k_cache, v_cache, md, sm_scale=spec.sm_scale,
                               sliding_window=spec.sliding_window, soft_cap=spec.soft_cap,
                               impl=spec.impl)
