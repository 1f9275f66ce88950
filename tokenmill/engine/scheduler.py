"""The scheduler: which sequences run in the next step, and how many tokens each.

Each step has a token budget (`max_num_batched_tokens`). Running sequences go
first, oldest first: a decoding sequence costs one token, a sequence still in its
prompt takes as much of the budget as is left (chunked prefill: a long prompt is
split over several steps so it never stalls everyone's decoding). While any
sequence decodes, the step's prompt chunks together take at most
PREFILL_BESIDE_DECODE tokens: a decoding client's next token then waits for 64 prompt
tokens of someone else's, not 512. On 2 Zen 5 cores, beside one decode and 1.5k tokens
into a prompt, a step took 49 ms with 16 prompt tokens, 109 ms with 64, 179 ms with 128
and ~1 s with 512; the whole prompt took 2.6 s in 64-token chunks, 2.1 s in 128. Waiting
sequences are admitted while budget, sequence slots and free blocks last; while any
wait, running prompts take at most half of the prompt tokens, so a small request that
arrives during someone's long prompt starts at once.

Traced requests (the inspector) are low priority: a step that carries a trace runs off
the fused decode path and summarises every layer, which costs every row in it, so beside
untraced work a trace joins one step in TRACE_EVERY, its prompt in TRACE_CHUNK pieces.

Fairness between requests: a sequence belongs to a group (its API request: the n
choices of one request share one). Admission takes the waiting sequence whose group
has the fewest running, oldest first among equals, so one request's 128 choices
cannot queue ahead of a small request that came later. When a group with nothing
running waits for a slot or for blocks, the newest sequence of the group holding the
most slots beyond its fair share (max_num_seqs / active groups) is preempted to make
room. When a running sequence needs a block and none is free, the victim is the
newest sequence of the group running the most (with one group: simply the newest):
its blocks are released and it returns to the waiting queue, to be recomputed later
(its full blocks often come straight back from the prefix cache).
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass

from tokenmill.engine.block_manager import BlockManager
from tokenmill.engine.sequence import Sequence, Status

PREFILL_BESIDE_DECODE = 64  # prompt tokens a step may carry beside decode rows
# A traced step costs every row in it: the trace takes the layers off the fused decode path
# and summarises each one. On 2 Zen 5 cores (smollm2-135m), a step carrying a traced 64-token
# chunk 1.5k tokens into its prompt took 162 ms beside one decode, against ~10 ms for the
# decode alone. So traced work is low priority: while untraced sequences run or wait, a
# traced one joins one step in TRACE_EVERY, and its prompt goes in chunks of at most
# TRACE_CHUNK. Alone, it runs every step and its prompt as one matrix (up to the budget).
TRACE_EVERY = 4
TRACE_CHUNK = PREFILL_BESIDE_DECODE


def is_decode(seq: Sequence, num_tokens: int) -> bool:
    """The decode-or-prefill rule, in one place: one token after a cached context is a
    decode row; anything else (a prompt's first chunk, more tokens) is prefill."""
    return num_tokens == 1 and seq.num_computed > 0


@dataclass
class ScheduledChunk:
    seq: Sequence
    num_tokens: int  # tokens computed for this sequence in this step
    # Speculative guesses (engine/speculative.py) after the sequence's last token: the
    # chunk runs that token and these, num_tokens = 1 + len(proposal), and every row
    # samples; () for a plain chunk.
    proposal: tuple[int, ...] = ()

    @property
    def is_decode(self) -> bool:
        """A decode row: one new token of a sequence whose earlier tokens are all cached
        (the model runner packs these first; see is_decode)."""
        return is_decode(self.seq, self.num_tokens)

    @property
    def samples(self) -> bool:
        """Does this chunk reach the sequence's end, so its last row yields a token?"""
        return self.seq.num_computed + self.num_tokens == len(self.seq) + len(self.proposal)

    def token_at(self, i: int) -> int:
        """Token at position i of the sequence, its guesses following its last token."""
        n = len(self.seq)
        return self.seq.token_at(i) if i < n else self.proposal[i - n]


class Scheduler:
    def __init__(self, blocks: BlockManager, max_num_seqs: int, max_num_batched_tokens: int):
        self.blocks = blocks
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.num_steps = 0
        self.last_traced_step = -TRACE_EVERY  # the last step that carried a trace
        # propose(seq, limit) -> up to `limit` guesses for a decoding sequence (the
        # engine's speculation, engine/speculative.py); None: never speculate.
        self.propose: Callable[[Sequence, int], list[int]] | None = None

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> list[ScheduledChunk]:
        budget = self.max_num_batched_tokens
        chunks: list[ScheduledChunk] = []
        self._make_room_for_starved()
        self.num_steps += 1
        untraced = any(s.trace is None for s in self.running) or any(
            s.trace is None for s in self.waiting
        )
        trace_allowed = not untraced or self.num_steps - self.last_traced_step >= TRACE_EVERY
        trace_chunk = TRACE_CHUNK if untraced else budget
        turn = self._trace_turn() if trace_allowed else None
        traced = not trace_allowed  # no (more) traced sequence in this step
        decoding = any(is_decode(s, s.num_uncomputed) for s in self.running)
        prefill_left = min(budget, PREFILL_BESIDE_DECODE) if decoding else budget
        # prompts already running leave half of that to waiting ones: a small request
        # that arrives during a long prompt starts now, not after its last chunk
        admitting = self.waiting and len(self.running) < self.max_num_seqs
        continuing_left = prefill_left // 2 if admitting else prefill_left
        # ---- running sequences: decode steps and prefill continuations ----
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            prefill = not is_decode(seq, seq.num_uncomputed)
            if (seq.trace is not None and seq is not turn) or (prefill and not continuing_left):
                i += 1  # one traced sequence a step, and bounded prompt work: it waits
                continue
            n = min(seq.num_uncomputed, budget, continuing_left if prefill else 1)
            if seq.trace is not None:
                n = min(n, trace_chunk)
            proposal: list[int] = []
            if not prefill and self.propose is not None:
                proposal = self.propose(seq, budget - n)
                # guesses never cost anyone their blocks: short of room, a plain row
                if not self.blocks.can_grow(seq.block_table, seq.num_computed + n + len(proposal)):
                    proposal = []
                n += len(proposal)
            while not self.blocks.can_grow(seq.block_table, seq.num_computed + n):
                victim = self._victim(i)  # only among those not scheduled yet
                self._preempt(victim)
                if victim is seq:
                    break
            if seq.status is not Status.RUNNING:
                continue  # preempted itself: running[i] is now the next one
            self.blocks.grow(seq.block_table, seq.num_computed + n)
            chunks.append(ScheduledChunk(seq, n, tuple(proposal)))
            seq.last_step = self.num_steps
            traced |= seq.trace is not None
            budget -= n
            if prefill:
                prefill_left, continuing_left = prefill_left - n, continuing_left - n
            i += 1
        # ---- admit waiting sequences, fewest running in their group first ----
        running = Counter(seq.group for seq in self.running)
        while (
            self.waiting and min(budget, prefill_left) > 0 and len(self.running) < self.max_num_seqs
        ):
            admissible = (s for s in self.waiting if not (traced and s.trace is not None))
            seq = min(admissible, key=lambda s: running[s.group], default=None)
            if seq is None:  # only traced ones wait, and this step has its trace
                break
            # an embedding pooled over every row (mean, CLS) must run every row: no
            # prefix-cache hit for it (its full blocks are still named for others)
            every_row = seq.pool is not None and seq.pool.pooling.needs_every_row
            if not seq.block_table and not every_row:
                seq.block_table, seq.last_hash = self.blocks.match_prefix(
                    seq.token_ids, seq.cache_salt
                )
                seq.committed_blocks = len(seq.block_table)
                seq.num_computed = len(seq.block_table) * self.blocks.block_size
                if seq.num_preemptions == 0:
                    seq.num_cached_prompt = seq.num_computed
            n = min(seq.num_uncomputed, budget, prefill_left)
            if seq.trace is not None:
                n = min(n, trace_chunk)
            if not self.blocks.can_grow(seq.block_table, seq.num_computed + n):
                self._reset(seq)  # don't sit on cached blocks while waiting
                break
            self.blocks.grow(seq.block_table, seq.num_computed + n)
            if seq.num_preemptions == 0:
                self.blocks.query_tokens += len(seq.prompt_ids)
                self.blocks.hit_tokens += seq.num_cached_prompt
            self.waiting.remove(seq)
            seq.status = Status.RUNNING
            self.running.append(seq)
            running[seq.group] += 1
            chunks.append(ScheduledChunk(seq, n))
            seq.last_step = self.num_steps
            traced |= seq.trace is not None
            budget -= n
            prefill_left -= n
        if any(c.seq.trace is not None for c in chunks):
            self.last_traced_step = self.num_steps
        return chunks

    def _trace_turn(self) -> Sequence | None:
        """The one traced running sequence this step may run. A step records one trace
        (the model runner hands the layers one trace's rows), so traced sequences take
        turns: the one that ran least recently; and when another traced request is
        waiting, every other traced step has no running trace, so that it is admitted."""
        turn = min(
            (s for s in self.running if s.trace is not None),
            key=lambda s: s.last_step,
            default=None,
        )
        if turn is not None and turn.last_step == self.last_traced_step:
            if any(s.trace is not None for s in self.waiting):
                return None
        return turn

    def _victim(self, start: int) -> Sequence:
        """The sequence to preempt among running[start:]: the newest of the group that
        runs the most sequences (with a single group, the newest of all)."""
        counts = Counter(seq.group for seq in self.running)
        candidates = range(start, len(self.running))
        return self.running[max(candidates, key=lambda j: (counts[self.running[j].group], j))]

    def _make_room_for_starved(self) -> None:
        """A group with nothing running that cannot be admitted (no slot, or too few
        free blocks for its next chunk) takes from the group furthest above its fair
        share of slots (max_num_seqs / groups) or of blocks (the pool / groups), newest
        sequence first, until it fits or no group is above its share."""
        counts = Counter(seq.group for seq in self.running)
        starved = next((s for s in self.waiting if counts[s.group] == 0), None)
        if starved is None or not self.running:
            return
        need = self.blocks.blocks_for(min(len(starved), self.max_num_batched_tokens))
        if need > self.blocks.num_blocks:
            return  # it can never fit: LLMEngine refuses it, no one is preempted for it
        groups = len(counts) + 1
        while True:
            if len(self.running) >= self.max_num_seqs:
                held = counts  # short of slots
                fair = max(1, self.max_num_seqs // groups)
            elif need > self.blocks.num_free:
                held = Counter()  # short of blocks
                for seq in self.running:
                    held[seq.group] += len(seq.block_table)
                fair = max(1, self.blocks.num_blocks // groups)
            else:
                return  # it fits now
            group, most = held.most_common(1)[0]
            if most <= fair:
                return
            newest = max(j for j, s in enumerate(self.running) if s.group == group)
            self._preempt(self.running[newest])
            counts[group] -= 1

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
