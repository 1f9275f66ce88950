"""Linear layers whose weights the native kernels read as stored, and how they run.

Decode on CPU is memory-bound: every token reads every weight once, so a weight kept in
its checkpoint's encoding (4/8-bit blocks, or 16-bit floats) is read 2-8x faster than a
float32 copy. Two kinds share the machinery here:

  QuantLinear (quant_linear.py)  4/8-bit blocks with per-block scales (GGUF Q4/Q5/Q8...)
  FloatLinear (below)            float16, bfloat16 or float32 rows, as the file has them

How a forward pass of x [T, in] runs is decided in C, by tm_linear_path (linear.c), which
tm_linear asks too; `NativeLinear.path(T)` returns its answer (kernels.LinearPath: the
path and why), and `tokenmill info`/the inspector show the prefill one:
  GEMV            few rows (decode, small batches): the native GEMV (kernels.linear):
                  packed weights multiply quantized activations in exact integer
                  arithmetic, float weights multiply float32 x.
  integer GEMM    packed weights from kernels.gemm_min_rows() rows (16 AVX2, 24 AVX-512;
                  builds where it is faster): kernels.linear too, the C side multiplies
                  by gemm.c's GEMM: the GEMV's integers, int16 multiplies at twice the
                  multiply-adds per instruction of float32 FMAs. The fused decode stack
                  calls the same C function, so batched decode steps that size take it.
  float32 tiles   more rows otherwise (kernels.PREFILL_MIN_T): weight rows converted chunk
                  by chunk to float32 tiles (kernels.dequant_lanes), multiplied by torch's
                  float32 GEMM: within 1e-4 of the exact product on SmolLM2's logits. (A
                  bfloat16 GEMM ran a 512-token prefill 2x faster on AMX but moved logits
                  by up to 0.5, so that a prompt prefilled alone and in a batch continued
                  differently.)
  no native library
      the whole weight converted with torch ops, then F.linear (slow, exact).
"""

from __future__ import annotations

import ctypes

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill import kernels

# Most bytes of float32 W per GEMM call in the prefill path: bounds the temporary (a
# 49152-row un-embedding would be 56 MB); cache-sized 1-4 MB chunks measured no faster
# than whole layers, since every call re-packs its operands.
_PREFILL_CHUNK_BYTES = 16 << 20


