"""Independent float64 NumPy implementations of vLLM's sampling definitions (test oracle)."""

from __future__ import annotations

import numpy as np

NEG_INF = -np.inf


def processed_logits(
    raw: np.ndarray,  # [V]
    *,
    prompt: list[int] = (),
    outputs: list[int] = (),
    allowed: list[int] | None = None,
    logit_bias: dict[int, float] | None = None,
    bad_words: list[list[int]] = (),
    min_tokens: int = 0,
    stop_ids: list[int] = (),
    presence: float = 0.0,
    frequency: float = 0.0,
    repetition: float = 1.0,
) -> np.ndarray:
    """allowed_token_ids -> bad words -> logit_bias -> min_tokens -> penalties (vLLM v1)."""
    x = raw.astype(np.float64).copy()
    V = x.shape[0]
    if allowed is not None:
        banned = np.ones(V, bool)
        banned[list(allowed)] = False
        x[banned] = NEG_INF
    outs = list(outputs)
    for word in bad_words:
        if len(word) > len(outs) + 1:
            continue
        prefix = list(word[:-1])
        if not prefix or outs[len(outs) - len(prefix):] == prefix:
            x[word[-1]] = NEG_INF
    for tok, b in (logit_bias or {}).items():
        x[tok] += b
    if len(outs) < min_tokens:
        x[list(stop_ids)] = NEG_INF
    counts = np.bincount(np.asarray(outs, np.int64), minlength=V).astype(np.float64)
    seen = counts > 0
    seen[list(prompt)] = True
    x = np.where(seen & (x > 0), x / repetition, np.where(seen, x * repetition, x))
    x = x - frequency * counts
    x = x - presence * (counts > 0)
    return x


def kept_tokens(
    x: np.ndarray, temperature: float, min_p: float = 0.0, top_k: int = 0, top_p: float = 1.0
) -> tuple[np.ndarray, np.ndarray]:
    """(keep [V] bool, distribution [V]) after temperature, min_p, top_k (ties at the k-th value
    kept), top_p (shortest prefix of (prob desc, id asc) with mass >= top_p)."""
    V = x.shape[0]
    s = x / temperature
    p = np.exp(s - s.max())
    keep = np.isfinite(s)
    if min_p > 0:
        keep &= p >= min_p * p.max()
    if 0 < top_k < V:
        vals = np.sort(s[keep])[::-1]
        if len(vals) > top_k:
            keep &= s >= vals[top_k - 1]
    if top_p < 1.0:
        ids = np.nonzero(keep)[0]
        order = ids[np.lexsort((ids, -s[ids]))]
        q = p[order] / p[order].sum()
        c = np.cumsum(q)
        j = int(np.searchsorted(c, top_p))  # first prefix with mass >= top_p
        j = min(j, len(order) - 1)
        keep = np.zeros(V, bool)
        keep[order[: j + 1]] = True
    dist = np.where(keep, p, 0.0)
    return keep, dist / dist.sum()


def near_boundary(
    x: np.ndarray, temperature: float, min_p: float, top_p: float, top_k: int = 0,
    tol: float = 1e-4,
) -> bool:
    """True when float32 rounding could flip a min_p or top_p decision (skip such cases)."""
    s = x / temperature
    p = np.exp(s - s.max())
    keep = np.isfinite(s)
    if min_p > 0:
        r = p / p.max()
        if np.any(np.abs(r[keep] - min_p) < tol * min_p + 1e-12):
            return True
        keep &= r >= min_p
    if top_p < 1.0:
        if 0 < top_k < len(x):
            vals = np.sort(s[keep])[::-1]
            if len(vals) > top_k:
                keep &= s >= vals[top_k - 1]
        q = np.sort(p[keep])[::-1]
        c = np.cumsum(q) / q.sum()
        if np.any(np.abs(c - top_p) < tol):
            return True
    return False


def log_softmax(raw: np.ndarray) -> np.ndarray:
    x = raw.astype(np.float64)
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


def top_ids(raw: np.ndarray, k: int) -> np.ndarray:
    """[R, V] -> [R, k] ids by (value desc, id asc)."""
    V = raw.shape[-1]
    return np.stack([np.lexsort((np.arange(V), -row))[:k] for row in raw])
