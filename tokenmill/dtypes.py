"""The activation dtypes a model runs in, by the name a user gives (`--dtype`, `dtype=`).

Beside config.py, at the bottom of the layers, so that the engine, the CLI and every rank
of a parallel run (distributed/runtime.py) read one table. Not in config.py itself: that
module stays free of torch, because the CLI checks a checkpoint's config before torch loads.
"""

from __future__ import annotations

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# ---- the KV cache's 8-bit format (kv_cache_dtype="q8_0") ----
# llama.cpp's q8_0 layout: every 32 values of a K or V row are one block of 34 bytes, a
# float16 scale d then 32 int8 q, the value being q * d. A cache of it is a uint8 tensor
# [slots, Hkv, hd / 32 * 34]; the kernels (attention.c) read and write the same bytes.
Q8_0 = "q8_0"
Q8_0_BLOCK = 32  # values per block
Q8_0_BYTES = 34  # bytes per block: the float16 scale, then 32 int8


def kv_value_bytes(dtype: torch.dtype | str, n: int) -> int:
    """Bytes that n values (a multiple of Q8_0_BLOCK for q8_0) take in a cache of dtype."""
    if dtype == Q8_0:
        return n // Q8_0_BLOCK * Q8_0_BYTES
    return n * torch.empty((), dtype=dtype).element_size()


def quantize_q8_0(x: torch.Tensor) -> torch.Tensor:
    """x [..., n] (n a multiple of 32) -> its q8_0 bytes [..., n / 32 * 34] (uint8).

    Per block: d = max|x| / 127, q = round(x / d) to nearest even, computed as
    x * (1 / d) in float32, as the kernels' kv_store does, so both write the same bytes for
    the same x; d is stored rounded to float16 (as llama.cpp does)."""
    *lead, n = x.shape
    blocks = x.float().reshape(*lead, n // Q8_0_BLOCK, Q8_0_BLOCK)  # [..., nb, 32]
    d = blocks.abs().amax(dim=-1, keepdim=True) / 127.0  # [..., nb, 1]
    inv = torch.where(d > 0, 1.0 / d, torch.zeros_like(d))
    q = torch.round(blocks * inv).clamp_(-127, 127).to(torch.int8)
    scale = d.to(torch.float16).view(torch.uint8)  # [..., nb, 2], little-endian
    return torch.cat([scale, q.view(torch.uint8)], dim=-1).reshape(*lead, -1)


def dequantize_q8_0(b: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """q8_0 bytes b [..., nb * 34] (uint8) -> the values [..., nb * 32] in dtype: q * d,
    multiplied in float32 as the kernels do."""
    *lead, nbytes = b.shape
    blocks = b.reshape(*lead, nbytes // Q8_0_BYTES, Q8_0_BYTES)  # [..., nb, 34]
    d = blocks[..., :2].contiguous().view(torch.float16).float()  # [..., nb, 1]
    q = blocks[..., 2:].contiguous().view(torch.int8).float()  # [..., nb, 32]
    return (q * d).reshape(*lead, -1).to(dtype)
