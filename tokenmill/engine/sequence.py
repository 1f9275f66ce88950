"""One generation request's state as it moves through the engine.

A sequence's tokens are its prompt followed by what it generated. `num_computed`
counts the leading tokens whose K/V already sit in the cache; each engine step
computes the next chunk of the rest (a whole prompt, a prefill chunk, or the one
newest token when decoding).
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from tokenmill.engine.pooling import PoolState
from tokenmill.sampling import FinishReason, SamplingParams, SamplingState


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Sequence:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    sampling: SamplingState
    arrival: float = field(default_factory=time.perf_counter)
    output_ids: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    num_computed: int = 0  # leading tokens with K/V in the cache
    num_cached_prompt: int = 0  # prompt tokens served by the prefix cache at admission
    num_prefill_computed: int = 0  # prompt tokens this request actually ran through the model
    block_table: list[int] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    first_token_time: float | None = None
    finish_time: float | None = None
    num_preemptions: int = 0
    committed_blocks: int = 0  # leading blocks named for the prefix cache
    # The root of this sequence's prefix-cache hash chain: None for the shared cache, a
    # salt (block_manager.salt_root) for a private one; blocks named under one root are
    # never matched under another (vLLM's cache_salt).
    cache_salt: int | None = None
    last_hash: int | None = None  # hash of the last named block (cache_salt before any)
    trace: object | None = None  # a tokenmill.inspect.trace.Trace recording this request's steps
    last_step: int = -1  # the scheduler step that last ran it (traced ones take turns)
    # Who this sequence counts against for fair scheduling: its API request (the n
    # choices of one request share it). None: a group of its own (request_id).
    group: str | None = None
    # An embedding request's pooling (engine/pooling.py): its prompt runs, nothing is
    # sampled, and the model runner hands it the rows' final-norm hidden states.
    pool: PoolState | None = None
    # Its speculation (engine/speculative.py's SpecState: n-gram index, k, acceptance),
    # made at its first proposal; None without speculation.
    spec: object | None = None

    def __post_init__(self) -> None:
        self.last_hash = self.cache_salt
        if self.group is None:
            self.group = self.request_id

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    def __len__(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def num_uncomputed(self) -> int:
        return len(self) - self.num_computed

    def token_at(self, i: int) -> int:
        n = len(self.prompt_ids)
        return self.prompt_ids[i] if i < n else self.output_ids[i - n]
