"""A MoE layer's experts pack in one pass per projection (QuantLinear.from_gguf_experts,
models/quantize._pack_experts), byte for byte as the per-expert path packed them.

The reference here is the per-expert packing as it was before that pass: each expert's
slice of the 3-D ffn_*_exps tensor on its own, Q6_K requantized through gguf-py's
dequantize and the torch q8 chain (tests/test_requant_q8's), the codes put in lane order
by kernels/layout.py, gate and up joined with torch.cat. The files are random blocks of
tokenmill/bench/shapes.py's MoE layout at a tiny shape: Q4_K_M (Q4_K gate/up and down in
two layers, Q6_K down in the third, Q6_K output) and Q8_0.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf.constants import GGML_QUANT_SIZES
from gguf.quants import dequantize as gguf_dequantize
from test_requant_q8 import _reference_q8

from tokenmill import LLM, SamplingParams, kernels
from tokenmill.bench import shapes
from tokenmill.kernels.layout import half_scale_perm, pack6, pack_codes
from tokenmill.layers.quant_linear import (
    QuantLinear,
    _dequantize_q6_k,
    _pack_lanes,
    _quantize_rows,
)
from tokenmill.loader import open_checkpoint
from tokenmill.loader.gguf_blocks import EXACT_GGUF_TYPES, parse_exact, parse_q6_k
from tokenmill.models import quantize

GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
BUFFERS = ("codes", "scales_raw", "mins_raw", "dsup_raw", "msup_raw")


def _write(tmp_path, ftype: str, fe: int, monkeypatch) -> Path:
    """A 3-layer qwen3moe file of random blocks: d 512, 8 experts of fe, top 2."""
    tiny = dict(arch="qwen3moe", d=512, heads=4, kv=2, hd=64, experts=8, fe=fe, top=2,
                vocab=300, theta=10000.0, qk_norm="head", layers=3)  # fmt: skip
    monkeypatch.setitem(shapes.MOE, "tiny", tiny)
    path = tmp_path / f"tiny-{ftype}-{fe}.gguf"
    shapes.write("tiny", ftype, path, layers=3)
    return path


def _old_pack(raw: np.ndarray, qtype: Q, k: int) -> dict:
    """One expert's projection [rows, row bytes] as the per-expert path packed it:
    {buffer name: tensor}, bits."""
    rows = raw.shape[0]
    gb = kernels.group_blocks()
    blocks = raw.reshape(rows, -1, GGML_QUANT_SIZES[qtype][1])
    if qtype == Q.Q6_K and QuantLinear.runs_6bit(k):
        nat, sc, mn, bits, sup = parse_q6_k(blocks)
    elif qtype in EXACT_GGUF_TYPES:
        nat, sc, mn, bits, sup = parse_exact(blocks, qtype)
    else:  # gguf-py's floats, the torch q8 chain
        w = torch.from_numpy(gguf_dequantize(np.ascontiguousarray(raw), qtype).reshape(rows, -1))
        (nat, sc), mn, bits, sup = _reference_q8(w), None, 8, None
    if bits == 6:
        codes, sc = pack6(nat, gb), sc[:, half_scale_perm(k, gb)]
    else:
        codes = pack_codes(nat, bits, gb)
    lin = QuantLinear(
        torch.from_numpy(np.ascontiguousarray(codes)),
        torch.from_numpy(np.ascontiguousarray(sc)),
        None if mn is None else torch.from_numpy(np.ascontiguousarray(mn)),
        bits, k, rows, None, gb,
        None if sup is None else torch.from_numpy(np.ascontiguousarray(sup)),
    )  # fmt: skip
    return lin


def _old_experts(ckpt, layer: int, experts: int) -> dict[str, QuantLinear]:
    """{experts.j.up / .down: layer} of MoE layer `layer`, one expert at a time."""
    out = {}
    for j in range(experts):
        stem = f"layers.{layer}.mlp.experts.{j}"
        for proj, parts in (("up", ("gate", "up")), ("down", ("down",))):
            layers = []
            for part in parts:
                qtype, data = ckpt.raw[f"{stem}.{part}.weight"]()
                k = data.shape[1] // GGML_QUANT_SIZES[qtype][1] * GGML_QUANT_SIZES[qtype][0]
                layers.append(_old_pack(np.asarray(data), qtype, k))
            out[f"{stem}.{proj}"] = layers[0] if len(layers) == 1 else QuantLinear.cat(layers)
    return out


def _assert_same_bytes(got: QuantLinear, want: QuantLinear, name: str) -> None:
    assert (got.bits, got.group_blocks, got.in_features, got.out_features) == (
        want.bits, want.group_blocks, want.in_features, want.out_features,
    ), name  # fmt: skip
    for b in BUFFERS:
        g, w = getattr(got, b), getattr(want, b)
        assert (g is None) == (w is None), (name, b)
        if g is not None:
            assert g.dtype == w.dtype and g.shape == w.shape, (name, b)
            assert torch.equal(g.contiguous().view(torch.uint8), w.contiguous().view(torch.uint8)), (
                name, b,
            )  # fmt: skip


@pytest.mark.parametrize(
    "ftype, fe, six",
    [
        ("q4_k_m", 256, None),  # Q6_K down of 256 inputs: a half group on AVX-512
        ("q4_k_m", 512, True),  # Q6_K down of 512 inputs: 6-bit codes where a kernel reads them
        ("q4_k_m", 512, False),  # ... and requantized, as on a build without 6-bit kernels
        ("q8_0", 256, None),
    ],
)
def test_experts_pack_byte_identical_to_the_per_expert_path(tmp_path, monkeypatch, ftype, fe, six):
    path = _write(tmp_path, ftype, fe, monkeypatch)
    if six is not None:
        if six and not QuantLinear.runs_6bit(fe):
            pytest.skip("this build's kernels read no 6-bit codes of this width")
        monkeypatch.setattr(QuantLinear, "runs_6bit", staticmethod(lambda k: six))
    llm = LLM(path, kv_cache_memory="256tok")
    model = llm.engine.model
    ckpt = open_checkpoint(path)
    types = set()
    for i in range(3):
        moe = model.layers[i].mlp
        for name, want in _old_experts(ckpt, i, 8).items():
            got = model.get_submodule(name)
            assert isinstance(got, QuantLinear), name
            _assert_same_bytes(got, want, name)
        types |= {ckpt.raw[f"layers.{i}.mlp.experts.0.{p}.weight"]()[0] for p in ("up", "down")}
        # each expert's layer views the projection's one buffer: no copies
        assert moe.experts[1].up.codes.untyped_storage().data_ptr() == (
            moe.experts[0].up.codes.untyped_storage().data_ptr()
        )
    assert types == ({Q.Q8_0} if ftype == "q8_0" else {Q.Q4_K, Q.Q6_K})
    # the same greedy tokens as the per-expert path (_pack for each expert, as any projection)
    prompt = list(range(5, 40))
    fast = llm.generate([prompt], GREEDY)[0].token_ids
    monkeypatch.setattr(quantize, "_pack_experts", lambda *a: {})
    slow = LLM(path, kv_cache_memory="256tok")
    for name, want in _old_experts(ckpt, 2, 8).items():
        _assert_same_bytes(slow.engine.model.get_submodule(name), want, name)
    assert slow.generate([prompt], GREEDY)[0].token_ids == fast


def test_q6_k_dequantize_bit_identical_to_gguf():
    """_dequantize_q6_k (the requant path's floats) against gguf-py's, on random blocks:
    negative sub-scales, every code, d from tiny to large."""
    rng = np.random.default_rng(3)
    rows, k = 37, 768
    raw = rng.integers(0, 256, (rows, k // 256, 210), dtype=np.uint8)
    d = rng.standard_normal((rows, k // 256)) * 10.0 ** rng.integers(-6, 3, (rows, k // 256))
    raw[..., 208:210] = d.astype(np.float16)[..., None].view(np.uint8)
    got = _dequantize_q6_k(raw)
    want = gguf_dequantize(raw.reshape(rows, -1), Q.Q6_K).reshape(rows, k)
    assert got.dtype == np.float32
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))


def test_q8_requant_bit_identical_on_extremes():
    """_quantize_rows (numpy) against the torch chain on values whose scale rounds to a
    float16 subnormal, overflows it, or is zero, and on exact ties."""
    g = torch.Generator().manual_seed(5)
    w = torch.randn(64, 256, generator=g)
    w[:16] *= 1e-6  # subnormal float16 scales
    w[16:20] *= 1e7  # scales beyond float16: inf
    w[20, :64] = 0
    w[21] = torch.randint(-8, 9, (256,), generator=g).float() * 0.25
    codes, d, _, _, _ = _quantize_rows(w, "q8")
    ref_codes, ref_d = _reference_q8(w)
    assert np.array_equal(d.view(np.uint16), ref_d.view(np.uint16))
    assert np.array_equal(codes, ref_codes)
    # and from numpy, as the GGUF requant path hands it
    codes_np, d_np, _, _, _ = _quantize_rows(w.numpy(), "q8")
    assert np.array_equal(codes_np, codes) and np.array_equal(
        d_np.view(np.uint16), d.view(np.uint16)
    )


@pytest.mark.parametrize("bits", [4, 8])
def test_pack_lanes_equals_pack_codes(bits):
    """_pack_lanes (word reshapes, into a view of a bigger buffer) against layout.pack_codes
    (index gathers) for every group width and rows of whole groups, tails of 64-value
    chunks, and a last single block."""
    rng = np.random.default_rng(bits)
    for k in (32, 64, 96, 160, 256, 512, 768, 800, 2048, 2080):
        for gb in (1, 2, 4, 8, 16):
            nat = rng.integers(0, 1 << bits, (3, 5, k), dtype=np.uint8)
            big = np.zeros((3, 7, k * bits // 8 + 16), np.uint8)
            _pack_lanes(nat, bits, gb, big[:, 1:6, 16:])
            want = pack_codes(nat.reshape(15, k), bits, gb)
            assert np.array_equal(big[:, 1:6, 16:].reshape(15, -1), want), (k, gb)
            assert not big[:, [0, 6]].any() and not big[..., :16].any()  # nothing outside
