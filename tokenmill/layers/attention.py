"""Masked multi-head attention over a paged KV cache.

One forward pass carries a packed batch: T tokens from several sequences laid end
to end. The first `num_decode` rows are decode steps (one new token each); after
them come prefill chunks (many tokens of one sequence). Every new token's K and V
are written into the cache pool at its slot (block * block_size + offset); queries
then read their sequence's keys and values back through the slots of its blocks.

Shapes: T packed tokens, H query heads, Hkv key/value heads (H % Hkv == 0: MHA,
GQA and MQA alike), hd head dim, C context length.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill import kernels
from tokenmill.config import ModelConfig
from tokenmill.layers.linear import Linear
from tokenmill.layers.norm import RMSNorm
from tokenmill.layers.rotary import Rotary

# Decode rows of float32 CPU batches run their whole attention in one native call
# (tokenmill/kernels, tm_decode_attention) instead of ~40 torch ops per layer; the torch
# path below stays the reference. TOKENMILL_FUSED_DECODE=0 turns it off.
FUSED_DECODE = os.environ.get("TOKENMILL_FUSED_DECODE", "1") != "0"


@dataclass
class PrefillSpan:
    start: int  # first row of this chunk in the packed batch
    end: int  # one past its last row
    context_len: int  # tokens of the sequence after this chunk (cached + new)
    # [context_len] cache slots of the whole context; None when the chunk is the whole
    # context (nothing cached before it), so attention reads the fresh K/V directly.
    slots: torch.Tensor | None


@dataclass
class AttentionMetadata:
    positions: torch.Tensor  # [T] position of each token in its sequence
    slot_mapping: torch.Tensor  # [T] cache slot each new token's K/V is written to
    num_decode: int = 0
    decode_slots: torch.Tensor | None = None  # [Bd, Cmax] slots to read, padded
    decode_context_lens: torch.Tensor | None = None  # [Bd]
    prefills: list[PrefillSpan] = field(default_factory=list)
    # Tracing (tokenmill/trace.py): the traced request's rows in the packed batch, and
    # where its attention runs: ("decode", row) or ("prefill", span index). None when off.
    trace: object | None = None
    trace_rows: slice | None = None
    trace_attn: tuple[str, int] | None = None
    _masks: dict = field(default_factory=dict)

    def decode_mask(self, window: int | None) -> torch.Tensor:
        """[Bd, 1, 1, Cmax] bool: which padded cache slots each decode query may see."""
        key = ("decode", window)
        if key not in self._masks:
            cmax = self.decode_slots.shape[1]
            j = torch.arange(cmax, device=self.decode_slots.device)
            ctx = self.decode_context_lens.unsqueeze(1)  # [Bd, 1]
            ok = j < ctx
            if window is not None:
                ok &= j >= ctx - window  # the query sits at position ctx - 1
            self._masks[key] = ok[:, None, None, :]
        return self._masks[key]

    def prefill_mask(self, i: int, window: int | None) -> torch.Tensor | None:
        """[L, C] bool causal (and sliding-window) mask for prefill span i; None = plain causal."""
        span = self.prefills[i]
        length = span.end - span.start
        if span.slots is None and (window is None or window >= length):
            return None
        key = ("prefill", i, window)
        if key not in self._masks:
            device = self.positions.device
            q = torch.arange(span.context_len - length, span.context_len, device=device)[:, None]
            k = torch.arange(span.context_len, device=device)[None, :]
            ok = k <= q
            if window is not None:
                ok &= q - k < window
            self._masks[key] = ok
        return self._masks[key]


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int, rotary: Rotary | None):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads, self.head_dim = (
            cfg.num_heads,
            cfg.num_kv_heads,
            cfg.head_dim,
        )
        self.scale = cfg.attn_scale
        self.window = cfg.sliding_window if cfg.layer_types[layer_idx] == "sliding" else None
        d = cfg.hidden_size
        self.q_size, self.kv_size = cfg.q_size, cfg.kv_size
        # Q, K and V projections fused into one matrix [q_size + 2 kv_size, d]: one GEMV per
        # layer instead of three. The loader concatenates the checkpoint's q/k/v rows.
        self.qkv = Linear(d, cfg.q_size + 2 * cfg.kv_size, bias=cfg.qkv_bias)
        self.o = Linear(cfg.q_size, d, bias=cfg.o_bias)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.norm_eps) if cfg.qk_norm else None
        self.rotary = rotary
        # This layer's view of the cache pool, [num_slots, Hkv, hd] each; set by the runner.
        self.k_cache: torch.Tensor | None = None
        self.v_cache: torch.Tensor | None = None

    def forward(self, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        T = x.shape[0]
        # ---- Q, K, V projections: [T, d] -> [T, q_size + 2 kv_size] ----
        qkv = self.qkv(x)
        out = torch.empty(T, self.q_size, dtype=qkv.dtype, device=qkv.device)  # [T, H hd]
        nd = meta.num_decode if self._fused_decode_ok(qkv, meta) else 0
        if nd:
            # ---- decode rows: the whole attention in one native call ----
            self._fused_decode(qkv[:nd], meta, out[:nd])
        if nd < T:
            self._attend(qkv, meta, out, nd)
        return self.o(out)

    def _fused_decode_ok(self, qkv: torch.Tensor, meta: AttentionMetadata) -> bool:
        """Whether the decode rows can take the native fused path (float32 CPU, no tracing)."""
        return (
            FUSED_DECODE
            and meta.num_decode > 0
            and meta.trace is None
            and qkv.dtype is torch.float32
            and qkv.device.type == "cpu"
            and self.k_cache.dtype is torch.float32
            and kernels.library() is not None
        )

    def _fused_decode(self, qkv: torch.Tensor, meta: AttentionMetadata, out: torch.Tensor) -> None:
        # qkv [Bd, q_size + 2 kv_size] -> out [Bd, q_size]; also writes the rows' K/V to the cache
        nd = qkv.shape[0]
        rot = self.rotary
        kernels.decode_attention(
            qkv.contiguous(), out, self.num_heads, self.num_kv_heads, self.head_dim,
            None if self.q_norm is None else self.q_norm.weight,
            None if self.k_norm is None else self.k_norm.weight,
            0.0 if self.q_norm is None else self.q_norm.eps,
            None if rot is None else rot.cos, None if rot is None else rot.sin,
            meta.positions[:nd], self.k_cache, self.v_cache, meta.slot_mapping[:nd],
            meta.decode_slots, meta.decode_context_lens, self.window or 0,
            self.head_dim**-0.5 if self.scale is None else self.scale,
        )  # fmt: skip

    def _attend(self, qkv: torch.Tensor, meta: AttentionMetadata, out: torch.Tensor, r0: int):
        """The torch path for packed rows r0.. of qkv [T, q_size + 2 kv_size], into out
        [T, q_size]. r0 = num_decode when the fused path did the decode rows, else 0."""
        qkv, positions, slot_mapping = qkv[r0:], meta.positions[r0:], meta.slot_mapping[r0:]
        T = qkv.shape[0]
        q = qkv[:, : self.q_size].view(T, self.num_heads, self.head_dim)
        k = qkv[:, self.q_size : self.q_size + self.kv_size].view(
            T, self.num_kv_heads, self.head_dim
        )
        v = qkv[:, self.q_size + self.kv_size :].view(T, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        # ---- positions: rotate q and k by each token's position ----
        if self.rotary is not None:
            q, k = self.rotary(q, k, positions)
        # ---- KV cache write: every new token's K/V goes to its slot ----
        self.k_cache.index_copy_(0, slot_mapping, k)
        self.v_cache.index_copy_(0, slot_mapping, v)

        out = out[r0:].view(T, self.num_heads, self.head_dim)
        nd = meta.num_decode - r0
        if nd:
            # ---- decode rows: one query each over its cached context ----
            keys = self.k_cache[meta.decode_slots].transpose(1, 2)  # [Bd, Hkv, Cmax, hd]
            values = self.v_cache[meta.decode_slots].transpose(1, 2)
            mask = meta.decode_mask(self.window)  # [Bd, 1, 1, Cmax]
            qd = q[:nd].unsqueeze(2)  # [Bd, H, 1, hd]
            out[:nd] = self._sdpa(qd, keys, values, mask, False).squeeze(2)
            if meta.trace is not None:
                meta.trace.on_attention(
                    meta, ("decode", -1), self.layer_idx, qd, keys, mask, self.scale
                )
        for i, span in enumerate(meta.prefills):
            # ---- prefill chunk: all its queries at once, causally masked ----
            s, e = span.start - r0, span.end - r0
            if span.slots is None:
                keys, values = k[s:e], v[s:e]  # the whole context is new
            else:
                keys, values = self.k_cache[span.slots], self.v_cache[span.slots]
            keys = keys.transpose(0, 1).unsqueeze(0)  # [1, Hkv, C, hd]
            values = values.transpose(0, 1).unsqueeze(0)
            qp = q[s:e].transpose(0, 1).unsqueeze(0)  # [1, H, L, hd]
            mask = meta.prefill_mask(i, self.window)
            causal = mask is None
            out[s:e] = self._sdpa(qp, keys, values, mask, causal)[0].transpose(0, 1)
            if meta.trace is not None:
                meta.trace.on_attention(
                    meta, ("prefill", i), self.layer_idx, qp, keys, mask, self.scale
                )

    def _sdpa(self, q, k, v, mask, causal: bool) -> torch.Tensor:
        # q [B, H, L, hd], k/v [B, Hkv, C, hd]
        rep = self.num_heads // self.num_kv_heads
        if rep > 1 and q.shape[2] == 1 and not causal:
            # GQA/MQA decode: the `rep` query heads sharing a K/V head become `rep` queries
            # of that head ([B, Hkv, rep, hd]); the mask [B, 1, 1, C] broadcasts over them.
            B, H, _, hd = q.shape
            out = F.scaled_dot_product_attention(
                q.reshape(B, self.num_kv_heads, rep, hd), k, v, attn_mask=mask, scale=self.scale
            )
            return out.reshape(B, H, 1, hd)
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=causal, scale=self.scale, enable_gqa=rep > 1
        )
