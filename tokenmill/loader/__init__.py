"""Checkpoint loading: a path in, a ModelConfig plus named weight tensors out.

Two formats: Hugging Face checkpoint folders (safetensors) and GGUF files. Both
produce tensors under tokenmill's own parameter names (see `models/transformer.py`),
so the model never knows where its weights came from.
"""

from __future__ import annotations

from pathlib import Path

# The types live in a module of their own, so the format readers import them without
# importing this package's dispatch (which imports the readers).
from tokenmill.loader.checkpoint import Checkpoint, LoadError

__all__ = ["Checkpoint", "LoadError", "open_checkpoint", "sniff_format"]


def open_checkpoint(path: str | Path) -> Checkpoint:
    """Open a checkpoint folder or .gguf file and read its configuration (not yet its weights)."""
    from tokenmill.loader import gguf_file, hf_folder

    path = Path(path)
    if sniff_format(path) == "hf":
        return hf_folder.open_folder(path)
    return gguf_file.open_gguf(path)


def sniff_format(path: str | Path) -> str:
    """ "hf" (a folder with a config.json) or "gguf" (a file starting with the GGUF magic),
    else LoadError.

    Reads at most 4 bytes and imports nothing heavy, so the CLI can refuse a wrong
    path before it spends seconds importing torch."""
    path = Path(path)
    if not path.exists():
        raise LoadError(path, "no such file or folder")
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise LoadError(path, "no config.json (not a Hugging Face checkpoint folder)")
        return "hf"
    try:
        with open(path, "rb") as f:
            magic = f.read(4)
    except OSError as e:
        raise LoadError(path, e.strerror or str(e)) from None
    if magic == b"GGUF":
        return "gguf"
    if path.suffix == ".gguf":
        raise LoadError(path, f"not a GGUF file (magic {magic!r}, expected b'GGUF')")
    raise LoadError(path, "not a checkpoint folder or .gguf file")
