"""The feed-forward network applied to every token after attention.

gated (Llama SwiGLU, Gemma GeGLU): down(act(gate(x)) * up(x))
plain (GPT-2):                     down(act(up(x)))
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
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        d, f = cfg.hidden_size, cfg.intermediate_size
        self.gated = cfg.mlp == "gated"
        self.gate = Linear(d, f, bias=cfg.mlp_bias) if self.gated else None
        self.up = Linear(d, f, bias=cfg.mlp_bias)
        self.down = Linear(f, d, bias=cfg.mlp_bias)
        self.act = ACTIVATIONS[cfg.activation]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, d] -> [T, f] -> [T, d]
        if self.gated:
            return self.down(self.act(self.gate(x)) * self.up(x))
        return self.down(self.act(self.up(x)))
