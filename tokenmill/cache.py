"""The cache folder: $TOKENMILL_CACHE, else ~/.cache/tokenmill.

Known models (hub.py) and the compiled kernels (kernels/build.py) live under it. A leaf
module (standard library only), so the kernels find their folder without importing the
model hub and, through it, the loaders.
"""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """The cache folder, created if missing."""
    root = os.environ.get("TOKENMILL_CACHE") or Path.home() / ".cache" / "tokenmill"
    path = Path(root)
    path.mkdir(parents=True, exist_ok=True)
    return path
