"""The scheduler: which sequences run in the next step, and how many tokens each.

Each step has a token budget (`max_num_batched_tokens`). Running sequences go
first, oldest first: a decoding sequence costs one token, a sequence still in its
prompt takes as much of the budget as is left (chunked prefill: a long prompt is
split over several steps so it never stalls everyone's decoding). Waiting
sequences are admitted first come, first served while budget, sequence slots and
free blocks last. When a running sequence needs a block and none is free, the
newest running sequence is preempted: its blocks are released and it returns to
the front of the waiting queue, to be recomputed later (its full blocks often
come straight back from the prefix cache).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from tokenmill.engine.block_manager import BlockManager
from tokenmill.engine.sequence import Sequence, Status


def is_decode(seq: Sequence, num_tokens: int) -> bool:
    """The decode-or-prefill rule, in one place: one token after a cached context is a
    decode row; anything else (a prompt's first chunk, more tokens) is prefill."""
    return num_tokens == 1 and seq.num_computed > 0


@dataclass
class ScheduledChunk:
    seq: Sequence
    num_tokens: int  # tokens computed for this sequence in this step

    @property
    def is_decode(self) -> bool:
        """A decode row: one new token of a sequence whose earlier tokens are all cached
        (the model runner packs these first; see is_decode)."""
        return is_decode(self.seq, self.num_tokens)

    @property
    def samples(self) -> bool:
        """Does this chunk reach the sequence's end, so its last row yields a token?"""
        return self.seq.num_computed + self.num_tokens == len(self.seq)


class Scheduler:
    def __init__(self, blocks: BlockManager, max_num_seqs: int, max_num_batched_tokens: int):
        self.blocks = blocks
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> list[ScheduledChunk]:
        budget = self.max_num_batched_tokens
        chunks: list[ScheduledChunk] = []
        # ---- running sequences: decode steps and prefill continuations ----
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_uncomputed, budget)
            while not self.blocks.can_grow(seq.block_table, seq.num_computed + n):
                victim = self.running[-1]
                self._preempt(victim)
                if victim is seq:
                    break
            if seq.status is not Status.RUNNING:
                break  # preempted itself: everyone after it is gone too
            self.blocks.grow(seq.block_table, seq.num_computed + n)
            chunks.append(ScheduledChunk(seq, n))
            budget -= n
            i += 1
        # ---- admit waiting sequences, first come first served ----
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if not seq.block_table:
                seq.block_table, seq.last_hash = self.blocks.match_prefix(
                    seq.token_ids, seq.cache_salt
                )
                seq.committed_blocks = len(seq.block_table)
                seq.num_computed = len(seq.block_table) * self.blocks.block_size
                if seq.num_preemptions == 0:
                    seq.num_cached_prompt = seq.num_computed
            n = min(seq.num_uncomputed, budget)
            if not self.blocks.can_grow(seq.block_table, seq.num_computed + n):
                self._reset(seq)  # don't sit on cached blocks while waiting
                break
            self.blocks.grow(seq.block_table, seq.num_computed + n)
            if seq.num_preemptions == 0:
                self.blocks.query_tokens += len(seq.prompt_ids)
                self.blocks.hit_tokens += seq.num_cached_prompt
            self.waiting.popleft()
            seq.status = Status.RUNNING
            self.running.append(seq)
            chunks.append(ScheduledChunk(seq, n))
            budget -= n
        return chunks

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self._reset(seq)
        seq.status = Status.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def _reset(self, seq: Sequence) -> None:
        self.blocks.release(seq.block_table)
        seq.num_computed = 0
        seq.committed_blocks, seq.last_hash = 0, seq.cache_salt

    def finish(self, seq: Sequence) -> None:
        """Remove a finished or aborted sequence and free its blocks at once."""
        if seq.status is Status.RUNNING:
            self.running.remove(seq)
        elif seq.status is Status.WAITING and seq in self.waiting:
            self.waiting.remove(seq)
        self._reset(seq)
        seq.status = Status.FINISHED
