"""The feed-forward network applied to every token after attention.

gated (Llama SwiGLU, Gemma GeGLU): down(act(gate(x)) * up(x))
clamped (gpt-oss's SwiGLU):        down((u + 1) * g * sigmoid(alpha g)), with
                                   g = min(gate(x), limit), u = clamp(up(x), -limit, limit)
plain (GPT-2):                     down(act(up(x)))
For gated MLPs `up` holds [gate; up] stacked: [2f, d].
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.config import ModelConfig
from tokenmill.layers.linear import Linear

ACTIVATIONS = {
    "silu": F.silu,
    "gelu": F.gelu,
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
}


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, intermediate_size: int | None = None):
        super().__init__()
        # intermediate_size: an MoE expert's own width (layers/moe.py); None: the config's
        d, f = cfg.hidden_size, intermediate_size or cfg.intermediate_size
        self.gated = cfg.mlp == "gated"
        self.f = f
        # gated: gate and up projections fused into one [2f, d] matrix (one GEMV, not two)
        self.up = Linear(d, 2 * f if self.gated else f, bias=cfg.mlp_bias)
        self.down = Linear(f, d, bias=cfg.mlp_bias)
        self.act = ACTIVATIONS[cfg.activation]
        self.limit, self.alpha = cfg.swiglu_limit, cfg.swiglu_alpha

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, d] -> [T, f] -> [T, d]
        h = self.up(x)
        if self.limit is not None:  # gpt-oss
            g = h[:, : self.f].clamp(max=self.limit)
            u = h[:, self.f :].clamp(-self.limit, self.limit)
            return self.down((u + 1) * (g * torch.sigmoid(g * self.alpha)))
        if self.gated:
            return self.down(self.act(h[:, : self.f]) * h[:, self.f :])
        return self.down(self.act(h))
