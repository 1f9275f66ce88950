"""The numpy q8 requantizer (_quantize_rows) against the torch chain it replaced."""

import numpy as np
import torch

from tokenmill.layers.quant_linear import _quantize_rows


def _reference_q8(w: torch.Tensor):
    """The previous torch implementation: w float32 [rows, K] -> (codes u8, d f16)."""
    rows, k = w.shape
    b = w.reshape(rows, k // 32, 32)
    d = (b.abs().amax(-1) / 127).half()
    inv = torch.where(d == 0, 0.0, 1.0 / d.float())
    q = torch.round(b * inv[..., None]).clamp(-127, 127).to(torch.int16) + 128
    return q.to(torch.uint8).reshape(rows, k).numpy(), d.numpy()


def test_q8_codes_bit_identical_to_torch_reference():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(257, 768, generator=g) * 0.05
    w[3] = 0  # all-zero blocks: d == 0 -> codes 128
    w[5, :32] = torch.arange(32, dtype=torch.float32) - 15.5  # half-way values after scaling
    w[7] = torch.randint(-4, 5, (768,), generator=g).float() / 2  # many exact ties
    codes, d, mins, bits, sup = _quantize_rows(w, "q8")
    ref_codes, ref_d = _reference_q8(w)
    assert bits == 8 and mins is None and sup is None
    assert np.array_equal(d.view(np.uint16), ref_d.view(np.uint16))
    assert np.array_equal(codes, ref_codes)
    assert (codes[3] == 128).all()
