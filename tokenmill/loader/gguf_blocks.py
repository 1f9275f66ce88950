"""GGUF block formats -> natural-order codes and per-32 scales, for QuantLinear.

Parses a tensor's raw blocks ([rows, blocks, type_size] bytes, as the file stores them)
into the packed format's pieces: unsigned codes per value, a scale (and min) per block
of 32, and for K-quants the super-block scales they multiply. Exact for the types in
EXACT_GGUF_TYPES; for Q6_K, Q3_K and Q2_K as 6-, 3- and 2-bit codes with a scale per 16
values (parse_q6_k, parse_q3_k, parse_q2_k); for the table-coded 4-bit types (IQ4_NL,
IQ4_XS, MXFP4: parse_table) as 4-bit codes into a table, and the grid types the same way
(parse_grid, parse_grid16): 4-bit codes for those of 16 points (IQ3_S, IQ3_XXS), 3-bit
ones under Q3_K's per-16 scales for those of at most 8 (GRID3_TYPES). With the native
kernels IQ3_S and IQ3_XXS keep their own bits instead (parse_grid_own: grid indices, sign
bits and scale nibbles, rearranged for the lanes by layout.pack_grid). Where their own
forms cannot run, Q6_K, Q3_K, Q2_K, IQ2_XS, IQ2_S and IQ1_M are requantized by
QuantLinear (REQUANT_GGUF_TYPES).
"""

from __future__ import annotations

import functools

import numpy as np
from gguf import GGMLQuantizationType as GT

EXACT_GGUF_TYPES = frozenset({GT.Q4_0, GT.Q4_1, GT.Q4_K, GT.Q8_0, GT.Q5_0, GT.Q5_1, GT.Q5_K})
# 4-bit codes that index a table of 16 values (parse_table): held as they are, looked up
# in registers
TABLE_GGUF_TYPES = frozenset({GT.IQ4_NL, GT.IQ4_XS, GT.MXFP4})
# Types whose values are a grid point times a scale per 32 (the 2- and 3-bit i-quants with
# one scale per 32, IQ1_S, the ternary TQ types): each value's grid point is one of at most
# 16 integers, so it is held as a code into a table like the types above (parse_grid: 4-bit
# codes for 16 points, 3-bit ones for at most 8, GRID3_TYPES)
GRID_VALUES = {
    GT.IQ2_XXS: (8, 25, 43),  # iq2xxs_grid's magnitudes, times a sign per value
    GT.IQ3_XXS: (4, 12, 20, 28, 36, 44, 52, 62),
    GT.IQ3_S: (1, 3, 5, 7, 9, 11, 13, 15),
    GT.IQ1_S: (-9, -7, -1, 1, 7, 9),  # 8 * (grid -1/0/1 + delta +-1/8): scale d * (2s+1) / 8
    GT.TQ1_0: (-1, 0, 1),
    GT.TQ2_0: (-1, 0, 1, 2),  # 2-bit codes - 1 (llama.cpp's quantizer writes only -1..1)
}
GRID_GGUF_TYPES = frozenset(GRID_VALUES)
# Grid types with a scale per 16 values, d (2s + 1) / 8, and at most 8 points (parse_grid16)
GRID16_VALUES = {
    GT.IQ2_XS: (-43, -25, -8, 8, 25, 43),  # iq2xs_grid's magnitudes times a sign
    GT.IQ2_S: (-43, -25, -8, 8, 25, 43),
    GT.IQ1_M: (-9, -7, -1, 1, 7, 9),  # 8 * (grid -1/0/1 + delta +-1/8)
}
# The grid types of at most 8 points: 3-bit codes into a table of them, in Q3_K's form (three
# planes per lane group, Q3_K's 6-bit scale code per 16 values, a float16 per 256: the scales
# per 32 of IQ2_XXS, IQ1_S and TQ as two equal ones); the others (IQ3_S, IQ3_XXS: 16
# points) 4-bit codes under a scale code per 32 where they cannot keep their own bits
# (GRID_OWN_BITS)
GRID3_TYPES = frozenset({GT.IQ2_XXS, GT.IQ1_S, GT.TQ1_0, GT.TQ2_0, *GRID16_VALUES})
# IQ4_XS's scales are signed 6-bit codes stored + 32: d = the 256-block's d * (code - 32)
TABLE_SCALE_ZERO = {GT.IQ4_XS: 32}
# Requantized to 8-bit codes where their own forms cannot run (without the native
# kernels): Q6_K, Q3_K and Q2_K, and the 3-bit grid types of GRID16_VALUES.
REQUANT_GGUF_TYPES = frozenset({GT.Q6_K, GT.Q2_K, GT.Q3_K, GT.IQ2_XS, GT.IQ2_S, GT.IQ1_M})
# Every quantized type a layer holds (layers/quant_linear.py), one of the four ways above
QUANT_GGUF_TYPES = EXACT_GGUF_TYPES | TABLE_GGUF_TYPES | GRID_GGUF_TYPES | REQUANT_GGUF_TYPES


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


