"""A checkpoint checked against its own config, before any model is built from it.

A file's numbers size what loading allocates: the layer count makes that many blocks,
vocabulary x hidden size the embedding, the context length the RoPE tables. So before
`Transformer(config)` runs, the checkpoint must agree with itself:

- layers: tensors for exactly layers 0..N-1 of the N the config claims (a block_count of
  10^8 would otherwise build 10^8 blocks, minutes and gigabytes, before anything looked);
- tensors: every tensor the model will load is in the file, with the shape the config
  implies (`loader/shapes.py`, below the model it describes);
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

from tokenmill.loader.checkpoint import Checkpoint, LoadError
from tokenmill.loader.shapes import checkpoint_shapes

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
    expected = checkpoint_shapes(ckpt.config)
    shapes = dict(ckpt.shapes)
    available = set(ckpt.tensors)
    if "embed.weight" in available and "lm_head.weight" in expected:
        available.add("lm_head.weight")  # tied in the file, not the config: load_weights copies
        shapes.setdefault("lm_head.weight", shapes.get("embed.weight"))
    missing = [name for name in expected if name not in available]
    if missing:
        raise LoadError(ckpt.path, f"missing tensor {missing[0]!r} ({len(missing)} missing)")
    for name, shape in expected.items():
        found = shapes.get(name)  # None: a checkpoint without header shapes
        if found is not None and tuple(found) != shape:
            raise LoadError(
                ckpt.path, f"tensor {name!r} has shape {tuple(found)}, expected {shape}"
            )
    rotary_dim = (ckpt.config.rope.dim or ckpt.config.head_dim) // 2
    if "rope_freqs" in shapes and tuple(shapes["rope_freqs"]) != (rotary_dim,):
        raise LoadError(
            ckpt.path,
            f"tensor 'rope_freqs' has shape {tuple(shapes['rope_freqs'])}, expected {(rotary_dim,)}",
        )


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
