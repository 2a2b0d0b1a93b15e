"""A reference quantiser for llama.cpp's K-quant blocks (Q4_K, Q5_K, Q6_K), written from the formats' definitions,
so that test files of those formats can be made here (gguf quantises none of them; it dequantises all).

A super-block holds 256 weights. Q4_K and Q5_K split it into 8 sub-blocks of 32, each with a 6-bit scale and a
6-bit minimum under the super-block's float16 d and dmin: w = d * sc * q - dmin * m, q 4 or 5 bits. Q6_K splits it
into 16 sub-blocks of 16, each with an 8-bit signed scale under one float16 d: w = d * sc * (q - 32), q 6 bits.
The scales here come from each sub-block's range in one pass, rounded up so that no weight falls outside its
quants: simpler than llama.cpp's search (its files are a little more accurate). What matters for the tests is that
the bytes are the format's, which gguf's dequantiser checks.
"""

from __future__ import annotations

import numpy as np

QK_K = 256  # weights a super-block holds
BYTES = {"Q4_K": 144, "Q5_K": 176, "Q6_K": 210}


def _f16_up(x: np.ndarray) -> np.ndarray:
    """x (float32, >= 0) rounded up to a float16 and back: a block's stored scale, never below what it must reach."""
    half = x.astype(np.float16)
    half = np.where(half.astype(np.float32) < x, np.nextafter(half, np.float16(np.inf)), half)
    return half.astype(np.float32)


def _divide(x: np.ndarray, by: np.ndarray) -> np.ndarray:
    """x / by, 0 where by is 0."""
    return np.divide(x, by, out=np.zeros_like(x), where=by != 0)


def _scales_and_mins(x: np.ndarray, levels: int) -> tuple[np.ndarray, ...]:
    """For Q4_K / Q5_K: x (n, 8, 32) -> the super-block's d, dmin (n,) float16-exact, each sub-block's 6-bit sc, m
    (n, 8) and the quants q (n, 8, 32) in 0..levels. Every stored figure is rounded up, so that a sub-block's grid,
    from -dmin * m in steps of d * sc, covers all its weights: none is clipped."""
    offset = -np.minimum(x.min(-1), 0.0)  # (n, 8): a sub-block's offset is never above zero, as llama.cpp's
    dmin = _f16_up(offset.max(-1) / 63)  # (n,)
    m = np.clip(np.ceil(_divide(offset, dmin[:, None])), 0, 63)
    shift = dmin[:, None] * m  # (n, 8): as the reader computes it
    needed = (x.max(-1) + shift) / levels  # (n, 8): the step that reaches the largest weight from -shift
    d = _f16_up(needed.max(-1) / 63)  # (n,)
    sc = np.clip(np.ceil(_divide(needed, d[:, None])), 0, 63)
    step = np.broadcast_to((d[:, None] * sc)[..., None], x.shape)  # (n, 8, 32)
    q = np.clip(np.rint(_divide(x + shift[..., None], step)), 0, levels)
    return d, dmin, sc.astype(np.uint8), m.astype(np.uint8), q.astype(np.uint8)


def _pack_scales(sc: np.ndarray, m: np.ndarray) -> np.ndarray:
    """(n, 8) 6-bit scales and minimums -> (n, 12) bytes: the first four of each in the low 6 bits of bytes 0-3 and
    4-7, the last four's low nibbles in bytes 8-11 and their top two bits in the top bits of bytes 0-7."""
    first = sc[:, :4] | ((sc[:, 4:] >> 4) << 6)
    mins = m[:, :4] | ((m[:, 4:] >> 4) << 6)
    rest = (sc[:, 4:] & 15) | ((m[:, 4:] & 15) << 4)
    return np.concatenate([first, mins, rest], axis=1).astype(np.uint8)


def _halves(d: np.ndarray) -> np.ndarray:
    return d.astype(np.float16).view(np.uint8).reshape(len(d), 2)  # (n, 2) little-endian bytes


