"""Embeddings: one vector per prompt, pooled from the model's final-norm hidden states.

An embedding request runs its prompt's prefill like any other (batched, chunked) and,
instead of sampling, keeps the hidden states after the final norm at the rows its pooling
needs:

    last   the prompt's last token (decoder embedding models: Qwen3-Embedding, gte-Qwen2)
    cls    the prompt's first token (BERT-style [CLS])
    mean   the mean over every prompt token (a running sum across prefill chunks)

then, with `normalize`, divides the vector by its L2 norm. Which one a model uses comes
from sentence-transformers' files in its folder when present: `modules.json` lists the
modules in order (Transformer, Pooling, optionally Normalize) and the Pooling module's
folder has `config.json` with `pooling_mode_{cls_token,mean_tokens,lasttoken}`. Without
them: last token, normalized (what decoder-based embedding models use).

    read_pooling(folder)       the model folder -> Pooling (PoolingError if unsupported)
    PoolState                  one sequence's accumulator (the model runner feeds it)
    truncate(vector, dims)     Matryoshka: the first dims values, renormalized
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

MODES = ("last", "cls", "mean")
# sentence-transformers' Pooling config key -> our mode
_ST_MODES = {
    "pooling_mode_lasttoken": "last",
    "pooling_mode_cls_token": "cls",
    "pooling_mode_mean_tokens": "mean",
}
_ST_UNSUPPORTED = (
    "pooling_mode_max_tokens",
    "pooling_mode_mean_sqrt_len_tokens",
    "pooling_mode_weightedmean_tokens",
)


class PoolingError(ValueError):
    """The model folder asks for a pooling (or a module) tokenmill does not implement."""


@dataclass(frozen=True)
class Pooling:
    mode: str = "last"  # one of MODES
    normalize: bool = True  # L2-normalize the pooled vector

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise PoolingError(f"pooling mode {self.mode!r} is not one of {', '.join(MODES)}")

    @property
    def needs_every_row(self) -> bool:
        """Does the pooling read prompt rows before the last? Then none may be served by
        the prefix cache (cached rows are never run, so their hidden states never exist)."""
        return self.mode != "last"


def read_pooling(folder: Path | None) -> Pooling:
    """The pooling sentence-transformers' files in `folder` describe; last-token and
    normalized when there are none (or `folder` is not a folder, e.g. a GGUF file)."""
    modules_file = None if folder is None else Path(folder) / "modules.json"
    if modules_file is None or not modules_file.is_file():
        return Pooling()
    try:
        modules = json.loads(modules_file.read_text())
    except (OSError, ValueError) as e:
        raise PoolingError(f"{modules_file}: not readable JSON ({e})") from None
    if not isinstance(modules, list):
        raise PoolingError(f"{modules_file}: expected a list of modules")
    mode, normalize = "last", False
    for module in modules:
        kind = str(module.get("type", "")).rsplit(".", 1)[-1]
        if kind == "Transformer":
            continue
        if kind == "Normalize":
            normalize = True
        elif kind == "Pooling":
            mode = _read_st_pooling(Path(folder) / str(module.get("path", "")) / "config.json")
        else:  # Dense, LayerNorm, ...: a further layer tokenmill would have to run
            raise PoolingError(
                f"{modules_file}: module {module.get('name', '?')!r} of type "
                f"{module.get('type')!r} is not supported (only Transformer, Pooling, Normalize)"
            )
    return Pooling(mode, normalize)


def _read_st_pooling(path: Path) -> str:
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise PoolingError(f"{path}: not readable JSON ({e})") from None
    if config.get("pooling_mode") is not None:  # newer files may name the mode directly
        named = {"lasttoken": "last", "cls": "cls", "mean": "mean"}.get(config["pooling_mode"])
        if named is None:
            raise PoolingError(f"{path}: pooling_mode {config['pooling_mode']!r} not supported")
        return named
    unsupported = [key for key in _ST_UNSUPPORTED if config.get(key)]
    modes = [mode for key, mode in _ST_MODES.items() if config.get(key)]
    if unsupported or len(modes) != 1:
        on = unsupported + [k for k in _ST_MODES if config.get(k)]
        raise PoolingError(
            f"{path}: pooling {', '.join(on) or 'none'} is not supported "
            "(exactly one of last token, CLS token, mean)"
        )
    if config.get("include_prompt") is False:
        raise PoolingError(f"{path}: include_prompt false is not supported")
    return modes[0]


class PoolState:
    """One embedding sequence's pooling: which of its rows to keep, and their sum.

    The model runner asks `rows(start, end, length)` for each chunk (prompt positions
    start..end-1 of a prompt of `length` tokens), runs the model, and hands the final-norm
    hidden states of those rows to `add`. A chunk that starts at position 0 starts over
    (a preempted sequence recomputes its prompt)."""

    def __init__(self, pooling: Pooling, score: Callable[[torch.Tensor], float] | None = None):
        self.pooling = pooling
        self.score = score  # a reranker's head: the pooled vector [d] -> its relevance
        self.total: torch.Tensor | None = None  # [d] float32: the sum of the kept rows
        self.count = 0

    def rows(self, start: int, end: int, length: int) -> range:
        """Positions (in start..end-1) whose hidden states this pooling keeps."""
        mode = self.pooling.mode
        if mode == "mean":
            return range(start, end)
        if mode == "cls":
            return range(0, 1) if start == 0 else range(0)
        return range(length - 1, length) if end == length else range(0)  # last

    def add(self, hidden: torch.Tensor, restart: bool) -> None:
        """hidden [k, d]: the kept rows of one chunk."""
        if restart:
            self.total, self.count = None, 0
        if hidden.shape[0] == 0:
            return
        part = hidden.float().sum(dim=0)
        self.total = part if self.total is None else self.total + part
        self.count += hidden.shape[0]

    def result(self) -> list[float]:
        """The pooled vector [d] (mean over the kept rows, then L2-normalized if asked)."""
        if self.total is None:
            raise RuntimeError("no hidden state was pooled for this sequence")
        vector = self.total / self.count
        if self.score is not None:
            return [self.score(vector)]
        if self.pooling.normalize:
            vector = torch.nn.functional.normalize(vector, dim=0)
        return vector.tolist()


def truncate(vector: list[float], dims: int) -> list[float]:
    """Matryoshka truncation: the first `dims` values, L2-renormalized."""
    head = torch.tensor(vector[:dims], dtype=torch.float32)
    return torch.nn.functional.normalize(head, dim=0).tolist()
