"""Which code runs a forward pass's decode rows: the one place that decides, and says why.

| path             | what runs                                                    | when |
|------------------|--------------------------------------------------------------|------|
| stack            | every layer and the final norm in one C call (tm_decode_stack) | a step of decode rows only, untraced, and the model fits the stack (RMSNorm, gated SiLU/GELU MLP, every linear native) |
| native-attention | the per-layer modules; each layer's decode-row attention in one C call (tm_decode_attention) | decode rows, untraced, but the step also has prefill rows or the model does not fit the stack |
| torch            | the per-layer modules, attention with torch SDPA: the reference | a traced step (the inspector records every op), no decode rows, no native library, not float32 on CPU, or TOKENMILL_FUSED_DECODE=0 |

Linear layers run their own native kernel on every path where the weights are native
(layers/native_linear.py); the paths differ in what runs around them. `choose` is called
by the model once per step; the first time a (path, reason) pair is seen it is logged at
debug level, and `tokenmill inspect` shows it.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch

from tokenmill import kernels

log = logging.getLogger(__name__)

STACK, NATIVE_ATTENTION, TORCH = "stack", "native-attention", "torch"
# the native attention reads these (uint8: q8_0 blocks)
KV_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.uint8)
# TOKENMILL_FUSED_DECODE=0 keeps every step on the torch path (the reference).
NATIVE_DECODE = os.environ.get("TOKENMILL_FUSED_DECODE", "1") != "0"


@dataclass(frozen=True)
class DecodePath:
    name: str  # STACK, NATIVE_ATTENTION or TORCH
    reason: str  # why this path and not a faster one


def native_blocker(model) -> str | None:
    """Why no native decode path can run for this model at all, or None."""
    if not NATIVE_DECODE:
        return "TOKENMILL_FUSED_DECODE=0"
    if kernels.library() is None:
        return "no native kernel library"
    if model.dtype is not torch.float32:
        return f"activations are {str(model.dtype).removeprefix('torch.')}, not float32"
    cache = model.layers[0].attn.k_cache
    if cache is None:
        return "no KV cache attached"
    if cache.device.type != "cpu" or cache.dtype not in KV_DTYPES:
        return f"the KV cache is {cache.dtype} on {cache.device.type}, not a 32/16-bit float or q8_0 on cpu"
    return None


def best_decode_path(model) -> DecodePath:
    """The path an untraced step of decode rows only takes on this model."""
    blocker = native_blocker(model)
    if blocker is not None:
        return DecodePath(TORCH, blocker)
    stack_blocker = model.native_model().stack_blocker
    if stack_blocker is not None:
        return DecodePath(NATIVE_ATTENTION, stack_blocker)
    return DecodePath(STACK, "a step of decode rows only, untraced")


def choose(model, meta, num_rows: int) -> DecodePath:
    """The path of one step: `meta` its AttentionMetadata, `num_rows` its packed rows."""
    if meta.num_decode == 0:
        path = DecodePath(TORCH, "no decode rows (prefill only)")
    elif meta.trace is not None:
        path = DecodePath(TORCH, "traced step: the inspector records every op")
    else:
        path = best_decode_path(model)
        if path.name == STACK and meta.num_decode < num_rows:
            path = DecodePath(NATIVE_ATTENTION, "the step has prefill rows too")
    if path not in model._paths_seen:
        model._paths_seen.add(path)
        log.debug("decode path %s: %s", path.name, path.reason)
    return path
