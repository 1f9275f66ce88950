"""Tiled prefill attention (tokenmill/layers/tiled_attention.py) equals
attention written out whole: causal, with chunk offsets, sliding-window masks, Gemma 2's
soft-cap, gpt-oss's sinks, grouped-query heads and tiles that do not divide the context;
and equals torch's SDPA where SDPA applies."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenmill.layers.tiled_attention import tiled_attention


def whole(q, k, v, scale, mask=None, causal=False, softcap=None, sinks=None):
    """The untiled oracle: every score [B, H, L, C] at once, in float64."""
    B, H, L, _ = q.shape
    rep = H // k.shape[1]
    k, v = k.double().repeat_interleave(rep, 1), v.double().repeat_interleave(rep, 1)
    s = (q.double() @ k.transpose(-1, -2)) * scale
    if softcap is not None:
        s = torch.tanh(s / softcap) * softcap
    C = s.shape[-1]
    if causal:
        mask = torch.ones(L, C, dtype=torch.bool).tril(C - L)
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    if sinks is not None:
        sink = sinks.double().view(1, H, 1, 1).expand(B, H, L, 1)
        return (torch.softmax(torch.cat([s, sink], -1), -1)[..., :-1] @ v).float()
    return (torch.softmax(s, -1) @ v).float()


def window_mask(L: int, C: int, window: int) -> torch.Tensor:
    """[L, C]: query i (position i + C - L) sees keys within `window` behind it."""
    pos = torch.arange(L).view(L, 1) + (C - L)
    keys = torch.arange(C).view(1, C)
    return (keys <= pos) & (keys > pos - window)


@settings(max_examples=40, deadline=None)
@given(
    L=st.integers(1, 40),
    extra=st.integers(0, 70),
    heads=st.sampled_from([(4, 4), (4, 2), (6, 1)]),
    tile=st.integers(1, 33),
    kind=st.sampled_from(["causal", "window", "mask"]),
    softcap=st.sampled_from([None, 5.0]),
    sink=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_tiles_equal_the_whole(L, extra, heads, tile, kind, softcap, sink, seed):
    g = torch.Generator().manual_seed(seed)
    H, Hkv = heads
    C, hd, B = L + extra, 8, 2
    q = torch.randn(B, H, L, hd, generator=g) * 2
    k, v = torch.randn(B, Hkv, C, hd, generator=g) * 2, torch.randn(B, Hkv, C, hd, generator=g)
    sinks = torch.randn(H, generator=g) * 3 if sink else None
    mask, causal = None, kind == "causal"
    if kind == "window":
        mask = window_mask(L, C, window=max(1, C // 3))
    elif kind == "mask":  # per batch row, as decode masks are: [B, 1, L, C], each row sees key 0
        mask = torch.rand(B, 1, L, C, generator=g) < 0.5
        mask[..., 0] = True
    want = whole(q, k, v, 0.3, mask, causal, softcap, sinks)
    got = tiled_attention(
        q, k, v, scale=0.3, mask=mask, causal=causal, softcap=softcap, sinks=sinks, tile=tile
    )
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("L, C", [(64, 64), (17, 300), (1, 129)])
def test_equals_sdpa(L, C):
    g = torch.Generator().manual_seed(L * C)
    q, k, v = (torch.randn(1, 6, n, 16, generator=g) for n in (L, C, C))
    k, v = k[:, :2], v[:, :2]
    mask = torch.ones(L, C, dtype=torch.bool).tril(C - L)
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.25, enable_gqa=True)
    for causal, m in ((True, None), (False, mask)):
        got = tiled_attention(q, k, v, scale=0.25, mask=m, causal=causal, tile=32)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_tiles_before_the_window_are_skipped(monkeypatch):
    """A sliding window far behind the chunk: the tiles before it are never multiplied."""
    L, C, window = 8, 4096, 64
    q, k, v = torch.randn(1, 2, L, 8), torch.randn(1, 2, C, 8), torch.randn(1, 2, C, 8)
    calls = []
    real = torch.exp
    monkeypatch.setattr(torch, "exp", lambda x: calls.append(x.shape) or real(x))
    mask = window_mask(L, C, window)
    got = tiled_attention(q, k, v, scale=0.35, mask=mask, tile=256)
    assert len(calls) == 2 * 1  # one tile holds the window: exp of scores and of the rescale
    torch.testing.assert_close(got, whole(q, k, v, 0.35, mask), atol=2e-5, rtol=1e-4)


def test_memory_grows_with_the_tile_not_the_context():
    """The largest tensor made for a 256-query chunk over 16k keys is ~L x TILE, where the
    whole form makes H x L x C float32 scores (here 64 MiB against the tiles' 4 MiB)."""
    L, C, H = 256, 16384, 4
    q, k, v = torch.randn(1, H, L, 64), torch.randn(1, 1, C, 64), torch.randn(1, 1, C, 64)
    sizes = []
    from torch.utils._python_dispatch import TorchDispatchMode

    class Sizes(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if isinstance(out, torch.Tensor):
                sizes.append(out.numel() * out.element_size())
            return out

    with Sizes():
        tiled_attention(q, k, v, scale=0.125, causal=True, softcap=30.0, tile=512)
    assert max(sizes) <= H * L * 512 * 4 * 1.01, max(sizes) >> 20
    assert max(sizes) < H * L * C * 4 / 8
