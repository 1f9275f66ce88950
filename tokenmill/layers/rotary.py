"""Rotary position embedding (RoPE): position enters attention by rotating q and k.

Each pair of dimensions (i, i + d/2) of a head is rotated by angle pos * inv_freq[i]
("rotate half" / NEOX layout, as in HF; GGUF llama Q/K rows are unpermuted at load
so one layout serves every format). cos/sin are precomputed for all positions.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from tokenmill.config import RopeConfig


def inv_frequencies(rope: RopeConfig, dim: int) -> torch.Tensor:
    """[dim/2] angular frequencies, with linear or llama3 scaling applied."""
    # float32 throughout, as the HF reference computes it.
    inv_freq = 1.0 / (rope.theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    if rope.scaling == "linear":
        inv_freq = inv_freq / rope.factor
    elif rope.scaling == "llama3":
        # Llama 3.1: long wavelengths are slowed by `factor`, short ones kept,
        # and the band between is interpolated smoothly.
        low_wavelen = rope.original_max_position / rope.low_freq_factor
        high_wavelen = rope.original_max_position / rope.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        smooth = (rope.original_max_position / wavelen - rope.low_freq_factor) / (
            rope.high_freq_factor - rope.low_freq_factor
        )
        scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
        mid = (wavelen <= low_wavelen) & (wavelen >= high_wavelen)
        inv_freq = torch.where(mid, (1 - smooth) * inv_freq / rope.factor + smooth * inv_freq, scaled)
    return inv_freq


class Rotary(nn.Module):
    def __init__(self, rope: RopeConfig, head_dim: int, max_position: int):
        super().__init__()
        self.rope = rope
        self.dim = rope.dim or head_dim
        self.max_position = max_position
        self._build(inv_frequencies(rope, self.dim))

    def _build(self, inv_freq: torch.Tensor) -> None:
        pos = torch.arange(self.max_position, dtype=torch.float32)
        freqs = torch.outer(pos, inv_freq)  # [P, dim/2]
        emb = torch.cat([freqs, freqs], dim=-1)  # [P, dim]
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)

    def set_freq_factors(self, factors: torch.Tensor) -> None:
        """GGUF `rope_freqs`: per-frequency divisors (how llama.cpp stores llama3 scaling)."""
        device = self.cos.device
        self._build(inv_frequencies(self.rope, self.dim) / factors.float().cpu())
        self.cos, self.sin = self.cos.to(device), self.sin.to(device)

    def forward(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor):
        # q: [T, H, hd], k: [T, Hkv, hd], positions: [T]
        cos = self.cos[positions].unsqueeze(1)  # [T, 1, dim]
        sin = self.sin[positions].unsqueeze(1)
        return _rotate(q, cos, sin, self.dim), _rotate(k, cos, sin, self.dim)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, dim: int) -> torch.Tensor:
    rot, rest = x[..., :dim], x[..., dim:]
    x1, x2 = rot.float().chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    out = (rot.float() * cos + rotated * sin).to(x.dtype)
    return out if rest.shape[-1] == 0 else torch.cat([out, rest], dim=-1)
