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
    """[dim/2] angular frequencies, with linear, llama3 or YaRN scaling applied."""
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
        inv_freq = torch.where(
            mid, (1 - smooth) * inv_freq / rope.factor + smooth * inv_freq, scaled
        )
    elif rope.scaling == "yarn":
        inv_freq = _yarn(rope, dim, inv_freq)
    return inv_freq


def _yarn(rope: RopeConfig, dim: int, inv_freq: torch.Tensor) -> torch.Tensor:
    """[dim/2] YaRN frequencies: dimensions that turn more than beta_fast times over the
    original context keep their frequency (extrapolation), those that turn fewer than
    beta_slow times are divided by `factor` (interpolation), and a linear ramp blends the
    ones between, as transformers' _compute_yarn_parameters does."""

    def dim_turning(turns: float) -> float:  # the dimension that turns `turns` times
        return (dim * math.log(rope.original_max_position / (turns * 2 * math.pi))) / (
            2 * math.log(rope.theta)
        )

    low, high = dim_turning(rope.beta_fast), dim_turning(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # a ramp of zero width
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # [dim/2]: 1 where the plain frequency stays
    base = rope.theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)
    return 1.0 / (rope.factor * base) * (1 - keep) + inv_freq * keep  # rounded as HF rounds


def _longrope_inv(rope: RopeConfig, dim: int, factors: list[float]) -> torch.Tensor:
    """[dim/2] LongRoPE frequencies: the plain ones divided by one set of `factors`."""
    base = rope.theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)
    return 1.0 / (torch.tensor(factors, dtype=torch.float32) * base)


class Rotary(nn.Module):
    def __init__(self, rope: RopeConfig, head_dim: int, max_position: int):
        super().__init__()
        self.rope = rope
        self.dim = rope.dim or head_dim
        self.max_position = max_position
        if rope.scaling == "longrope":
            # Phi-3: the short factors below the original context, the long ones from it on.
            # transformers rotates a whole sequence with one set: short while it fits in
            # original_max_position, long once it is longer, and Phi-3's generate() drops
            # its cache at the crossing to recompute every key with the long set. A paged
            # cache keeps the keys it wrote, so here the set is chosen per position: equal
            # to transformers for every sequence within the original context, and the
            # same whatever the chunking, batching or shared prefix (vLLM mixes the two
            # sets too, chosen per batch).
            short = _longrope_inv(rope, self.dim, rope.short_factor)
            long = _longrope_inv(rope, self.dim, rope.long_factor)
            self._build(short, long, rope.original_max_position)
        else:
            self._build(inv_frequencies(rope, self.dim))

    def _build(
        self, inv_freq: torch.Tensor, long: torch.Tensor | None = None, switch: int = 0
    ) -> None:
        pos = torch.arange(self.max_position, dtype=torch.float32)
        freqs = torch.outer(pos, inv_freq)  # [P, dim/2]
        if long is not None:  # LongRoPE: positions >= switch use the long frequencies
            freqs[switch:] = torch.outer(pos[switch:], long)
        emb = torch.cat([freqs, freqs], dim=-1)  # [P, dim]
        scale = self.rope.attention_factor  # LongRoPE's and YaRN's magnitude correction, else 1
        self.register_buffer("cos", emb.cos() * scale, persistent=False)
        # rotate_half(x) * sin == roll(x, dim/2) * [-sin, sin]: the sign is baked in here so
        # applying RoPE is roll, mul, fused multiply-add.
        sin = emb.sin() * scale
        sin[:, : self.dim // 2] *= -1
        self.register_buffer("sin", sin, persistent=False)

    def set_freq_factors(self, factors: torch.Tensor) -> None:
        """GGUF `rope_freqs`: per-frequency divisors (how llama.cpp stores llama3 scaling)."""
        device = self.cos.device
        self._build(inv_frequencies(self.rope, self.dim) / factors.float().cpu())
        self.cos, self.sin = self.cos.to(device), self.sin.to(device)

    def forward(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor):
        # q: [T, H, hd], k: [T, Hkv, hd], positions: [T]
        cos = self.cos[positions].unsqueeze(1)  # [T, 1, dim]
        sin = self.sin[positions].unsqueeze(1)
        return self._rotate(q, cos, sin), self._rotate(k, cos, sin)

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        dim = self.dim
        if dim == x.shape[-1]:
            xf = x.float()
            return torch.addcmul(xf * cos, xf.roll(dim // 2, -1), sin).to(x.dtype)
        # partial rotary: only the first `dim` features of each head rotate
        rot = x[..., :dim].float()
        out = torch.addcmul(rot * cos, rot.roll(dim // 2, -1), sin).to(x.dtype)
        return torch.cat([out, x[..., dim:]], dim=-1)
