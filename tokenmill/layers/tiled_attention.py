"""Attention over key tiles with an online softmax (flash-attention's scheme, in torch).

For what torch's scaled_dot_product_attention cannot do, soft-capped scores (Gemma 2)
and sink logits (gpt-oss), attention used to be written out whole: scores [B, H, L, C]
in float32, 1.2 GiB per layer for a 2,048-token chunk over 16k of context with 9 heads,
and O(T^2) for a whole prompt. Here the keys go by in tiles of TILE: each tile's scores
[B, Hkv, rep, L, TILE] are soft-capped, masked and folded into a running maximum m,
denominator l (`denom`) and output accumulator acc, so memory grows with L x TILE, not L x C:

    m'   = max(m, max_j s_j)                 per query row
    acc' = acc * exp(m - m') + sum_j exp(s_j - m') v_j
    l'   = l   * exp(m - m') + sum_j exp(s_j - m')
    out  = acc / l        (a sink: one more logit in l, and none in acc)

Tiles every query of the chunk is masked from (before a sliding window, or past them
all) are skipped. The query heads that share a K/V head are multiplied together with
it (grouped-query attention without repeating K/V).
"""

from __future__ import annotations

import torch

TILE = 512  # keys per tile: the scores of 2,048 queries x 9 heads then take 36 MiB


def tiled_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    scale: float,
    mask: torch.Tensor | None = None,
    causal: bool = False,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    tile: int = TILE,
) -> torch.Tensor:
    """Softmax attention of q [B, H, L, hd] over k, v [B, Hkv, C, hd] -> [B, H, L, hd].

    mask: bool, broadcastable to [B, 1, L, C] (True: the key is visible); causal: query
    i sees keys 0 .. i + C - L (the chunk's queries are the last L positions); softcap:
    scores -> tanh(s / softcap) * softcap before masking; sinks [H]: a learned logit per
    head that joins each row's softmax denominator. Scores and the softmax are float32;
    the products with q and v stay in q's dtype, as in the untiled form."""
    B, H, L, hd = q.shape
    Hkv, C = k.shape[1], k.shape[2]
    rep = H // Hkv
    qg = q.reshape(B, Hkv, rep * L, hd)  # the rep heads of one K/V head: [B, Hkv, rep L, hd]
    if mask is not None:
        mask = mask.reshape(*([1] * (4 - mask.dim())), *mask.shape)  # [b, 1, L, C]
    m = torch.full((B, Hkv, rep, L, 1), float("-inf"), device=q.device)
    denom = torch.zeros((B, Hkv, rep, L, 1), device=q.device)
    acc = torch.zeros((B, Hkv, rep * L, hd), device=q.device)
    rows = torch.arange(L, device=q.device).view(L, 1) + (C - L)  # each query's position
    for j0 in range(0, C, tile):
        j1 = min(j0 + tile, C)
        visible = None  # [b, 1, L, t] bool, None: every key of the tile
        if causal:
            visible = (torch.arange(j0, j1, device=q.device).view(1, -1) <= rows).view(
                1, 1, L, j1 - j0
            )
        elif mask is not None:
            visible = mask[..., j0:j1]
            if not bool(visible.any()):  # before a sliding window: nobody sees this tile
                continue
        s = (qg @ k[:, :, j0:j1].transpose(-1, -2)).float() * scale  # [B, Hkv, rep L, t]
        s = s.view(B, Hkv, rep, L, j1 - j0)
        if softcap is not None:
            s = torch.tanh(s / softcap) * softcap
        if visible is not None:  # [b, 1, L, t] -> [b, 1, 1, L, t] over the rep heads
            s = s.masked_fill(~visible.unsqueeze(2), float("-inf"))
        m_new = torch.maximum(m, s.amax(dim=-1, keepdim=True))
        ref = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)  # rows seen none
        p = torch.exp(s - ref)  # [B, Hkv, rep, L, t]
        keep = torch.exp(m - ref)  # 0 for a row that saw no key before
        denom = denom * keep + p.sum(dim=-1, keepdim=True)
        pv = p.view(B, Hkv, rep * L, j1 - j0).to(v.dtype) @ v[:, :, j0:j1]
        acc = acc * keep.view(B, Hkv, rep * L, 1) + pv.float()
        m = m_new
    if sinks is not None:  # the sink's exp joins the denominator, rescaled to its max
        sink = sinks.float().view(1, Hkv, rep, 1, 1)
        m_new = torch.maximum(m, sink)
        keep = torch.exp(m - m_new)
        denom = denom * keep + torch.exp(sink - m_new)
        acc = acc * keep.view(B, Hkv, rep * L, 1)
    out = acc / denom.view(B, Hkv, rep * L, 1)
    return out.view(B, H, L, hd).to(q.dtype)
