"""The activation dtypes a model runs in, by the name a user gives (`--dtype`, `dtype=`).

Beside config.py, at the bottom of the layers, so that the engine, the CLI and every rank
of a parallel run (distributed/runtime.py) read one table. Not in config.py itself: that
module stays free of torch, because the CLI checks a checkpoint's config before torch loads.
"""

from __future__ import annotations

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
