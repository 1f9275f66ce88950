"""The model as the native kernels see it: one descriptor per layer, shared by both
native decode paths (models/paths.py says which path a step takes).

Why a native decode step: it is ~120 small GEMVs plus ~300 tiny ops (norms, adds, the
MLP activation). Each torch op costs ~5-30 us of dispatch on a CPU, as much as the
GEMVs' memory traffic itself. So:

  per-layer native attention   the decode rows' attention of one layer in one C call
                               (tm_decode_attention: q/k norm, RoPE, KV write, softmax, values)
  the whole-step stack         every layer and the final norm in one C call (tm_decode_stack):

    per layer:  h = [rmsnorm](x);  qkv = h Wqkv^T;  attention over the paged cache
                x += [post_norm](attn Wo^T);  h = [rmsnorm](x)
                x += [post_norm](down(act(gate(h)) * up(h)))

Both read the same `TmLayer` per block, built here once (after the KV cache is attached)
from the modules' own tensors: the attention path reads its attention fields, the stack
all of them. An MoE layer's MLP is a TmMoe (router, each expert's packed weights, the
shared expert), run by the stack's moe_mlp. The stack needs RMSNorms (before each sublayer, after it, or both), a gated
SiLU or tanh-GELU MLP (Llama, Mistral, Qwen2/3, Gemma 2/3, Phi-3, OLMo 2, SmolLM3,
Granite) and every linear layer native (QuantLinear or FloatLinear); when it cannot run,
`stack_blocker` says why. Attention covers per-head and whole-projection Q/K norms (Qwen3,
OLMo 2) and Gemma 2's score soft-cap. Phi-3's
LongRoPE is in the rotary tables, SmolLM3's NoPE layers have none, and Granite's
multipliers sit outside the stack (embedding, logits) or in its layers (attention's score
scale, the residual adds' scale).
"""

from __future__ import annotations

import ctypes

import torch
from torch import nn

from tokenmill import kernels
from tokenmill.layers.moe import MoE
from tokenmill.layers.native_linear import NativeLinear
from tokenmill.layers.norm import RMSNorm

ACTIVATIONS = {"silu": 0, "gelu_tanh": 1}
# the KV cache's dtype -> tm_layer.kv_bits (paths.native_blocker refuses any other)
KV_BITS = {
    torch.float32: kernels.F32,
    torch.float16: kernels.F16,
    torch.bfloat16: kernels.BF16,
    torch.uint8: kernels.Q8_0,  # a uint8 cache holds q8_0 blocks (engine/kv_cache.py)
}
CLAMPED_SWIGLU = 2  # tm_shape.act of gpt-oss's MLP (ModelConfig.swiglu_limit set)


