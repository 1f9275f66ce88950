"""Swap the model's float projections for layers the native kernels read as stored.

Decode reads every weight once per token, so bytes per weight set its speed. The ways in:
  "gguf"      keep the GGUF file's own blocks (Q4_0/Q4_1/Q8_0/Q5_x/Q4_K/Q6_K exactly;
              the 2/3-bit K types, IQ4_NL/IQ4_XS/MXFP4, and Q6_K on AVX-512 builds,
              requantized to 8 bits)
              as QuantLinear, never making a float32 copy, and its F16/BF16/F32
              tensors as FloatLinear;
  "float"     keep a checkpoint's float tensors in their own dtype (FloatLinear): a
              bf16 safetensors folder is read at 2 bytes per weight, not 4;
  "q8", "q4"  quantize float weights (HF checkpoints) per 32-value block.
Fused parts of different formats (a Q4_K_M file's Q4_K q beside its Q6_K v) become one
SegmentedLinear: each part in its own format, one native call.
"""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGMLQuantizationType as GT
from torch import nn

from tokenmill import kernels
from tokenmill.layers.linear import Linear
from tokenmill.layers.moe import MoE
from tokenmill.layers.native_linear import FloatLinear, NativeLinear, SegmentedLinear
from tokenmill.layers.quant_linear import QUANT_GGUF_TYPES, QuantLinear
from tokenmill.loader import Checkpoint, LoadError

PACKABLE = QUANT_GGUF_TYPES
FLOAT_GGUF = {GT.F16: torch.float16, GT.BF16: torch.bfloat16, GT.F32: torch.float32}
SCHEMES = ("gguf", "float", "q8", "q4")
CHOICES = ("auto", "none", *SCHEMES)  # what LLMEngine(quantization=) and --quantization take


def pick_scheme(requested: str, fmt: str, dtype: torch.dtype, device: torch.device) -> str | None:
    """The scheme to load a checkpoint of format `fmt` ("gguf", ...) with, for a request
    among CHOICES; None: torch Linears in `dtype`. "auto" keeps a GGUF file's blocks and a
    float checkpoint's dtype for the native kernels where they run."""
    if requested not in CHOICES:
        raise ValueError(f"quantization must be one of {', '.join(CHOICES)}; got {requested!r}")
    if requested != "none" and device.type != "cpu":
        if requested != "auto":
            raise ValueError("quantized weights run on the CPU kernels only; use device='cpu'")
        return None
    if requested == "auto":
        if fmt == "gguf":
            return "gguf"
        # float checkpoints: the native float GEMV reads them as stored (bf16 at 2 bytes
        # per weight) when activations are float32 and the kernels exist
        native = dtype is torch.float32 and kernels.library() is not None
        return "float" if native else None
    return None if requested == "none" else requested


def quantize_model(model: nn.Module, ckpt: Checkpoint, scheme: str, parts_of) -> list[str]:
    """Replace every Linear (and the token embedding) whose checkpoint source can be packed.
    Returns the checkpoint tensors packed, whose file pages were released.

    parts_of(param_name) -> the checkpoint tensor names stacked to make that parameter.
    """
    if scheme not in SCHEMES:
        raise ValueError(f"quantization must be one of none, {', '.join(SCHEMES)}; got {scheme!r}")
    targets = [(n, m) for n, m in model.named_modules() if isinstance(m, Linear)]
    if isinstance(model.embed, nn.Embedding):
        targets.append(("embed", model.embed))
    released: list[str] = []  # packed tensors whose file pages were dropped
    # a MoE layer's experts: each projection of all experts packed in one pass (GGUF)
    by_expert: dict[str, NativeLinear] = {}
    if scheme in ("gguf", "float"):
        for name, moe in model.named_modules():
            if isinstance(moe, MoE):
                by_expert.update(_pack_experts(ckpt, name, moe, parts_of, released))
    for name, module in targets:
        parts = parts_of(f"{name}.weight")
        if name == "lm_head" and "lm_head.weight" not in ckpt.tensors:
            parts = ["embed.weight"]  # tied in the file though not in the config
        packed = by_expert.pop(name, None)
        if packed is None:
            packed = _pack(ckpt, parts, scheme, released)
        if packed is None:
            continue
        rows = module.weight.shape[0]
        if packed.out_features != rows or packed.in_features != module.weight.shape[1]:
            raise LoadError(
                ckpt.path,
                f"tensor {'+'.join(parts)!r} has shape ({packed.out_features}, "
                f"{packed.in_features}), expected {tuple(module.weight.shape)}",
            )
        if getattr(module, "bias", None) is not None:
            packed.bias = module.bias  # filled by name by the float loader afterwards
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, packed)
    return released


