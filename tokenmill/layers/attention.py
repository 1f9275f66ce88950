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

from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.config import ModelConfig
from tokenmill.dtypes import dequantize_q8_0, quantize_q8_0
from tokenmill.layers.linear import Linear
from tokenmill.layers.norm import RMSNorm
from tokenmill.layers.rotary import Rotary
from tokenmill.layers.tiled_attention import tiled_attention


@dataclass
class PrefillSpan:
    start: int  # first row of this chunk in the packed batch
    end: int  # one past its last row
    context_len: int  # tokens of the sequence after this chunk (cached + new)
    # [context_len] cache slots of the whole context; None when the chunk is the whole
    # context (nothing cached before it), so attention reads the fresh K/V directly.
    slots: torch.Tensor | None


@dataclass(frozen=True)
class AttentionSite:
    """Which attention call of a step: the decode rows' (one call for all of them), or
    prefill chunk `index` (one call each). As the traced request's site (TracedRows.site),
    a decode site's index is the request's row among the decode rows."""

    kind: Literal["decode", "prefill"]
    index: int | None = None


class ForwardHooks(Protocol):
    """What the forward pass calls on a traced batch (TracedRows.hooks): the model
    (models/transformer.py) after the embedding and each residual add, this module at
    each attention call, an MoE layer (layers/moe.py) once its router has chosen, between
    the layer's on_residual("attention") and on_residual("mlp"). The engine's StepHooks
    (engine/hooks.py) adds the step's own hooks around them; the layers and the model
    know only these."""

    def on_embedding(
        self, meta: AttentionMetadata, input_ids: torch.Tensor, x: torch.Tensor
    ) -> None: ...

    def on_attention(
        self,
        meta: AttentionMetadata,
        site: AttentionSite,
        layer_idx: int,
        q: torch.Tensor,
        keys: torch.Tensor,
        mask: torch.Tensor | None,
        scale: float,
    ) -> None: ...

    def on_residual(
        self,
        meta: AttentionMetadata,
        layer_idx: int,
        sublayer: Literal["attention", "mlp"],
        x: torch.Tensor,
    ) -> None: ...

    def on_router(
        self, meta: AttentionMetadata, layer_idx: int, ids: torch.Tensor, weights: torch.Tensor
    ) -> None:
        """An MoE layer's routing of every row of the batch: ids [T, k] int64 (the chosen
        experts, best first) and weights [T, k] (what each one's output is scaled by)."""
        ...


@dataclass(frozen=True)
class TracedRows:
    """The one traced request of a step, as the runner attaches it: its hooks, its rows in
    the packed batch, and where its attention runs (AttentionSite("decode", row) or
    ("prefill", span))."""

    hooks: ForwardHooks
    rows: slice
    site: AttentionSite


@dataclass(frozen=True)
class NativeStep:
    """What the model attaches when a step's decode rows run natively (models/paths.py):
    its NativeModel and the decode rows' C view (kernels.decode_rows)."""

    model: Any
    rows: Any


@dataclass
class AttentionMetadata:
    """One forward pass's packed batch: the layout the runner packs (positions, slots,
    decode rows, prefill spans), plus two attachments kept apart from it: the traced
    request (TracedRows, from the runner) and the native decode path (NativeStep, which
    the model adds on a copy for its layers, never into the runner's). Every type it names
    is declared here or below, so the layers never import the engine."""

    positions: torch.Tensor  # [T] position of each token in its sequence
    slot_mapping: torch.Tensor  # [T] cache slot each new token's K/V is written to
    num_decode: int = 0
    decode_slots: torch.Tensor | None = None  # [Bd, Cmax] slots to read, padded
    decode_context_lens: torch.Tensor | None = None  # [Bd]
    prefills: list[PrefillSpan] = field(default_factory=list)
    trace: TracedRows | None = None
    native: NativeStep | None = None
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