class NativeModel:
    """The C descriptors of a model (shapes, one TmLayer per block, the stack) and the
    two native calls. Build with `NativeModel(model)` once the KV cache is attached."""

    def __init__(self, model: nn.Module):
        cfg = model.cfg
        self._keep: list = []  # tensors and structs the C side points into
        self.stack_blocker: str | None = None  # why tm_decode_stack cannot run, or None
        act = CLAMPED_SWIGLU if cfg.swiglu_limit else ACTIVATIONS.get(cfg.activation, -1)
        self.shape = kernels.TmShape(
            cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
            cfg.intermediate_size, act, cfg.norm_eps, cfg.swiglu_limit or 0.0, cfg.swiglu_alpha,
        )  # fmt: skip
        self.layers = (kernels.TmLayer * cfg.num_layers)()
        for desc, block in zip(self.layers, model.layers, strict=True):
            self._describe(desc, block)
        final = model.final_norm  # None on a pipeline stage before the last
        tp = model.tp
        self.stack = kernels.TmStack(
            ctypes.addressof(self.shape),
            ctypes.addressof(self.layers),
            self._ptr(final.weight) if isinstance(final, RMSNorm) else None,
            tp.c_allreduce if tp is not None else kernels.ALLREDUCE_FN(),
            None,
        )
        if cfg.norm != "rms" or not (final is None or isinstance(final, RMSNorm)):
            self._block("the stack needs RMSNorm (this family uses LayerNorm)")
        elif cfg.mlp != "gated" or cfg.activation not in ACTIVATIONS:
            self._block(f"the stack needs a gated SiLU/GELU MLP, not {cfg.mlp} {cfg.activation}")

    # -- building the descriptors ---------------------------------------------------------

    def _block(self, reason: str) -> None:
        self.stack_blocker = self.stack_blocker or reason

    def _ptr(self, t: torch.Tensor | None) -> int | None:
        if t is None:
            return None
        t = t.detach().float().contiguous()
        self._keep.append(t)
        return t.data_ptr()

    def _weight(self, name: str, lin: nn.Module) -> int | None:
        cw = lin.native() if isinstance(lin, NativeLinear) else None
        if cw is None:
            self._block(f"{name} is a torch {type(lin).__name__}, not a native layer")
            return None
        self._keep.append(cw)
        return ctypes.addressof(cw)

    def _describe(self, desc: kernels.TmLayer, block: nn.Module) -> None:
        a, m = block.attn, block.mlp
        i = a.layer_idx
        linears = {"qkv": a.qkv, "o": a.o}
        if not isinstance(m, MoE):
            linears.update(up=m.up, down=m.down)
        for name, lin in linears.items():
            setattr(desc, name, self._weight(f"layer {i} {name}", lin))
            setattr(desc, f"{name}_bias", self._ptr(lin.bias))
        experts = self._moe(desc, m, i) if isinstance(m, MoE) else []
        for name in ("attn_norm", "mlp_norm"):
            norm = getattr(block, name)
            # None: OLMo 2 norms after the sublayers only (the stack copies instead)
            if norm is not None and not isinstance(norm, RMSNorm):
                self._block(f"layer {i} {name} is not an RMSNorm")
            setattr(desc, name, None if norm is None else self._ptr(norm.weight))
        for name in ("post_attn_norm", "post_mlp_norm"):
            norm = getattr(block, name)
            setattr(desc, name, None if norm is None else self._ptr(norm.weight))
        desc.q_norm = None if a.q_norm is None else self._ptr(a.q_norm.weight)
        desc.k_norm = None if a.k_norm is None else self._ptr(a.k_norm.weight)
        rot = a.rotary
        desc.rcos = None if rot is None else self._ptr(rot.cos)
        desc.rsin = None if rot is None else self._ptr(rot.sin)
        desc.rot_dim = 0 if rot is None else rot.cos.shape[1]
        desc.k_cache, desc.v_cache = a.k_cache.data_ptr(), a.v_cache.data_ptr()
        desc.kv_bits = KV_BITS[a.k_cache.dtype]
        desc.window = a.window or 0
        act_bits = {getattr(lin, "act_bits", 16) for lin in [*linears.values(), *experts]}
        if len(act_bits) != 1:
            self._block(f"layer {i} mixes activation precisions {sorted(act_bits)}")
        desc.act16 = int(act_bits == {16})
        desc.scale = a.scale
        desc.qk_full = int(a.qk_norm_full)  # OLMo 2: norms [H hd] and [Hkv hd]
        desc.softcap = a.softcap or 0.0  # Gemma 2
        desc.sinks = self._ptr(a.sinks)  # gpt-oss
        desc.residual_scale = block.residual_scale  # Granite

    def _moe(self, desc: kernels.TmLayer, m: MoE, i: int) -> list[nn.Module]:
        """desc.moe for MoE layer i (a TmMoe: router, experts, shared expert); returns
        the layer's expert projections, for the activation-precision check."""
        mlps = [*m.experts, *([m.shared] if m.shared is not None else [])]
        if m.shared is not None and m.shared.up.bias is not None:
            self._block(f"layer {i}'s shared expert has biases, which the fused stack lacks")
        moe = kernels.TmMoe()
        moe.E, moe.k, moe.fe = m.num_experts, m.top_k, m.experts[0].f
        moe.fs = m.shared.f if m.shared is not None else 0
        moe.softmax_first = int(m.router_kind == "softmax_topk")
        moe.norm_topk = int(bool(m.norm_topk_prob))
        moe.router, moe.router_bias = self._ptr(m.router.weight), self._ptr(m.router.bias)
        for name in ("up", "down"):  # [E] pointers to each expert's packed weight
            ptrs = (ctypes.c_void_p * m.num_experts)(
                *(
                    self._weight(f"layer {i} expert {e} {name}", getattr(x, name))
                    for e, x in enumerate(m.experts)
                )
            )
            self._keep.append(ptrs)
            setattr(moe, name, ctypes.addressof(ptrs))
            if m.experts[0].up.bias is not None:  # gpt-oss: [E] pointers to each one's bias
                biases = (ctypes.c_void_p * m.num_experts)(
                    *(self._ptr(getattr(x, name).bias) for x in m.experts)
                )
                self._keep.append(biases)
                setattr(moe, f"{name}_bias", ctypes.addressof(biases))
        if m.shared is not None:
            moe.shared_up = self._weight(f"layer {i} shared up", m.shared.up)
            moe.shared_down = self._weight(f"layer {i} shared down", m.shared.down)
            moe.shared_gate = self._ptr(None if m.shared_gate is None else m.shared_gate.weight)
        self._keep.append(moe)
        desc.moe = ctypes.addressof(moe)
        return [lin for mlp in mlps for lin in (mlp.up, mlp.down)]

    # -- the two native calls ---------------------------------------------------------------

    def attention(self, layer_idx: int, rows: kernels.TmRows, qkv: torch.Tensor, out: torch.Tensor):
        """Decode attention of one layer: qkv [Bd, q_size + 2 kv_size] -> out [Bd, q_size];
        writes the rows' K/V into the cache."""
        kernels.decode_attention(self.shape, self.layers[layer_idx], rows, qkv.contiguous(), out)

    def run_stack(self, x: torch.Tensor, rows: kernels.TmRows) -> torch.Tensor:
        """x [Bd, d] embedded decode rows -> the final norm of the residual stream after the
        last layer (the un-embedding's input)."""
        x = x.contiguous()
        kernels.decode_stack(self.stack, rows, x)
        return x
