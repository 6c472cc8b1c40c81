"""Pure-JAX reference ragged paged attention: the semantic spec, and the CPU serving path.

Semantics (the `AttentionMetadata` conventions are in `metadata.py`). For a live token t of
request r at sequence position p, with scaled scores `s_j = sm_scale * <q_t, k_j>` (then
`s_j = soft_cap * tanh(s_j / soft_cap)` when `soft_cap` is set):

    out_t = sum_j softmax(s)_j * v_j   over positions j of request r with  j <= p
                                       and, when `sliding_window = W` is set,  j > p - W.

With `sinks` (one float32 logit per query head, [Hq]: gpt-oss's attention sinks), head h's
sink joins the softmax's denominator and contributes no value:

    out_t = sum_j exp(s_j - m) v_j / (exp(sinks[h] - m) + sum_j exp(s_j - m)),

the same for sliding-window and full layers (HF transformers' `GptOssAttention`). Here every
row's online-softmax state starts as (m, l, acc) = (sinks[h], 1, 0) instead of (-inf, 0, 0).

The window follows the HF transformers / Mistral convention (`sliding_window_overlay` in
`transformers.masking_utils`: `kv_idx > q_idx - sliding_window`): a window of W lets a token
see itself and the W - 1 tokens before it. Query head h reads KV head `h // (Hq // Hkv)`.
Softmax is computed in float32 whatever the input dtype; both matmuls accumulate in float32
(`preferred_element_type`), the probabilities stay float32 and V is upcast for the second one;
the result is cast to `q.dtype`. Quantized pages (fp8, int8: `kv_quant.py`) are read as they are
and converted to q's dtype before the products; their scales are folded into q and the output
by the caller. Padding tokens (flat index >= `query_start_loc[num_seqs]`)
output exact zeros; padding requests (empty query range, kv_len 0) read nothing.

Design. The caller has already written this step's K/V (`write_kv` at `slot_mapping`, which by
contract is the block-table slot of each token's position), so every key is read from the
cache through the block table, page chunk by page chunk, in `lax.fori_loop`s whose trip counts
are TRACED: one compiled executable serves every context length, short contexts are cheap, and
nothing of size [T, max_context] is ever built. Each row keeps an online-softmax state (running
max, sum, accumulator); parts are merged by log-sum-exp. Every live token takes one path:

- decode path, requests with exactly one query this step: one row per request. Each iteration
  gathers `chunk_pages` pages of every such request ([R, chunk, page_size, Hkv * D], viewed as
  [R, chunk * page_size, Hkv, D]: a reshape of the gathered pages only) and contracts them with
  the request's query. Trip count: the max over those requests of the chunks their
  (window-limited) context spans. The default chunk is 128 keys: on XLA:CPU the cost is in the
  gather and the K/V transposes feeding the two products, not in the loop, and a long chunk
  means few iterations (measured in a 30-layer step at 32 x 200 context: 217 ms with 128-key
  chunks, 242 ms with 32).
- prefill path, requests with several queries (prefill, chunked prefill, prefix-cache hits): a
  sequential loop over work items (request, block of `query_block` consecutive queries); each
  gathers its request's pages once per key chunk, shared by the block's queries, and contracts
  a [query_block, chunk] tile per KV head, with an inner trip count covering just the keys the
  block can see (from the window start of its first query to its last query, causally masked).
  Cached context is read once per query block, never once per token, so chunked prefill costs
  about what a dense attention over the same tokens costs; and requests never pay for each
  other's tokens.

Option `dense_step=True` instead attends this step's own tokens as one dense [T, T] block
(gathered once through `slot_mapping`, same-request causal mask) and leaves only the cached
context to the loops. Measured on CPU (2 cores) it is at best ~20% faster for a lone prefill
of <= 128 tokens and several times slower for batches of several prefills (the block is
quadratic in T across requests), so it is off by default; it stays as a tested alternative.

GQA never materialises repeated K/V: q is viewed as [T, Hkv, G, D] and contracted per KV head.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from jaxserve.pallas_kernels.kv_quant import upcast
from jaxserve.pallas_kernels.ragged_paged_attention.metadata import (
    AttentionMetadata,
    num_kv_heads,
)

# Keys per loop iteration when chunk_pages is not given (CPU-tuned defaults, see
# benchmarks/attention_reference_bench.py), and queries per prefill work item.
DEFAULT_DECODE_CHUNK_TOKENS = 128
DEFAULT_PREFILL_CHUNK_TOKENS = 64
DEFAULT_QUERY_BLOCK = 32

_F32 = jnp.float32
_I32 = jnp.int32


def default_chunk_pages(page_size: int, *, prefill: bool = False) -> int:
    tokens = DEFAULT_PREFILL_CHUNK_TOKENS if prefill else DEFAULT_DECODE_CHUNK_TOKENS
    return max(1, tokens // page_size)


def _cdiv(a, b):
    return (a + b - 1) // b


def _scores(s: jax.Array, sm_scale: float, soft_cap: float | None) -> jax.Array:
    s = s * _F32(sm_scale)
    if soft_cap is not None:
        s = _F32(soft_cap) * jnp.tanh(s / _F32(soft_cap))
    return s


def _online_update(m, l, acc, s, mask, v, pv_spec):
    """One online-softmax step. s: f32 scores [..., K]; mask broadcastable to s; m, l: s[..., 0]."""
    s = jnp.where(mask, s, -jnp.inf)
    m_new = jnp.maximum(m, s.max(axis=-1))
    # Rows that have seen no key yet keep m = -inf; use 0 as their base to avoid inf - inf.
    # A fully masked row is left exactly unchanged (p = 0, alpha = 1, or 0 on a zero state).
    m_base = jnp.where(m_new == -jnp.inf, 0.0, m_new)
    p = jnp.exp(s - m_base[..., None])
    alpha = jnp.exp(m - m_base)
    l_new = alpha * l + p.sum(axis=-1)
    pv = jnp.einsum(pv_spec, p, v.astype(_F32), preferred_element_type=_F32)
    return m_new, l_new, alpha[..., None] * acc + pv


def _initial_state(sinks, shape, hkv: int, group: int, *, head_axis: int):
    """The (m, l) an online-softmax row starts from, of `shape` with the KV head at
    `head_axis` and the group head last: (-inf, 0), or (sink, 1) with attention sinks (the sink
    is then one more score, of value zero)."""
    if sinks is None:
        return jnp.full(shape, -jnp.inf, _F32), jnp.zeros(shape, _F32)
    view = [1] * len(shape)
    view[head_axis], view[-1] = hkv, group
    m = jnp.broadcast_to(sinks.astype(_F32).reshape(view), shape)
    return m, jnp.ones(shape, _F32)


def _finish(l, acc):
    return acc / jnp.where(l > 0, l, 1.0)[..., None]


def _lse(m, l):
    """A row's log-sum-exp from its online-softmax state; -inf where it saw nothing."""
    return jnp.where(l > 0, m + jnp.log(jnp.where(l > 0, l, 1.0)), -jnp.inf)


