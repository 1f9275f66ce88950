"""A rank's view of a checkpoint: the same Checkpoint interface, with every tensor cut to
the rank's part (distributed/plan.py) and, for pipeline stages, only its layers.

Cuts are row or column slices, taken lazily when the loader asks for a tensor. Packed
GGUF tensors are cut in their file encoding: a row slice is a slice of whole rows of
blocks, a column slice a slice of whole blocks of every row, so a rank reads only its
bytes of the file and never makes a float32 copy of the whole tensor. A column cut that
falls inside a block (a 256-value K-quant block spanning heads of two ranks) cannot be
cut in the encoding: that rank's columns are dequantized from the covering blocks only
and kept as float32 (FloatLinear).
"""

from __future__ import annotations

import re
from collections.abc import Callable

import numpy as np
import torch
from gguf import GGMLQuantizationType as GT
from gguf.constants import GGML_QUANT_SIZES
from gguf.quants import dequantize

from tokenmill.distributed.plan import PPStage, TPShard
from tokenmill.loader import Checkpoint

Slicer = tuple[str, int, int] | None  # ("rows" | "cols" | "first-rank-only", start, end)
_FLOAT_RAW = {GT.F32, GT.F16}  # raw data that comes as float arrays, not block bytes


def tp_slicer(name: str, shard: TPShard, head_dim: int) -> Slicer:
    """How tensor `name` (tokenmill's names) is cut for `shard`; None: every rank has it whole."""
    q0, q1 = (h * head_dim for h in shard.q_heads)
    k0, k1 = (h * head_dim for h in shard.kv_heads)
    f0, f1 = shard.mlp
    v0, v1 = shard.vocab
    rules = [
        (r"\.attn\.q\.(weight|bias)$", ("rows", q0, q1)),
        (r"\.attn\.[kv]\.(weight|bias)$", ("rows", k0, k1)),
        (r"\.attn\.o\.weight$", ("cols", q0, q1)),
        (r"\.mlp\.(gate|up)\.(weight|bias)$", ("rows", f0, f1)),
        (r"\.mlp\.down\.weight$", ("cols", f0, f1)),
        (r"\.(attn\.o|mlp\.down)\.bias$", ("first-rank-only", 0, 0)),  # added once, after the sum
        (r"^(embed|lm_head)\.weight$", ("rows", v0, v1)),
    ]
    for pattern, cut in rules:
        if re.search(pattern, name):
            return cut
    return None


def _cut_tensor(t: torch.Tensor, cut: Slicer, rank: int) -> torch.Tensor:
    if cut is None:
        return t
    kind, a, b = cut
    if kind == "rows":
        return t[a:b].contiguous()
    if kind == "cols":
        return t[:, a:b].contiguous()
    return t if rank == 0 else torch.zeros_like(t)


def _cut_raw(qtype, data: np.ndarray, cut: Slicer) -> tuple:
    """A GGUF tensor in its file encoding (qtype, [rows, bytes or values per row]) cut."""
    if cut is None or cut[0] == "first-rank-only":
        return qtype, data
    kind, a, b = cut
    if kind == "rows":
        return qtype, data[a:b]
    if qtype in _FLOAT_RAW:
        return qtype, data[:, a:b]
    block, size = GGML_QUANT_SIZES[qtype]
    if a % block == 0 and b % block == 0:  # whole blocks of every row: cut the bytes
        return qtype, data[:, a // block * size : b // block * size]
    # the cut falls inside a block: dequantize just the covering blocks, keep float32
    lo, hi = a // block, -(-b // block)
    part = np.ascontiguousarray(data[:, lo * size : hi * size])
    w = dequantize(part, qtype).reshape(data.shape[0], -1)
    return GT.F32, np.ascontiguousarray(w[:, a - lo * block : b - lo * block])


def _view(ckpt: Checkpoint, names: dict[str, tuple[str, Slicer]], rank: int) -> Checkpoint:
    """A Checkpoint whose tensor `local` is the source tensor cut by its slicer."""

    def tensor(src: str, cut: Slicer) -> Callable[[], torch.Tensor]:
        return lambda: _cut_tensor(ckpt.tensors[src](), cut, rank)

    def raw(src: str, cut: Slicer) -> Callable[[], tuple]:
        return lambda: _cut_raw(*ckpt.raw[src](), cut)

    tensors = {
        local: tensor(src, cut) for local, (src, cut) in names.items() if src in ckpt.tensors
    }
    raws = {local: raw(src, cut) for local, (src, cut) in names.items() if src in ckpt.raw}
    # First-rank-only tensors (row-parallel biases) are zero on the other ranks: their
    # raw form must not bypass that, so those stay float.
    for local, (_, cut) in names.items():
        if cut is not None and cut[0] == "first-rank-only":
            raws.pop(local, None)
    release = lambda n: ckpt.release(names[n][0]) if n in names else None  # noqa: E731
    return Checkpoint(
        ckpt.path, ckpt.format, ckpt.config, tensors, ckpt.generation_config, raws, release
    )


def tp_checkpoint(ckpt: Checkpoint, shard: TPShard) -> Checkpoint:
    """The checkpoint as tensor-parallel rank `shard.rank` loads it."""
    hd = ckpt.config.head_dim
    names = {n: (n, tp_slicer(n, shard, hd)) for n in ckpt.tensors}
    return _view(ckpt, names, shard.rank)


def pp_checkpoint(ckpt: Checkpoint, stage: PPStage) -> Checkpoint:
    """The checkpoint as pipeline stage `stage` loads it: its layers renumbered from 0,
    the embedding on the first stage (and the last when tied), the head on the last."""
    l0, l1 = stage.layers
    names: dict[str, tuple[str, Slicer]] = {}
    for n in ckpt.tensors:
        m = re.match(r"layers\.(\d+)\.(.*)", n)
        if m:
            i = int(m.group(1))
            if l0 <= i < l1:
                names[f"layers.{i - l0}.{m.group(2)}"] = (n, None)
        elif n.startswith(("embed.", "pos_embed.")):
            if stage.first or (stage.last and n.startswith("embed.")):
                names[n] = (n, None)
        elif n.startswith(("final_norm.", "lm_head.")):
            if stage.last:
                names[n] = (n, None)
        else:
            names[n] = (n, None)  # rope_freqs and the like
    return _view(ckpt, names, 0)
