"""A checkpoint checked against its own config, before any model is built from it.

A file's numbers size what loading allocates: the layer count makes that many blocks,
vocabulary x hidden size the embedding, the context length the RoPE tables. So before
`Transformer(config)` runs, the checkpoint must agree with itself:

- layers: tensors for exactly layers 0..N-1 of the N the config claims (a block_count of
  10^8 would otherwise build 10^8 blocks, minutes and gigabytes, before anything looked);
- tensors: every parameter the model will have is in the file, with the shape the config
  implies. The model is built on torch's meta device for this (shapes, no memory), so the
  expected shapes come from the one place that defines them;
- tables sized from the config alone (RoPE cos/sin: positions x rotary dims x 2) fit in
  this machine's memory.

Weights are then bounded by the file itself: every tensor's bytes were checked against
the file's length when its header was read. Each failure is one LoadError naming the
file and the key or tensor.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import torch

from tokenmill.loader import Checkpoint, LoadError

_LAYER = re.compile(r"layers\.(\d+)\.")


def physical_memory_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def check_checkpoint(ckpt: Checkpoint, *, layer_key: str) -> None:
    """Raise LoadError unless `ckpt`'s tensors and tables match its config (see above).
    layer_key: the file's name for the layer count, for the message."""
    _check_layers(ckpt, layer_key)
    _check_tensors(ckpt)
    _check_tables(ckpt)


def part_shape(path: Path, name: str, shape: tuple[int, ...], part: str | None) -> tuple[int, ...]:
    """The shape of one of q, k, v cut from a fused QKV tensor (rows [q; k; v]), or the
    tensor's own shape when `part` is None."""
    if part is None:
        return tuple(shape)
    if not shape or shape[0] % 3:
        raise LoadError(path, f"tensor {name}: fused QKV with {shape[0]} rows (not 3 equal parts)")
    return (shape[0] // 3, *shape[1:])


def _check_layers(ckpt: Checkpoint, layer_key: str) -> None:
    n = ckpt.config.num_layers  # at most MAX_SIZES["num_layers"]: the sets below are small
    present = {int(m.group(1)) for name in ckpt.tensors if (m := _LAYER.match(name))}
    expected = set(range(n))
    if present == expected:
        return
    missing, extra = sorted(expected - present), sorted(present - expected)
    if missing:
        problem = (
            f"{layer_key} is {n}, but the file has no tensors for layer {missing[0]} "
            f"({len(missing)} of {n} layers missing)"
        )
    else:
        problem = f"{layer_key} is {n}, but the file has tensors for layer {extra[0]}"
    raise LoadError(ckpt.path, problem)


def _check_tensors(ckpt: Checkpoint) -> None:
    from tokenmill.models.transformer import Transformer, checkpoint_parts

    with torch.device("meta"):
        model = Transformer(ckpt.config)
    gated = ckpt.config.mlp == "gated"
    shapes = dict(ckpt.shapes)
    available = set(ckpt.tensors)
    if "embed.weight" in available and model.lm_head is not None:
        available.add("lm_head.weight")  # tied in the file, not the config: load_weights copies
        shapes.setdefault("lm_head.weight", shapes.get("embed.weight"))
    plan = {name: checkpoint_parts(name, gated) for name, _ in model.named_parameters()}
    missing = [p for parts in plan.values() for p in parts if p not in available]
    if missing:
        raise LoadError(ckpt.path, f"missing tensor {missing[0]!r} ({len(missing)} missing)")
    for name, param in model.named_parameters():
        parts = [shapes.get(p) for p in plan[name]]
        if any(s is None for s in parts):
            continue  # a checkpoint without header shapes: load_weights checks after reading
        _check_stack(ckpt.path, plan[name], parts, tuple(param.shape))
    if "rope_freqs" in shapes and model.rotary is not None:
        expected = (model.rotary.dim // 2,)
        if tuple(shapes["rope_freqs"]) != expected:
            raise LoadError(
                ckpt.path,
                f"tensor 'rope_freqs' has shape {shapes['rope_freqs']}, expected {expected}",
            )


def _check_stack(
    path: Path, names: list[str], shapes: list[tuple[int, ...]], expected: tuple[int, ...]
) -> None:
    """The tensors `names` stacked along rows (torch.cat, dim 0) must make shape `expected`."""
    rest = {tuple(s[1:]) for s in shapes}
    stacked = None
    if all(len(s) == len(expected) for s in shapes) and len(rest) == 1:
        stacked = (sum(s[0] for s in shapes), *shapes[0][1:])
    if stacked == expected:
        return
    if len(names) == 1:
        raise LoadError(path, f"tensor {names[0]!r} has shape {shapes[0]}, expected {expected}")
    shown = stacked if stacked is not None else " + ".join(str(s) for s in shapes)
    raise LoadError(path, f"tensor {'+'.join(names)!r} has shape {shown}, expected {expected}")


def _check_tables(ckpt: Checkpoint) -> None:
    cfg = ckpt.config
    if cfg.position != "rope":
        return  # learned positions are a tensor of the file: checked above
    ropes = [r for r in (cfg.rope, cfg.rope_local) if r is not None]
    # Rotary keeps cos and sin, float32, for every position: [max_position, rotary dims].
    nbytes = sum(2 * cfg.max_position * (r.dim or cfg.head_dim) * 4 for r in ropes)
    memory = physical_memory_bytes()
    if nbytes > memory // 2:
        raise LoadError(
            ckpt.path,
            f"a context length of {cfg.max_position} positions needs {nbytes / 2**30:.1f} GiB "
            f"of RoPE tables, more than half of this machine's {memory / 2**30:.1f} GiB",
        )
