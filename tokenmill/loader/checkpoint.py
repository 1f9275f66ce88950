"""What a loader returns: a Checkpoint (a config and its tensors, read lazily), or a
LoadError naming the file and the problem. Torch-free at import (annotations only)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tokenmill.config import ModelConfig

if TYPE_CHECKING:  # annotations only: the CLI checks a path with sniff_format before torch loads
    import torch


class LoadError(RuntimeError):
    """A checkpoint could not be loaded. The message is one line naming file and problem."""

    def __init__(self, path: str | Path, problem: str):
        super().__init__(f"{path}: {problem}")
        self.path = str(path)
        self.problem = problem


@dataclass
class Checkpoint:
    path: Path
    format: str  # "hf" | "gguf"
    config: ModelConfig
    # name -> a function producing the tensor (lazily: nothing is read until called)
    tensors: dict[str, Callable[[], torch.Tensor]]
    generation_config: dict = field(default_factory=dict)
    # GGUF only: name -> a function giving the tensor still in its file encoding, as
    # (GGMLQuantizationType, array [rows, bytes per row]) with rows already in tokenmill's
    # order (Q/K unpermuted, fused QKV split). Quantized layers are built from these
    # without ever making a float32 copy.
    raw: dict[str, Callable[[], tuple]] = field(default_factory=dict)
    # name -> the tensor's shape as `tensors[name]()` will return it, read from the file's
    # header without touching the data: checks.py compares them with the config
    shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)
    # release(name): the caller is done with that tensor's file bytes (GGUF: drops the
    # mapped pages from the resident set, so packing a model never holds the file twice)
    release: Callable[[str], None] = lambda name: None
    # release_view(array): the caller is done with these bytes of a `raw` array (a row
    # range, while a big tensor packs); GGUF drops the pages under it if they are the
    # file's, nothing otherwise
    release_view: Callable[[Any], None] = lambda view: None

    def items(self) -> Iterator[tuple[str, Callable[[], torch.Tensor]]]:
        return iter(self.tensors.items())