def quantise_q4_k(x: np.ndarray) -> np.ndarray:
    """x (n, 256) float32 -> (n, 144) bytes: d, dmin, scales, then 128 bytes of nibbles, each 32 bytes holding
    sub-block 2g in their low nibbles and 2g + 1 in their high ones."""
    d, dmin, sc, m, q = _scales_and_mins(x.reshape(-1, 8, 32), 15)
    qs = (q[:, 0::2] | (q[:, 1::2] << 4)).reshape(len(x), 128)
    return np.concatenate([_halves(d), _halves(dmin), _pack_scales(sc, m), qs], axis=1)


def quantise_q5_k(x: np.ndarray) -> np.ndarray:
    """x (n, 256) float32 -> (n, 176) bytes: d, dmin, scales, 32 bytes of high bits (bit j of byte l: sub-block j's
    weight l), then the low nibbles as Q4_K lays them out."""
    d, dmin, sc, m, q = _scales_and_mins(x.reshape(-1, 8, 32), 31)
    low, high = q & 15, q >> 4  # (n, 8, 32) each
    qh = (high << np.arange(8, dtype=np.uint8)[None, :, None]).sum(1, dtype=np.uint8)  # (n, 32)
    qs = (low[:, 0::2] | (low[:, 1::2] << 4)).reshape(len(x), 128)
    return np.concatenate([_halves(d), _halves(dmin), _pack_scales(sc, m), qh, qs], axis=1)


def quantise_q6_k(x: np.ndarray) -> np.ndarray:
    """x (n, 256) float32 -> (n, 210) bytes: 128 bytes of low nibbles, 64 of high bit pairs, 16 signed scales, d.
    Of each half of 128 weights, weight w's low nibble is in byte w % 64 (the high nibble from w = 64 on) and its
    high pair in byte w % 32 at bit 2 * (w // 32)."""
    n = len(x)
    blocks = x.reshape(n, 16, 16)
    scale = np.abs(blocks).max(-1) / 31  # (n, 16): q - 32 spans -32..31, and reaches +-31 steps
    d = _f16_up(scale.max(-1) / 127)  # (n,): rounded up, so that no sub-block's scale passes 127
    sc = np.clip(np.ceil(_divide(scale, d[:, None])), 0, 127)  # (n, 16): rounded up, as Q4_K's
    step = np.broadcast_to((d[:, None] * sc)[..., None], blocks.shape)  # (n, 16, 16)
    q = (np.clip(np.rint(_divide(blocks, step)), -32, 31) + 32).astype(np.uint8).reshape(n, 2, 128)  # per half
    low, high = q & 15, q >> 4  # (n, 2, 128)
    ql = (low[..., :64] | (low[..., 64:] << 4)).reshape(n, 128)
    pairs = high.reshape(n, 2, 4, 32)  # weight 32 * s + l of a half: its pair at bit 2 s of byte l
    qh = (pairs << (2 * np.arange(4, dtype=np.uint8))[None, None, :, None]).sum(2, dtype=np.uint8).reshape(n, 64)
    return np.concatenate([ql, qh, sc.astype(np.int8).view(np.uint8), _halves(d)], axis=1)


QUANTISERS = {"Q4_K": quantise_q4_k, "Q5_K": quantise_q5_k, "Q6_K": quantise_q6_k}


def quantise(values: np.ndarray, fmt: str) -> np.ndarray:
    """A matrix (rows, columns), columns a multiple of 256, as `fmt`'s blocks: (rows, columns / 256 * bytes)."""
    rows, columns = values.shape
    if columns % QK_K:
        raise ValueError(f"{fmt} needs rows of a multiple of {QK_K} weights, not {columns}")
    blocks = QUANTISERS[fmt](np.ascontiguousarray(values, dtype=np.float32).reshape(-1, QK_K))
    return blocks.reshape(rows, columns // QK_K * BYTES[fmt])
