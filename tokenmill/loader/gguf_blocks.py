"""GGUF block formats -> natural-order codes and per-32 scales, for QuantLinear.

Parses a tensor's raw blocks ([rows, blocks, type_size] bytes, as the file stores them)
into the packed format's pieces: unsigned codes per value, a scale (and min) per block
of 32, and for K-quants the super-block scales they multiply. Exact for the types in
EXACT_GGUF_TYPES, and for Q6_K as 6-bit codes with a scale per 16 values (parse_q6_k);
the 16-value sub-block types (Q6_K where 6-bit codes cannot run, Q2_K, Q3_K) and the
table-coded 4-bit ones (IQ4_NL, IQ4_XS, MXFP4) are requantized by QuantLinear instead
(REQUANT_GGUF_TYPES).
"""

from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType as GT

EXACT_GGUF_TYPES = frozenset({GT.Q4_0, GT.Q4_1, GT.Q4_K, GT.Q8_0, GT.Q5_0, GT.Q5_1, GT.Q5_K})
# 4-bit codes that index a table of 16 values (parse_table): held as they are, looked up
# in registers
TABLE_GGUF_TYPES = frozenset({GT.IQ4_NL, GT.IQ4_XS, GT.MXFP4})
# IQ4_XS's scales are signed 6-bit codes stored + 32: d = the 256-block's d * (code - 32)
TABLE_SCALE_ZERO = {GT.IQ4_XS: 32}
# ... and the non-linear 4-bit types (a 16-entry table per value: IQ4_NL, IQ4_XS; gpt-oss's
# MXFP4, e2m1 values under a power-of-two scale), which the integer kernels have no code
# for: dequantized by gguf-py, then packed as 8-bit Q8_0-like blocks (2x their bytes).
REQUANT_GGUF_TYPES = frozenset({GT.Q6_K, GT.Q2_K, GT.Q3_K})


def _f16(b: np.ndarray) -> np.ndarray:
    """[..., 2] uint8 -> [...] float16 (little-endian, as GGUF stores it)."""
    return np.ascontiguousarray(b).view(np.float16)[..., 0]


def _nibbles16(qs: np.ndarray) -> np.ndarray:
    """Q4_0/Q4_1/Q5 low bits: [.., 16] bytes -> [.., 32]: value j<16 low, j>=16 high nibble."""
    return np.concatenate([qs & 15, qs >> 4], axis=-1)


