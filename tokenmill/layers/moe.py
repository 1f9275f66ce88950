"""The Mixture-of-Experts feed-forward network (Qwen2-MoE, Qwen3-MoE, Mixtral, OLMoE,
gpt-oss, Granite-MoE).

Per token x [d]:
    logits = router(x)                                   [E]
    w, e   = top-k of softmax(logits)  (or softmax of the top-k logits), optionally
             renormalized to sum to 1 (norm_topk_prob)   [k], [k]
    y      = sum_j w_j * expert_{e_j}(x)                 each expert a gated MLP (mlp.py)
           + sigmoid(shared_gate(x)) * shared(x)         Qwen2-MoE's shared expert only
             (Granite-MoE-shared: + shared(x), no gate)

A step's tokens are grouped by expert: one matmul per active expert over the rows that
chose it (so rows that picked the same expert share one read of its weights), added back
with index_add. Rows never mix: each output row sums only its own k experts' rows.

On a traced step (meta.trace set) the router's choice is handed to the trace's hooks
(ForwardHooks.on_router, layers/attention.py): ids and weights [T, k] of every row, as
computed here; the hook keeps the traced request's rows.

Experts are separate `MLP` modules whose projections are `Linear`s, so models/quantize.py
packs them like any other projection (FloatLinear, QuantLinear). The router and the
shared expert's gate are `Gate`s, not `Linear`s: they stay float, since a routing choice
flipped by rounding costs more than a rounded weight. Parameter names (loader/shapes.py):
    mlp.router.{weight [E, d], bias [E]}    mlp.experts.j.{up [2fe, d] (gate; up), down [d, fe]}
    mlp.shared.{up [2fs, d], down [d, fs]}  mlp.shared_gate.weight [1, d]
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.config import ModelConfig
from tokenmill.layers.attention import AttentionMetadata
from tokenmill.layers.mlp import MLP


class Gate(nn.Module):
    """A small float linear (router, shared-expert gate) that quantization leaves alone."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class MoE(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int = 0):
        super().__init__()
        self.layer_idx = layer_idx  # named in the trace's router records
        d = cfg.hidden_size
        self.num_experts, self.top_k = cfg.num_experts, cfg.num_experts_per_tok
        self.router_kind, self.norm_topk_prob = cfg.router, cfg.norm_topk_prob
        self.router = Gate(d, cfg.num_experts, bias=cfg.router_bias)
        self.experts = nn.ModuleList(
            MLP(cfg, cfg.moe_intermediate_size) for _ in range(cfg.num_experts)
        )
        fs = cfg.shared_expert_intermediate_size
        self.shared = MLP(cfg, fs) if fs else None
        self.shared_gate = Gate(d, 1) if fs and cfg.shared_expert_gate else None

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, d] -> (weights [T, k] in x's dtype, expert ids [T, k] int64)."""
        logits = self.router(x)  # [T, E], in the activation dtype as the references do
        if self.router_kind == "softmax_topk":
            probs = torch.softmax(logits, dim=-1, dtype=torch.float32)  # [T, E]
            weights, ids = torch.topk(probs, self.top_k, dim=-1)  # [T, k]
            if self.norm_topk_prob:
                weights = weights / weights.sum(dim=-1, keepdim=True)
        else:  # topk_softmax
            top, ids = torch.topk(logits, self.top_k, dim=-1)
            weights = torch.softmax(top, dim=-1, dtype=torch.float32)
        return weights.to(x.dtype), ids

    def forward(self, x: torch.Tensor, meta: AttentionMetadata | None = None) -> torch.Tensor:
        # x: [T, d] -> [T, d]; meta: the step's batch, for its trace (None: untraced)
        weights, ids = self.route(x)  # [T, k], [T, k]
        if meta is not None and meta.trace is not None:
            meta.trace.hooks.on_router(meta, self.layer_idx, ids, weights)
        out = torch.zeros_like(x)  # [T, d]
        # ---- group the T*k (token, expert) pairs by expert ----
        flat = ids.reshape(-1)  # [T k]: pair p is token p // k's (p % k)-th choice
        order = torch.argsort(flat, stable=True)  # [T k] pairs sorted by expert
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()  # [E]
        pair_weights = weights.reshape(-1)  # [T k]
        start = 0
        for e, n in enumerate(counts):
            if n == 0:
                continue
            pairs = order[start : start + n]  # [n]: the pairs that chose expert e
            start += n
            rows = pairs // self.top_k  # [n] token rows, each at most once (top-k ids differ)
            h = self.experts[e](x[rows])  # [n, d]: one matmul over the expert's rows
            out.index_add_(0, rows, h * pair_weights[pairs, None])
        if self.shared is not None and self.shared_gate is None:  # Granite: ungated
            out = out + self.shared(x)
        elif self.shared is not None:
            gate = torch.sigmoid(self.shared_gate(x))  # [T, 1]
            out = out + gate * self.shared(x)
        return out
