"""Quantized and float linear layers: GGUF conversion exactness, the native kernels of
every instruction-set build vs references and vs each other, the pure-torch fallback,
threads and builds."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as GT
from gguf.constants import GGML_QUANT_SIZES
from gguf.quants import dequantize, quantize
from kernel_builds import BUILDS, library_for, use_build

from tokenmill import kernels
from tokenmill.kernels import build
from tokenmill.layers import native_linear, quant_linear
from tokenmill.layers.native_linear import FloatLinear, SegmentedLinear
from tokenmill.layers.quant_linear import PREFILL_MIN_T, QuantLinear

SIMPLE = [GT.Q4_0, GT.Q4_1, GT.Q8_0, GT.Q5_0, GT.Q5_1]  # gguf.quants can quantize these
K_QUANTS = [GT.Q4_K, GT.Q5_K]
TABLES = [GT.IQ4_NL, GT.IQ4_XS, GT.MXFP4]  # 4-bit codes into a table of 16 values
# grid points times a scale per 32: codes into a table of their points (4-bit for IQ3_S's
# and IQ3_XXS's 16 points, else 3-bit in Q3_K's form)
GRIDS = [GT.IQ2_XXS, GT.IQ3_XXS, GT.IQ3_S, GT.IQ1_S, GT.TQ1_0, GT.TQ2_0]
# the grid types held as their own bits with TOKENMILL_GRID_FILE_BITS=1: (kernels' bits,
# bytes per 32 values, the grid's bytes); the file's 13.75 and 12.25 (IQ3_XXS's 7-bit sign
# indices widened to 8 sign bits)
OWN_GRIDS = {GT.IQ3_S: (13, 13.75, 2048), GT.IQ3_XXS: (12, 12.75, 1024)}
# grid points times a scale per 16: 3-bit codes into a table of their points, in Q3_K's form
# (requantized to 8-bit codes, a scale per 32, without the native kernels)
GRID16 = [GT.IQ2_XS, GT.IQ2_S, GT.IQ1_M]
# a scale per 16 values, held as their own codes on rows of whole lane groups
SIXTEENS = [GT.Q6_K, GT.Q3_K, GT.Q2_K]
# (out, in): odd out sizes; in with no tail, a 1-block tail, a 2-block tail, a 15-block tail
SHAPES = [(1, 32), (7, 64), (33, 576), (17, 512), (5, 1024 + 480), (64, 1536)]
K_SHAPES = [(3, 256), (33, 768), (9, 2048 + 256), (5, 1024)]  # 1024: whole groups everywhere


def gguf_bytes(qtype: GT, n: int, k: int, seed: int = 0) -> np.ndarray:
    """Raw GGUF blocks [n, row_bytes] of a random weight (random valid blocks for K-quants)."""
    rng = np.random.default_rng(seed)
    if qtype in SIMPLE:
        return quantize((rng.standard_normal((n, k)) * 0.05).astype(np.float32), qtype)
    block, size = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(n, k // block, size), dtype=np.uint8)
    if qtype == GT.MXFP4:  # an E8M0 exponent first: scales 2^-10 .. 2^-3
        raw[..., 0] = rng.integers(118, 126, size=(n, k // block), dtype=np.uint8)
        return raw.reshape(n, -1)
    scales = (rng.random((n, k // block, 2)) * 1e-3).astype(np.float16).view(np.uint8)
    if qtype in (GT.Q6_K, GT.TQ1_0, GT.TQ2_0, GT.Q3_K):  # d is the last 2 bytes
        raw[..., -2:] = scales[..., :2]
    elif qtype == GT.IQ1_M:  # d's 4 nibbles in the top of the last 4 uint16 scale words
        d = scales[..., :2].copy().view(np.uint16)  # [n, blocks, 1]
        words = raw[..., -8:].copy().view(np.uint16) & np.uint16(0x0FFF)
        nib = (d >> np.array([0, 4, 8, 12], np.uint16)) & np.uint16(15)
        raw[..., -8:] = (words | (nib << np.uint16(12))).view(np.uint8)
    elif qtype == GT.Q2_K:  # d, dmin are the last 4 bytes
        raw[..., -4:] = scales
    elif qtype in (GT.IQ4_NL, GT.IQ4_XS) or qtype in GRIDS or qtype in GRID16:
        raw[..., 0:2] = scales[..., :2]  # d first, the rest random codes, grids and signs
    else:  # d, dmin first
        raw[..., 0:4] = scales.reshape(n, k // block, 4)
    return raw.reshape(n, -1)


def kernel_reference(layer: QuantLinear, x: torch.Tensor, act_bits: int = 8) -> torch.Tensor:
    """What the decode kernel computes, in float64: x quantized per 32-block to
    act_bits exactly as quant.c does, then sum_b dx*xq.(w - m) + m * sum(x)."""
    t, k = x.shape
    qmax = 127.0 if act_bits == 8 else 32767.0
    xb = x.reshape(t, k // 32, 32)
    amax = xb.abs().amax(-1, keepdim=True)
    # tensor / tensor: `scalar / tensor` is reciprocal-then-multiply in torch, which
    # rounds differently from the C division and moves exact .5 ties.
    inv = torch.where(amax > 0, torch.full_like(amax, qmax) / amax, torch.zeros_like(amax))
    xq = torch.round(xb * inv)  # half to even, like cvtps2dq
    dx = amax / qmax
    w = layer.dequantize().double().reshape(layer.out_features, k // 32, 32)
    mins = torch.zeros(w.shape[:2], dtype=torch.float64)
    if layer.mins is not None:
        mins = layer.mins.double()
    xd = (xq.double() * dx.double()).reshape(t, k)
    y = xd @ (w - mins[..., None]).reshape(layer.out_features, k).T
    y += xb.double().sum(-1) @ mins.T
    if layer.bias is not None:
        y += layer.bias.double()
    return y


def dot_error_scale(layer: QuantLinear, x: torch.Tensor) -> torch.Tensor:
    """sum |x| |w| per output: float32 rounding in a dot product scales with this, not
    with |y| (terms can cancel, e.g. the min term against the code term)."""
    return x.double().abs() @ layer.dequantize().double().abs().T + 1e-30


def assert_close_rel(y: torch.Tensor, ref: torch.Tensor, rel: float) -> None:
    err = (y.double() - ref).abs().max().item()
    scale = ref.abs().max().item() or 1.0
    assert err <= rel * scale, f"max err {err:.3g} > {rel:g} * {scale:.3g}"


@pytest.fixture
def native():
    if kernels.library() is None:
        pytest.skip("native kernels unavailable")


@pytest.fixture(params=BUILDS)
def kbuild(request, monkeypatch):
    """Runs the test once per kernel build (native, AVX2, scalar), each the active library."""
    use_build(monkeypatch, request.param)
    return request.param


# ----------------------------------------------------------------------------------
# conversion
# ----------------------------------------------------------------------------------


def shapes_for(qtype: GT) -> list[tuple[int, int]]:
    """Test shapes whose rows hold whole blocks of the type (256 values for K-quants)."""
    return K_SHAPES if GGML_QUANT_SIZES[qtype][0] == 256 else SHAPES


@pytest.mark.parametrize(
    "qtype, shape",
    [(q, shape) for q in SIMPLE + K_QUANTS + TABLES + GRIDS for shape in shapes_for(q)],
)
def test_gguf_conversion_is_exact(qtype, shape):
    n, k = shape
    raw = gguf_bytes(qtype, n, k)
    ref = dequantize(raw, qtype).reshape(n, k)
    layer = QuantLinear.from_gguf(raw, qtype, n, k)
    assert np.array_equal(layer.dequantize().numpy(), ref)
    if qtype in (GT.Q4_0, GT.Q4_1, GT.Q8_0):  # same size as the file: nothing expanded
        assert layer.nbytes == raw.nbytes
    if qtype in TABLES:  # 4-bit codes, the scales as the file has them (MXFP4's exponents)
        per32 = {GT.IQ4_NL: 18, GT.IQ4_XS: 17.25, GT.MXFP4: 17}[qtype]  # file: 18, 17, 17
        assert layer.bits == 4 and layer.nbytes == n * k // 32 * per32 + 16  # + the table
    if qtype in GRIDS:  # under the file's d per 256: 4-bit codes and an odd code per 32 (16
        # points), or 3-bit ones and an int8 code per 16 (at most 8 points)
        bits, per32 = (4, 17.25) if qtype in OWN_GRIDS else (3, 13.75)
        assert layer.bits == bits and layer.nbytes == n * k // 32 * per32 + 16


@pytest.mark.parametrize("qtype", [GT.IQ3_S, GT.IQ3_XXS, GT.IQ2_XXS, GT.IQ1_S])
def test_grid_scales_are_odd_codes_under_the_files_d(qtype):
    """A grid i-quant's scale per 32 is d (2s + 1) / 2^n: held as the byte 2s + 1 under
    the file's d as a float16 per 256 values, read times 2^-n (sup_shift): 17.25 bytes
    per 32 values with the 4-bit codes of IQ3_S and IQ3_XXS; 13.75 with the 3-bit ones of
    IQ2_XXS and IQ1_S (their code per 16 twice, as Q3_K's 6-bit ones), against 20 with
    float32 scales. Exact for
    any d, the float16 subnormals too (whose quotient by 2^n no float16 holds), and the
    kernels read it as the float32 scales they stand for."""
    n, k = 6, 512
    raw = gguf_bytes(qtype, n, k)
    blocks = raw.reshape(n, k // 256, -1)
    d = np.random.default_rng(1).uniform(1e-2, 2e-2, (n, k // 256)).astype(np.float16)
    blocks[..., 0:2] = d.view(np.uint8).reshape(n, k // 256, 2)
    blocks[2, 1, 0:2] = np.array([0x0401], np.uint16).view(np.uint8)  # 2^-14 (1 + 2^-10)
    blocks[3, 0, 0:2] = np.array([0x0003], np.uint16).view(np.uint8)  # a subnormal
    layer = QuantLinear.from_gguf(raw, qtype, n, k)
    ref = dequantize(raw, qtype).reshape(n, k)
    assert np.array_equal(layer.dequantize().numpy(), ref)
    four = qtype in OWN_GRIDS
    assert layer.scales_raw.dtype == torch.uint8
    assert layer.nbytes == n * k // 32 * (17.25 if four else 13.75) + 16
    assert layer.sup_shift == {GT.IQ3_S: 0, GT.IQ3_XXS: 2}.get(qtype, 3)
    x = torch.randn(3, k)
    err = (layer(x).double() - kernel_reference(layer, x, 16)).abs()
    assert (err <= 1e-5 * dot_error_scale(layer, x)).all()


def test_mxfp4_scales_are_its_exponent_bytes_or_float32():
    """MXFP4's scales are its exponent bytes, 17 bytes per 32 values like the file; a
    block exponent of 1 (2^-128 once halved: a float32 subnormal, no byte form) makes the
    tensor's scales float32: still exact, 20 bytes per 32 values."""
    n, k = 5, 64
    raw = gguf_bytes(GT.MXFP4, n, k)
    byte = QuantLinear.from_gguf(raw, GT.MXFP4, n, k)
    assert byte.scales_raw.dtype == torch.uint8 and byte.nbytes == raw.nbytes + 16
    raw.reshape(n, -1, 17)[2, 1, 0] = 1
    layer = QuantLinear.from_gguf(raw, GT.MXFP4, n, k)
    assert layer.scales.dtype == torch.float32 and layer.nbytes == n * k // 32 * 20 + 16
    assert np.array_equal(layer.dequantize().numpy(), dequantize(raw, GT.MXFP4).reshape(n, k))
    experts = QuantLinear.from_gguf_experts([[raw[:2]], [raw[2:4]]], GT.MXFP4, k)
    assert all(e.scales.dtype == torch.float32 for e in experts)


@pytest.mark.parametrize("qtype", GRID16)
@pytest.mark.parametrize("k", [512, 768])
def test_grid_types_with_a_scale_per_16_are_their_own_3_bit_codes(qtype, k):
    """IQ2_XS, IQ2_S, IQ1_M: grid points times d (2s + 1) / 8 per 16 values, held as 3-bit
    codes into a table of their points in Q3_K's form, under its 6-bit codes per 16 times
    the file's d per 256 (read times 1/8: 13.75 bytes per 32 values), exactly gguf-py's values,
    any d, any row length (768 ends in a partial lane group on AVX-512). Without the
    native kernels requantized to 8-bit codes and a float16 scale per 32 (34 bytes),
    within its bound; said so."""
    n = 9
    raw = gguf_bytes(qtype, n, k)
    ref = dequantize(raw, qtype).reshape(n, k)
    own = QuantLinear.runs_6bit(k)
    for tiny in (False, True):
        if tiny:  # a d of 2^-14 (1 + 2^-10): d / 8 would be a subnormal, its last bit lost
            d = np.array([0x0401], np.uint16)
            at = raw.reshape(n, k // 256, -1)[4, 1]
            if qtype == GT.IQ1_M:  # its nibbles in the top of the scale words at 48
                words = at[48:56].copy().view(np.uint16) & np.uint16(0x0FFF)
                nib = (d >> np.array([0, 4, 8, 12], np.uint16)) & np.uint16(15)
                at[48:56] = (words | (nib << np.uint16(12))).view(np.uint8)
            else:
                at[0:2] = d.view(np.uint8)
            ref = dequantize(raw, qtype).reshape(n, k)
        layer = QuantLinear.from_gguf(raw, qtype, n, k)
        if own:
            assert layer.bits == 3 and layer.lut is not None
            assert layer.nbytes == n * k // 32 * 13.75 + 16
            assert np.array_equal(layer.dequantize().numpy(), ref)
        else:
            assert layer.bits == 8 and layer.nbytes == n * k // 32 * 34
            _assert_requantized(layer.dequantize().numpy(), ref)


@pytest.mark.parametrize("qtype", SIXTEENS)
@pytest.mark.parametrize("k", [256, 512, 768])
def test_q6_k_is_exact_where_6_bit_kernels_run(k, qtype):
    """Q6_K, Q2_K and Q3_K as the file holds them (Q3_K at 3 bits in Q6_K's form, its scales
    per 16 values the file's 6-bit codes: 13.75 bytes per 32 values, the file's)."""
    n = 9
    raw = gguf_bytes(qtype, n, k)
    ref = dequantize(raw, qtype).reshape(n, k)
    layer = QuantLinear.from_gguf(raw, qtype, n, k)
    if QuantLinear.runs_6bit(k):  # whole lane-order groups on a build with 6-bit kernels
        bits, size = {GT.Q6_K: (6, 26.25), GT.Q3_K: (3, 13.75), GT.Q2_K: (2, 10.5)}[qtype]
        assert layer.bits == bits and layer.nbytes == n * k * size / 32
        assert np.array_equal(layer.dequantize().numpy(), ref)
    else:
        assert layer.bits == 8
        _assert_requantized(layer.dequantize().numpy(), ref)


def _assert_requantized(got: np.ndarray, ref: np.ndarray) -> None:
    """Each value within half a step (max|w| / 254 of its 32-block) of gguf-py's, plus the
    float16 scale's rounding (relative 2^-11, or 2^-25 absolute where it is subnormal)."""
    n = ref.shape[0]
    step = np.abs(ref).reshape(n, -1, 32).max(-1, keepdims=True) / 127
    err = np.abs(got - ref).reshape(n, -1, 32)
    assert (err <= step * (0.5 + 127 * 2**-11) + 127 * 2**-25).all()


@pytest.mark.parametrize("qtype", SIXTEENS)
def test_q6_k_is_requantized_where_6_bit_kernels_cannot_run(monkeypatch, qtype):
    """Where 6-bit kernels cannot run (rows not in whole lane-order groups of the loaded
    width) Q6_K, Q3_K and Q2_K get 8-bit blocks: at load, or when such a library is loaded
    after a layer of their own codes was made."""
    n, k = 9, 512
    raw = gguf_bytes(qtype, n, k)
    ref = dequantize(raw, qtype).reshape(n, k)
    six = QuantLinear.from_gguf(raw, qtype, n, k)
    monkeypatch.setattr(QuantLinear, "runs_6bit", staticmethod(lambda k: False))
    layer = QuantLinear.from_gguf(raw, qtype, n, k)
    assert layer.bits == 8
    _assert_requantized(layer.dequantize().numpy(), ref)
    if six.bits != 8 and kernels.library() is not None:
        x = torch.randn(2, k)
        y = six(x)  # converts itself first
        assert six.bits == 8 and six.dsup_raw is None and six.msup_raw is None
        _assert_requantized(six.dequantize().numpy(), ref)
        exact = x @ torch.from_numpy(ref).T
        assert (y - exact).abs().max() <= 1e-2 * exact.abs().max()


@pytest.mark.parametrize("qtype", SIXTEENS)
def test_q6_k_relayout_for_another_vector_width(qtype):
    """6-, 3- and 2-bit codes and their per-group scale order repack for a library of
    another width."""
    n, k = 5, 1024
    raw = gguf_bytes(qtype, n, k)
    layer = QuantLinear.from_gguf(raw, qtype, n, k)
    if layer.bits == 8:
        pytest.skip(f"this build holds {qtype.name} as 8-bit blocks")
    other = 4 if layer.group_blocks != 4 else 8
    layer._relayout(other)
    assert layer.group_blocks == other
    assert np.array_equal(layer.dequantize().numpy(), dequantize(raw, qtype).reshape(n, k))


def test_from_gguf_checks_sizes():
    raw = gguf_bytes(GT.Q8_0, 4, 64)
    with pytest.raises(ValueError, match="expected"):
        QuantLinear.from_gguf(raw, GT.Q8_0, 5, 64)
    with pytest.raises(ValueError, match="float Linear"):
        QuantLinear.from_gguf(np.zeros(16, np.uint8), GT.F32, 2, 2)


def test_from_gguf_reads_rows_in_chunks(monkeypatch):
    """Big tensors are converted a few rows at a time (no float32 copy of the weight) on
    the numpy path, where the native packer (one pass per row, no copy) does not run."""
    monkeypatch.setattr(QuantLinear, "_packs_natively", classmethod(lambda cls, q, k: False))
    calls = []
    parse = quant_linear.parse_exact
    monkeypatch.setattr(
        quant_linear, "parse_exact", lambda b, q, *a: calls.append(b.shape[0]) or parse(b, q, *a)
    )
    n, k = 4096 + 3, 2048
    raw = gguf_bytes(GT.Q4_1, n, k)
    layer = QuantLinear.from_gguf(raw, GT.Q4_1, n, k)
    assert max(calls) < n and sum(calls) == n
    assert np.array_equal(
        layer.dequantize(torch.tensor([0, n - 1])).numpy(),
        dequantize(raw[[0, n - 1]], GT.Q4_1).reshape(2, k),
    )


@pytest.mark.parametrize("scheme,bound", [("q8", 1 / 254), ("q4", 1 / 30)])
def test_from_float(scheme, bound):
    w = torch.randn(19, 576)
    layer = QuantLinear.from_float(w, scheme)
    err = (layer.dequantize() - w).abs().reshape(19, -1, 32)
    span = w.reshape(19, -1, 32)
    span = span.abs().amax(-1) if scheme == "q8" else span.amax(-1) - span.amin(-1)
    assert (err.amax(-1) <= span * bound * 1.02 + 1e-6).all()


# ----------------------------------------------------------------------------------
# native kernels
# ----------------------------------------------------------------------------------


@pytest.mark.parametrize("act_bits", [8, 16])
@pytest.mark.parametrize("qtype", SIMPLE + K_QUANTS + SIXTEENS + TABLES + GRIDS[::2] + GRID16[:2])
def test_decode_kernel_matches_reference(kbuild, qtype, act_bits):
    torch.manual_seed(0)
    shapes = shapes_for(qtype)
    for n, k in shapes:
        layer = QuantLinear.from_gguf(gguf_bytes(qtype, n, k), qtype, n, k, bias=torch.randn(n))
        layer.act_bits = act_bits
        for t in [1, 2, 3, 4, 5, 6, 7, 8, 9, 17, PREFILL_MIN_T]:
            x = torch.randn(t, k)
            x[0, :32] = 0  # an all-zero block (scale 0)
            x[-1, -32:] *= 1000  # an outlier block
            err = (layer(x).double() - kernel_reference(layer, x, act_bits)).abs()
            assert (err <= 1e-5 * dot_error_scale(layer, x)).all(), (n, k, t)


@pytest.mark.parametrize("act_bits", [8, 16])
def test_q8_0_extreme_bytes_are_exact(kbuild, act_bits):
    """Q8_0 bytes of -128 and 127 (llama.cpp's quantizer never writes -128, a file may)
    against activations that quantize to +-127: the AVX2 8-bit dot multiplies |c - 128| by
    q with c's sign, and -128 is the one byte whose negation does not fit."""
    n, k = 9, 1024 + 64  # whole groups and a 2-block tail on every lane width
    raw = gguf_bytes(GT.Q8_0, n, k).reshape(n, k // 32, 34).copy()
    rng = np.random.default_rng(1)
    raw[..., 2:] = rng.choice(np.array([0x80, 0x7F, 0x81, 0x00], np.uint8), size=raw[..., 2:].shape)
    layer = QuantLinear.from_gguf(raw.reshape(n, -1), GT.Q8_0, n, k)
    layer.act_bits = act_bits
    for t in [1, 3, PREFILL_MIN_T]:
        x = torch.from_numpy(rng.choice(np.array([-1.0, 1.0, 0.5], np.float32), size=(t, k)))
        err = (layer(x).double() - kernel_reference(layer, x, act_bits)).abs()
        assert (err <= 1e-5 * dot_error_scale(layer, x)).all(), t


@pytest.mark.parametrize("act_bits", [8, 16])
@pytest.mark.parametrize("qtype", [GT.Q4_0, GT.Q4_1, GT.Q8_0, GT.Q4_K, GT.Q6_K, GT.Q2_K, GT.IQ4_NL])
def test_small_t_rows_equal_one_row_at_a_time(kbuild, qtype, act_bits):
    """The GEMV multiplies each weight block into T <= 16 rows of x while it is in
    registers (a speculative verification's rows): every row's output equals, bit for
    bit, the one-row product of that row alone, tails included (576 columns: a pair of
    tail blocks on AVX-512, 544: a lone one). Where T rows take the integer GEMM instead
    (16 on AVX2: kernels.gemm_min_rows), the same integers summed in another order: within
    the float rounding of the dot products."""
    torch.manual_seed(2)
    shapes = K_SHAPES if qtype in (GT.Q4_K, GT.Q6_K, GT.Q2_K) else [(33, 576), (17, 544), (9, 1536)]
    for n, k in shapes:
        layer = QuantLinear.from_gguf(gguf_bytes(qtype, n, k), qtype, n, k, bias=torch.randn(n))
        layer.act_bits = act_bits
        for t in [2, 3, 5, 8, 9, 16]:
            x = torch.randn(t, k)
            x[0, :32] = 0  # an all-zero block (scale 0)
            y = layer(x)
            rows = torch.cat([layer(x[r : r + 1]) for r in range(t)])
            if layer.path(t).name == kernels.GEMV:
                assert torch.equal(y, rows), (n, k, t)
            else:
                err = (y.double() - rows.double()).abs()
                assert (err <= 1e-5 * dot_error_scale(layer, x)).all(), (n, k, t)


@pytest.mark.parametrize("act_bits,rel", [(8, 2e-2), (16, 2e-4)])
@pytest.mark.parametrize("scheme", ["q4", "q8"])
def test_decode_kernel_close_to_float(kbuild, scheme, act_bits, rel):
    """Quantized activations cost little against the exact float product."""
    torch.manual_seed(1)
    layer = QuantLinear.from_float(torch.randn(96, 1536) * 0.02, scheme)
    layer.act_bits = act_bits
    x = torch.randn(4, 1536)
    assert_close_rel(layer(x), (x.double() @ layer.dequantize().double().T), rel)


@pytest.mark.parametrize("qtype", [GT.Q4_1, GT.Q4_0, GT.Q8_0, GT.Q5_1, GT.Q4_K])
@pytest.mark.parametrize("t", [PREFILL_MIN_T + 1, 200])
def test_prefill_path_matches_its_reference(kbuild, monkeypatch, qtype, t):
    """Prefill-sized x: the integer GEMM's exact integers where it is the prefill path
    (AVX2), else the float32 product of the dequantized weight."""
    torch.manual_seed(2)
    n, k = (130, 768) if qtype == GT.Q4_K else (130, 576)
    layer = QuantLinear.from_gguf(gguf_bytes(qtype, n, k), qtype, n, k, bias=torch.randn(n))
    x = torch.randn(t, k)
    if kernels.gemm_prefill():
        err = (layer(x).double() - kernel_reference(layer, x, 16)).abs()
        assert (err <= 1e-5 * dot_error_scale(layer, x)).all()
        return
    ref = x.double() @ layer.dequantize().double().T + layer.bias.double()
    assert_close_rel(layer(x), ref, 1e-5)
    # row-chunked GEMMs (big layers) give the same result
    monkeypatch.setattr(native_linear, "_PREFILL_CHUNK_BYTES", 64 * 4 * k)
    assert_close_rel(layer(x), ref, 1e-5)


@pytest.mark.parametrize("act_bits", [8, 16])
@pytest.mark.parametrize("qtype", SIMPLE + K_QUANTS + SIXTEENS + TABLES + GRID16[2:])
def test_integer_gemm_matches_reference_and_gemv(kbuild, qtype, act_bits):
    """The integer GEMM of every build (also where it is not the prefill path): the
    GEMV's integers, row and token counts off its tiles (RT rows, 3 tokens), K tails."""
    torch.manual_seed(7)
    shapes = shapes_for(qtype)
    for n, k in shapes:
        layer = QuantLinear.from_gguf(gguf_bytes(qtype, n, k), qtype, n, k, bias=torch.randn(n))
        layer.act_bits = act_bits
        cw = layer.native()
        for t in [1, 2, 3, 4, 8, 50]:
            x = torch.randn(t, k)
            x[0, :32] = 0  # an all-zero block (scale 0)
            x[-1, -32:] *= 1000  # an outlier block
            y = kernels.gemm(cw, x, layer.bias, act_bits)
            scale = dot_error_scale(layer, x)
            assert ((y.double() - kernel_reference(layer, x, act_bits)).abs() <= 1e-5 * scale).all()
            gemv = kernels.linear(cw, x, layer.bias, act_bits)
            assert ((y - gemv).double().abs() <= 1e-6 * scale).all(), (n, k, t)


# (the build whose GEMM runs on AMX tiles, the same build's layer without them)
AMX_PAIRS = [("amx-emulated", "avx512-vnni-simde"), ("sapphirerapids", "avx512-vnni")]


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="x86-64 targets")
@pytest.mark.parametrize("pair", AMX_PAIRS, ids=[p[0] for p in AMX_PAIRS])
@pytest.mark.parametrize("act_bits", [8, 16])
def test_amx_gemm_equals_the_vnni_gemm_bit_for_bit(monkeypatch, pair, act_bits):
    """The GEMM on AMX tiles (simd_amx.h: real, or its plain-C emulation on any host)
    computes the VNNI micro-kernel's integers per block, 16-bit activations as a high and
    a low byte product, and applies the scales in its order: the same floats, bit for bit,
    for every type (6-bit codes stay on VNNI), whole 16- and 8-token chunks and the rest,
    and K tails."""
    tiles, plain = pair
    for name in (tiles, plain):
        use_build(monkeypatch, name)  # skips the real pair where the CPU lacks AMX
    assert library_for(tiles).tm_amx().decode().startswith("+amx")
    assert library_for(plain).tm_amx().decode() == ""
    torch.manual_seed(3)
    for qtype in SIMPLE + K_QUANTS + [GT.Q6_K] + TABLES:
        n, k = shapes_for(qtype)[2]
        layer = QuantLinear.from_gguf(gguf_bytes(qtype, n, k), qtype, n, k, bias=torch.randn(n))
        for t in [1, 7, 8, 9, 16, 17, 40]:
            x = torch.randn(t, k)
            x[0, :32] = 0  # an all-zero block (scale 0)
            x[-1, -32:] *= 1000  # an outlier block
            ys = []
            for name in pair:
                use_build(monkeypatch, name)
                ys.append(kernels.gemm(layer.native(), x, layer.bias, act_bits))
            assert torch.equal(ys[0], ys[1]), (qtype.name, t)


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="x86-64 targets")
def test_integer_gemm_plain_c_tiles(monkeypatch):
    """The plain-C tile builder (every block on AVX-512 builds, the tails elsewhere), forced
    on an AVX2 build (GEMM_SCALAR_TILES): the same integers as the reference."""
    library_for("x86-64-v3")  # skips where the host cannot run AVX2
    try:
        lib = kernels.load(("-march=x86-64-v3", "-DGEMM_SCALAR_TILES"))
    except (kernels.BuildError, OSError) as e:
        pytest.skip(f"cannot build: {e}")
    monkeypatch.setattr(kernels, "_lib", lib)
    monkeypatch.setattr(kernels, "_tried", True)
    torch.manual_seed(8)
    for qtype in [GT.Q4_0, GT.Q8_0, GT.Q5_1, GT.Q4_K, GT.Q6_K]:
        n, k = (17, 2048 + 256) if qtype in (GT.Q4_K, GT.Q6_K) else (17, 1024 + 480)
        layer = QuantLinear.from_gguf(gguf_bytes(qtype, n, k), qtype, n, k, bias=torch.randn(n))
        x = torch.randn(5, k)
        err = (
            kernels.gemm(layer.native(), x, layer.bias, 16).double()
            - kernel_reference(layer, x, 16)
        ).abs()
        assert (err <= 1e-5 * dot_error_scale(layer, x)).all(), qtype


def test_prefill_rows_take_the_path_the_build_names(kbuild, monkeypatch):
    """Where the integer GEMM is the prefill path, kernels.linear (so packed layers and the
    fused decode stack) multiplies gemm_min_rows() rows and more by it, fewer by the GEMV;
    elsewhere more than PREFILL_MIN_T rows go to float32 tiles. The GEMV's rows are
    independent (one row at a time gives the same bits), the GEMM's sums run in another
    order: bit equality tells which ran."""
    torch.manual_seed(4)
    layer = QuantLinear.from_gguf(gguf_bytes(GT.Q4_K, 64, 512), GT.Q4_K, 64, 512)
    cw = layer.native()

    def gemv(x):
        return torch.cat([kernels.linear(cw, x[i : i + 1], None, 16) for i in range(len(x))])

    assert kernels.gemm_prefill() == kernels.isa().startswith(("avx2", "avx512"))
    assert kernels.gemm_min_rows() == (
        0 if not kernels.gemm_prefill() else 24 if kernels.group_blocks() == 16 else 16
    )
    if kernels.gemm_prefill():
        x = torch.randn(kernels.gemm_min_rows(), 512)
        assert torch.equal(layer(x[:-1]), gemv(x[:-1]))
        assert torch.equal(layer(x), kernels.gemm(cw, x, None, 16))
        assert not torch.equal(layer(x), gemv(x))
        return
    calls = []
    for name in ("linear", "dequant_lanes"):
        real = getattr(kernels, name)
        monkeypatch.setattr(kernels, name, lambda *a, _r=real, _n=name: calls.append(_n) or _r(*a))
    x = torch.randn(PREFILL_MIN_T + 1, 512)
    y = layer(x[:-1])
    assert calls == ["linear"]
    calls.clear()
    layer(x)
    assert calls == ["dequant_lanes"]
    assert torch.equal(y, gemv(x[:-1]))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_float_weights_match_reference(kbuild, dtype):
    """FloatLinear: the native float GEMV (and the prefill tiles, and embedding rows)
    against float64 products of the same 16/32-bit weights."""
    torch.manual_seed(4)
    for n, k in [(1, 8), (7, 64), (33, 576), (5, 1000)]:  # k with and without a tail
        w = (torch.randn(n, k) * 0.05).to(dtype)
        layer = FloatLinear(w, bias=torch.randn(n))
        for t in [1, 3, 8, 9, PREFILL_MIN_T + 1]:
            x = torch.randn(t, k)
            ref = x.double() @ w.double().T + layer.bias.double()
            err = (layer(x).double() - ref).abs()
            assert (err <= 1e-5 * (x.double().abs() @ w.double().abs().T)).all(), (n, k, t)
        assert torch.equal(layer.embed(torch.tensor([n - 1, 0])), w[[n - 1, 0]].float())
    layer.to(torch.bfloat16)  # a model-wide cast leaves the stored weights alone
    assert layer.weight.dtype is dtype


def test_kquant_scales_stay_compact(kbuild, monkeypatch):
    """Q4_K/Q5_K keep the file's scale codes (18.5 bytes per 32 4-bit values, not 24; 22.5
    per 32 5-bit ones, 768 values a row: on AVX-512 a partial last group); a library that
    reads float scales only (kernels.reads_kquant_scales() False) gets float32 copies, same
    results."""
    torch.manual_seed(5)
    for qtype, per32 in ((GT.Q4_K, 18.5), (GT.Q5_K, 22.5)):
        n, k = 33, 768
        layer = QuantLinear.from_gguf(gguf_bytes(qtype, n, k), qtype, n, k)
        assert layer.kquant and layer.nbytes == n * k // 32 * per32
        x = torch.randn(3, k)
        compact = layer(x)
        monkeypatch.setattr(kernels, "reads_kquant_scales", lambda: False)
        layer._cw = None
        assert_close_rel(layer(x), compact.double(), 1e-6)
        assert layer._plain is not None and layer._plain[0].dtype is torch.float32
        monkeypatch.undo()
        use_build(monkeypatch, kbuild)


def test_segmented_layer_runs_mixed_formats_in_one_call(kbuild):
    """A fused projection of parts that pack differently (Q4_K beside a requantized Q6_K,
    Q8_0 and a float16 part): one native call over the chain, equal to the parts."""
    torch.manual_seed(6)
    k = 512
    parts = [
        QuantLinear.from_gguf(gguf_bytes(GT.Q4_K, 40, k), GT.Q4_K, 40, k),
        QuantLinear.from_gguf(gguf_bytes(GT.Q6_K, 24, k), GT.Q6_K, 24, k),
        QuantLinear.from_gguf(gguf_bytes(GT.Q8_0, 8, k), GT.Q8_0, 8, k),
        FloatLinear((torch.randn(16, k) * 0.05).half()),
    ]
    layer = SegmentedLinear(parts, bias=torch.randn(88))
    calls = []
    real = kernels.linear
    with pytest.MonkeyPatch.context() as m:
        m.setattr(kernels, "linear", lambda *a: calls.append(1) or real(*a))
        for t in (1, 3, PREFILL_MIN_T + 1):
            x = torch.randn(t, k)
            calls.clear()
            want = torch.cat([p(x) for p in parts], dim=1) + layer.bias
            if t <= PREFILL_MIN_T:
                calls.clear()
                got = layer(x)
                assert len(calls) == 1  # the whole chain in one call
            else:
                got = layer(x)
            ref = x.double() @ layer.dequantize().double().T + layer.bias.double()
            assert_close_rel(got, ref, 2e-4)
            assert_close_rel(got, want.double(), 1e-5)
    assert layer.nbytes == sum(p.nbytes for p in parts)


@pytest.mark.parametrize("qtype", [GT.Q8_0, GT.Q4_1, GT.Q4_0, GT.Q5_0])
def test_embedding_rows_are_exact(kbuild, qtype):
    n, k = 50, 576
    raw = gguf_bytes(qtype, n, k)
    layer = QuantLinear.from_gguf(raw, qtype, n, k)
    ids = torch.tensor([[3, 0], [49, 3]])
    ref = dequantize(raw, qtype).reshape(n, k)[ids.numpy()]
    assert np.array_equal(layer.embed(ids).numpy(), ref)
    with pytest.raises(IndexError):
        layer.embed(torch.tensor([n]))


def test_forward_shapes_and_dtypes(native):
    layer = QuantLinear.from_float(torch.randn(48, 64), "q8")
    x = torch.randn(2, 3, 64)
    y = layer(x)
    assert y.shape == (2, 3, 48) and y.dtype == torch.float32
    assert layer(x.bfloat16()).dtype == torch.bfloat16
    assert torch.equal(layer(x[:, 1]), y[:, 1])  # non-contiguous input


def test_float_casts_leave_the_packed_format_alone(native):
    layer = QuantLinear.from_float(torch.randn(40, 64), "q4", bias=torch.randn(40))
    x = torch.randn(2, 64)
    y = layer(x)
    layer.to(torch.bfloat16)  # what model.to(dtype) does to every module
    assert layer.scales.dtype == torch.float16 and layer.bias.dtype == torch.bfloat16
    assert torch.allclose(layer(x), y, atol=0.05)  # only the bias lost precision


def test_cat_fuses_projections(kbuild):
    """Parts of one packed format fuse (576 values: 5-bit codes in a partial last group);
    parts of two (5-bit Q5_0 beside 8-bit Q8_0, or 4-bit codes) do not."""
    parts = [
        QuantLinear.from_gguf(gguf_bytes(q, n, 576, seed=n), q, n, 576, bias=torch.randn(n))
        for q, n in [(GT.Q5_0, 64), (GT.Q5_0, 16), (GT.Q5_0, 24)]
    ]
    fused = QuantLinear.cat(parts)
    x = torch.randn(3, 576)
    assert torch.equal(fused(x), torch.cat([p(x) for p in parts], dim=1))
    q8 = QuantLinear.from_gguf(gguf_bytes(GT.Q8_0, 8, 576), GT.Q8_0, 8, 576)
    for other in (q8, QuantLinear.from_float(torch.randn(8, 576), "q4")):
        with pytest.raises(ValueError, match="format"):
            QuantLinear.cat([parts[0], other])


def test_concurrent_callers_get_their_own_results(native):
    """Activation scratch is per calling thread: parallel forwards must not mix."""
    layer = QuantLinear.from_float(torch.randn(256, 1024), "q4")
    xs = [torch.randn(3, 1024) for _ in range(4)]
    expected = [layer(x) for x in xs]
    errors = []

    def run(i):
        for _ in range(50):
            if not torch.equal(layer(xs[i]), expected[i]):
                errors.append(i)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors


def test_single_and_multi_thread_agree(kbuild):
    layer = QuantLinear.from_float(torch.randn(1000, 576), "q4")
    x = torch.randn(5, 576)
    old = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = layer(x)
        torch.set_num_threads(max(2, old))
        assert torch.equal(layer(x), one)
    finally:
        torch.set_num_threads(old)


# ----------------------------------------------------------------------------------
# fallbacks and the build
# ----------------------------------------------------------------------------------


def test_fallback_without_library(monkeypatch):
    raw = gguf_bytes(GT.Q4_1, 40, 576)
    layer = QuantLinear.from_gguf(raw, GT.Q4_1, 40, 576, bias=torch.randn(40))
    monkeypatch.setattr(kernels, "library", lambda: None)
    layer._cw = None
    w = torch.from_numpy(dequantize(raw, GT.Q4_1).reshape(40, 576))
    for t in (1, 100):
        x = torch.randn(t, 576)
        assert torch.allclose(layer(x), F.linear(x, w, layer.bias), rtol=1e-5, atol=1e-5)
    assert torch.equal(layer.embed(torch.tensor([7])), w[7:8])


def test_build_failure_warns_once_and_falls_back(monkeypatch, capsys):
    def fail(*_args, **_kwargs):
        raise build.BuildError("no C compiler found")

    monkeypatch.delenv("TOKENMILL_REQUIRE_NATIVE", raising=False)  # scripts/test.sh sets it
    monkeypatch.setattr(kernels, "_lib", None)
    monkeypatch.setattr(kernels, "_tried", False)
    monkeypatch.setattr(kernels, "compile_library", fail)
    assert kernels.library() is None
    err = capsys.readouterr().err
    assert err.startswith("tokenmill: native kernels unavailable") and "pure-torch" in err
    assert kernels.library() is None  # cached: no second message, no second build
    assert capsys.readouterr().err == ""
    layer = QuantLinear.from_float(torch.randn(8, 64), "q8")
    x = torch.randn(2, 64)
    assert torch.allclose(layer(x), x @ layer.dequantize().T, atol=1e-5)


def test_builds_agree(native, monkeypatch):
    """Every build the host can run (native, AVX2, scalar) gives the native numbers:
    the same integer block dots, float sums in another order. Each packs the codes
    for its own vector width. Prefill-sized x is compared between builds whose prefill
    path is the same (integer GEMM or float32 tiles: each is checked against its own
    reference in test_prefill_path_matches_its_reference)."""
    cases = [
        (GT.Q4_1, 21, 576, 8),
        (GT.Q8_0, 9, 1024 + 96, 16),
        (GT.Q4_K, 5, 768, 16),
        (GT.Q4_0, 5, 576, 16),
        (GT.Q5_1, 7, 1024 + 480, 16),
    ]
    torch.manual_seed(3)
    xs = {k: torch.randn(3, k) for _, _, k, _ in cases}

    def outputs():
        out = []
        for qtype, n, k, act_bits in cases:
            layer = QuantLinear.from_gguf(gguf_bytes(qtype, n, k), qtype, n, k)
            layer.act_bits = act_bits
            rows = layer.embed(torch.tensor([1, 0]))
            big = layer(torch.cat([xs[k]] * 40))  # the prefill path
            out.append((layer(xs[k]), rows, big, kernels.gemm_prefill()))
        return out

    use_build(monkeypatch, "native")
    ref = outputs()
    ran = []
    for name in BUILDS[1:]:
        try:
            use_build(monkeypatch, name)
        except pytest.skip.Exception:
            continue
        ran.append(name)
        for (y, rows, big, gemm), (y0, rows0, big0, gemm0) in zip(outputs(), ref, strict=True):
            assert_close_rel(y, y0.double(), 1e-5)
            assert torch.equal(rows, rows0)  # dequantization is exact everywhere
            if gemm == gemm0:
                assert_close_rel(big, big0.double(), 1e-5)
    if len(BUILDS) > 1 and not ran:
        pytest.skip("no other build runs on this CPU")


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="x86-64 targets")
def test_tokenmill_march_picks_the_build(tmp_path):
    """TOKENMILL_MARCH builds another target: the scalar path on any x86-64 host, and the
    engine's load line names it."""
    code = (
        "from tokenmill import kernels; from tokenmill.kernels import build; "
        "print(kernels.isa(), kernels.group_blocks(), build.default_arch_flags()[0])"
    )
    env = {**os.environ, "TOKENMILL_MARCH": "x86-64-v2"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.stdout.split() == ["scalar", "4", "-march=x86-64-v2"], out.stderr
    env["TOKENMILL_MARCH"] = "x86-64-v2; rm -rf /"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert "TOKENMILL_MARCH" in out.stderr and "not a -march value" in out.stderr


@pytest.mark.skipif(kernels.library() is None, reason="native kernels unavailable")
def test_prefetch_distance_is_8_kb_or_the_environments():
    """The GEMV prefetches 8 KB ahead (tm.h), unless TOKENMILL_PREFETCH says otherwise; the
    products are the same at any distance."""
    code = "from tokenmill import kernels; print(kernels.prefetch_bytes())"

    def distance(value: str | None) -> int:
        env = {k: v for k, v in os.environ.items() if k != "TOKENMILL_PREFETCH"}
        if value is not None:
            env["TOKENMILL_PREFETCH"] = value
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
        return int(out.stdout.strip() or -1)

    assert distance(None) == 8192
    assert distance("4096") == 4096
    assert distance("-5") == 0
    if "TOKENMILL_PREFETCH" not in os.environ:
        assert kernels.prefetch_bytes() == 8192


def test_concurrent_builds_share_one_library(tmp_path):
    """Two processes compiling into an empty cache both end with a loadable library."""
    code = (
        "import ctypes; from tokenmill.kernels import build; "
        "ctypes.CDLL(str(build.compile_library())); print(build.compile_library())"
    )
    env = {"TOKENMILL_CACHE": str(tmp_path), "PATH": "/usr/bin:/bin"}
    procs = [
        subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    outs = [p.communicate(timeout=120)[0].strip() for p in procs]
    assert all(p.returncode == 0 for p in procs)
    assert outs[0] == outs[1] and Path(outs[0]).exists()
    assert not list((tmp_path / "kernels").glob("*.tmp.so"))


@pytest.mark.parametrize("act_bits", [8, 16])
@pytest.mark.parametrize("qtype", list(OWN_GRIDS))
def test_3_bit_i_quants_are_held_as_their_files_bits(kbuild, monkeypatch, qtype, act_bits):
    """With TOKENMILL_GRID_FILE_BITS=1 IQ3_S and IQ3_XXS keep their file's bits, rearranged
    for the lanes (grid indices, 9th bits, signs, a scale nibble per 32): IQ3_S byte for
    byte the file's size, IQ3_XXS a bit per 8 values more (its 7-bit sign indices as their 8
    signs), the grid once per layer. Exact values on every build's lane width (a partial
    group: 768 on AVX-512), repacked for another width alike; the GEMV's and the GEMM's
    products within the float rounding of the exact integers; embedding rows, fused layers
    and experts alike."""
    monkeypatch.setenv(quant_linear.GRID_FILE_BITS_ENV, "1")
    torch.manual_seed(4)
    bits, per32, table = OWN_GRIDS[qtype]
    for n, k in [(5, 768), (3, 2048)]:
        raw = gguf_bytes(qtype, n, k, seed=3)
        ref = dequantize(raw, qtype).reshape(n, k)
        layer = QuantLinear.from_gguf(raw, qtype, n, k)
        assert layer.bits == bits and layer.nbytes - table == n * k // 32 * per32
        if qtype == GT.IQ3_S:
            assert layer.nbytes - table == raw.nbytes
        assert np.array_equal(layer.dequantize().numpy(), ref)
        ids = torch.tensor([[n - 1, 0], [2, 2]])
        assert np.array_equal(layer.embed(ids).numpy(), ref[ids.numpy()])
        gb = layer.group_blocks
        for other in (4, 8, 16):  # another library's lanes, and back
            layer._relayout(other)
            assert np.array_equal(layer.dequantize().numpy(), ref)
        layer._relayout(gb)
        fused = QuantLinear.cat([layer, QuantLinear.from_gguf(raw[:2], qtype, 2, k)])
        assert np.array_equal(fused.dequantize().numpy(), np.concatenate([ref, ref[:2]]))
        fused.act_bits = act_bits
        for t in [1, 3, 8, 17, 50]:  # the GEMV, and the integer GEMM where a build has it
            x = torch.randn(t, k)
            x[0, :32] = 0  # an all-zero block (scale 0)
            err = (fused(x).double() - kernel_reference(fused, x, act_bits)).abs()
            assert (err <= 1e-5 * dot_error_scale(fused, x)).all(), (n, k, t)
            y = kernels.gemm(fused.native(), x, None, act_bits)
            err = (y.double() - kernel_reference(fused, x, act_bits)).abs()
            assert (err <= 1e-5 * dot_error_scale(fused, x)).all(), (n, k, t)
    experts = QuantLinear.from_gguf_experts([[raw[:1], raw[1:2]], [raw[2:3], raw[1:2]]], qtype, k)
    assert experts[1].bits == bits
    assert np.array_equal(experts[1].dequantize().numpy(), ref[[2, 1]])
