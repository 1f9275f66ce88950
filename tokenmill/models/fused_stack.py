"""The decode step of every layer in one native call (tm_decode_stack in kernels/stack.c).

Why: a decode step is ~120 small GEMVs plus ~300 tiny ops (norms, adds, the MLP
activation). Each torch op costs ~5-30 us of dispatch on this CPU, as much as the
GEMVs' memory traffic itself. When every decode row of a step can take the native path,
the runner hands the embedded rows [Bd, d] to one C call that runs

    per layer:  h = rmsnorm(x);  qkv = h Wqkv^T;  attention over the paged cache
                x += [post_norm](attn Wo^T);  h = rmsnorm(x)
                x += [post_norm](down(act(gate(h)) * up(h)))

with the same kernels the per-op path calls (tm_linear, tm_decode_attention), and
returns the final norm of the residual stream, ready for the un-embedding.

It applies to RMSNorm models with a gated SiLU or tanh-GELU MLP (Llama, Mistral, Qwen2/3,
Gemma 3) whose linear layers the native kernels read (QuantLinear or FloatLinear, with
the native library), in float32 on CPU, for steps made only of decode rows and not traced. Everything else runs
the per-layer modules, which stay the reference (TOKENMILL_FUSED_DECODE=0 turns this off
along with the fused attention).
"""

from __future__ import annotations

import ctypes

import torch
from torch import nn

from tokenmill import kernels
from tokenmill.layers import attention
from tokenmill.layers.attention import AttentionMetadata
from tokenmill.layers.native_linear import NativeLinear
from tokenmill.layers.norm import RMSNorm

ACTIVATIONS = {"silu": 0, "gelu_tanh": 1}


class FusedDecodeStack:
    """The ctypes description of every layer, built once; `run` does one decode step."""

    def __init__(self, stack: kernels.TmStack, keep: list):
        self.stack = stack
        self._keep = keep  # tensors and structs the C side points into

    @classmethod
    def build(cls, model: nn.Module) -> FusedDecodeStack | None:
        """None if some part of the model needs the per-layer path."""
        cfg = model.cfg
        if (
            kernels.library() is None
            or cfg.norm != "rms"
            or cfg.mlp != "gated"
            or cfg.activation not in ACTIVATIONS
            or model.dtype is not torch.float32
        ):
            return None
        keep: list = []

        def ptr(t: torch.Tensor | None) -> int | None:
            if t is None:
                return None
            t = t.detach().float().contiguous()
            keep.append(t)
            return t.data_ptr()

        def weight(lin: nn.Module) -> int | None:
            if not isinstance(lin, NativeLinear):
                return None
            cw = lin.native()
            if cw is None:
                return None
            keep.append(cw)
            return ctypes.addressof(cw)

        def norm(n: nn.Module | None) -> int | None:
            return None if n is None else ptr(n.weight)

        layers = (kernels.TmLayer * cfg.num_layers)()
        for desc, block in zip(layers, model.layers, strict=True):
            a, m = block.attn, block.mlp
            linears = (a.qkv, a.o, m.up, m.down)
            ptrs = [weight(lin) for lin in linears]
            cache = a.k_cache
            if None in ptrs or cache is None or cache.dtype is not torch.float32:
                return None
            if cache.device.type != "cpu":
                return None
            if not all(isinstance(n, RMSNorm) for n in (block.attn_norm, block.mlp_norm)):
                return None
            act_bits = {getattr(lin, "act_bits", 16) for lin in linears}
            if len(act_bits) != 1:
                return None
            desc.qkv, desc.o, desc.up, desc.down = ptrs
            desc.qkv_bias, desc.o_bias, desc.up_bias, desc.down_bias = (
                ptr(lin.bias) for lin in linears
            )
            desc.attn_norm, desc.mlp_norm = norm(block.attn_norm), norm(block.mlp_norm)
            desc.post_attn_norm = norm(block.post_attn_norm)
            desc.post_mlp_norm = norm(block.post_mlp_norm)
            desc.q_norm, desc.k_norm = norm(a.q_norm), norm(a.k_norm)
            rot = a.rotary
            desc.rcos = None if rot is None else ptr(rot.cos)
            desc.rsin = None if rot is None else ptr(rot.sin)
            desc.rot_dim = 0 if rot is None else rot.cos.shape[1]
            desc.k_cache, desc.v_cache = a.k_cache.data_ptr(), a.v_cache.data_ptr()
            desc.window = a.window or 0
            desc.act16 = int(act_bits == {16})
            desc.scale = a.head_dim**-0.5 if a.scale is None else a.scale
        if not isinstance(model.final_norm, RMSNorm):
            return None
        keep.append(layers)
        stack = kernels.TmStack(
            ctypes.addressof(layers),
            norm(model.final_norm),
            cfg.num_layers,
            cfg.hidden_size,
            cfg.num_heads,
            cfg.num_kv_heads,
            cfg.head_dim,
            cfg.intermediate_size,
            ACTIVATIONS[cfg.activation],
            cfg.norm_eps,
        )
        return cls(stack, keep)

    def run(self, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """x [Bd, d] embedded decode rows -> the final norm of the residual stream after
        the last layer (the un-embedding's input)."""
        x = x.contiguous()
        kernels.decode_stack(
            self.stack,
            x,
            meta.positions,
            meta.slot_mapping,
            meta.decode_slots,
            meta.decode_context_lens,
        )
        return x


def applies(meta: AttentionMetadata, num_rows: int) -> bool:
    """Whether this step can run fused: only decode rows, no tracing, switched on."""
    return attention.FUSED_DECODE and meta.num_decode == num_rows and meta.trace is None