def ragged_paged_attention_reference(
    q: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    md: AttentionMetadata,
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    chunk_pages: int | None = None,
    query_block: int | None = None,
    dense_step: bool = False,
    sinks: jax.Array | None = None,
    value_dim: int | None = None,
    context_only: bool = False,
    return_lse: bool = False,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """Ragged paged attention over one layer's paged cache. See the module docstring.

    q: [T, Hq, D]; k_cache, v_cache: [N, page_size, Hkv * D] (one layer); returns [T, Hq, D] in
    q.dtype (zeros for padding tokens). Tuning knobs, none
    of which changes the result beyond float rounding: `chunk_pages`, pages read per key-loop
    iteration (default: CPU-tuned per path); `query_block`, queries per prefill work item
    (default 32); `dense_step`, attend this step's own tokens as one dense [T, T] block (default
    off, see the module docstring). `sinks`: [Hq] attention-sink logits, or None.
    `value_dim`: the values are the keys' first `value_dim` columns, read with them (multi-head
    latent attention's rows: `mla_paged_attention/reference.py`; v_cache is not read), and the
    result is [T, Hq, value_dim]. `context_only`: each query attends to its request's cached
    context only (the positions before this step's first token), not to this step's tokens
    (what multi-head latent attention's split prefill reads absorbed: `mla_paged_attention`).
    `return_lse`: also return each row's log-sum-exp of its scaled scores, [T, Hq] float32
    (the sink's term included; -inf for a row that saw no key, padding tokens included).
    """
    T, Hq, D = q.shape
    if v_cache.shape != k_cache.shape:
        raise ValueError(
            f"k_cache/v_cache must both be [N, page_size, Hkv * D] (one layer); got "
            f"{k_cache.shape} and {v_cache.shape}"
        )
    Hkv = num_kv_heads(k_cache, D)  # the cache's pages are cut into heads once gathered
    ps = k_cache.shape[1]
    if Hq % Hkv:
        raise ValueError(f"Hq={Hq} must be a multiple of Hkv={Hkv}")
    if md.num_tokens != T:
        raise ValueError(f"slot_mapping has {md.num_tokens} tokens, q has {T}")
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be >= 1, got {sliding_window}")
    if chunk_pages is not None and chunk_pages < 1:
        raise ValueError(f"chunk_pages must be >= 1, got {chunk_pages}")
    if context_only and dense_step:
        raise ValueError("context_only reads the cached context only; dense_step attends this "
                         "step's tokens as well")
    if query_block is not None and query_block < 1:
        raise ValueError(f"query_block must be >= 1, got {query_block}")
    G = Hq // Hkv
    Dv = D if value_dim is None else value_dim
    R, P = md.block_tables.shape

    def values(cache, pages, keys):  # the gathered pages' values, or the keys' first columns
        return keys[..., :Dv] if value_dim is not None else upcast(cache[pages], q.dtype)

    W = sliding_window
    score = lambda s: _scores(s, sm_scale, soft_cap)  # noqa: E731

    qsl = md.query_start_loc.astype(_I32)
    live_req = jnp.arange(R, dtype=_I32) < md.num_seqs.astype(_I32)
    q_len = jnp.where(live_req, qsl[1:] - qsl[:-1], 0)
    kv_len = jnp.where(live_req, md.kv_lens.astype(_I32), 0)
    ctx_len = jnp.maximum(kv_len - q_len, 0)  # cached before this step
    # The loops read key positions < key_end (and <= the row's own position).
    key_end = ctx_len if dense_step or context_only else kv_len
    block_tables = md.block_tables.astype(_I32)
    qg = q.reshape(T, Hkv, G, D)
    # Row state (running max m, sum l, accumulator acc) lives KV-head-major, [Hkv, T, G(, D)]:
    # it is then the natural output layout of every dot below (batch dim h first), and the
    # prefill path slices a block of rows without transposing.
    qh = qg.transpose(1, 0, 2, 3)  # [Hkv, T, G, D]
    in_page = jnp.arange(ps, dtype=_I32)

    # ---------------- dense_step: this step's tokens as one dense [T, T] block ----------------
    m, l = _initial_state(sinks, (Hkv, T, G), Hkv, G, head_axis=0)
    acc = jnp.zeros((Hkv, T, G, Dv), _F32)
    if dense_step:
        t_idx = jnp.arange(T, dtype=_I32)
        # == metadata.token_request_index(md), as a compare-all count: jnp.searchsorted lowers
        # to a while loop, which costs compile time and runs serially on CPU.
        tok_req = jnp.minimum(jnp.sum(qsl[None, 1:] <= t_idx[:, None], axis=1, dtype=_I32), R - 1)
        tok_live = t_idx < qsl[md.num_seqs]
        tok_pos = kv_len[tok_req] - (qsl[tok_req + 1] - t_idx)
        slots = md.slot_mapping.astype(_I32)
        k_new = upcast(k_cache[slots // ps, slots % ps].reshape(T, Hkv, D), q.dtype)  # one gather
        v_new = (k_new[..., :Dv] if value_dim is not None
                 else upcast(v_cache[slots // ps, slots % ps].reshape(T, Hkv, D), q.dtype))
        mask = (
            (tok_req[:, None] == tok_req[None, :])
            & (t_idx[None, :] <= t_idx[:, None])
            & tok_live[:, None]
            & tok_live[None, :]
        )
        if W is not None:
            mask &= tok_pos[None, :] > tok_pos[:, None] - W
        s = score(jnp.einsum("htgd,shd->htgs", qh, k_new, preferred_element_type=_F32))
        m, l, acc = _online_update(m, l, acc, s, mask[None, :, None, :], v_new, "htgs,shd->htgd")

    # ---------------- prefill path: (request, query block) work items ----------------
    C = min(chunk_pages or default_chunk_pages(ps, prefill=True), P)
    Bq = min(query_block or DEFAULT_QUERY_BLOCK, T)
    in_prefill = (q_len > 1) & (key_end > 0)
    n_blocks = jnp.where(in_prefill, _cdiv(q_len, Bq), 0)
    blocks_end = jnp.cumsum(n_blocks)  # work items of requests 0..r
    rows_in_block = jnp.arange(Bq, dtype=_I32)
    chunk_off = jnp.arange(C, dtype=_I32)

    def work_item(w, state):
        m_all, l_all, acc_all = state
        r = jnp.minimum(jnp.sum(blocks_end <= w, dtype=_I32), R - 1)  # w's request
        qb = w - (blocks_end[r] - n_blocks[r])
        q_end, kv_r, end_r = qsl[r + 1], kv_len[r], key_end[r]
        t0 = qsl[r] + qb * Bq  # first token of the block
        t0c = jnp.minimum(t0, T - Bq)  # the slice start (clamped to fit inside [0, T))
        rows = t0c + rows_in_block
        row_ok = (rows >= t0) & (rows < q_end)
        row_pos = kv_r - (q_end - rows)  # sequence positions of the block's rows
        first_pos = kv_r - (q_end - t0)
        last_pos = kv_r - (q_end - jnp.minimum(t0 + Bq, q_end))
        lo = jnp.int32(0) if W is None else jnp.maximum(first_pos - W + 1, 0)
        hi = jnp.minimum(last_pos + 1, end_r)  # exclusive
        start_page = lo // ps
        n_iter = _cdiv(jnp.maximum(_cdiv(hi, ps) - start_page, 0), C)
        qrows = lax.dynamic_slice_in_dim(qh, t0c, Bq, axis=1)  # [Hkv, Bq, G, D]
        bt_r = block_tables[r]

        def key_chunk(c, carry):
            m, l, acc = carry
            page_idx = start_page + c * C + chunk_off  # [C]
            pages = bt_r[jnp.minimum(page_idx, P - 1)]
            kc = upcast(k_cache[pages].reshape(C * ps, Hkv, D), q.dtype)
            vc = values(v_cache, pages, kc).reshape(C * ps, Hkv, Dv)
            key_pos = (page_idx[:, None] * ps + in_page).reshape(C * ps)
            k_pos = key_pos[None, :]
            mask = (k_pos <= row_pos[:, None]) & (k_pos < end_r) & row_ok[:, None]
            if W is not None:
                mask &= k_pos > row_pos[:, None] - W
            s = score(jnp.einsum("hqgd,khd->hqgk", qrows, kc, preferred_element_type=_F32))
            return _online_update(m, l, acc, s, mask[None, :, None, :], vc, "hqgk,khd->hqgd")

        def rows_of(x):  # [Hkv, T, ...] -> this block's rows, [Hkv, Bq, ...]
            return lax.dynamic_slice_in_dim(x, t0c, Bq, axis=1)

        init = (rows_of(m_all), rows_of(l_all), rows_of(acc_all))
        new = lax.fori_loop(0, n_iter, key_chunk, init)

        def put(x_all, x_old, x_new):  # rows outside the block keep their state
            ok = row_ok.reshape((1, Bq) + (1,) * (x_new.ndim - 2))
            return lax.dynamic_update_slice_in_dim(x_all, jnp.where(ok, x_new, x_old), t0c, axis=1)

        return tuple(put(a, o, n) for a, o, n in zip(state, init, new))

    m, l, acc = lax.fori_loop(0, blocks_end[-1], work_item, (m, l, acc))

    # ---------------- decode path: one row per single-query request ----------------
    C = min(chunk_pages or default_chunk_pages(ps), P)
    is_single = q_len == 1
    tok = jnp.clip(qsl[1:] - 1, 0, T - 1)  # the request's (only) token
    pos = kv_len - 1
    lo = jnp.zeros_like(pos) if W is None else jnp.maximum(pos - W + 1, 0)
    hi = jnp.minimum(pos + 1, key_end)  # exclusive
    start_page = lo // ps
    d_hi = jnp.where(is_single, hi, 0)
    n_chunks = _cdiv(jnp.maximum(_cdiv(d_hi, ps) - start_page, 0), C)
    n_iter = jnp.max(n_chunks)
    qd = qg[tok]  # [R, Hkv, G, D]
    chunk_off = jnp.arange(C, dtype=_I32)

    def decode_chunk(c, carry):
        m, l, acc = carry
        if W is None:  # every request reads from its first page: a column slice of the table
            page_idx = c * C + chunk_off  # [C]
            pages = block_tables[:, jnp.minimum(page_idx, P - 1)]  # [R, C]
            key_pos = (page_idx[:, None] * ps + in_page).reshape(1, C * ps)
        else:
            page_idx = start_page[:, None] + c * C + chunk_off  # [R, C]
            pages = jnp.take_along_axis(block_tables, jnp.minimum(page_idx, P - 1), axis=1)
            key_pos = (page_idx[:, :, None] * ps + in_page).reshape(R, C * ps)
        kc = upcast(k_cache[pages].reshape(R, C * ps, Hkv, D), q.dtype)
        vc = values(v_cache, pages, kc).reshape(R, C * ps, Hkv, Dv)
        mask = key_pos < d_hi[:, None]  # d_hi is 0 for requests not on this path
        if W is not None:
            mask &= key_pos >= lo[:, None]
        s = score(jnp.einsum("rhgd,rkhd->rhgk", qd, kc, preferred_element_type=_F32))
        return _online_update(m, l, acc, s, mask[:, None, None, :], vc, "rhgk,rkhd->rhgd")

    if dense_step:  # continue from this step's own keys, already attended above
        init = tuple(jnp.swapaxes(x[:, tok], 0, 1) for x in (m, l, acc))  # [R, Hkv, ...]
    else:
        init = (*_initial_state(sinks, (R, Hkv, G), Hkv, G, head_axis=1),
                jnp.zeros((R, Hkv, G, Dv), _F32))
    dm, dl, dacc = lax.fori_loop(0, n_iter, decode_chunk, init)

    out = _finish(l, acc)  # [Hkv, T, G, D]; padding tokens: acc == 0 -> exact zeros
    out = out.transpose(1, 0, 2, 3).reshape(T, Hq, Dv)
    dest = jnp.where(is_single, tok, T)  # out of range: dropped
    out = out.at[dest].set(_finish(dl, dacc).reshape(R, Hq, Dv), mode="drop").astype(q.dtype)
    if not return_lse:
        return out
    lse = _lse(m, l).transpose(1, 0, 2).reshape(T, Hq)
    return out, lse.at[dest].set(_lse(dm, dl).reshape(R, Hq), mode="drop")
