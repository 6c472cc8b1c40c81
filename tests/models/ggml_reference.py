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


# IQ4_NL's and IQ4_XS's 16 non-linear levels (kvalues_iq4nl)
IQ4_LEVELS = np.asarray([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113],
                        np.float32)


def _scale_min_k4(j: int, scales: np.ndarray) -> tuple[int, int]:
    """Q4_K's and Q5_K's 6-bit scale and min number j of 8, packed in 12 bytes."""
    if j < 4:
        return scales[j] & 63, scales[j + 4] & 63
    return ((scales[j + 4] & 0xF) | ((scales[j - 4] >> 6) << 4),
            (scales[j + 4] >> 4) | ((scales[j] >> 6) << 4))


def _q3_k_scale(k: int, b: np.ndarray) -> int:
    """Q3_K's 6-bit scale number k of 16, signed (-32..31): the low 4 bits in a nibble of
    bytes 0-7, the high 2 bits in bytes 8-11."""
    low = (b[k % 8] >> (4 * (k // 8))) & 0xF
    high = (b[8 + k % 4] >> (2 * (k // 4))) & 3
    return int(low | (high << 4)) - 32


def _ref_block(qtype: QT, b: np.ndarray) -> np.ndarray:
    y = np.zeros(gguf.GGML_QUANT_SIZES[qtype][0], np.float32)
    if qtype in _NEW_TYPES:
        return _ref_block_2(qtype, b, y)
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


_NEW_TYPES = (QT.Q2_K, QT.Q3_K, QT.Q5_K, QT.IQ4_NL, QT.IQ4_XS)


def _ref_block_2(qtype: QT, b: np.ndarray, y: np.ndarray) -> np.ndarray:
    b = b.astype(np.int64)
    raw = b.astype(np.uint8)
    if qtype == QT.Q2_K:  # scales[16] (4-bit scale | 4-bit min), qs[64] (2 bits), d, dmin
        scales, qs, d, dmin = b[0:16], b[16:80], _f16(raw[80:]), _f16(raw[82:])
        for i in range(16):  # sub-blocks of 16 values: 128-value halves, 4 shifts, 2 runs of 16
            half, rest = divmod(i, 8)
            shift, run = 2 * (rest // 2), rest % 2
            q = (qs[32 * half + 16 * run: 32 * half + 16 * run + 16] >> shift) & 3
            dl, ml = d * np.float32(scales[i] & 0xF), dmin * np.float32(scales[i] >> 4)
            y[16 * i: 16 * i + 16] = dl * q.astype(np.float32) - ml
    elif qtype == QT.Q3_K:  # hmask[32] (high bit), qs[64] (low 2 bits), scales[12], d
        hmask, qs, scales, d = b[0:32], b[32:96], b[96:108], _f16(raw[108:])
        for i in range(16):
            half, rest = divmod(i, 8)
            shift, run = 2 * (rest // 2), rest % 2
            lo = (qs[32 * half + 16 * run: 32 * half + 16 * run + 16] >> shift) & 3
            bit = 4 * half + rest // 2  # the hmask bit of this sub-block
            hi = (hmask[16 * run: 16 * run + 16] >> bit) & 1
            q = lo - np.where(hi == 1, 0, 4)
            dl = d * np.float32(_q3_k_scale(i, scales))
            y[16 * i: 16 * i + 16] = dl * q.astype(np.float32)
    elif qtype == QT.Q5_K:  # d, dmin, scales[12], qh[32] (5th bits), qs[128] (low 4 bits)
        d, dmin, scales, qh, qs = _f16(raw), _f16(raw[2:]), b[4:16], b[16:48], b[48:176]
        for i in range(4):  # 64 values each: low nibbles, then high nibbles
            chunk = qs[32 * i: 32 * i + 32]
            for k, nib in ((0, chunk & 0xF), (1, chunk >> 4)):
                sc, m = _scale_min_k4(2 * i + k, scales)
                q = nib + 16 * ((qh >> (2 * i + k)) & 1)
                y[64 * i + 32 * k: 64 * i + 32 * k + 32] = (
                    d * np.float32(sc) * q.astype(np.float32) - dmin * np.float32(m))
    elif qtype == QT.IQ4_NL:  # d, qs[16]: level indices, low nibbles first
        d, qs = _f16(raw), b[2:18]
        y[:16], y[16:] = d * IQ4_LEVELS[qs & 0xF], d * IQ4_LEVELS[qs >> 4]
    elif qtype == QT.IQ4_XS:  # d, scales_h (u16), scales_l[4], qs[128]: 8 runs of 32
        d = _f16(raw)
        scales_h = int(raw[2:4].copy().view("<u2")[0])
        scales_l, qs = b[4:8], b[8:136]
        for i in range(8):
            ls = ((scales_l[i // 2] >> (4 * (i % 2))) & 0xF) | (((scales_h >> (2 * i)) & 3) << 4)
            dl = d * np.float32(ls - 32)
            q = qs[16 * i: 16 * i + 16]
            y[32 * i: 32 * i + 16], y[32 * i + 16: 32 * i + 32] = (
                dl * IQ4_LEVELS[q & 0xF], dl * IQ4_LEVELS[q >> 4])
    else:
        raise AssertionError(qtype)
    return y


def reference_dequantize(qtype: QT, raw: np.ndarray, rows: int, cols: int) -> np.ndarray:
    _, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    blocks = raw.reshape(-1, block_bytes)
    return np.concatenate([_ref_block(qtype, b) for b in blocks]).reshape(rows, cols)


def random_k_blocks(qtype: QT, rows: int, cols: int, scale=(1e-3, 1e-1)) -> np.ndarray:
    """Random bytes in the blocks of a K-quant or IQ4 type, with sane float16 scales (gguf
    cannot quantize these types)."""
    block_elems, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    raw = RNG.integers(0, 256, size=(rows * cols // block_elems, block_bytes), dtype=np.uint8)
    scale = RNG.uniform(*scale, size=(raw.shape[0], 2)).astype(np.float16).view(np.uint8)
    # where each type keeps its float16 d (and dmin, right after it)
    at = {QT.Q4_K: 0, QT.Q5_K: 0, QT.Q6_K: 208, QT.Q2_K: 80, QT.Q3_K: 108, QT.IQ4_NL: 0,
          QT.IQ4_XS: 0}[qtype]
    width = 4 if qtype in (QT.Q4_K, QT.Q5_K, QT.Q2_K) else 2
    raw[:, at: at + width] = scale[:, :width]
    return raw.reshape(rows, -1)