class NativeLinear(nn.Module):
    """y = x W^T + b with W in a format the native kernels read (subclasses define it).

    Same interface as layers.linear.Linear: forward(x [.., in]) -> [.., out] float32
    (x's dtype if it is not float32). `bias` is a float32 Parameter like Linear's, so the
    loader can fill it by name. Subclasses provide `_make_native` (the C view of the
    weight), `dequantize` (W as float32 with torch ops) and `nbytes`; `packed` says
    whether the weight is packed blocks: then its float32 tiles come out in the packed
    column order (x is permuted to match), and the integer GEMM can take it.
    """

    packed = False

    def __init__(self, in_features: int, out_features: int, bias: torch.Tensor | None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.bias = (
            None
            if bias is None
            else nn.Parameter(bias.to(torch.float32).contiguous(), requires_grad=False)
        )
        self._cw: kernels.TmWeight | None = None

    def _make_native(self) -> kernels.TmWeight:
        raise NotImplementedError

    def dequantize(self, rows: torch.Tensor | None = None) -> torch.Tensor:
        """W (or its rows `rows`) as float32 [rows, in], natural column order (torch ops)."""
        raise NotImplementedError

    @property
    def nbytes(self) -> int:
        """Bytes held by the weight (what one full forward pass reads)."""
        raise NotImplementedError

    def native(self) -> kernels.TmWeight | None:
        """The C view of the weight (built once), or None without the native library."""
        cw = self._cw
        if cw is None and kernels.library() is not None:
            cw = self._cw = self._make_native()
        return cw

    def _apply(self, fn, recurse=True):
        self._cw = None  # .to(), .share_memory_()...: buffers may move, rebuild pointers
        return super()._apply(fn, recurse)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2 and x.dtype is torch.float32:  # the hot path: no reshapes
            return self._forward2d(x.contiguous())
        shape, dtype = x.shape, x.dtype
        y = self._forward2d(x.reshape(-1, self.in_features).to(torch.float32).contiguous())
        return y.reshape(*shape[:-1], self.out_features).to(dtype)

    def _forward2d(self, x: torch.Tensor) -> torch.Tensor:
        cw = self._cw or self.native()
        if cw is None:
            bias = None if self.bias is None else self.bias.float()
            return F.linear(x, self.dequantize(), bias)
        if self.path(x.shape[0]).name == kernels.TILES:
            return self._prefill(cw, x)
        return kernels.linear(cw, x, self.bias, getattr(self, "act_bits", 16))

    def path(self, rows: int) -> kernels.LinearPath:
        """How a product of `rows` rows of x runs (tm_linear_path decides): kernels.linear
        takes the GEMV and integer GEMM ones, float32 tiles run here (_prefill)."""
        return kernels.linear_path(self.packed, rows)

    def _prefill(self, cw: kernels.TmWeight, x: torch.Tensor) -> torch.Tensor:
        """Many rows: float32 GEMM against W converted tile by tile; for packed weights
        x's columns are permuted to the lane order (the permutation of the shared K axis
        cancels out)."""
        xl = kernels.lanes_f32(x) if self.packed else x  # [T, K]
        n = self.out_features
        chunk = max(64, _PREFILL_CHUNK_BYTES // (4 * self.in_features) // 64 * 64)
        if chunk >= n:
            return F.linear(xl, kernels.dequant_lanes(cw, 0, n), self.bias)
        y = torch.empty(x.shape[0], n, dtype=torch.float32)
        for r0 in range(0, n, chunk):
            r1 = min(n, r0 + chunk)
            torch.mm(xl, kernels.dequant_lanes(cw, r0, r1).T, out=y[:, r0:r1])
        if self.bias is not None:
            y += self.bias
        return y

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """Embedding lookup: rows `ids` of W as float32 [*ids.shape, in].

        Raises IndexError for ids outside [0, out_features).
        """
        flat = ids.reshape(-1)
        if flat.dtype is not torch.int64:
            flat = flat.long()
        flat = flat.contiguous()
        cw = self._cw or self.native()
        if cw is not None:
            rows = kernels.dequant_rows(cw, flat)
        else:
            if flat.numel() and (flat.min() < 0 or flat.max() >= self.out_features):
                raise IndexError(f"id out of range [0, {self.out_features})")
            rows = self.dequantize(flat)
        return rows.view(*ids.shape, self.in_features)


class SegmentedLinear(NativeLinear):
    """A fused projection whose parts pack differently: a Q4_K_M file's Q4_K q and k beside
    its Q6_K v, or Q4_K gate beside a Q6_K up. The parts' rows follow one another, each in
    its own format, and one native call runs them all (tm_weight.next chains them); the
    prefill runs each part's own GEMM. Without this the fused layer would fall back to a
    float32 torch Linear: 4-7x the bytes per token, and off the native decode stack."""

    def __init__(self, parts: list[NativeLinear], bias: torch.Tensor | None = None):
        if any(p.in_features != parts[0].in_features for p in parts):
            raise ValueError("SegmentedLinear: parts differ in input size")
        super().__init__(parts[0].in_features, sum(p.out_features for p in parts), bias)
        self.parts = nn.ModuleList(parts)
        self.act_bits = getattr(parts[0], "act_bits", 16)
        self.packed = all(p.packed for p in parts)  # all packed: the packed rule of path()

    def _make_native(self) -> kernels.TmWeight:
        # copies: each part's own TmWeight stays a single segment for standalone calls
        chain = [kernels.TmWeight.from_buffer_copy(p.native()) for p in self.parts]
        for cw, following in zip(chain, chain[1:], strict=False):
            cw.next = ctypes.addressof(following)
        self._chain = chain  # kept alive with the layer
        return chain[0]

    def _apply(self, fn, recurse=True):
        for p in self.parts:
            p._cw = None
        return super()._apply(fn, recurse)

    def _forward2d(self, x: torch.Tensor) -> torch.Tensor:
        cw = self._cw or self.native()
        if cw is not None and self.path(x.shape[0]).name != kernels.TILES:
            return kernels.linear(cw, x, self.bias, self.act_bits, self.out_features)
        y = torch.cat([p._forward2d(x) for p in self.parts], dim=1)
        return y if self.bias is None else y + self.bias.float()

    def dequantize(self, rows: torch.Tensor | None = None) -> torch.Tensor:
        w = torch.cat([p.dequantize() for p in self.parts])
        return w if rows is None else w[rows]

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, segments"


# The float weights the native GEMV reads, by dtype: (kernel kind, raw-bits view dtype).
_FLOAT_KINDS = {
    torch.float16: (kernels.F16, torch.int16),
    torch.bfloat16: (kernels.BF16, torch.int16),
    torch.float32: (kernels.F32, torch.int32),
}


class FloatLinear(NativeLinear):
    """y = x W^T + b with W kept as float16, bfloat16 or float32 [out, in], the way the
    checkpoint stores it (a bf16 safetensors folder, an F16 GGUF file): the native GEMV
    converts 8 (AVX2) or 4 (NEON) values at a time to float32 in registers, so a 16-bit
    weight is read at half the bytes of a float32 copy, and the fused decode step
    (models/native_model.py) takes these layers like packed ones.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        out_features, in_features = weight.shape
        super().__init__(in_features, out_features, bias)
        if weight.dtype not in _FLOAT_KINDS:
            raise ValueError(f"FloatLinear holds float16, bfloat16 or float32, not {weight.dtype}")
        self.weight_dtype = weight.dtype
        # Stored as raw bits (an int view): a float cast of the model (model.to(dtype))
        # must not convert the weights.
        self.register_buffer("weight_raw", weight.contiguous().view(_FLOAT_KINDS[weight.dtype][1]))

    @property
    def weight(self) -> torch.Tensor:
        """The weight in its stored dtype [out, in]."""
        return self.weight_raw.view(self.weight_dtype)

    @classmethod
    def cat(cls, parts: list[FloatLinear]) -> FloatLinear:
        """Stack layers with the same input and dtype along out_features (fused QKV, gate+up)."""
        first = parts[0]
        if any(
            p.in_features != first.in_features or p.weight_dtype != first.weight_dtype
            for p in parts
        ):
            raise ValueError("FloatLinear.cat: parts differ in input size or dtype")
        if any(p.bias is not None for p in parts) and not all(p.bias is not None for p in parts):
            raise ValueError("FloatLinear.cat: either all parts have a bias or none")
        bias = None if first.bias is None else torch.cat([p.bias for p in parts])
        return cls(torch.cat([p.weight for p in parts]), bias)

    def _make_native(self) -> kernels.TmWeight:
        kind = _FLOAT_KINDS[self.weight_dtype][0]
        return kernels.TmWeight(
            self.weight_raw.data_ptr(), None, None, kind, 0, self.out_features, self.in_features
        )

    def dequantize(self, rows: torch.Tensor | None = None) -> torch.Tensor:
        w = self.weight if rows is None else self.weight[rows]
        return w.to(torch.float32)

    @property
    def nbytes(self) -> int:
        return self.weight_raw.numel() * self.weight_raw.element_size()

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, {self.weight_dtype}"
        )
