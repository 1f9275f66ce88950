"""The KV cache pool: one preallocated block of memory per layer for keys and values.

    k[layer], v[layer]: [num_blocks * block_size, Hkv, hd]  (a flat array of token slots)

in float32, float16 or bfloat16; or, for kv_cache_dtype "q8_0", uint8
[num_blocks * block_size, Hkv, hd / 32 * 34]: each 32 values of a head's row one q8_0
block (tokenmill/dtypes.py), so a token takes 34/128 of its float32 bytes.

Its size is the user's choice in bytes (`kv_cache_memory`) or tokens; the default
takes a modest share of the machine's memory. Capacity is reported at start-up.
"""

from __future__ import annotations

import ctypes
import functools

import numpy as np
import torch

from tokenmill.checks import ParamError
from tokenmill.config import ModelConfig
from tokenmill.dtypes import Q8_0, Q8_0_BLOCK, kv_value_bytes
from tokenmill.loader.checks import physical_memory_bytes
from tokenmill.units import parse_memory


def default_kv_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free * 0.5)
    return int(min(1 << 30, physical_memory_bytes() // 16))


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero-filled pool. On CPU the memory comes from calloc (via numpy), so the OS maps
    pages lazily: resident memory grows with the tokens actually cached, not the pool size.
    Zeros (not garbage) matter: padded decode slots are read and masked, and 0 * NaN would
    poison the attention output."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    numel = 1
    for d in shape:
        numel *= d
    raw = np.zeros(numel * torch.empty((), dtype=dtype).element_size(), dtype=np.uint8)
    return torch.from_numpy(raw).view(dtype).view(shape)


PAGE = 4096
_MADV_POPULATE_WRITE = 23  # linux/mman.h


@functools.cache
def _madvise():
    """libc's madvise, or None where there is no such call."""
    try:
        madvise = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    return madvise


def _populate(pool: torch.Tensor) -> bool:
    """madvise(MADV_POPULATE_WRITE) over the whole pages of `pool`; False where the kernel
    (or the platform) has no such advice."""
    if (madvise := _madvise()) is None:
        return False
    start = -(-pool.data_ptr() // PAGE) * PAGE  # first whole page
    end = (pool.data_ptr() + pool.numel() * pool.element_size()) // PAGE * PAGE
    return end <= start or madvise(start, end - start, _MADV_POPULATE_WRITE) == 0


@functools.cache
def can_populate() -> bool:
    """Does this kernel take MADV_POPULATE_WRITE (so KVCache.make_resident may run beside
    the engine)?"""
    return _populate(torch.zeros(4 * PAGE, dtype=torch.uint8))


BLOCK_SIZE = 16  # token slots per block, the engine's default


def check_pool_fits(tokens: int, bytes_per_token: int, device: torch.device, memory) -> None:
    """ParamError (kv_cache_memory) for a CPU pool of `tokens` larger than the machine's
    memory; `memory` is the value asked for, as the message quotes it."""
    if device.type == "cpu" and tokens * bytes_per_token > (total := physical_memory_bytes()):
        raise ParamError.named(
            "kv_cache_memory",
            f" {memory!r} means {tokens} tokens, {tokens * bytes_per_token / 2**30:.1f} GiB: "
            f"more than this machine's {total / 2**30:.1f} GiB of memory",
        )


KVDtype = torch.dtype | str  # a torch float dtype, or Q8_0


def kv_bytes_per_token(cfg: ModelConfig, dtype: KVDtype) -> int:
    """Bytes the KV cache of `dtype` holds per token, over all layers (K and V). A q8_0
    cache needs a head_dim that is a multiple of 32 (its blocks never straddle heads)."""
    if dtype == Q8_0 and cfg.head_dim % Q8_0_BLOCK:
        raise ParamError.named(
            "kv_cache_dtype",
            f" q8_0 needs a head_dim that is a multiple of {Q8_0_BLOCK}; "
            f"this model's is {cfg.head_dim}",
        )
    return 2 * cfg.num_layers * cfg.num_kv_heads * kv_value_bytes(dtype, cfg.head_dim)


def kv_blocks(
    cfg: ModelConfig, block_size: int, dtype: KVDtype, device: torch.device, memory
) -> int:
    """Blocks of a pool of `memory` (bytes, "512MiB", "8192tok"; None: the default) for
    the model `cfg`, its cache in `dtype`: the pool holds memory / bytes per token tokens."""
    per_token = kv_bytes_per_token(cfg, dtype)
    amount = parse_memory(memory)
    if amount is None:
        amount = default_kv_bytes(device)
    tokens = -amount if amount < 0 else amount // per_token
    return max(1, tokens // block_size)


class KVCache:
    def __init__(
        self,
        cfg: ModelConfig,
        block_size: int,
        dtype: KVDtype,
        device: torch.device,
        memory: int | str | None = None,
        num_blocks: int | None = None,
    ):
        """num_blocks: the pool's size in blocks, overriding `memory` (the ranks of a
        parallel run size their part of the pool from the whole model's)."""
        self.block_size = block_size
        # what it stores: the activations' dtype, or kv_cache_dtype's (a torch dtype or Q8_0)
        self.dtype = dtype
        self.bytes_per_token = kv_bytes_per_token(cfg, dtype)
        if num_blocks is None:
            num_blocks = kv_blocks(cfg, block_size, dtype, device, memory)
        self.num_blocks = num_blocks
        self.capacity_tokens = slots = num_blocks * block_size  # fixed from here on
        self.nbytes = slots * self.bytes_per_token
        check_pool_fits(slots, self.bytes_per_token, device, memory)
        if dtype == Q8_0:  # [slots, Hkv, hd / 32 * 34] bytes
            shape, store = (
                (slots, cfg.num_kv_heads, kv_value_bytes(Q8_0, cfg.head_dim)),
                torch.uint8,
            )
        else:
            shape, store = (slots, cfg.num_kv_heads, cfg.head_dim), dtype
        self.k = [_zeros(shape, store, device) for _ in range(cfg.num_layers)]
        self.v = [_zeros(shape, store, device) for _ in range(cfg.num_layers)]

    def make_resident(self) -> None:
        """Back the whole pool with memory now. A server does this at start, as llama.cpp
        clears its KV buffer and vLLM reserves its GPU memory: the free list hands out the
        least recently freed block first, so a long-running server touches every block
        within minutes anyway. Doing it up front states the memory once, keeps RSS flat
        under bursts (it climbed by the pool's 1 GiB in the soak as bursts reached new
        blocks) and keeps first-touch page faults (2.5 s per GiB in a VM) out of requests.

        With MADV_POPULATE_WRITE (Linux 5.14+) the kernel maps the pages and leaves their
        contents alone, so this may run beside a working engine; elsewhere it writes a
        zero into each page, so it must run before the first KV write."""
        if not self.k or self.k[0].device.type != "cpu":
            return
        for pool in (*self.k, *self.v):
            if not (can_populate() and _populate(pool)):
                pool.view(-1).view(torch.uint8)[::PAGE].zero_()  # [bytes / PAGE]
