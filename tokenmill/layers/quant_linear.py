"""Weight-only quantized linear layers that keep GGUF weights compressed in memory.

Decode on CPU is memory-bound: every token reads every weight once. Dequantizing a
Q4_1 file to float32 at load time makes each token read 7x more bytes than the file
holds. QuantLinear keeps the 4/8-bit codes and the native kernels multiply them
directly (how a forward pass runs: layers/native_linear.py). Activations are quantized
per 32-block to int16 (act_bits=16, the default) or int8 (act_bits=8, llama.cpp's q8
scheme) for the decode kernel.

Packed format (see tokenmill/kernels/linear.c for the lane order of the codes):

    w = d * (c - Z) + m       per block of 32 values of a row
    codes  uint8 [N, K/2] (4-bit) or [N, K] (8-bit), lane order for `group_blocks`
           blocks per group (the loaded kernel library's vector width; repacked if a
           library of another width is loaded later)
    scales float16 or float32 [N, K/32] (or MXFP4's exponent bytes);  mins: same, or None
           (then Z = 8 or 128);
           or, for GGUF K-quants, as the file has them: a uint8 code per block (6 bits)
           times a float16 per 256 values (`dsup`, `msup` [N, K/256]): 18.5 bytes per 32
           4-bit values like the file's 18, where float32 scales would make 24

GGUF types and how they map (exact = identical values to gguf.quants.dequantize):
    Q4_0  4-bit, Z=8, f16 scales                 exact, 18 bytes / 32 values
    Q4_1  4-bit, f16 scales + mins               exact, 20 B / 32
    Q4_K  4-bit, K-quant scales + mins            exact, 18.5 B / 32 (file: 18)
    Q8_0  8-bit, Z=128, f16 scales               exact, 34 B / 32
    Q5_0  5-bit, Z=16, f16 scales                exact, 22 B / 32 (file: 22)
    Q5_1  5-bit, f16 scales + mins               exact, 24 B / 32 (file: 24)
    Q5_K  5-bit, K-quant scales + mins            exact, 22.5 B / 32 (file: 22)
          (5-bit codes: codes [N, K*5/8] in lane-order groups, a row that is not whole
          groups, e.g. Qwen2.5's 896 on AVX-512, ending in a partial one)
    Q6_K  6-bit, Z=32, an int8 scale per 16       exact, 26.25 B / 32 (file: 26.25):
          values times a float16 per 256          codes [N, K*3/4], scales int8 [N, K/16]
                                                  (kernels/linear.c has the layout)
    Q3_K  3-bit, Z=4, the file's 6-bit scale     exact, 13.75 B / 32 (file: 13.75):
          codes (scale + 32) per 16 values, d per   codes [N, K*3/8] (three planes of
          256                                       whole codes; Q6_K's form, 3-bit dots),
                                                    scales uint8 [N, K*3/64]
                                                    (layout.pack_scales6)
    Q2_K  2-bit, a scale and a min per 16 values  exact, 10.5 B / 32 (file: 10.5): codes
          as the file's bytes (sc + 16 m) times     [N, K/4] (two planes of pairs), scales
          d and dmin per 256                        uint8 [N, K/16]; Q6_K's form, 3-bit
                                                    dots
    Without the native kernels IQ2_XS, IQ2_S, IQ1_M, Q2_K, Q3_K and Q6_K: requantized to
          8-bit Z=128 with a per-32 f16 scale (as Q8_0 would): the added error is at most
          max|w_block| / 254 per value, about a quarter of Q6_K's own step.
    IQ3_S, IQ3_XXS (grid points times a scale per 32, 16 points): 4-bit codes into a table
          of the type's signed grid points (gguf_blocks.GRID_VALUES); the scales d (2s + 1)
          / 2^n as the odd code byte under the file's f16 d per 256 (IQ4_XS's form, read
          times 2^-n: `sup_shift`): exact, 17.25 B / 32. With TOKENMILL_GRID_FILE_BITS=1
          (and the native kernels) their own bits instead (bits 13 and 12: bytes per block,
          the kernels' grid kinds, layout.pack_grid): per block 8 grid indices (IQ3_S: and
          their 9th bits), 32 sign bits, s as a nibble, under the file's d; `lut` holds the
          grid (its magnitudes + 128): exact, IQ3_S 13.75 B / 32 (file: 13.75), IQ3_XXS
          12.75 (file: 12.25: its 7-bit sign indices as 8 signs). Smaller, but a gather per
          4 values makes decode slower than the 4-bit codes' lookups (GRID_FILE_BITS_ENV).
    IQ2_XXS, IQ2_XS, IQ2_S, IQ1_S, IQ1_M, TQ1_0, TQ2_0 (at most 8 points, a scale per 32 or
          16): 3-bit codes into a table of their points, in Q3_K's form (three planes,
          looked up in registers), under Q3_K's 6-bit scale codes per 16 values (a
          scale per 32 twice) and the file's f16 d per 256 (read times 2^-n): exact, 13.75
          B / 32.
    IQ4_NL, IQ4_XS, MXFP4 (4-bit codes into a 16-value table: `lut`, the values + 128):
          4-bit codes as stored, looked up to 8-bit ones in registers, Z=128; exact.
          IQ4_NL f16 scales: 18 B / 32 (file: 18); IQ4_XS its 6-bit scale codes as bytes
          times a f16 per 256 (d * (code - 32): `scale_zero`): 17.25 B / 32 (file: 17);
          MXFP4 its E8M0 exponent bytes as they are (2^(e - 128), the kernels' E8M0
          form) where every block's is a normal float32 (e in [2, 254]: 17 B / 32, the
          file's), else f32 (20 B / 32: its scales reach 2^-128).
"""

from __future__ import annotations

import os
from collections.abc import Callable

import numpy as np
import torch
from gguf import GGMLQuantizationType as GT
from gguf.constants import GGML_QUANT_SIZES
from gguf.quants import dequantize as gguf_dequantize

from tokenmill import kernels
from tokenmill.kernels import PREFILL_MIN_T  # re-exported: the tests' and benchmarks' name
from tokenmill.kernels.layout import (
    QK,
    half_scale_perm,
    pack2,
    pack3,
    pack5,
    pack6,
    pack_codes,
    pack_grid,
    pack_scales6,
    unpack2,
    unpack3,
    unpack5,
    unpack6,
    unpack_grid,
    unpack_index,
    unpack_scales6,
)
from tokenmill.layers.native_linear import NativeLinear
from tokenmill.loader.gguf_blocks import (
    EXACT_GGUF_TYPES,
    GRID16_VALUES,
    GRID_GGUF_TYPES,
    GRID_OWN_BITS,
    GRID_SCALE_SHIFT,
    QUANT_GGUF_TYPES,
    REQUANT_GGUF_TYPES,
    TABLE_GGUF_TYPES,
    TABLE_SCALE_ZERO,
    grid_table,
    mxfp4_scales_fit_byte,
    parse_exact,
    parse_grid,
    parse_grid16,
    parse_grid_own,
    parse_q2_k,
    parse_q3_k,
    parse_q6_k,
    parse_table,
    table_of,
)