def parse_q3_k(blocks: np.ndarray):
    """Q3_K blocks [rows, nsup, 110] -> (codes [rows, K] u8 (0..7, value d16 * (c - 4)),
    sub-scales int8 [rows, K/16], None, 3, d float16 [rows, K/256, 1]): parse_q6_k's form
    at 3 bits. A Q3_K value is d * (scale - 32) * (q - 4) with q in 0..7 and a 6-bit scale
    per 16 values: the int8 sub-scale (scale - 32) and the same d hold it exactly.

    A super-block: 32 bytes of high bits (value 32i + j: bit i of byte j, the offset 4 where
    it is 0), 64 of 2-bit low parts (per 128-value half, value 32s + j at bits 2s of byte
    j), 12 of scales (low nibbles in bytes 0-7, top 2 bits in bytes 8-11), then d."""
    rows, nsup = blocks.shape[:2]
    hmask, qs, sc = blocks[..., 0:32], blocks[..., 32:96], blocks[..., 96:108]
    low = sc[..., 0:8].reshape(rows, nsup, 1, 8) >> np.array([0, 4], np.uint8).reshape(2, 1)
    high = sc[..., 8:12].reshape(rows, nsup, 1, 4) >> np.array([0, 2, 4, 6], np.uint8).reshape(4, 1)
    scale = (low.reshape(rows, nsup, 16) & 15) | ((high.reshape(rows, nsup, 16) & 3) << 4)
    ql = qs.reshape(rows, nsup, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(4, 1)
    qh = hmask.reshape(rows, nsup, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(8, 1)
    q = (ql.reshape(rows, nsup, 256) & 3) + 4 * (qh.reshape(rows, nsup, 256) & 1)
    sub = (scale.astype(np.int16) - 32).astype(np.int8)
    d = np.ascontiguousarray(blocks[..., 108:110]).view(np.float16)  # [rows, nsup, 1]
    return q.reshape(rows, -1), sub.reshape(rows, -1), None, 3, d


def parse_q2_k(blocks: np.ndarray):
    """Q2_K blocks [rows, nsup, 84] -> (codes [rows, K] u8 (0..3), the file's scale bytes
    uint8 [rows, K/16] (scale code + 16 * min code), None, 2, (d, dmin) float16 [rows,
    K/256, 2]): w = d * sc * q - dmin * m per 16 values, as the file has it.

    A super-block: 16 scale bytes, 64 bytes of 2-bit values (per 128-value half, value 32s
    + j at bits 2s of byte j), then d and dmin."""
    rows, nsup = blocks.shape[:2]
    sc, qs = blocks[..., 0:16], blocks[..., 16:80]
    q = qs.reshape(rows, nsup, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(4, 1)
    sup = np.ascontiguousarray(blocks[..., 80:84]).view(np.float16)  # [rows, nsup, 2]
    return (q & 3).reshape(rows, -1), np.ascontiguousarray(sc).reshape(rows, -1), None, 2, sup


def table_of(qtype: GT) -> np.ndarray:
    """A table type's 16 values + 128, uint8 [16]: what a code looks up (gguf-py's
    kvalues; MXFP4's FP4 values doubled, its scale halved to match, as gguf-py does; a
    grid type's signed grid points, sorted, the unused entries 0)."""
    from gguf import quants

    if qtype in GRID_VALUES or qtype in GRID16_VALUES:
        table = np.zeros(16, np.int16)
        points = _grid_points(qtype) if qtype in GRID_VALUES else np.array(GRID16_VALUES[qtype])
        table[: len(points)] = points
        return (table + 128).astype(np.uint8)
    kvalues = {GT.IQ4_NL: quants.IQ4_NL, GT.IQ4_XS: quants.IQ4_NL, GT.MXFP4: quants.MXFP4}
    return (np.array(kvalues[qtype].kvalues, np.int16) + 128).astype(np.uint8)


# MXFP4's E8M0 exponent bytes the kernels read as they are (tm.h TM_SCALE_E8M0): 2^(e -
# 128), the scale halved to match the doubled table, a normal float32 (2^-126 to 2^126;
# 0 and 1 stand for subnormals, 255 for NaN)
MXFP4_BYTE_EXPONENTS = (2, 254)


def mxfp4_scales_fit_byte(raw: np.ndarray) -> bool:
    """Whether every block exponent of MXFP4 rows (raw bytes [rows, row_bytes], or several
    such arrays) is one the kernels read as a byte: then the scales are held as the file's
    exponent bytes (17 bytes per 32 values, the file's), else as float32 (20)."""
    lo, hi = MXFP4_BYTE_EXPONENTS
    for part in raw if isinstance(raw, list | tuple) else [raw]:
        e = np.asarray(part).reshape(-1, 17)[:, 0]  # each 17-byte block: exponent, 16 nibble bytes
        if e.size and (e.min() < lo or e.max() > hi):
            return False
    return True


def parse_table(blocks: np.ndarray, qtype: GT, byte: bool = False):
    """IQ4_NL / IQ4_XS / MXFP4 blocks [rows, nblk, type_size] -> (codes [rows, K] u8 (0..15,
    table indices), scales, None, 4, sup). Scales: float16 [rows, K/32] for IQ4_NL, as the
    file; IQ4_XS's 6-bit codes uint8 [rows, K/32] with its d per 256 values as sup float16
    [rows, K/256, 1] (scale = d * (code - 32), TABLE_SCALE_ZERO); MXFP4's with `byte`
    its exponent bytes uint8 [rows, K/32] (scale 2^(e - 128); the caller checked
    mxfp4_scales_fit_byte over the whole tensor), else float32 powers of two. The value of
    code c is scale * (table_of(qtype)[c] - 128), gguf-py's float32 operations."""
    from gguf import quants

    rows = blocks.shape[0]
    if qtype == GT.IQ4_NL:  # d, then value j's code in the low nibble of byte j < 16, the
        d = _f16(blocks[..., 0:2])  # high one for j + 16 (Q4_0's layout)
        return _nibbles16(blocks[..., 2:18]).reshape(rows, -1), d, None, 4, None
    if qtype == GT.MXFP4:  # an E8M0 exponent, then Q4_0's nibbles
        e = np.ascontiguousarray(blocks[..., 0:1]).reshape(-1, 1)
        d = e.reshape(rows, -1)  # the bytes (TM_SCALE_E8M0)
        if not byte:
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


def _grid_points(qtype: GT) -> np.ndarray:
    """The signed integers a grid type's values are multiples of, sorted: int16 [<= 16]."""
    v = np.array(GRID_VALUES[qtype], np.int16)
    signed = qtype in (GT.IQ2_XXS, GT.IQ3_XXS, GT.IQ3_S)  # magnitudes, times a sign bit
    return np.unique(np.concatenate([-v, v]) if signed else v)


# A grid i-quant's scale per 32 (IQ2_XS, IQ2_S, IQ1_M: per 16) values is its super-block's
# d times an odd integer code over a power of two: d (2s + 1) / 2^shift. Held in the
# K-quant form, the code as a byte under the file's d as a float16 per 256 values (the
# kernels' dsup, read times 2^-shift: tm_weight.sup_shift), exact: 8.25 bits of scale per
# 32 values against a float32's 32.
GRID_SCALE_SHIFT = {GT.IQ3_S: 0, GT.IQ3_XXS: 2, GT.IQ2_XXS: 3, GT.IQ1_S: 3, GT.IQ2_XS: 3,
                    GT.IQ2_S: 3, GT.IQ1_M: 3}  # fmt: skip


def _grid_scale_codes(blocks: np.ndarray, qtype: GT):
    """A grid i-quant's scales as (odd codes uint8 [rows, K/32], the file's d float16
    [rows, K/256, 1]): scale = d * code / 2^GRID_SCALE_SHIFT, exactly gguf-py's."""
    rows, nsup = blocks.shape[:2]
    sup = np.ascontiguousarray(blocks[..., 0:2]).view(np.float16)
    if qtype in (GT.IQ2_XXS, GT.IQ3_XXS):  # the top 4 bits of a uint32 per 32
        words = np.ascontiguousarray(
            blocks[..., 2:66] if qtype == GT.IQ2_XXS else blocks[..., 66:98]
        ).view(np.uint32)
        s = ((words[..., 1::2] if qtype == GT.IQ2_XXS else words) >> 28).astype(np.uint8)
    elif qtype == GT.IQ3_S:  # 4 bytes of 4-bit scales at 106
        s = (blocks[..., 106:110, None] >> np.array([0, 4], np.uint8)) & 15
    else:  # IQ1_S: bits 12-14 of a uint16 per 32 at 34
        s = ((np.ascontiguousarray(blocks[..., 34:50]).view(np.uint16) >> 12) & 7).astype(np.uint8)
    return (2 * s + 1).astype(np.uint8).reshape(rows, -1), sup.reshape(rows, nsup, 1)


def _grid_levels(qtype: GT) -> np.ndarray:
    """A grid type's grid as level indices: uint8 [entries, values per entry], each value's
    index in gguf-py's grid_map (ascending: the magnitudes, or IQ1_S's -1, 0, 1)."""
    from gguf import quants

    cls = {GT.IQ2_XXS: quants.IQ2_XXS, GT.IQ3_XXS: quants.IQ3_XXS, GT.IQ3_S: quants.IQ3_S,
           GT.IQ1_S: quants.IQ1_S, GT.IQ2_XS: quants.IQ2_XS, GT.IQ2_S: quants.IQ2_S,
           GT.IQ1_M: quants.IQ1_M}[qtype]  # fmt: skip
    cls.init_grid()
    grid = cls.grid.reshape(cls.grid_shape)
    return np.searchsorted(np.array(cls.grid_map, np.float32), grid).astype(np.uint8)


def _bits8(b: np.ndarray) -> np.ndarray:
    """uint8 [...] -> its bits, low first: [..., 8] of 0/1."""
    return (b[..., None] >> np.arange(8, dtype=np.uint8)) & 1


def _signed_codes(levels: np.ndarray, negative: np.ndarray, n: int) -> np.ndarray:
    """Table indices of sign * magnitude level l (of n) in _grid_points' order: the
    negatives' mirror below, the positives above."""
    return np.where(negative.astype(bool), n - 1 - levels, n + levels).astype(np.uint8)


@functools.cache
def _ksigns() -> np.ndarray:
    """gguf-py's ksigns: a 7-bit sign index -> its 8 sign bits (the 8th the parity), uint8
    [128]."""
    from gguf import quants

    return np.frombuffer(quants.IQ2_XXS.ksigns, np.uint8)


def _word_signs(words: np.ndarray) -> np.ndarray:
    """uint32 words of four 7-bit sign indices (IQ2_XXS's, IQ3_XXS's; the top 4 bits left
    out) -> their sign bytes [..., 4], one per 8 values."""
    return _ksigns()[(words[..., None] >> np.array([0, 7, 14, 21], np.uint32)) & 127]


def _grid_codes(blocks: np.ndarray, qtype: GT) -> np.ndarray | None:
    """A grid type's table indices straight from its bits, as gguf-py's dequantization
    orders the values: codes uint8 [rows, K]; None for TQ1_0 (the generic way)."""
    rows, nsup = blocks.shape[:2]
    if qtype == GT.TQ2_0:  # 2-bit q + 1 per value, 4 planes of 32 bytes per 128 values
        q = blocks[..., 0:64].reshape(rows, nsup, 2, 1, 32) >> np.array(
            [0, 2, 4, 6], np.uint8
        ).reshape(4, 1)
        return (q & 3).reshape(rows, -1)
    if qtype == GT.TQ1_0:
        return None
    lv = _grid_levels(qtype)
    if qtype == GT.IQ1_S:  # 32 grid bytes, then per 32 values a uint16: 3 high bits per
        qh = np.ascontiguousarray(blocks[..., 34:50]).view(np.uint16)  # index, delta's sign
        idx = blocks[..., 2:34].reshape(rows, nsup, 8, 4).astype(np.uint16) | (
            ((qh[..., None] >> np.array([0, 3, 6, 9], np.uint16)) & 7) << 8
        )
        plus = (qh & 0x8000) == 0  # delta +1/8 -> grid point 8 g + 1
        return (2 * lv[idx] + plus[..., None, None]).astype(np.uint8).reshape(rows, -1)
    if qtype == GT.IQ3_S:  # 64 low index bytes, 8 bytes of 9th bits, 32 bytes of signs
        idx = blocks[..., 2:66].astype(np.uint16) | (
            _bits8(blocks[..., 66:74]).reshape(rows, nsup, 64).astype(np.uint16) << 8
        )
        signs = blocks[..., 74:106]  # a byte per 8 values: a nibble per grid entry of 4
        nibbles = np.stack([signs & 15, signs >> 4], axis=-1).reshape(rows, nsup, 64)
        return _entry_codes(qtype, 8)[idx, nibbles].view(np.uint8).reshape(rows, -1)
    if qtype == GT.IQ3_XXS:  # 64 index bytes (4 values each), then a uint32 per 32 values
        aux = np.ascontiguousarray(blocks[..., 66:98]).view(np.uint32)  # 4 x 7 sign bits
        signs = _word_signs(aux)
        nibbles = np.stack([signs & 15, signs >> 4], axis=-1).reshape(rows, nsup, 64)
        return _entry_codes(qtype, 8)[blocks[..., 2:66], nibbles].view(np.uint8).reshape(rows, -1)
    # IQ2_XXS: per 32 values a uint32 of 4 index bytes (8 values each), one of signs
    words = np.ascontiguousarray(blocks[..., 2:66]).view(np.uint32).reshape(rows, nsup, 8, 2)
    idx = np.ascontiguousarray(words[..., 0]).view(np.uint8).reshape(rows, nsup, 8, 4)
    signs = _word_signs(words[..., 1])
    return _entry_codes(qtype, 3)[idx, signs].view(np.uint8).reshape(rows, -1)


@functools.cache
def _entry_codes(qtype: GT, n: int) -> np.ndarray:
    """Every grid entry's table indices under every sign pattern, packed one entry per
    word: [entries, 2 ** per] of uint32 (4 values per entry) or uint64 (8), its bytes the
    entry's values in order (bit v of the pattern: value v is negative). One gather per
    entry then decodes a row, instead of sign bits expanded value by value."""
    lv = _grid_levels(qtype)  # [entries, per]
    per = lv.shape[1]
    negative = ((np.arange(2**per)[:, None] >> np.arange(per)) & 1).astype(bool)  # [2^per, per]
    codes = _signed_codes(lv[:, None, :], negative[None], n)  # [entries, 2^per, per]
    return np.ascontiguousarray(codes).view(np.uint32 if per == 4 else np.uint64)[..., 0]


def parse_grid(blocks: np.ndarray, qtype: GT):
    """IQ2_XXS / IQ3_XXS / IQ3_S / IQ1_S / TQ1_0 / TQ2_0 blocks [rows, nsup, type_size] ->
    (codes [rows, K] u8: indices into table_of(qtype), scales, None, bits, sup): sup the
    file's d float16 [rows, K/256, 1] (the layer reads it times 2^-GRID_SCALE_SHIFT), the
    scales its codes: IQ3_S and IQ3_XXS 4-bit codes under odd codes uint8 [rows, K/32]
    (_grid_scale_codes); the GRID3_TYPES 3-bit ones under int8 codes [rows, K/16], the
    i-quants' per 32 twice, TQ's all 1. The codes come from the grids' and signs' bits
    (_grid_codes); TQ1_0's base-3 bytes through gguf-py (_ternary_codes)."""
    rows, nsup = blocks.shape[:2]
    codes = _grid_codes(blocks, qtype)
    if qtype in (GT.TQ1_0, GT.TQ2_0):  # d per 256, at the block's end
        codes = _ternary_codes(blocks, qtype) if codes is None else codes
        sup = np.ascontiguousarray(blocks[..., -2:]).view(np.float16)
        return codes, np.ones((rows, nsup * 16), np.int8), None, 3, sup
    scale_codes, sup = _grid_scale_codes(blocks, qtype)
    if qtype in GRID3_TYPES:
        return codes, np.repeat(scale_codes, 2, axis=-1).view(np.int8), None, 3, sup
    return codes, scale_codes, None, 4, sup


# The grid i-quants held as their file's own bits (kernels bits TM_GRID9 / TM_GRID8: bytes
# per block, layout.pack_grid), where the native kernels run: IQ3_S's 9-bit and IQ3_XXS's
# 8-bit indices into grids of 4 magnitudes, a sign bit per value, a 4-bit scale code per 32
GRID_OWN_BITS = {GT.IQ3_S: 13, GT.IQ3_XXS: 12}


@functools.cache
def grid_table(qtype: GT) -> np.ndarray:
    """A GRID_OWN_BITS type's grid as the kernels read it: uint8 [entries * 4], each
    entry's 4 magnitudes + 128 (a negative value is 256 minus the byte)."""
    from gguf import quants

    cls = {GT.IQ3_S: quants.IQ3_S, GT.IQ3_XXS: quants.IQ3_XXS}[qtype]
    cls.init_grid()
    return (np.asarray(cls.grid).reshape(-1) + 128).astype(np.uint8)


def parse_grid_own(blocks: np.ndarray, qtype: GT):
    """IQ3_S / IQ3_XXS blocks [rows, nsup, type_size] -> (records uint8 [rows, K/32, B]:
    per block its 8 low grid indices, (IQ3_S) their 9th bits as a byte, its 32 sign bits;
    scale nibbles uint8 [rows, K/64] (block 2j's s low, 2j + 1's high: d (2 s + 1) /
    2^GRID_SCALE_SHIFT), None, B, the file's d float16 [rows, K/256, 1]). The file's bits
    rearranged, nothing decoded (IQ3_XXS's 7-bit sign indices widened to their 8 bits)."""
    rows, nsup = blocks.shape[:2]
    sup = np.ascontiguousarray(blocks[..., 0:2]).view(np.float16)
    idx = blocks[..., 2:66].reshape(rows, nsup, 8, 8)
    if qtype == GT.IQ3_S:  # 8 bytes of 9th bits at 66 (one per block), 32 of signs at 74
        parts = [idx, blocks[..., 66:74, None], blocks[..., 74:106].reshape(rows, nsup, 8, 4)]
        nib = blocks[..., 106:110]
    else:  # IQ3_XXS: per block a uint32 at 66: four 7-bit sign indices, the scale on top
        aux = np.ascontiguousarray(blocks[..., 66:98]).view(np.uint32)  # [rows, nsup, 8]
        parts = [idx, _word_signs(aux)]
        s = (aux >> 28).astype(np.uint8)
        nib = s[..., 0::2] | (s[..., 1::2] << 4)
    rec = np.concatenate(parts, axis=-1).reshape(rows, nsup * 8, -1)
    return (
        rec,
        np.ascontiguousarray(nib).reshape(rows, -1),
        None,
        GRID_OWN_BITS[qtype],
        sup.reshape(rows, nsup, 1),
    )


def _ternary_codes(blocks: np.ndarray, qtype: GT) -> np.ndarray:
    """TQ1_0's codes through gguf-py: each value divided by its super-block's d (float16,
    at the block's end) is an integer grid point, checked to be one of the type's: uint8
    [rows, K]."""
    from gguf.quants import dequantize

    rows = blocks.shape[0]
    w = dequantize(np.ascontiguousarray(blocks).reshape(rows, -1), qtype).reshape(rows, -1, 256)
    s = (
        np.ascontiguousarray(blocks[..., -2:]).view(np.float16).astype(np.float32)
    )  # [rows, nsup, 1]
    with np.errstate(divide="ignore", invalid="ignore"):
        t = np.where(s == 0, 0, np.rint(w / s))
    points = _grid_points(qtype)
    codes = np.searchsorted(points, t).clip(0, len(points) - 1)
    if not np.array_equal(points[codes] * s, np.where(s == 0, 0, w)):
        raise ValueError(f"{qtype.name} blocks hold values off the type's grid")
    return codes.astype(np.uint8).reshape(rows, -1)


def _grid16_d(blocks: np.ndarray, qtype: GT) -> np.ndarray:
    """IQ2_XS / IQ2_S / IQ1_M super-block scales d, float16 [rows, nsup, 1] (IQ1_M's from the
    top nibbles of its four scale words)."""
    if qtype != GT.IQ1_M:
        return np.ascontiguousarray(blocks[..., 0:2]).view(np.float16)
    words = np.ascontiguousarray(blocks[..., 48:56]).view(np.uint16)  # [rows, nsup, 4]
    nib = (words & np.uint16(0xF000)) >> np.array([12, 8, 4, 0], np.uint16)
    return np.bitwise_or.reduce(nib, axis=-1, keepdims=True).view(np.float16)


def _grid16_scale_codes(blocks: np.ndarray, qtype: GT) -> np.ndarray:
    """Their odd scale codes 2s + 1 per 16 values, in order: uint8 [rows, nsup, 16]."""
    if qtype == GT.IQ1_M:  # 3 bits each at 0, 3, 6, 9 of four uint16
        words = np.ascontiguousarray(blocks[..., 48:56]).view(np.uint16)
        s = (words[..., None] >> np.array([0, 3, 6, 9], np.uint16)) & 7
    else:  # a nibble each, low first, of 8 bytes at 66 (IQ2_XS) or 74 (IQ2_S)
        at = 66 if qtype == GT.IQ2_XS else 74
        s = (blocks[..., at : at + 8, None] >> np.array([0, 4], np.uint8)) & 15
    return (2 * s + 1).astype(np.uint8).reshape(*blocks.shape[:2], 16)


def _grid16_codes(blocks: np.ndarray, qtype: GT) -> np.ndarray:
    """IQ2_XS / IQ2_S / IQ1_M table indices straight from their bits, as gguf-py's
    dequantization orders the values: uint8 [rows, K] (a gather per grid entry of 8)."""
    rows, nsup = blocks.shape[:2]
    if qtype == GT.IQ1_M:  # 32 grid bytes, then a nibble per entry: 3 high index bits and
        nib = blocks[..., 32:48, None] >> np.array([0, 4], np.uint8)  # the delta's sign
        nib = nib.reshape(rows, nsup, 32)
        idx = blocks[..., 0:32].astype(np.uint16) | (nib & 7).astype(np.uint16) << 8
        plus = (nib & 8) == 0  # delta +1/8 -> grid point 8 g + 1
        return (2 * _grid_levels(qtype)[idx] + plus[..., None]).astype(np.uint8).reshape(rows, -1)
    if qtype == GT.IQ2_XS:  # per 8 values a uint16: a 9-bit index, a 7-bit sign index
        qs = np.ascontiguousarray(blocks[..., 2:66]).view(np.uint16)  # [rows, nsup, 32]
        idx, signs = qs & np.uint16(511), _ksigns()[qs >> 9]
    else:  # IQ2_S: 32 low index bytes, 32 sign bytes, 8 bytes of 2 high bits per entry
        high = (blocks[..., 66:74, None] >> np.array([0, 2, 4, 6], np.uint8)) & 3
        idx = (
            blocks[..., 2:34].astype(np.uint16)
            | high.reshape(rows, nsup, 32).astype(np.uint16) << 8
        )
        signs = blocks[..., 34:66]
    return _entry_codes(qtype, 3)[idx, signs].view(np.uint8).reshape(rows, -1)


def parse_grid16(blocks: np.ndarray, qtype: GT):
    """IQ2_XS / IQ2_S / IQ1_M blocks [rows, nsup, type_size] -> (codes [rows, K] u8: indices
    into table_of(qtype), scale codes int8 [rows, K/16] (2s + 1, natural order), None, 3,
    sup = the file's d float16 [rows, K/256, 1]): value = sup * code / 8 * point, exactly
    gguf-py's (the codes from the grids' and signs' bits: _grid16_codes)."""
    rows, nsup = blocks.shape[:2]
    sup = _grid16_d(blocks, qtype)
    sc = _grid16_scale_codes(blocks, qtype)
    return (
        _grid16_codes(blocks, qtype),
        sc.view(np.int8).reshape(rows, -1),
        None,
        3,
        sup.reshape(rows, nsup, 1),
    )