DECODE = AttentionSite("decode")  # the decode rows' one attention call of a layer


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
        self.softcap = cfg.attn_logit_softcap  # Gemma 2: scores -> cap * tanh(scores / cap)
        # gpt-oss: [H] one more logit in each head's softmax, a key without a value
        self.sinks = (
            nn.Parameter(torch.zeros(cfg.num_heads), requires_grad=False)
            if cfg.attn_sinks
            else None
        )
        self.window = cfg.sliding_window if cfg.layer_types[layer_idx] == "sliding" else None
        d = cfg.hidden_size
        self.q_size, self.kv_size = cfg.q_size, cfg.kv_size
        # Q, K and V projections fused into one matrix [q_size + 2 kv_size, d]: one GEMV per
        # layer instead of three. The loader concatenates the checkpoint's q/k/v rows.
        self.qkv = Linear(d, cfg.q_size + 2 * cfg.kv_size, bias=cfg.qkv_bias)
        self.o = Linear(cfg.q_size, d, bias=cfg.o_bias)
        # qk_norm "head": weights [hd], each head apart; "full": [H hd] and [Hkv hd], over
        # the whole projection (OLMoE, OLMo 2)
        full = cfg.qk_norm == "full"
        q_dim, k_dim = (cfg.q_size, cfg.kv_size) if full else (cfg.head_dim, cfg.head_dim)
        self.q_norm = RMSNorm(q_dim, cfg.norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(k_dim, cfg.norm_eps) if cfg.qk_norm else None
        self.qk_norm_full = full
        self.rotary = rotary
        # This layer's view of the cache pool, [num_slots, Hkv, hd] each; set by the runner.
        self.k_cache: torch.Tensor | None = None
        self.v_cache: torch.Tensor | None = None

    def forward(self, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        T = x.shape[0]
        # ---- Q, K, V projections: [T, d] -> [T, q_size + 2 kv_size] ----
        qkv = self.qkv(x)
        out = torch.empty(T, self.q_size, dtype=qkv.dtype, device=qkv.device)  # [T, H hd]
        nd = meta.num_decode if meta.native is not None else 0
        if nd:
            # ---- decode rows: norms, RoPE, KV write and attention in one native call ----
            meta.native.model.attention(self.layer_idx, meta.native.rows, qkv[:nd], out[:nd])
        if nd < T:
            self._attend(qkv[nd:], meta, out[nd:], nd)
        return self.o(out)

    def _attend(self, qkv: torch.Tensor, meta: AttentionMetadata, out: torch.Tensor, r0: int):
        """The torch path for packed rows r0.. (qkv [T, q_size + 2 kv_size] -> out [T,
        q_size], both already cut at r0): r0 = num_decode when the native path did the
        decode rows, else 0."""
        positions, slot_mapping = meta.positions[r0:], meta.slot_mapping[r0:]
        T = qkv.shape[0]
        q = qkv[:, : self.q_size].view(T, self.num_heads, self.head_dim)
        k = qkv[:, self.q_size : self.q_size + self.kv_size].view(
            T, self.num_kv_heads, self.head_dim
        )
        v = qkv[:, self.q_size + self.kv_size :].view(T, self.num_kv_heads, self.head_dim)
        if self.qk_norm_full:  # over [T, H hd] and [T, Hkv hd], then back to heads
            q = self.q_norm(q.reshape(T, self.q_size)).view(T, self.num_heads, self.head_dim)
            k = self.k_norm(k.reshape(T, self.kv_size)).view(T, self.num_kv_heads, self.head_dim)
        elif self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        # ---- positions: rotate q and k by each token's position ----
        if self.rotary is not None:
            q, k = self.rotary(q, k, positions)
        self.write_kv(k, v, slot_mapping)
        out = out.view(T, self.num_heads, self.head_dim)
        nd = meta.num_decode - r0
        if nd:
            out[:nd] = self.decode_attention(q[:nd], meta)
        for i, span in enumerate(meta.prefills):
            s, e = span.start - r0, span.end - r0
            out[s:e] = self.prefill_attention(q[s:e], k[s:e], v[s:e], meta, i)

    def write_kv(self, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """The KV cache write: every new token's k, v [T, Hkv, hd] to its slot [T], in the
        cache's dtype (a 16-bit cache rounds to nearest even, as the native path does)."""
        self.k_cache.index_copy_(0, slot_mapping, self._to_cache(k))
        self.v_cache.index_copy_(0, slot_mapping, self._to_cache(v))

    def _to_cache(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, Hkv, hd] as the cache stores it: its dtype, or (a uint8 cache: q8_0) the
        8-bit blocks [T, Hkv, hd / 32 * 34], the bytes the native kv_store writes."""
        if self.k_cache.dtype == torch.uint8:
            return quantize_q8_0(x)
        return x.to(self.k_cache.dtype)

    def _from_cache(self, cache: torch.Tensor, slots: torch.Tensor, dtype) -> torch.Tensor:
        """The cached rows at `slots` (any shape S) -> [*S, Hkv, hd] in dtype."""
        rows = cache[slots]
        if cache.dtype == torch.uint8:  # q8_0 blocks: q * d, multiplied in float32
            return dequantize_q8_0(rows, dtype)
        return rows.to(dtype)

    def decode_attention(self, q: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Decode rows: one query each, q [Bd, H, hd], over its cached context (the new
        token's K/V already written) -> [Bd, H, hd]."""
        keys = self._from_cache(self.k_cache, meta.decode_slots, q.dtype).transpose(1, 2)
        values = self._from_cache(self.v_cache, meta.decode_slots, q.dtype).transpose(1, 2)
        # keys, values [Bd, Hkv, Cmax, hd]
        mask = meta.decode_mask(self.window)  # [Bd, 1, 1, Cmax]
        qd = q.unsqueeze(2)  # [Bd, H, 1, hd]
        if meta.trace is not None:
            meta.trace.hooks.on_attention(meta, DECODE, self.layer_idx, qd, keys, mask, self.scale)
        return self._sdpa(qd, keys, values, mask, False).squeeze(2)

    def prefill_attention(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata, i: int
    ) -> torch.Tensor:
        """Prefill chunk i: all its queries q [L, H, hd] at once, causally masked, over its
        whole context (k, v [L, Hkv, hd] are the chunk's own) -> [L, H, hd]."""
        span = meta.prefills[i]
        if span.slots is None and self.k_cache.dtype == torch.uint8:
            # q8_0: the chunk's own K/V as the cache holds them (what a later chunk, a decode
            # step or a recompute after preemption reads), not the float32 ones
            keys = dequantize_q8_0(quantize_q8_0(k), q.dtype)
            values = dequantize_q8_0(quantize_q8_0(v), q.dtype)
        elif span.slots is None:
            keys, values = k, v  # the whole context is new
        else:
            keys = self._from_cache(self.k_cache, span.slots, q.dtype)  # [C, Hkv, hd]
            values = self._from_cache(self.v_cache, span.slots, q.dtype)
        keys = keys.transpose(0, 1).unsqueeze(0)  # [1, Hkv, C, hd]
        values = values.transpose(0, 1).unsqueeze(0)
        qp = q.transpose(0, 1).unsqueeze(0)  # [1, H, L, hd]
        mask = meta.prefill_mask(i, self.window)
        if meta.trace is not None:
            site = AttentionSite("prefill", i)
            meta.trace.hooks.on_attention(meta, site, self.layer_idx, qp, keys, mask, self.scale)
        return self._sdpa(qp, keys, values, mask, mask is None)[0].transpose(0, 1)

    def _sdpa(self, q, k, v, mask, causal: bool) -> torch.Tensor:
        # q [B, H, L, hd], k/v [B, Hkv, C, hd]
        rep = self.num_heads // self.num_kv_heads
        if self.softcap is not None or self.sinks is not None:
            return self._explicit(q, k, v, mask, causal)
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

    def _explicit(self, q, k, v, mask, causal: bool) -> torch.Tensor:
        """Attention for what SDPA cannot do: soft-capped scores (Gemma 2) and sink logits
        (gpt-oss), over key tiles with an online softmax, so a long prompt's scores never
        exist whole (layers/tiled_attention). q [B, H, L, hd], k/v [B, Hkv, C, hd], mask
        [.., L, C] bool or None -> [B, H, L, hd]."""
        return tiled_attention(
            q,
            k,
            v,
            scale=self.scale,
            mask=mask,
            causal=causal,
            softcap=self.softcap,
            sinks=self.sinks,
        )
