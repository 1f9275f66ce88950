"""Request sampling parameters, the batched sampler, and stop conditions.

`params` (SamplingParams) is torch-free and the CLI validates arguments with it
before anything heavy loads, so the sampler's names (torch) are imported on
first use (PEP 562) rather than here.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from tokenmill.sampling.params import SamplingParams

__all__ = [
    "FinishReason",
    "LogitsTrace",
    "SampleOutput",
    "Sampler",
    "SamplingParams",
    "SamplingState",
    "StopStringMatcher",
    "apply_logit_bias",
    "apply_penalties",
    "apply_temperature",
    "finish_reason",
    "is_stop_token",
    "mask_logits",
    "min_p_mask",
    "process_logits",
    "sample_from_probs",
    "top_k_mask",
    "top_p_mask",
]
_STOP = ("FinishReason", "StopStringMatcher", "finish_reason", "is_stop_token")

if TYPE_CHECKING:  # for type checkers and editors; never executed
    from tokenmill.sampling.sampler import (
        LogitsTrace,
        SampleOutput,
        Sampler,
        SamplingState,
        apply_logit_bias,
        apply_penalties,
        apply_temperature,
        mask_logits,
        min_p_mask,
        process_logits,
        sample_from_probs,
        top_k_mask,
        top_p_mask,
    )
    from tokenmill.sampling.stop import (
        FinishReason,
        StopStringMatcher,
        finish_reason,
        is_stop_token,
    )


def __getattr__(name: str) -> Any:
    if name in __all__:
        module = "tokenmill.sampling.stop" if name in _STOP else "tokenmill.sampling.sampler"
        value = getattr(importlib.import_module(module), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'tokenmill.sampling' has no attribute {name!r}")