__all__ = [
    "QuantLinear", "PREFILL_MIN_T", "EXACT_GGUF_TYPES", "REQUANT_GGUF_TYPES", "TABLE_GGUF_TYPES",
    "QUANT_GGUF_TYPES",
]  # fmt: skip


# Activation precision of the decode kernel: 16 (two byte-plane dot passes, ~1.3x the arithmetic,
# ~3-6% slower when streaming weights from memory) or 8 (llama.cpp's q8 scheme). On
# SmolLM2, 8-bit moves logits by up to ~3 and flips greedy tokens within 10-20 steps;
# 16-bit by ~0.01. Per layer: the `act_bits` attribute.
DEFAULT_ACT_BITS = 16

# plain scales' storage: float16 and float32 as their bits; MXFP4's E8M0 exponent bytes as
# they are (uint8 without sup: 2^(e - 128), kernels' TM_SCALE_E8M0)
_RAW = {torch.float16: torch.int16, torch.float32: torch.int32, torch.uint8: torch.uint8}
_FLOAT = {raw: f for f, raw in _RAW.items()}

# ----------------------------------------------------------------------------------
# float -> packed quantization (HF checkpoints, and requantized GGUF types)
# ----------------------------------------------------------------------------------


def _quantize_rows(w: torch.Tensor | np.ndarray, scheme: str):
    """w float32 [rows, K] -> (natural codes u8 [rows, K], f16 scales, f16 mins|None, bits,
    None: no K-quant super-block scales).

    q8: symmetric, d = max|w| / 127 (Q8_0). q4: asymmetric, d = (max - min) / 15,
    m = min (Q4_1). Codes are rounded against the float16-rounded d and m, so the
    stored values are the closest the format can hold to w.
    """
    rows, k = w.shape
    if scheme == "q8":
        # numpy only, single-threaded: torch's 2-thread ops stall for milliseconds each
        # when the other core is busy (a shared machine's load: ~10x slower per Q6_K
        # expert). The same IEEE float32 ops as torch's abs/amax/div/half/reciprocal, and
        # rint rounds half to even like torch.round: bit-identical codes and scales
        b = np.asarray(w.detach().numpy() if isinstance(w, torch.Tensor) else w)
        b = b.reshape(rows, k // QK, QK)
        with np.errstate(over="ignore", divide="ignore"):  # as torch: inf, no warning
            d = (np.abs(b).max(-1) / np.float32(127)).astype(np.float16)  # [rows, K/32]
            inv = np.where(d == 0, np.float32(0), np.float32(1) / d.astype(np.float32))
        q = b * inv[..., None]  # one float32 temporary, rounded in place
        np.rint(q, out=q)
        np.clip(q, -127, 127, out=q)
        q += 128
        return q.astype(np.uint8).reshape(rows, k), d, None, 8, None
    b = w.reshape(rows, k // QK, QK)
    if scheme == "q4":
        lo, hi = b.amin(-1), b.amax(-1)
        m = lo.half()
        d = ((hi - m.float()) / 15).half()
        inv = torch.where(d == 0, 0.0, 1.0 / d.float())
        q = torch.round((b - m.float()[..., None]) * inv[..., None]).clamp(0, 15)
        return q.to(torch.uint8).reshape(rows, k).numpy(), d.numpy(), m.numpy(), 4, None
    raise ValueError(f"unknown scheme {scheme!r} (use 'q8' or 'q4')")


def _dequantize_q6_k(blocks: np.ndarray) -> np.ndarray:
    """Q6_K blocks [rows, nsup, 210] -> float32 [rows, K], gguf.quants.dequantize's values
    bit for bit: its ops (d * sub-scale in float32, times the code - 32), on the whole
    array at once instead of 16 rows at a time through hsplit views."""
    q, sc, _, _, d = parse_q6_k(blocks)  # codes 0..63 [rows, K], int8 [rows, K/16], f16
    rows = q.shape[0]
    scale = d.astype(np.float32) * sc.reshape(rows, -1, 16).astype(np.float32)
    w = q.reshape(rows, -1, 16, 16).astype(np.float32)  # [rows, nsup, 16 sub-blocks, 16]
    w -= 32
    w *= scale[..., None]
    return w.reshape(rows, -1)


def _alloc(parsed: tuple, rows: int, in_features: int) -> tuple[int, dict]:
    """(bits, {codes, scales, mins?, sup?}): empty packed arrays for `rows` rows of the
    format a parse returned (parse(...) -> natural codes, scales, mins, bits, sup)."""
    _, sc, mn, bits, su = parsed
    arrays = {
        "codes": np.empty((rows, _code_bytes(in_features, bits)), np.uint8),
        "scales": np.empty((rows, sc.shape[1]), sc.dtype)
        if bits != 3
        else np.empty((rows, in_features * 3 // 64), np.uint8),  # 6-bit codes
    }
    if mn is not None:
        arrays["mins"] = np.empty((rows, sc.shape[1]), sc.dtype)
    if su is not None:
        arrays["sup"] = np.empty((rows, in_features // 256, su.shape[-1]), np.float16)
    return bits, arrays


# File bytes the native packer takes at a time from a big tensor, each chunk's pages
# released before the next (QuantLinear.from_gguf's release)
PACK_CHUNK_BYTES = 32 << 20
# GGUF types the native packer (kernels.pack_gguf) writes, and their code bits (5 and 6:
# on rows of whole lane groups, else 8)
_NATIVE_BITS = {
    GT.Q4_0: 4,
    GT.Q4_1: 4,
    GT.Q4_K: 4,
    GT.Q8_0: 8,
    GT.Q5_0: 5,
    GT.Q5_1: 5,
    GT.Q5_K: 5,
    GT.Q6_K: 6,
    GT.IQ4_NL: 4,
    GT.MXFP4: 4,
    GT.Q3_K: 3,
    GT.Q2_K: 2,
}  # fmt: skip
_FIVE = (GT.Q5_0, GT.Q5_1, GT.Q5_K)
_GRID_BITS = (12, 13)  # the grid kinds (IQ3_XXS, IQ3_S): their bytes per block of 32


def _code_bytes(k: int, bits: int) -> int:
    """Bytes of packed codes per row of k values."""
    return k // QK * bits if bits in _GRID_BITS else k * bits // 8


_SIXTEEN = (2, 3, 6)  # code bits with a scale per 16 values: Q2_K's, Q3_K's, Q6_K's forms
_OWN_SIXTEEN = {GT.Q6_K: parse_q6_k, GT.Q3_K: parse_q3_k, GT.Q2_K: parse_q2_k}
_SIXTEEN_CODES = {2: (pack2, unpack2, 0), 3: (pack3, unpack3, 4), 6: (pack6, unpack6, 32)}


# TOKENMILL_GRID_FILE_BITS=1: hold IQ3_S and IQ3_XXS at their file's bits (GRID_OWN_BITS).
# Not the default: decoding them reads a grid entry per 4 values by a gather, which costs
# more than the bytes it saves (vpgatherdd: ~30 cycles per 16 entries on Zen 4, IQ3_S
# decode 12 tok/s at the 1B shape against 43 with 4-bit table codes; docs/performance.md).
GRID_FILE_BITS_ENV = "TOKENMILL_GRID_FILE_BITS"


def _grid_file_bits() -> bool:
    """Whether IQ3_S and IQ3_XXS load as their file's bits (GRID_FILE_BITS_ENV)."""
    return os.environ.get(GRID_FILE_BITS_ENV, "0") not in ("", "0")


def _own_codes_run(in_features: int) -> bool:
    """Whether the loaded kernels read 2-, 3-, 5- and 6-bit codes in rows of this length:
    any multiple of 32, as whole lane-order groups and a last partial one
    (layout.partial_group); not without the native library."""
    return kernels.library() is not None and in_features % QK == 0


def _as_8bit(qtype: GT, in_features: int) -> bool:
    """Whether a 5- or 6-bit type's rows are packed as 8-bit codes (their own cannot run)."""
    if qtype in _FIVE:
        return not QuantLinear.runs_5bit(in_features)
    return qtype == GT.Q6_K and not QuantLinear.runs_6bit(in_features)


def _alloc_gguf(qtype: GT, rows: int, in_features: int) -> tuple[int, dict]:
    """(bits, {codes, scales, mins?, sup?}): empty packed arrays for `rows` rows of GGUF
    type `qtype`, as _alloc gives for its parse (the dtypes of gguf_blocks.parse_*)."""
    bits, k = _NATIVE_BITS[qtype], in_features
    if qtype in _FIVE and _as_8bit(qtype, k):  # the same values as 8-bit codes
        bits = 8
    if qtype == GT.Q6_K and _as_8bit(qtype, k):  # requantized to 8-bit blocks
        bits = 8
        scales = np.empty((rows, k // QK), np.float16)
        return bits, {"codes": np.empty((rows, k), np.uint8), "scales": scales}
    kquant = qtype in (GT.Q4_K, GT.Q5_K, GT.Q6_K)
    arrays = {"codes": np.empty((rows, k * bits // 8), np.uint8)}
    if qtype in _OWN_SIXTEEN:  # parse_q6_k's, parse_q3_k's and parse_q2_k's dtypes
        per16 = {
            GT.Q2_K: (k // 16, np.uint8),
            GT.Q3_K: (k * 3 // 64, np.uint8),
            GT.Q6_K: (k // 16, np.int8),
        }
        arrays["scales"] = np.empty((rows, per16[qtype][0]), per16[qtype][1])
        arrays["sup"] = np.empty((rows, k // 256, 2 if qtype == GT.Q2_K else 1), np.float16)
        return bits, arrays
    byte = kquant or qtype == GT.MXFP4  # K-quant scale codes, MXFP4's exponent bytes
    arrays["scales"] = np.empty((rows, k // QK), np.uint8 if byte else np.float16)
    if qtype in (GT.Q4_1, GT.Q5_1, GT.Q4_K, GT.Q5_K):
        arrays["mins"] = np.empty_like(arrays["scales"])
    if kquant:
        arrays["sup"] = np.empty((rows, k // 256, 2), np.float16)
    return bits, arrays


def _pack_native(qtype: GT, raw: np.ndarray, in_features: int, arrays: dict) -> bool:
    """raw GGUF rows (uint8 [rows, row bytes]) into arrays (_alloc_gguf's, or same-shaped
    views of contiguous rows) by the native packer; False where it does not pack them."""
    return kernels.pack_gguf(
        int(qtype), np.ascontiguousarray(raw), in_features, arrays["codes"], arrays["scales"],
        arrays.get("mins"), arrays.get("sup"),
        as_8bit=_as_8bit(qtype, in_features),
    )  # fmt: skip


def _pack_lanes(nat: np.ndarray, bits: int, gb: int, out: np.ndarray) -> None:
    """layout.pack_codes(nat, bits, gb), written into `out`: natural codes uint8 [..., K]
    -> out uint8 [..., K * bits / 8] (the same leading shape, each row contiguous; a view
    of a bigger buffer is fine). By reshapes of uint32 words, 4 codes each (the 4 values
    of a lane move together): ~10x pack_codes' index gathers on 2048-wide rows."""
    k, lead = nat.shape[-1], nat.shape[:-1]
    nfull = k // (QK * gb)
    full = nfull * QK * gb // 4  # words of natural codes in whole groups
    src = np.ascontiguousarray(nat).view(np.uint32)  # [..., K/4]
    dst = out.view(np.uint32)  # [..., K*bits/32]
    if bits == 8:  # group words [kb, i] -> [i, kb]; the tail stays in natural order
        g = src[..., :full].reshape(*lead, nfull, gb, 8)
        dst[..., :full].reshape((*lead, nfull, 8, gb), copy=False)[...] = g.swapaxes(-1, -2)
        dst[..., full:] = src[..., full:]
        return
    # 4-bit: lane vector i = 2c + h holds word kb of each block; packed vector c holds
    # vector 2c in its low nibbles, 2c + 1 in its high ones (codes < 16: no carry)
    g = src[..., :full].reshape(*lead, nfull, gb, 4, 2)
    d = dst[..., : full // 2].reshape((*lead, nfull, 4, gb), copy=False)
    np.left_shift(g[..., 1].swapaxes(-1, -2), 4, out=d)
    d |= g[..., 0].swapaxes(-1, -2)
    o, b = full, full // 2  # the tail, in words: chunks of 64 values (halves of 8 words)
    while o < k // 4:  # and a last single block of 32 (halves of 4)
        rem = k // 4 - o
        n, half = (rem // 16, 8) if rem >= 16 else (1, 4)
        t = src[..., o : o + n * 2 * half].reshape(*lead, n, 2, half)
        d = dst[..., b : b + n * half].reshape((*lead, n, half), copy=False)
        np.left_shift(t[..., 1, :], 4, out=d)
        d |= t[..., 0, :]
        o, b = o + n * 2 * half, b + n * half


def _store(dst: dict, parsed: tuple, in_features: int, gb: int) -> None:
    """Pack one parse's rows into dst (views of _alloc's arrays over the same rows, in
    row order, of any leading shape): codes in the kernels' lane order."""
    nat, sc, mn, bits, su = parsed
    codes = None
    if bits == 3:  # 6-bit codes per 16 values, as the file's (layout.pack_scales6)
        sc = pack_scales6(sc, in_features, gb)
    elif np.shape(sc)[-1] == in_features // 16:  # per 16 values: the kernels' group order
        sc = sc[:, half_scale_perm(in_features, gb)]
    if bits in _SIXTEEN:
        codes = _SIXTEEN_CODES[bits][0](nat, gb)
    elif bits in _GRID_BITS:  # natural block records [rows, nb, bits]
        codes = pack_grid(nat, gb)
    elif bits == 5:
        codes = pack5(nat, gb)
    else:  # straight into the destination
        out = dst["codes"]
        _pack_lanes(nat.reshape(*out.shape[:-1], in_features), bits, gb, out)
    # numpy copies (single-threaded), not torch slice assignment: see _quantize_rows
    for name, src in (("codes", codes), ("scales", sc), ("mins", mn), ("sup", su)):
        if src is not None:
            out = dst[name]
            np.copyto(out, np.reshape(src, out.shape))


# ----------------------------------------------------------------------------------
# the module
# ----------------------------------------------------------------------------------


class QuantLinear(NativeLinear):
    """y = x W^T + b with W held in the packed 4/8-bit format above.

    The packed tensors are buffers (saved by state_dict, not parameters); `act_bits`
    (8 or 16) picks the decode kernel's activation precision (DEFAULT_ACT_BITS at
    construction). The rest of the interface: NativeLinear.
    """

    packed = True

    def __init__(
        self,
        codes: torch.Tensor,
        scales: torch.Tensor,
        mins: torch.Tensor | None,
        bits: int,
        in_features: int,
        out_features: int,
        bias: torch.Tensor | None = None,
        group_blocks: int | None = None,
        sup: torch.Tensor | None = None,
    ):
        """sup: K-quant super-block scales (d, dmin) float16 [out, in/256, 2], with scales
        and mins their uint8 codes per block; None: scales and mins are float. 6-bit codes
        (Q6_K): scales int8 [out, in/16] in the kernels' group order, sup d [out, in/256, 1]."""
        super().__init__(in_features, out_features, bias)
        if in_features % QK or bits not in (2, 3, 4, 5, 6, 8, *_GRID_BITS):
            raise ValueError(f"need in_features % {QK} == 0 and bits in (2, 3, 4, 5, 6, 8, 12, 13)")
        if bits in _GRID_BITS and (in_features % 256 or sup is None or mins is not None):
            raise ValueError(
                "grid codes (bits 12, 13) need in_features % 256 == 0, sup and no mins"
            )
        shape = (out_features, _code_bytes(in_features, bits))
        if codes.shape != shape or codes.dtype != torch.uint8:
            raise ValueError(f"codes: expected uint8 {shape}")
        # values per scale (grid kinds: a nibble per 32, two to a byte)
        per = 16 if bits in _SIXTEEN else 2 * QK if bits in _GRID_BITS else QK
        # (3-bit codes: 6-bit codes per 16 values, 12 bytes per 256: layout.pack_scales6)
        n_scales = in_features * 3 // 64 if bits == 3 else in_features // per
        if scales.shape != (out_features, n_scales):
            raise ValueError(f"scales: expected shape {(out_features, n_scales)}")
        if sup is None and scales.dtype not in _RAW:
            raise ValueError(f"scales must be float16, float32 or uint8 (E8M0), got {scales.dtype}")
        # sup's columns: d and dmin, or d alone (6-bit codes, and scale codes without mins)
        # (2-bit: d and dmin, its scale bytes holding a scale and a min code each)
        nsup = 2 if bits == 2 else 1 if bits in _SIXTEEN or mins is None else 2
        if sup is not None and (
            scales.dtype != (torch.int8 if bits == 6 else torch.uint8)
            or sup.shape != (out_features, in_features // 256, nsup)
            or sup.dtype != torch.float16
        ):
            raise ValueError(
                "K-quant scales: uint8 codes and float16 sup [out, in/256, 2] (no mins: "
                "[out, in/256, 1]; 6-bit: int8 per 16 values, 3-bit: packed 6-bit codes, and sup [out, in/256, 1];"
                " 2-bit: uint8 per 16 values and sup [out, in/256, 2])"
            )
        if bits in _SIXTEEN and (sup is None or mins is not None):
            raise ValueError("2-, 3- and 6-bit codes need sup and no mins")
        if mins is not None and (mins.shape != scales.shape or mins.dtype != scales.dtype):
            raise ValueError("mins must match scales in shape and dtype")
        self.bits = bits
        # the lane order `codes` is packed in (None: that of the loaded kernels)
        self.group_blocks = kernels.group_blocks() if group_blocks is None else group_blocks
        self.register_buffer("codes", codes.contiguous())
        # Float scales and mins are stored as their raw bits (int16/int32 views): a float
        # cast of the model (model.to(torch.bfloat16)) must not touch the packed format.
        raw = scales.dtype if sup is not None else _RAW[scales.dtype]
        self.register_buffer("scales_raw", scales.contiguous().view(raw))
        self.register_buffer("mins_raw", None if mins is None else mins.contiguous().view(raw))
        # K-quants: d and dmin per 256 values, float16 bits, each [out, in/256]
        self.register_buffer(
            "dsup_raw", None if sup is None else sup[..., 0].contiguous().view(torch.int16)
        )
        self.register_buffer(
            "msup_raw",
            None if sup is None or nsup == 1 else sup[..., 1].contiguous().view(torch.int16),
        )
        self._plain: tuple | None = None  # float32 scales for builds that need them
        self.act_bits = DEFAULT_ACT_BITS
        # table-coded 4-bit weights (IQ4_NL, IQ4_XS, MXFP4): uint8 [16], the values + 128
        self.register_buffer("lut", None)
        self.scale_zero = 0  # K-quant scale codes: d = dsup * (code - scale_zero)
        # dsup's values are its float16s times 2^-sup_shift (the grid i-quants' d / 2^n,
        # held as the file's d: gguf_blocks.GRID_SCALE_SHIFT)
        self.sup_shift = 0
        # the GGUF types this layer's weights came from: {type name: weights}, for the load
        # line's bits per weight against the file's (engine/report.py weight_forms)
        self.sources: dict[str, int] = {}

    def set_table(self, table: np.ndarray | torch.Tensor, scale_zero: int = 0) -> None:
        """Make the 4-bit (or 3-bit) codes indices into `table` (uint8 [16]: each value +
        128; 3-bit codes: its first 8), so that w = d * (table[c] - 128); scale_zero:
        K-quant scale codes' zero (IQ4_XS's 6-bit codes: d = dsup * (code - 32))."""
        table = torch.as_tensor(table)
        if self.bits not in (3, 4) or self.mins_raw is not None or (scale_zero and not self.kquant):
            raise ValueError("a table indexes 3- or 4-bit codes with scales and no mins")
        if table.shape != (16,) or table.dtype != torch.uint8:
            raise ValueError(f"table: expected uint8 [16], got {table.dtype} {tuple(table.shape)}")
        self.lut, self.scale_zero = table.contiguous(), scale_zero

    # -- construction -----------------------------------------------------------------

    @classmethod
    def from_gguf(
        cls,
        raw: np.ndarray,
        ggml_type: GT | int,
        out_features: int,
        in_features: int,
        bias: torch.Tensor | None = None,
        release: Callable[[np.ndarray], None] | None = None,
    ) -> QuantLinear:
        """From a GGUF tensor's raw block bytes (`ReaderTensor.data`, uint8 [out, row_bytes]).

        Works on row chunks straight from the (memory-mapped) bytes, so the peak extra
        memory is the packed result plus a few MB, never a float32 copy of the weight.
        Row permutations/splits (llama Q/K un-permute, fused QKV split) can be applied
        to `raw` beforehand: rows are independent byte ranges. release(rows) is told of
        each chunk of `raw` once packed (a checkpoint drops its file pages: a big tensor
        never stays resident twice, as file and as packed copy).
        """
        qtype, row_bytes = _gguf_row_bytes(ggml_type, in_features)
        raw = np.asarray(raw)
        if raw.dtype != np.uint8 or raw.size != out_features * row_bytes:
            raise ValueError(
                f"raw data: expected {out_features * row_bytes} uint8 bytes for "
                f"{qtype.name} [{out_features}, {in_features}], got {raw.size} {raw.dtype}"
            )
        raw = raw.reshape(out_features, row_bytes)
        if cls._packs_natively(qtype, in_features):  # one pass in C, the same bytes
            bits, arrays = _alloc_gguf(qtype, out_features, in_features)
            step = max(1, PACK_CHUNK_BYTES // row_bytes)
            for r0 in range(0, out_features, step):
                rows = raw[r0 : r0 + step]
                part = {k: v[r0 : r0 + step] for k, v in arrays.items()}
                if not _pack_native(qtype, rows, in_features, part):
                    break
                if release is not None:
                    release(rows)
            else:
                tensors = {k: torch.from_numpy(v) for k, v in arrays.items()}
                return cls._from_arrays(tensors, bits, in_features, out_features, bias)._of(qtype)
        byte = qtype == GT.MXFP4 and mxfp4_scales_fit_byte(raw)
        parse_rows = cls._row_parser(qtype, in_features, byte)
        layer = cls._assemble(
            lambda r0, r1: parse_rows(raw[r0:r1]), in_features, out_features, bias
        )
        return layer._of(qtype)

    @classmethod
    def _row_parser(cls, qtype: GT, in_features: int, byte: bool = False):
        """parse(rows uint8 [n, row_bytes]) -> (natural codes u8 [n, K], scales, mins |
        None, bits, sup | None) for GGUF type `qtype`: the file's own blocks where a kernel
        reads them, else requantized to 8 bits. Row by row: any rows, any batch of them.
        byte: MXFP4's scales as its exponent bytes (every row's fit: mxfp4_scales_fit_byte)."""
        block, type_size = GGML_QUANT_SIZES[qtype]
        six = qtype in _OWN_SIXTEEN and cls.runs_6bit(in_features)
        grid16 = qtype in GRID16_VALUES and cls.runs_6bit(in_features)
        grid_own = qtype in GRID_OWN_BITS and cls.runs_6bit(in_features) and _grid_file_bits()
        five = qtype in _FIVE and cls.runs_5bit(in_features)

        def parse(rows: np.ndarray):
            blocks = rows.reshape(rows.shape[0], -1, type_size)
            if six:  # their own codes with a scale per 16 values (Q3_K, Q2_K: 3, 2 bits)
                return _OWN_SIXTEEN[qtype](blocks)
            if qtype in EXACT_GGUF_TYPES:
                return parse_exact(blocks, qtype, five)
            if qtype in TABLE_GGUF_TYPES:
                return parse_table(blocks, qtype, byte and qtype == GT.MXFP4)
            if grid_own:  # the file's bits, rearranged (else 4-bit table codes, below)
                return parse_grid_own(blocks, qtype)
            if qtype in GRID_GGUF_TYPES:
                return parse_grid(blocks, qtype)
            if grid16:  # (else requantized, below)
                return parse_grid16(blocks, qtype)
            if qtype == GT.Q6_K:  # gguf-py's float32 ops, vectorized (its own: per 16 rows)
                return _quantize_rows(_dequantize_q6_k(blocks), "q8")
            w = gguf_dequantize(np.ascontiguousarray(rows), qtype).reshape(rows.shape[0], -1)
            return _quantize_rows(w, "q8")

        return parse

    @classmethod
    def from_gguf_experts(
        cls,
        raws: list[list[np.ndarray]],
        ggml_type: GT | int,
        in_features: int,
        packed: Callable[[int, int], None] | None = None,
    ) -> list[QuantLinear]:
        """One layer per expert from a MoE layer's GGUF expert slices, all of one type:
        raws[j][p] is expert j's part p (gate, up, ...) as raw block bytes uint8 [rows_p,
        row_bytes], rows_p the same for every expert. Expert j's layer holds its parts
        stacked along out_features, byte for byte QuantLinear.cat of from_gguf of each part.

        All experts' codes, scales, mins and super-block scales are packed into one
        buffer each, [E, sum rows_p, ...], and each layer's are its expert's slice (a
        view): no per-expert allocation or cat copy. Experts smaller than a chunk (~1M
        values) are parsed several at once, larger ones in row chunks. packed(j, p) is
        called once expert j's part p is packed (to release its file pages).
        """
        qtype, row_bytes = _gguf_row_bytes(ggml_type, in_features)
        experts, heights = len(raws), [np.shape(r)[0] for r in raws[0]]
        for parts in raws:
            got = [np.shape(r) for r in parts]
            if got != [(h, row_bytes) for h in heights] or any(
                np.asarray(r).dtype != np.uint8 for r in parts
            ):
                raise ValueError(
                    f"raw data: expected uint8 parts {[(h, row_bytes) for h in heights]} for "
                    f"{qtype.name} experts of {in_features} inputs, got {got}"
                )
        total = sum(heights)  # each expert's out_features
        if cls._packs_natively(qtype, in_features):
            bits, arrays = _alloc_gguf(qtype, experts * total, in_features)
            stack = {k: v.reshape(experts, total, *v.shape[1:]) for k, v in arrays.items()}
            native = True
            for p, h in enumerate(heights):
                off = sum(heights[:p])
                for j in range(experts):
                    dst = {k: v[j, off : off + h] for k, v in stack.items()}
                    native = native and _pack_native(
                        qtype, np.asarray(raws[j][p]), in_features, dst
                    )
                    if packed is not None:
                        packed(j, p)
            if native:
                stacked = {k: torch.from_numpy(v) for k, v in stack.items()}
                return [
                    cls._from_arrays(
                        {k: v[j] for k, v in stacked.items()}, bits, in_features, total
                    )._of(qtype)
                    for j in range(experts)
                ]
        byte = qtype == GT.MXFP4 and mxfp4_scales_fit_byte([r for parts in raws for r in parts])
        parse_rows = cls._row_parser(qtype, in_features, byte)
        gb = kernels.group_blocks()
        chunk = max(1, (1 << 20) // in_features)  # rows per parse, as _assemble
        buf: tuple[int, dict] | None = None
        for p, h in enumerate(heights):
            off = sum(heights[:p])
            per = max(1, chunk // h)  # experts per parse
            for j0 in range(0, experts, per):
                j1 = min(experts, j0 + per)
                r_step = h if j1 > j0 + 1 else chunk  # several whole experts, or row chunks
                for r0 in range(0, h, r_step):
                    r1 = min(h, r0 + r_step)
                    rows = [np.asarray(raws[j][p])[r0:r1] for j in range(j0, j1)]
                    parsed = parse_rows(rows[0] if len(rows) == 1 else np.concatenate(rows))
                    if buf is None:
                        buf = _alloc(parsed, experts * total, in_features)
                    # rows r0..r1 of part p of experts j0..j1, in the [E, total, ...] stack
                    dst = {
                        k: v.reshape(experts, total, *v.shape[1:])[j0:j1, off + r0 : off + r1]
                        for k, v in buf[1].items()
                    }
                    _store(dst, parsed, in_features, gb)
                if packed is not None:
                    for j in range(j0, j1):
                        packed(j, p)
        bits, arrays = buf
        stacked = {
            k: torch.from_numpy(v).view(experts, total, *v.shape[1:]) for k, v in arrays.items()
        }
        return [
            cls._from_arrays({k: v[j] for k, v in stacked.items()}, bits, in_features, total)._of(
                qtype
            )
            for j in range(experts)
        ]

    @classmethod
    def held_bits(cls, qtype: GT | int, in_features: int) -> float:
        """Bits per weight a layer of GGUF type `qtype` and rows of `in_features` values
        holds, scales included (its table not): a layer packed from zero blocks, which
        every type decodes (MXFP4's with in-range exponents, so its float16 scales)."""
        qtype = GT(qtype)
        rows = 64
        _, row_bytes = _gguf_row_bytes(qtype, in_features)
        raw = np.zeros((rows, row_bytes), np.uint8)
        if qtype == GT.MXFP4:
            raw.reshape(-1, 17)[:, 0] = 127
        layer = cls.from_gguf(raw, qtype, rows, in_features)
        table = 0 if layer.lut is None else layer.lut.numel()
        return 8 * (layer.nbytes - table) / (rows * in_features)

    @classmethod
    def _packs_natively(cls, qtype: GT, in_features: int) -> bool:
        """Whether kernels.pack_gguf writes this type's rows (the types packed as stored,
        and Q6_K requantized to 8 bits where 6-bit codes do not run), given a library."""
        if qtype in (GT.Q3_K, GT.Q2_K) and not cls.runs_6bit(in_features):
            return False  # (taken not to run: requantized to 8-bit blocks by numpy)
        return kernels.library() is not None and qtype in _NATIVE_BITS

    @staticmethod
    def runs_6bit(in_features: int) -> bool:
        """Whether the loaded kernels multiply 6-bit codes for rows of this length."""
        return _own_codes_run(in_features)

    @staticmethod
    def runs_5bit(in_features: int) -> bool:
        """Whether the loaded kernels multiply 5-bit codes for rows of this length."""
        return _own_codes_run(in_features)

    @classmethod
    def from_float(
        cls, w: torch.Tensor, scheme: str = "q8", bias: torch.Tensor | None = None
    ) -> QuantLinear:
        """Quantize a float weight [out, in] (HF checkpoints): 'q8' (Q8_0-like) or 'q4' (Q4_1-like)."""
        out_features, in_features = w.shape
        if in_features % QK:
            raise ValueError(f"in_features {in_features} is not a multiple of {QK}")
        return cls._assemble(
            lambda r0, r1: _quantize_rows(w[r0:r1].to(torch.float32), scheme),
            in_features,
            out_features,
            bias,
        )

    @classmethod
    def _assemble(cls, parse, in_features: int, out_features: int, bias) -> QuantLinear:
        """Packs rows chunk by chunk into preallocated arrays.

        parse(r0, r1) -> (natural codes u8 [rows, K], scales, mins | None, bits, sup |
        None). About 1M values per chunk: the transient memory beyond the result stays a
        few MB.
        """
        chunk = max(1, (1 << 20) // in_features)
        gb = kernels.group_blocks()
        buf = None
        for r0 in range(0, out_features, chunk):
            r1 = min(out_features, r0 + chunk)
            parsed = parse(r0, r1)
            if buf is None:
                buf = _alloc(parsed, out_features, in_features)
            _store({k: v[r0:r1] for k, v in buf[1].items()}, parsed, in_features, gb)
        bits, arrays = buf
        tensors = {k: torch.from_numpy(v) for k, v in arrays.items()}
        return cls._from_arrays(tensors, bits, in_features, out_features, bias)

    @classmethod
    def _from_arrays(
        cls, t: dict, bits: int, in_features: int, out_features: int, bias=None
    ) -> QuantLinear:
        """The layer over packed tensors {codes, scales, mins?, sup?} (_alloc's names)."""
        gb = kernels.group_blocks()
        codes, scales, mins, sup = t["codes"], t["scales"], t.get("mins"), t.get("sup")
        return cls(codes, scales, mins, bits, in_features, out_features, bias, gb, sup)

    def _of(self, qtype: GT) -> QuantLinear:
        """This layer marked as packed from GGUF type `qtype` (its sources), with the
        type's table where its codes index one; returns it."""
        if self.bits in _GRID_BITS:  # the grid kinds: the grid itself
            self.lut, self.sup_shift = torch.from_numpy(grid_table(qtype)), GRID_SCALE_SHIFT[qtype]
        elif qtype in TABLE_GGUF_TYPES | GRID_GGUF_TYPES or (
            qtype in GRID16_VALUES and self.bits == 3
        ):
            self.set_table(table_of(qtype), TABLE_SCALE_ZERO.get(qtype, 0))
            if self.kquant:
                self.sup_shift = GRID_SCALE_SHIFT.get(qtype, 0)
        self.sources = {qtype.name: self.out_features * self.in_features}
        return self

    @classmethod
    def cat(cls, parts: list[QuantLinear]) -> QuantLinear:
        """Stack layers with the same input along out_features (fused QKV, gate+up).

        Needs the same packed format (bits, scale dtype, mins or not): e.g. GGUF Q5_0
        and Q8_0 both pack to 8-bit/f16/no-min and can be fused; Q4_K and Q6_K cannot.
        """
        first = parts[0]
        for p in parts[1:]:
            if (
                p.in_features != first.in_features
                or p.bits != first.bits
                or p.scales_raw.dtype != first.scales_raw.dtype
                or (p.mins_raw is None) != (first.mins_raw is None)  # (mins dequantizes)
                or p.kquant != first.kquant
                or p.group_blocks != first.group_blocks
                or (p.lut is None) != (first.lut is None)
                or (p.lut is not None and not torch.equal(p.lut, first.lut))
                or p.scale_zero != first.scale_zero
                or p.sup_shift != first.sup_shift
            ):
                raise ValueError("QuantLinear.cat: parts differ in input size or packed format")
        if any(p.bias is not None for p in parts) and not all(p.bias is not None for p in parts):
            raise ValueError("QuantLinear.cat: either all parts have a bias or none")

        def stored(name: str) -> torch.Tensor | None:  # scales/mins as stored, float or codes
            if getattr(first, f"{name}_raw") is None:
                return None
            raw = torch.cat([getattr(p, f"{name}_raw") for p in parts])
            return raw if first.kquant else raw.view(_FLOAT[raw.dtype])

        sup = None
        if first.kquant:
            names = ["dsup_raw"] if first.msup_raw is None else ["dsup_raw", "msup_raw"]
            sup = torch.stack([torch.cat([getattr(p, n) for p in parts]) for n in names], -1)
            sup = sup.view(torch.float16)
        fused = cls(
            torch.cat([p.codes for p in parts]),
            stored("scales"),
            stored("mins"),
            first.bits,
            first.in_features,
            sum(p.out_features for p in parts),
            None if first.bias is None else torch.cat([p.bias for p in parts]),
            first.group_blocks,
            sup,
        )
        if first.bits in _GRID_BITS:
            fused.lut = first.lut
        elif first.lut is not None:
            fused.set_table(first.lut, first.scale_zero)
        fused.sup_shift = first.sup_shift
        for p in parts:
            for name, n in p.sources.items():
                fused.sources[name] = fused.sources.get(name, 0) + n
        return fused

    @property
    def e8m0(self) -> bool:
        """Whether the scales are MXFP4's exponent bytes (2^(e - 128) each)."""
        return self.dsup_raw is None and self.scales_raw.dtype == torch.uint8

    @property
    def kquant(self) -> bool:
        """Whether scales and mins are K-quant codes times super-block scales."""
        return self.dsup_raw is not None

    def _natural_halves(self, raw: torch.Tensor | None = None) -> torch.Tensor:
        """The per-16 scale bytes (of `raw` rows, default all) in natural order."""
        raw = self.scales_raw if raw is None else raw
        natural = torch.empty_like(raw)
        natural[:, torch.from_numpy(half_scale_perm(self.in_features, self.group_blocks))] = raw
        return natural

    def _expand_sup(self, sup_raw: torch.Tensor, per: int = 8, shift: int = 0) -> torch.Tensor:
        """[out, in/256] float16 bits -> float32 [out, in/256 * per], one per block, times
        2^-shift (exact)."""
        sup = sup_raw.view(torch.float16).float().repeat_interleave(per, dim=1)
        return sup * 2.0**-shift if shift else sup

    @property
    def scales(self) -> torch.Tensor:
        """Block scales [out, in/32]: float16 or float32 as stored, or K-quant d * code in
        float32 (exact: an 11-bit d times a 6-bit code). 2-, 3- and 6-bit codes: [out,
        in/16], one per 16 values in natural order (d * an 8-bit code, exact)."""
        if self.bits == 2:  # the scale codes are the bytes' low nibbles
            return self._expand_sup(self.dsup_raw, 16) * (self._natural_halves() & 15).float()
        if self.bits in _GRID_BITS:  # d (2 s + 1), s a nibble per block, low first
            nib = torch.stack([self.scales_raw & 15, self.scales_raw >> 4], -1).flatten(1)
            return self._expand_sup(self.dsup_raw, 8, self.sup_shift) * (2 * nib.float() + 1)
        if self.bits == 3:  # 6-bit codes, unpacked to natural order
            sc = unpack_scales6(self.scales_raw.numpy(), self.in_features, self.group_blocks)
            return (
                self._expand_sup(self.dsup_raw, 16, self.sup_shift) * torch.from_numpy(sc).float()
            )
        if self.bits in _SIXTEEN:
            sup = self._expand_sup(self.dsup_raw, 16, self.sup_shift)
            return sup * self._natural_halves().float()
        if self.kquant:
            sup = self._expand_sup(self.dsup_raw, 8, self.sup_shift)
            return sup * (self.scales_raw.float() - self.scale_zero)
        if self.e8m0:  # 2^(e - 128), exact (e in [2, 254])
            e = self.scales_raw.int() - 128
            return torch.ldexp(torch.ones(e.shape), e)
        return self.scales_raw.view(_FLOAT[self.scales_raw.dtype])

    @property
    def mins(self) -> torch.Tensor | None:
        """Block mins like `scales` (K-quants: -dmin * code), or None (zero point 8 or 128
        instead)."""
        raw = self.mins_raw
        if raw is None:
            return None
        if self.kquant:
            return -(self._expand_sup(self.msup_raw) * raw.float())
        return raw.view(_FLOAT[raw.dtype])

    # -- compute ----------------------------------------------------------------------

    def _make_native(self) -> kernels.TmWeight:
        if self.bits in _SIXTEEN and not self.runs_6bit(self.in_features):
            self._to_8bit()  # a library without 6-bit kernels was loaded since
        if self.bits == 5 and not self.runs_5bit(self.in_features):
            self._to_8bit()  # a library of another group width was loaded since
        if self.group_blocks != kernels.group_blocks():
            self._relayout(kernels.group_blocks())
        scales, mins, dsup, msup = self.scales_raw, self.mins_raw, self.dsup_raw, self.msup_raw
        if self.kquant and not kernels.reads_kquant_scales():
            # a build that reads float scales only (AVX-512): float32 copies, kept alive here
            self._plain = (
                self.scales.contiguous(),
                None if mins is None else self.mins.contiguous(),
            )
            (scales, mins), dsup = self._plain, None
        return kernels.TmWeight(
            self.codes.data_ptr(),
            scales.data_ptr(),
            None if mins is None else mins.data_ptr(),
            self.bits,
            kernels.SCALE_E8M0 if self.e8m0 else int(scales.dtype == torch.int16),
            self.out_features,
            self.in_features,
            None if dsup is None else dsup.data_ptr(),
            None if dsup is None or msup is None else msup.data_ptr(),
            lut=None if self.lut is None else self.lut.data_ptr(),
            scale_zero=self.scale_zero,
            sup_shift=self.sup_shift,
        )

    def _to_8bit(self) -> None:
        """Requantize 3- and 6-bit codes to 8-bit blocks, as from_gguf does where they
        cannot run; 5-bit codes become the same values' 8-bit codes."""
        gb = kernels.group_blocks()
        if self.bits == 5:
            nat = unpack5(self.codes.numpy(), self.in_features, self.group_blocks)
            if self.mins_raw is None:  # d * (q - 16) = d * ((q + 112) - 128)
                nat = nat + np.uint8(112)
            self.codes = torch.from_numpy(pack_codes(nat, 8, gb))
            self.bits, self.group_blocks = 8, gb
            return
        nat, sc, _, bits, _ = _quantize_rows(self.dequantize(), "q8")
        self.codes = torch.from_numpy(pack_codes(nat, bits, gb))
        self.scales_raw = torch.from_numpy(sc).view(torch.int16)
        self.dsup_raw = self.msup_raw = self.lut = None
        self.bits, self.group_blocks, self.scale_zero, self.sup_shift = bits, gb, 0, 0

    def _relayout(self, gb: int) -> None:
        """Repack the codes for groups of gb blocks (a library of another vector width)."""
        if self.bits in _GRID_BITS:
            rec = unpack_grid(self.codes.numpy(), self.in_features, self.bits, self.group_blocks)
            self.codes, self.group_blocks = torch.from_numpy(pack_grid(rec, gb)), gb
            return
        if self.bits in _SIXTEEN:
            k, old = self.in_features, self.group_blocks
            if self.bits == 3:
                sc = unpack_scales6(self.scales_raw.numpy(), k, old)
                self.scales_raw = torch.from_numpy(pack_scales6(sc, k, gb))
            else:
                natural = torch.empty_like(self.scales_raw)
                natural[:, torch.from_numpy(half_scale_perm(k, old))] = self.scales_raw
                self.scales_raw = natural[:, torch.from_numpy(half_scale_perm(k, gb))].contiguous()
            pack, unpack, _ = _SIXTEEN_CODES[self.bits]
            self.codes = torch.from_numpy(pack(unpack(self.codes.numpy(), k, old), gb))
            self.group_blocks = gb
            return
        if self.bits == 5:
            k, old = self.in_features, self.group_blocks
            self.codes = torch.from_numpy(pack5(unpack5(self.codes.numpy(), k, old), gb))
            self.group_blocks = gb
            return
        byte, shift = unpack_index(self.in_features, self.bits, self.group_blocks)
        nat = self.codes[:, byte]
        if self.bits == 4:
            nat = (nat >> shift) & 15
        self.codes = torch.from_numpy(pack_codes(nat.numpy(), self.bits, gb))
        self.group_blocks = gb

    def dequantize(self, rows: torch.Tensor | None = None) -> torch.Tensor:
        """W (or its rows `rows`) as float32 [rows, in] in natural column order (torch ops).

        Computed as d * (c - Z) + m without fused multiply-add, the same float32 ops as
        gguf.quants.dequantize, so GGUF-exact formats reproduce it bit for bit.
        """
        codes, scales = self.codes, self.scales
        mins = self.mins
        if rows is not None:
            codes, scales = codes[rows], scales[rows]
            mins = None if mins is None else mins[rows]
        if self.bits in _GRID_BITS:  # d (2 s + 1) / 2^n * (the grid's value, signed)
            rec = unpack_grid(codes.numpy(), self.in_features, self.bits, self.group_blocks)
            c = torch.from_numpy(_grid_values(rec, self.lut.numpy())).to(torch.float32) - 128
            n = c.shape[0]
            return (scales[..., None] * c.reshape(n, -1, QK)).reshape(n, self.in_features)
        if self.bits == 2:  # d * sc * q - dmin * m per 16 values, like gguf's Q2_K
            n = codes.shape[0]
            nat = unpack2(codes.numpy(), self.in_features, self.group_blocks)
            q = torch.from_numpy(nat).reshape(n, -1, 16).to(torch.float32)
            byte = self._natural_halves(self.scales_raw if rows is None else self.scales_raw[rows])
            m = self._expand_sup(self.msup_raw if rows is None else self.msup_raw[rows], 16)
            ml = m * (byte >> 4).float()  # `scales` is d * sc
            return (scales[..., None] * q - ml[..., None]).reshape(n, self.in_features)
        if self.bits in _SIXTEEN:  # (d * code) * (c - Z) per 16 values, like gguf's Q6_K/Q3_K
            n = codes.shape[0]
            _, unpack, z = _SIXTEEN_CODES[self.bits]
            c = torch.from_numpy(unpack(codes.numpy(), self.in_features, self.group_blocks))
            if self.lut is not None:  # 3-bit table codes: their values + 128
                c, z = self.lut[c.long()], 128
            c = c.reshape(n, -1, 16).to(torch.float32) - z
            return (scales[..., None] * c).reshape(n, self.in_features)
        if self.bits == 5:
            c = torch.from_numpy(unpack5(codes.numpy(), self.in_features, self.group_blocks))
        else:
            byte, shift = unpack_index(self.in_features, self.bits, self.group_blocks)
            c = codes[:, byte]
            if self.bits == 4:
                c = (c >> shift) & 15
        if self.lut is not None:  # table codes: their values + 128
            c = self.lut[c.long()]
        n = c.shape[0]
        c = c.reshape(n, -1, QK).to(torch.float32)
        d = scales.to(torch.float32)[..., None]
        if mins is None:
            w = d * (c - (128 if self.lut is not None else {4: 8, 5: 16, 8: 128}[self.bits]))
        else:
            w = d * c + mins.to(torch.float32)[..., None]
        return w.reshape(n, self.in_features)

    @property
    def nbytes(self) -> int:
        tensors = [
            self.codes,
            self.scales_raw,
            self.mins_raw,
            self.dsup_raw,
            self.msup_raw,
            self.lut,
        ]
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)

    def extra_repr(self) -> str:
        scale = "kquant" if self.kquant else str(self.scales.dtype)
        kind = f"q{self.bits}{'+min' if self.mins_raw is not None else ''}/{scale}"
        return f"in_features={self.in_features}, out_features={self.out_features}, {kind}"


def _grid_values(rec: np.ndarray, grid: np.ndarray) -> np.ndarray:
    """Block records [rows, nb, 12 or 13] (layout.unpack_grid) and their grid (uint8 [entries
    * 4], magnitudes + 128) -> the values + 128, uint8 [rows, nb * 32] in natural order."""
    rows, nb, b = rec.shape
    idx = rec[..., :8].astype(np.int64)
    if b == 13:  # 9th bits
        idx |= ((rec[..., 8:9] >> np.arange(8, dtype=np.uint8)) & 1).astype(np.int64) << 8
    v = grid.reshape(-1, 4)[idx]  # [rows, nb, 8, 4]
    neg = ((rec[..., b - 4 :, None] >> np.arange(8, dtype=np.uint8)) & 1).reshape(rows, nb, 8, 4)
    return np.where(neg.astype(bool), (256 - v.astype(np.int16)).astype(np.uint8), v).reshape(
        rows, -1
    )


def _gguf_row_bytes(ggml_type, in_features: int) -> tuple[GT, int]:
    """(the GGUF type, bytes per row of in_features values) for a type QuantLinear holds;
    ValueError naming the type or the width otherwise."""
    qtype = GT(ggml_type)
    if qtype not in QUANT_GGUF_TYPES:
        raise ValueError(f"QuantLinear cannot hold GGUF type {qtype.name}; keep a float Linear")
    block, type_size = GGML_QUANT_SIZES[qtype]
    if in_features % block:
        raise ValueError(f"in_features {in_features} is not a multiple of {block}")
    return qtype, in_features // block * type_size
