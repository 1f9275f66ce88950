"""The trace contract: the hooks the engine and the model call on a traced request, and
the read-only view of the engine a trace may read at the end of a step.

tokenmill/inspect/trace.py's `Trace` implements `StepHooks`; anything else that does can watch a
request the same way. Hook order within one engine step:

    on_step_begin -> on_embedding -> per layer: on_attention, on_residual("attention"),
    on_residual("mlp") -> on_sample (if the step yields a token) -> on_step_end

A verification step (speculative decoding: the sequence's last token and its guesses as
1 + k rows, on_step_begin's `proposal`) calls on_sample once per token it emits, in
order: row j's token, while the tokens so far equal the guesses (so 1 to 1 + k calls).

The forward pass's three (on_embedding, on_attention, on_residual) and AttentionSite are
declared with the batch they see (layers/attention.py: ForwardHooks), below the engine,
so that the layers and the model never import it.

A traced row takes the whole step off the native decode paths (models/paths.py: the
hooks need each layer's tensors), so the other requests in that step run the torch path
too: tracing is cheap, but not free for a batch that shares a step with it.

on_attention gets a whole prefill chunk's queries and context (q [1, H, L, hd], keys
[1, Hkv, C, hd]): a hook must compute from them only the rows it keeps, or a long
prompt's trace costs O(L x C) per layer and chunk on the engine thread that every
request shares (trace.py computes at most SUMMARY_ROWS rows per layer, plus the map rows
asked for).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from tokenmill.layers.attention import ForwardHooks

if TYPE_CHECKING:
    from torch import Tensor

    from tokenmill.config import ModelConfig
    from tokenmill.engine.sequence import Sequence
    from tokenmill.sampling import SamplingParams, SamplingState


@dataclass(frozen=True)
class EngineView:
    """What a trace may read of the engine, read-only: facts fixed at load, the pool's
    current use, and the engine's own rules (so a trace never copies them)."""

    model_name: str
    config: ModelConfig
    tokenizer: Any  # tokenmill.tokenizer.Tokenizer
    info: dict[str, str]  # LLMEngine.info(): dtype, weights, kernels...
    decode_path: Any  # models.paths.DecodePath of an untraced decode step
    parallel: list[str] | None  # what each rank holds, in a parallel run
    position_encoding: Callable[[list[int], int], dict[str, Any]]  # positions, dims -> sample
    kv_bytes_per_token: int
    block_size: int
    kv_capacity_tokens: int
    kv_capacity_bytes: int
    pool_blocks_total: int
    pool_blocks_used: Callable[[], int]
    is_stop_token: Callable[[int, SamplingParams], bool]  # sampling/stop.py's rule
    # engine/speculative.py's counters now ({} while speculation is off)
    speculative_stats: Callable[[], dict[str, Any]]


class StepHooks(ForwardHooks, Protocol):
    """A traced request's observer (Sequence.trace; AttentionMetadata.trace.hooks in the
    forward pass): the forward pass's hooks (on_embedding, on_attention, on_residual:
    declared with the batch they see, layers/attention.py::ForwardHooks) and the engine's
    around them."""

    # proposal: a verification step's speculative guesses (engine/speculative.py), the
    # step's rows after the sequence's last token; () for any other step
    def on_step_begin(
        self, seq: Sequence, num_tokens: int, proposal: tuple[int, ...] = ()
    ) -> None: ...

    def on_sample(self, logits_row: Tensor, state: SamplingState, token_id: int) -> None: ...

    def on_step_end(self, seq: Sequence, engine: EngineView) -> None: ...