def _k_scale_min(sc: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K 12-byte packed 6-bit (scale, min) of 8 sub-blocks -> two [.., 8] arrays."""
    d, m, md = sc[..., 0:4], sc[..., 4:8], sc[..., 8:12]
    scale = np.concatenate([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return scale, mn


def parse_exact(blocks: np.ndarray, qtype: GT, five: bool = False):
    """blocks [rows, nblk, type_size] -> (codes [rows, K] u8, scales, mins|None, bits, sup).

    sup: None, or for K-quants (d, dmin) float16 [rows, K/256, 2] with scales and mins the
    uint8 codes that multiply them. Q5_0, Q5_1 and Q5_K: their 5-bit codes with `five`
    (Q5_0's zero point 16), else as 8-bit codes (Q5_0's biased to the zero point 128)."""
    rows = blocks.shape[0]
    if qtype in (GT.Q4_0, GT.Q4_1, GT.Q8_0, GT.Q5_0, GT.Q5_1):
        d = _f16(blocks[..., 0:2])
        has_min = qtype in (GT.Q4_1, GT.Q5_1)
        m = _f16(blocks[..., 2:4]) if has_min else None
        off = 4 if has_min else 2
        if qtype == GT.Q8_0:  # int8 q -> q + 128 (Z = 128)
            codes = blocks[..., 2:34] ^ np.uint8(0x80)
            return codes.reshape(rows, -1), d, None, 8, None
        if qtype in (GT.Q4_0, GT.Q4_1):  # Q4_0: raw nibble, Z = 8; Q4_1: nibble with min
            return _nibbles16(blocks[..., off : off + 16]).reshape(rows, -1), d, m, 4, None
        # Q5_0 / Q5_1: 4 bytes of high bits (bit j of a little-endian u32 for value j)
        qh = np.ascontiguousarray(blocks[..., off : off + 4]).view("<u4")  # [rows, nblk, 1]
        high = ((qh >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8) << 4
        q = _nibbles16(blocks[..., off + 4 : off + 20]) | high
        if five:
            return q.reshape(rows, -1), d, m, 5, None
        if qtype == GT.Q5_0:  # value d * (q - 16) = d * ((q + 112) - 128)
            q = q + np.uint8(112)
        return q.reshape(rows, -1), d, m, 8, None
    # K-quants: super-blocks of 256 = 8 sub-blocks of 32, each with a 6-bit scale/min
    # code: the sub-block's scale is d * code, its min -dmin * code (kept that way).
    sup = np.ascontiguousarray(blocks[..., 0:4]).view(np.float16)  # [rows, nsup, 2]: d, dmin
    sc, mn = _k_scale_min(blocks[..., 4:16])
    if qtype == GT.Q4_K:
        # 4 chunks of 32 bytes: sub-block 2c = low nibbles of chunk c, 2c+1 = high
        qs = blocks[..., 16:144].reshape(rows, -1, 4, 1, 32)
        q = (qs >> np.array([0, 4], dtype=np.uint8).reshape(2, 1)) & 15
        bits = 4
    elif qtype == GT.Q5_K:
        qh = blocks[..., 16:48].reshape(rows, -1, 1, 32)  # bit s = high bit, sub-block s
        qs = blocks[..., 48:176].reshape(rows, -1, 4, 1, 32)
        q = (qs >> np.array([0, 4], dtype=np.uint8).reshape(2, 1)) & 15
        high = (qh >> np.arange(8, dtype=np.uint8).reshape(8, 1)) & 1
        q = q.reshape(rows, -1, 8, 32) | (high << 4)
        bits = 5 if five else 8
    else:
        raise ValueError(f"not an exactly representable type: {qtype.name}")
    return q.reshape(rows, -1), sc.reshape(rows, -1), mn.reshape(rows, -1), bits, sup


def parse_q6_k(blocks: np.ndarray):
    """Q6_K blocks [rows, nsup, 210] -> (codes [rows, K] u8 (0..63, value d16 * (c - 32)),
    sub-scales int8 [rows, K/16], None, 6, d float16 [rows, K/256, 1]); d16 = d * sub-scale.

    A super-block: 128 bytes of low nibbles (two halves of 128 values: values 0-63 of a
    half in the low nibbles of its 64 bytes, 64-127 in the high ones), 64 bytes of top
    bits (per half, 32 bytes holding values 32s + j at bits 2s of byte j), 16 signed
    sub-scales, d."""
    rows = blocks.shape[0]
    ql = blocks[..., 0:128].reshape(rows, -1, 2, 1, 64) >> np.array([0, 4], np.uint8).reshape(2, 1)
    qh = blocks[..., 128:192].reshape(rows, -1, 2, 1, 32) >> np.array(
        [0, 2, 4, 6], np.uint8
    ).reshape(4, 1)
    q = (ql & 15).reshape(rows, -1, 256) | ((qh & 3).reshape(rows, -1, 256) << 4)
    sc = np.ascontiguousarray(blocks[..., 192:208]).view(np.int8)
    d = np.ascontiguousarray(blocks[..., 208:210]).view(np.float16)  # [rows, nsup, 1]
    return q.reshape(rows, -1), sc.reshape(rows, -1), None, 6, d


def table_of(qtype: GT) -> np.ndarray:
    """A table type's 16 values + 128, uint8 [16]: what a code looks up (gguf-py's
    kvalues; MXFP4's FP4 values doubled, its scale halved to match, as gguf-py does)."""
    from gguf import quants

    kvalues = {GT.IQ4_NL: quants.IQ4_NL, GT.IQ4_XS: quants.IQ4_NL, GT.MXFP4: quants.MXFP4}
    return (np.array(kvalues[qtype].kvalues, np.int16) + 128).astype(np.uint8)


def parse_table(blocks: np.ndarray, qtype: GT):
    """IQ4_NL / IQ4_XS / MXFP4 blocks [rows, nblk, type_size] -> (codes [rows, K] u8 (0..15,
    table indices), scales, None, 4, sup). Scales: float16 [rows, K/32] for IQ4_NL, as the
    file; IQ4_XS's 6-bit codes uint8 [rows, K/32] with its d per 256 values as sup float16
    [rows, K/256, 1] (scale = d * (code - 32), TABLE_SCALE_ZERO); float32 for MXFP4's
    powers of two, which float16 cannot hold. The value of code c is scale *
    (table_of(qtype)[c] - 128), gguf-py's float32 operations."""
    from gguf import quants

    rows = blocks.shape[0]
    if qtype == GT.IQ4_NL:  # d, then value j's code in the low nibble of byte j < 16, the
        d = _f16(blocks[..., 0:2])  # high one for j + 16 (Q4_0's layout)
        return _nibbles16(blocks[..., 2:18]).reshape(rows, -1), d, None, 4, None
    if qtype == GT.MXFP4:  # an E8M0 exponent, then Q4_0's nibbles
        e = np.ascontiguousarray(blocks[..., 0:1]).reshape(-1, 1)
        d = quants.MXFP4.e8m0_to_fp32_half(e).astype(np.float32).reshape(rows, -1)
        return _nibbles16(blocks[..., 1:17]).reshape(rows, -1), d, None, 4, None
    # IQ4_XS: super-blocks of 256: d, 2 bytes of top scale bits, 4 of low ones, 128 of codes
    d = np.ascontiguousarray(blocks[..., 0:2]).view(np.float16)  # [rows, nsup, 1]
    high = np.ascontiguousarray(blocks[..., 2:4]).view(np.uint16)  # [rows, nsup, 1]
    low = blocks[..., 4:8]  # [rows, nsup, 4]: sub-block ib's 4 bits at byte ib/2, nibble ib%2
    ib = np.arange(8)
    ls = ((low[..., ib // 2] >> (4 * (ib % 2)).astype(np.uint8)) & 15) | (
        ((high >> (2 * ib).astype(np.uint16)) & 3).astype(np.uint8) << 4
    )  # [rows, nsup, 8]: 0..63
    codes = _nibbles16(blocks[..., 8:136].reshape(rows, -1, 8, 16))  # per 32: Q4_0's order
    return codes.reshape(rows, -1), ls.reshape(rows, -1), None, 4, d
