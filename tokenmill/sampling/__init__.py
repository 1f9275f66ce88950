"""Request sampling parameters, the batched sampler, and stop conditions."""

from tokenmill.sampling.params import SamplingParams
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
from tokenmill.sampling.stop import StopStringMatcher, check_stop_token

__all__ = [
    "LogitsTrace",
    "SampleOutput",
    "Sampler",
    "SamplingParams",
    "SamplingState",
    "StopStringMatcher",
    "apply_logit_bias",
    "apply_penalties",
    "apply_temperature",
    "check_stop_token",
    "mask_logits",
    "min_p_mask",
    "process_logits",
    "sample_from_probs",
    "top_k_mask",
    "top_p_mask",
]