def _pack_experts(
    ckpt: Checkpoint, name: str, moe: MoE, parts_of, released: list[str]
) -> dict[str, NativeLinear]:
    """{module name: packed layer} for the experts of MoE layer `name` whose GGUF blocks
    pack in one QuantLinear.from_gguf_experts call per projection (every expert's parts of
    one packable type, of equal shapes); {} for a projection that does not (float experts,
    mixed types): those pack one by one in quantize_model, as any projection.

    Byte for byte what _pack gives each expert (from_gguf per part, then cat), without
    its per-expert cost: a 3-D ffn_*_exps tensor [E, rows, cols] is the E experts' slices
    (loader/gguf_file.py), and all of them are parsed and packed into one buffer [E,
    rows, ...] that each expert's layer views."""
    out: dict[str, NativeLinear] = {}
    projections = [n for n, m in moe.experts[0].named_children() if isinstance(m, Linear)]
    for proj in projections:  # up (gate; up), down
        names = [f"{name}.experts.{j}.{proj}" for j in range(len(moe.experts))]
        parts = [parts_of(f"{n}.weight") for n in names]  # [E][P] checkpoint names
        if any(p not in ckpt.tensors or p not in ckpt.raw for ps in parts for p in ps):
            continue  # the per-expert path reports or skips it
        raws = [[ckpt.raw[p]() for p in ps] for ps in parts]
        qtype = raws[0][0][0]
        if qtype not in PACKABLE or any(t != qtype for r in raws for t, _ in r):
            continue
        data = [[d for _, d in r] for r in raws]
        k = _in_features(qtype, data[0][0])
        if any([d.shape for d in r] != [d.shape for d in data[0]] for r in data):
            continue

        def done(j: int, p: int, parts=parts) -> None:  # packed: drop the file's pages
            ckpt.release(parts[j][p])
            released.append(parts[j][p])

        layers = QuantLinear.from_gguf_experts(data, qtype, k, done)
        out.update(zip(names, layers, strict=True))
    return out


def _pack(
    ckpt: Checkpoint, parts: list[str], scheme: str, released: list[str]
) -> NativeLinear | None:
    if any(p not in ckpt.tensors for p in parts):
        return None  # the float loader reports the missing tensor
    if scheme == "gguf":
        if any(p not in ckpt.raw for p in parts):
            return None
        raws = [ckpt.raw[p]() for p in parts]
        if any(qtype not in PACKABLE and qtype not in FLOAT_GGUF for qtype, _ in raws):
            return None
        layers = [_from_gguf(qtype, data, ckpt.release_view) for qtype, data in raws]
        for p in parts:
            ckpt.release(p)  # packed: the file's pages need not stay resident
        released.extend(parts)
    elif scheme == "float" and all(p in ckpt.raw for p in parts):
        # a float checkpoint's block-coded tensors (gpt-oss's MXFP4 experts) pack as GGUF's
        return _pack(ckpt, parts, "gguf", released)
    elif scheme == "float":
        tensors = [ckpt.tensors[p]() for p in parts]
        if any(t.dim() != 2 or t.dtype not in FLOAT_GGUF.values() for t in tensors):
            return None
        layers = [FloatLinear(t) for t in tensors]
    else:
        layers = [QuantLinear.from_float(ckpt.tensors[p](), scheme) for p in parts]
    if len(layers) == 1:
        return layers[0]
    kind = type(layers[0])
    if all(type(layer) is kind for layer in layers):
        try:
            return kind.cat(layers)  # one format: one packed tensor
        except ValueError:
            pass
    # parts that pack differently (Q4_K q and k beside a Q6_K v): one row segment each
    return SegmentedLinear(layers)


def _from_gguf(qtype, data: np.ndarray, release_view=None) -> NativeLinear:
    """A layer holding one GGUF tensor's data [rows, ...] in its own encoding (release_view:
    told of each row range once packed)."""
    if qtype in FLOAT_GGUF:  # float rows: F16/F32 come as their dtype, BF16 as bytes
        raw = np.ascontiguousarray(data).view(np.uint8).reshape(data.shape[0], -1)
        return FloatLinear(torch.from_numpy(raw.copy()).view(FLOAT_GGUF[qtype]))
    k = _in_features(qtype, data)
    return QuantLinear.from_gguf(data, qtype, data.shape[0], k, release=release_view)


def _in_features(qtype, data) -> int:
    from gguf.constants import GGML_QUANT_SIZES

    block, type_size = GGML_QUANT_SIZES[qtype]
    return data.shape[1] // type_size * block
