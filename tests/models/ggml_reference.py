"""Reference GGML block decoders for the GGUF tests, written from ggml's block layouts
(ggml-common.h / dequantize_row_* in ggml-quants.c), one block at a time, in the same float32
operation order as ggml, so equality with the loader's output is exact."""

from __future__ import annotations

import gguf
import numpy as np
from gguf import GGMLQuantizationType as QT

RNG = np.random.default_rng(4321)



def _f16(b: np.ndarray) -> np.float32:
    return np.float32(b[:2].copy().view(np.float16)[0])


def _ref_block(qtype: QT, b: np.ndarray) -> np.ndarray:
    y = np.zeros(gguf.GGML_QUANT_SIZES[qtype][0], np.float32)
    if qtype == QT.Q8_0:
        d = _f16(b)
        y[:] = d * b[2:34].view(np.int8).astype(np.float32)
    elif qtype in (QT.Q4_0, QT.Q4_1):
        d = _f16(b)
        qs = b[2:18] if qtype == QT.Q4_0 else b[4:20]
        lo, hi = (qs & 0xF).astype(np.float32), (qs >> 4).astype(np.float32)
        if qtype == QT.Q4_0:
            y[:16], y[16:] = d * (lo - 8), d * (hi - 8)
        else:
            m = _f16(b[2:])
            y[:16], y[16:] = d * lo + m, d * hi + m
    elif qtype in (QT.Q5_0, QT.Q5_1):
        d = _f16(b)
        start = 2 if qtype == QT.Q5_0 else 4
        qh = int(b[start : start + 4].copy().view("<u4")[0])
        qs = b[start + 4 : start + 20]
        for j in range(16):
            q0 = (int(qs[j]) & 0xF) | (((qh >> j) & 1) << 4)
            q1 = (int(qs[j]) >> 4) | (((qh >> (j + 16)) & 1) << 4)
            if qtype == QT.Q5_0:
                y[j], y[j + 16] = d * np.float32(q0 - 16), d * np.float32(q1 - 16)
            else:
                m = _f16(b[2:])
                y[j], y[j + 16] = d * np.float32(q0) + m, d * np.float32(q1) + m
    elif qtype == QT.Q4_K:
        d, dmin, scales, q = _f16(b), _f16(b[2:]), b[4:16].astype(int), b[16:144]

        def scale_min(j: int) -> tuple[int, int]:
            if j < 4:
                return scales[j] & 63, scales[j + 4] & 63
            return (
                (scales[j + 4] & 0xF) | ((scales[j - 4] >> 6) << 4),
                (scales[j + 4] >> 4) | ((scales[j] >> 6) << 4),
            )

        out = 0
        for i, j in enumerate(range(0, 256, 64)):
            sc1, m1 = scale_min(2 * i)
            sc2, m2 = scale_min(2 * i + 1)
            d1, mm1 = d * np.float32(sc1), dmin * np.float32(m1)
            d2, mm2 = d * np.float32(sc2), dmin * np.float32(m2)
            chunk = q[32 * i : 32 * i + 32]
            y[out : out + 32] = d1 * (chunk & 0xF).astype(np.float32) - mm1
            y[out + 32 : out + 64] = d2 * (chunk >> 4).astype(np.float32) - mm2
            out += 64
    elif qtype == QT.Q6_K:
        ql, qh, sc, d = b[0:128], b[128:192], b[192:208].view(np.int8), _f16(b[208:])
        for n in range(2):
            qln, qhn, scn = ql[64 * n :], qh[32 * n :], sc[8 * n :]
            for l in range(32):
                s = l // 16
                q1 = ((int(qln[l]) & 0xF) | (((int(qhn[l]) >> 0) & 3) << 4)) - 32
                q2 = ((int(qln[l + 32]) & 0xF) | (((int(qhn[l]) >> 2) & 3) << 4)) - 32
                q3 = ((int(qln[l]) >> 4) | (((int(qhn[l]) >> 4) & 3) << 4)) - 32
                q4 = ((int(qln[l + 32]) >> 4) | (((int(qhn[l]) >> 6) & 3) << 4)) - 32
                base = 128 * n
                for off, k, qv in ((0, 0, q1), (32, 2, q2), (64, 4, q3), (96, 6, q4)):
                    y[base + l + off] = d * np.float32(scn[s + k]) * np.float32(qv)
    else:
        raise AssertionError(qtype)
    return y


def reference_dequantize(qtype: QT, raw: np.ndarray, rows: int, cols: int) -> np.ndarray:
    _, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    blocks = raw.reshape(-1, block_bytes)
    return np.concatenate([_ref_block(qtype, b) for b in blocks]).reshape(rows, cols)


def random_k_blocks(qtype: QT, rows: int, cols: int) -> np.ndarray:
    """Random bytes for K-quant blocks, with sane float16 scales (gguf cannot quantize these)."""
    block_elems, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    raw = RNG.integers(0, 256, size=(rows * cols // block_elems, block_bytes), dtype=np.uint8)
    scale = RNG.uniform(1e-3, 1e-1, size=(raw.shape[0], 2)).astype(np.float16).view(np.uint8)
    if qtype == QT.Q4_K:
        raw[:, 0:4] = scale  # d, dmin
    else:  # Q6_K: d is the last two bytes
        raw[:, 208:210] = scale[:, :2]
    return raw.reshape(rows, -1)
