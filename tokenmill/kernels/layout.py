"""The lane order of packed codes: the column permutation the native kernels read.

The C side (kernels/linear.c) documents it; this is its one Python copy. Full groups of
`gb` blocks (the loaded library's vector width in 32-bit lanes: kernels.group_blocks())
interleave four values of each block per lane; the tail blocks stay in natural order.
Packing happens at load, for the host; QuantLinear repacks if a library of another
width is loaded later.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import lru_cache

import numpy as np
import torch

QK = 32  # values per block


@lru_cache(maxsize=64)
def lane_perm(k: int, gb: int) -> np.ndarray:
    """perm[p] = natural column of lane-order position p, for rows of k values and
    groups of gb blocks.

    Full groups: block kb, value j = 4i + t of group g sits at p = g*32gb + i*4gb +
    kb*4 + t. The tail (k/32 % gb blocks) stays in natural order.
    """
    nfull = k // QK // gb
    # natural index within a group, shaped [kb, i, t] -> lane order [i, kb, t]
    group = np.arange(gb * QK).reshape(gb, 8, 4).transpose(1, 0, 2).reshape(-1)
    full = (np.arange(nfull)[:, None] * gb * QK + group).reshape(-1)
    return np.concatenate([full, np.arange(full.size, k)]).astype(np.int64)


@lru_cache(maxsize=64)
def nibble_cols(k: int, gb: int) -> tuple[np.ndarray, np.ndarray]:
    """(lo, hi): natural columns of the low and high nibble of each 4-bit code byte.

    Full group (vectors of v = 4gb bytes): byte c*v + r holds lane positions
    (2c)*v + r (low) and (2c+1)*v + r (high).
    Tail chunk of n values (64, or 32 for a last single block) starting at value o:
    byte r holds values o + r (low) and o + n/2 + r (high).
    """
    perm = lane_perm(k, gb)
    nfull, v, gw = k // QK // gb, 4 * gb, QK * gb
    pos = np.arange(gw // 2)
    c, r = pos // v, pos % v
    lo = [perm[g * gw + 2 * c * v + r] for g in range(nfull)]
    hi = [perm[g * gw + (2 * c + 1) * v + r] for g in range(nfull)]
    for o in range(nfull * gw, k, 64):
        half = min(64, k - o) // 2
        lo.append(o + np.arange(half))
        hi.append(o + half + np.arange(half))
    return np.concatenate(lo).astype(np.int64), np.concatenate(hi).astype(np.int64)


@lru_cache(maxsize=64)
def unpack_index(k: int, bits: int, gb: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(byte, shift) per natural column: code = (codes[:, byte] >> shift) & mask."""
    if bits == 8:
        inv = np.empty(k, dtype=np.int64)
        inv[lane_perm(k, gb)] = np.arange(k)
        return torch.from_numpy(inv), torch.zeros(k, dtype=torch.uint8)
    lo, hi = nibble_cols(k, gb)
    byte = np.empty(k, dtype=np.int64)
    shift = np.empty(k, dtype=np.uint8)
    byte[lo], shift[lo] = np.arange(k // 2), 0
    byte[hi], shift[hi] = np.arange(k // 2), 4
    return torch.from_numpy(byte), torch.from_numpy(shift)


def pack_codes(nat: np.ndarray, bits: int, gb: int) -> np.ndarray:
    """Natural-order codes uint8 [rows, K] (< 16 for 4-bit) -> lane order for groups of gb."""
    k = nat.shape[1]
    if bits == 8:  # (C order: numpy may lay a fancy-indexed result out column-major)
        return np.ascontiguousarray(nat[:, lane_perm(k, gb)])
    lo, hi = nibble_cols(k, gb)
    return np.ascontiguousarray(nat[:, lo] | (nat[:, hi] << 4))


# 5- and 6-bit codes (GGUF Q5_0/Q5_1/Q5_K, Q6_K): rows of whole groups, each the low 4
# bits as a 4-bit group followed by the top bits; 3- and 2-bit codes (Q3_K, Q2_K): bit
# planes alone (linear.c)


def _vectors6(k: int, gb: int) -> tuple[int, int]:
    if k % (QK * gb):
        raise ValueError(
            f"2-, 3-, 5- and 6-bit rows need whole groups: {k} is not a multiple of {QK * gb}"
        )
    return k // (QK * gb), 4 * gb  # groups per row, bytes per vector


def pack_wide(nat: np.ndarray, bits: int, gb: int) -> np.ndarray:
    """Natural-order 5- or 6-bit codes uint8 [rows, K] -> [rows, K*bits/8]: per group of gb
    blocks, vectors 2c and 2c+1 in the low and high nibbles of GW/2 bytes, then the t =
    bits - 4 top bits in t vectors: top vector h holds vector (8/t) h + s at bits t s
    (5-bit: vector i's bit at bit i; 6-bit: vectors 4h + s at bits 2s)."""
    rows, k = nat.shape
    ng, v = _vectors6(k, gb)
    t = bits - 4
    lanes = nat[:, lane_perm(k, gb)].reshape(rows, ng, 8, v)
    lo, hi = lanes & 15, (lanes >> 4).reshape(rows, ng, t, 8 // t, v)
    nib = lo[:, :, 0::2] | (lo[:, :, 1::2] << 4)  # [rows, ng, 4, v]
    top = np.zeros((rows, ng, t, v), np.uint8)
    for s in range(8 // t):
        top |= hi[:, :, :, s] << (t * s)
    return np.ascontiguousarray(np.concatenate([nib, top], axis=2).reshape(rows, k * bits // 8))


def unpack_wide(codes: np.ndarray, k: int, bits: int, gb: int) -> np.ndarray:
    """The inverse of pack_wide: natural-order codes uint8 [rows, k]."""
    rows = codes.shape[0]
    ng, v = _vectors6(k, gb)
    t = bits - 4
    g = codes.reshape(rows, ng, bits, v)
    lanes = np.empty((rows, ng, 8, v), dtype=np.uint8)
    lanes[:, :, 0::2], lanes[:, :, 1::2] = g[:, :, :4] & 15, g[:, :, :4] >> 4
    for s in range(8 // t):  # vectors s, 8/t + s, ...: top vectors 0, 1, ...
        lanes[:, :, s :: 8 // t] |= ((g[:, :, 4:] >> (t * s)) & ((1 << t) - 1)) << 4
    nat = np.empty((rows, k), dtype=np.uint8)
    nat[:, lane_perm(k, gb)] = lanes.reshape(rows, k)
    return nat


def partial_group(k: int, gb: int) -> tuple[int, int]:
    """(values in whole groups, the last partial group's blocks or 0) of a row of k values
    (a multiple of 32): a row that is not whole groups of gb blocks ends in its k / 32 % gb
    blocks, laid out as a whole group of that many blocks (linear.c)."""
    full = k // (QK * gb) * QK * gb
    return full, (k - full) // QK


def _by_groups(bits: int) -> tuple[Callable, Callable]:
    """pack(nat, gb) and unpack(codes, k, gb) of `bits`-bit codes (pack_wide's 5 and 6,
    _pack_planes' 2 and 3) for whole groups, extended to a row's last partial group: its
    values packed as a group of its own, after the whole ones."""
    wide = bits >= 5

    def pack(nat: np.ndarray, gb: int) -> np.ndarray:
        return pack_wide(nat, bits, gb) if wide else _pack_planes(nat, bits, gb)

    def unpack(codes: np.ndarray, k: int, gb: int) -> np.ndarray:
        return unpack_wide(codes, k, bits, gb) if wide else _unpack_planes(codes, k, bits, gb)

    def pack_row(nat: np.ndarray, gb: int) -> np.ndarray:
        full, part = partial_group(nat.shape[1], gb)
        if not part:
            return pack(nat, gb)
        parts = ([pack(nat[:, :full], gb)] if full else []) + [pack(nat[:, full:], part)]
        return np.ascontiguousarray(np.concatenate(parts, axis=1))

    def unpack_row(codes: np.ndarray, k: int, gb: int) -> np.ndarray:
        full, part = partial_group(k, gb)
        if not part:
            return unpack(codes, k, gb)
        at = full * bits // 8
        tail = unpack(codes[:, at:], k - full, part)
        return np.concatenate([unpack(codes[:, :at], full, gb), tail], axis=1) if full else tail

    return pack_row, unpack_row


pack6, unpack6 = _by_groups(6)
pack5, unpack5 = _by_groups(5)


def _pack_planes(nat: np.ndarray, bits: int, gb: int) -> np.ndarray:
    """Natural-order 2- or 3-bit codes uint8 [rows, K] -> [rows, K*bits/8], per group of gb
    blocks, as linear.c reads them. 2-bit: two vectors of pairs (vector h holds code vector
    4h + s at bits 2s). 3-bit: three planes of whole codes (simd.h tm_plane3): vectors 0, 1
    and 2's low two bits at bits 0-2, 3-5, 6-7 of plane 0, 3, 4 and 5's of plane 1, 6 and 7
    at bits 0-2, 3-5 of plane 2 with the top bits of 2 and 5 at 6 and 7."""
    rows, k = nat.shape
    ng, v = _vectors6(k, gb)
    q = nat[:, lane_perm(k, gb)].reshape(rows, ng, 8, v).astype(np.uint8)
    planes = np.zeros((rows, ng, bits, v), np.uint8)
    if bits == 2:
        pairs = (q & 3).reshape(rows, ng, 2, 4, v)
        for s in range(4):
            planes |= pairs[:, :, :, s] << (2 * s)
    else:
        q = q & 7
        for j in range(2):
            planes[:, :, j] = (
                q[:, :, 3 * j] | q[:, :, 3 * j + 1] << 3 | (q[:, :, 3 * j + 2] & 3) << 6
            )
        planes[:, :, 2] = (
            q[:, :, 6] | q[:, :, 7] << 3 | (q[:, :, 2] >> 2) << 6 | (q[:, :, 5] >> 2) << 7
        )
    return np.ascontiguousarray(planes.reshape(rows, k * bits // 8))


def _unpack_planes(codes: np.ndarray, k: int, bits: int, gb: int) -> np.ndarray:
    """The inverse of _pack_planes: natural-order codes uint8 [rows, k]."""
    rows = codes.shape[0]
    ng, v = _vectors6(k, gb)
    g = codes.reshape(rows, ng, bits, v)
    lanes = np.empty((rows, ng, 8, v), dtype=np.uint8)
    if bits == 2:
        for i in range(8):
            lanes[:, :, i] = (g[:, :, i // 4] >> (2 * (i % 4))) & 3
    else:
        for j in range(2):
            lanes[:, :, 3 * j] = g[:, :, j] & 7
            lanes[:, :, 3 * j + 1] = (g[:, :, j] >> 3) & 7
        lanes[:, :, 6], lanes[:, :, 7] = g[:, :, 2] & 7, (g[:, :, 2] >> 3) & 7
        lanes[:, :, 2] = g[:, :, 0] >> 6 | ((g[:, :, 2] >> 4) & 4)
        lanes[:, :, 5] = g[:, :, 1] >> 6 | ((g[:, :, 2] >> 5) & 4)
    nat = np.empty((rows, k), dtype=np.uint8)
    nat[:, lane_perm(k, gb)] = lanes.reshape(rows, k)
    return nat


pack2, unpack2 = _by_groups(2)
pack3, unpack3 = _by_groups(3)


@lru_cache(maxsize=64)
def half_scale_perm(k: int, gb: int) -> np.ndarray:
    """perm[p] = natural index (2 * block + half) of the 16-value scale stored at p: per
    group, the first halves of its gb blocks, then the second halves (a last partial
    group: its blocks' first halves, then their second)."""
    full, part = partial_group(k, gb)
    if part:
        rest = half_scale_perm(k - full, part) + full // 16
        return np.concatenate([half_scale_perm(full, gb), rest]) if full else rest
    ng, _ = _vectors6(k, gb)
    idx = np.arange(ng * gb * 2).reshape(ng, gb, 2).transpose(0, 2, 1)
    return idx.reshape(-1).astype(np.int64)


# ---- the grid i-quants' own bits (linear.c: bits TM_GRID8 / TM_GRID9) -------------------
# A block's record in natural order: its 8 low grid-index bytes (index i: values 4i..4i+3),
# with 9-bit indices a byte whose bit i is index i's 9th, then its 32 sign bits (uint32,
# bit v: value v is negative). 12 or 13 bytes, the kernels' `bits`.


def _grid_groups(rec: np.ndarray) -> np.ndarray:
    """Records [..., G, B] of groups of G blocks -> their lane-order bytes [..., G * B]:
    per vector i its G index bytes, then the G 9th-bit bytes, then per vector i the sign
    nibbles i of the G blocks, two blocks to a byte (block 2m low, 2m + 1 high)."""
    g, b = rec.shape[-2:]
    hi = b - 12
    idx = rec[..., :8].swapaxes(-1, -2)  # [..., 8, G]
    sb = rec[..., 8 + hi :]  # [..., G, 4]
    nib = np.stack([sb & 15, sb >> 4], axis=-1).reshape(*rec.shape[:-2], g, 8).swapaxes(-1, -2)
    pairs = nib.reshape(*nib.shape[:-1], g // 2, 2)
    signs = pairs[..., 0] | (pairs[..., 1] << 4)  # [..., 8, G/2]
    lead = rec.shape[:-2]
    parts = (
        [idx.reshape(*lead, 8 * g)] + ([rec[..., 8]] if hi else []) + [signs.reshape(*lead, 4 * g)]
    )
    return np.concatenate(parts, axis=-1)


def _grid_records(codes: np.ndarray, g: int, b: int) -> np.ndarray:
    """The inverse of _grid_groups: bytes [..., G * B] -> records [..., G, B]."""
    hi = b - 12
    lead = codes.shape[:-1]
    idx = codes[..., : 8 * g].reshape(*lead, 8, g).swapaxes(-1, -2)
    signs = codes[..., (8 + hi) * g :].reshape(*lead, 8, g // 2)
    nib = np.stack([signs & 15, signs >> 4], axis=-1).reshape(*lead, 8, g).swapaxes(-1, -2)
    pairs = nib.reshape(*lead, g, 4, 2)
    sb = pairs[..., 0] | (pairs[..., 1] << 4)  # [..., G, 4]
    parts = [idx] + ([codes[..., 8 * g : 9 * g, None]] if hi else []) + [sb]
    return np.concatenate(parts, axis=-1)


def pack_grid(rec: np.ndarray, gb: int) -> np.ndarray:
    """Natural-order block records uint8 [rows, nb, B] (B 12 or 13) -> the kernels' bytes
    [rows, nb * B]: per group of gb blocks (a last partial one of its blocks) _grid_groups."""
    rows, nb, b = rec.shape
    full = nb // gb * gb
    out = [_grid_groups(rec[:, :full].reshape(rows, full // gb, gb, b)).reshape(rows, -1)]
    if full < nb:
        out.append(_grid_groups(rec[:, full:]))
    return np.ascontiguousarray(np.concatenate(out, axis=-1))


def unpack_grid(codes: np.ndarray, k: int, b: int, gb: int) -> np.ndarray:
    """The inverse of pack_grid: records uint8 [rows, k / 32, b] in natural order."""
    rows, nb = codes.shape[0], k // QK
    full = nb // gb * gb
    out = [
        _grid_records(codes[:, : full * b].reshape(rows, full // gb, gb * b), gb, b).reshape(
            rows, full, b
        )
    ]
    if full < nb:
        out.append(_grid_records(codes[:, full * b :], nb - full, b))
    return np.concatenate(out, axis=1)


# ---- 3-bit codes' scales: 6-bit codes, as the file has them (tm.h scale6_group) ----------


def _groups_of(k: int, gb: int) -> list[tuple[int, int, int]]:
    """(first block, groups, blocks per group) of a row of k values: its whole groups of gb
    blocks, then its last partial one (layout's partial_group)."""
    full, part = partial_group(k, gb)
    out = [(0, full // QK // gb, gb)] if full else []
    return out + ([(full // QK, 1, part)] if part else [])


def pack_scales6(sc: np.ndarray, k: int, gb: int) -> np.ndarray:
    """3-bit codes' scales int8 [rows, k / 16] in natural order (sub-block 2 b + h: block b,
    half h; -32..31) -> the kernels' uint8 [rows, k * 3 / 64]: per group of G blocks (a last
    partial one: its blocks) G bytes of the codes' (scale + 32) low nibbles, block k's half
    h at bits 4 h, then G / 2 bytes of their top pairs, block k's at bits 4 (k & 1) + 2 h."""
    rows = sc.shape[0]
    c = (sc.astype(np.int16) + 32).astype(np.uint8).reshape(rows, -1, 2)  # [rows, nb, half]
    lo = (c[..., 0] & 15) | ((c[..., 1] & 15) << 4)
    top = (c[..., 0] >> 4) | ((c[..., 1] >> 4) << 2)
    out = []
    for b0, ng, g in _groups_of(k, gb):
        lg = lo[:, b0 : b0 + ng * g].reshape(rows, ng, g)
        tg = top[:, b0 : b0 + ng * g].reshape(rows, ng, g)
        out.append(np.concatenate([lg, tg[..., 0::2] | (tg[..., 1::2] << 4)], -1).reshape(rows, -1))
    return np.ascontiguousarray(np.concatenate(out, -1))


def unpack_scales6(raw: np.ndarray, k: int, gb: int) -> np.ndarray:
    """The inverse of pack_scales6: int8 [rows, k / 16] in natural order."""
    rows, out, at = raw.shape[0], [], 0
    for _, ng, g in _groups_of(k, gb):
        part = raw[:, at : at + ng * g * 3 // 2].reshape(rows, ng, g * 3 // 2)
        at += ng * g * 3 // 2
        lo, hi = part[..., :g], part[..., g:]
        top = np.stack([hi & 15, hi >> 4], -1).reshape(rows, ng, g)
        c0 = (lo & 15) | ((top & 3) << 4)
        c1 = (lo >> 4) | (((top >> 2) & 3) << 4)
        out.append(np.stack([c0, c1], -1).reshape(rows, ng * g * 2))
    return (np.concatenate(out, -1).astype(np.int16) - 32).astype(np.int8)
