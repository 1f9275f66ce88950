"""How position enters the model, as a small JSON-able sample: the rotation angles of RoPE,
or the learned vectors added to the embeddings (GPT-2).

The engine hands traces `position_sample` through EngineView.position_encoding
(engine/hooks.py), so it lives here, beside the model it reads, where the engine may import
it; the trace (inspect/trace.py) records what it returns.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor


def rounded(values: Tensor | list[float], digits: int = 4) -> list:
    """A tensor (any rank) as nested lists of rounded floats: compact JSON."""
    if isinstance(values, Tensor):
        values = values.detach().float().cpu().tolist()
    if isinstance(values, list):
        return [rounded(v, digits) for v in values]
    return round(values, digits) if math.isfinite(values) else None


def position_sample(model, positions: list[int], sample_dims: int) -> dict[str, Any]:
    """How position enters at `positions` (the caller keeps them few: the trace passes at
    most its MAX_SAMPLE_ROWS), in the first `sample_dims` dims: RoPE rotation angles, or the
    learned vector added. model: a models.transformer.Transformer."""
    if model.pos_embed is not None:
        rows = model.pos_embed.weight[positions, :sample_dims]
        return {"kind": "learned", "sample": rounded(rows)}
    rotary = model.rotary
    half = rotary.dim // 2
    pairs = min(sample_dims, half)
    # Rotate unit vectors through the model's own RoPE: e_i at position p comes out as
    # cos(p·θ_i) in dim i and sin(p·θ_i) in dim i + dim/2 (rotate-half layout).
    pos = torch.tensor([1, *positions], device=rotary.cos.device)
    units = torch.zeros(len(pos), pairs, model.cfg.head_dim, device=pos.device)
    units[:, range(pairs), range(pairs)] = 1.0
    out, _ = rotary(units, units[:, :1], pos)
    cos, sin = (
        out[:, range(pairs), range(pairs)],
        out[:, range(pairs), range(half, half + pairs)],
    )
    inv_freq = torch.atan2(sin[0], cos[0])  # θ_i < π, so position 1 gives it exactly
    return {
        "kind": "rope",
        "rotary_dims": rotary.dim,
        "inv_freq": rounded(inv_freq, 6),
        "angles": rounded(torch.outer(pos[1:].float(), inv_freq), 4),
        "cos": rounded(cos[1:]),
        "sin": rounded(sin[1:]),
    }
