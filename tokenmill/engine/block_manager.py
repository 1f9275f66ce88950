"""The block manager: who owns which KV-cache block, and which blocks can be reused.

The cache pool is cut into `num_blocks` blocks of `block_size` token slots. A
sequence's block table lists its blocks in order; token i lives in slot
block_table[i // block_size] * block_size + i % block_size.

Prefix caching: once a block is full, it is named by the hash of its tokens
chained with its predecessor's hash, so equal hashes mean equal whole prefixes. A
new sequence whose prompt starts with blocks already named reuses them (reference
count + 1) instead of computing them again. A block whose count drops to zero goes
to the free list but keeps its name, so it can still be hit until it is evicted
for reuse (least recently freed first).

Isolation: the chain starts from a root, None for the shared cache or a salt
(`salt_root`, from a request's `cache_salt` or its API key) for a private one. The
same prompt under two roots gives different names, so one client can neither reuse
nor time another's cached prompt.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass
from typing import Protocol


class OutOfBlocks(RuntimeError):
    """The pool has no free block left."""


@dataclass
class Block:
    id: int
    ref_count: int = 0
    hash: int | None = None  # set once the block is full and its K/V computed
    tokens: tuple[int, ...] = ()  # the tokens behind `hash` (guards against collisions)
    parent: int | None = None  # the hash chained before them (so is the whole prefix)


_SHARED_ROOT = 0x746F6B656E6D696C  # the shared cache's root in the chain: hash(None) is
# an address before Python 3.12, a different one in every process, and names must outlive it


def chain_hash(prev: int | None, tokens: tuple[int, ...]) -> int:
    """The name of a block of `tokens` after the block named `prev` (None: the first block
    of the shared cache). Python's hash of a tuple of ints: the same in every process of
    one Python version, so names survive a restart (engine/disk_cache.py)."""
    return hash((_SHARED_ROOT if prev is None else prev, tokens))


def salt_root(*parts: str | None) -> int | None:
    """The hash-chain root for a cache scope named by `parts` (e.g. an API key's index and
    a request's cache_salt); None, the shared cache, when every part is None. A SHA-256,
    not Python's string hash (salted per process), so a scope names the same blocks after
    a restart (the prefix cache on disk, engine/disk_cache.py)."""
    if all(part is None for part in parts):
        return None
    text = "\0".join("" if p is None else f"={p}" for p in ("tokenmill-cache-salt", *parts))
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little", signed=True)


class BlockStore(Protocol):
    """Where named blocks also live beyond the pool (engine/disk_cache.py)."""

    def has(self, h: int) -> bool: ...

    def load(self, h: int, parent: int | None, tokens: tuple[int, ...], block_id: int) -> bool: ...

    def store(self, h: int, parent: int | None, tokens: tuple[int, ...], block_id: int) -> None: ...


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        # Blocks with ref_count 0, least recently freed first; they may still be named.
        self.free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.cached: dict[int, int] = {}  # hash -> block id
        # Prefix-cache effectiveness, in prompt tokens of admitted requests (vLLM's
        # definition): hit rate = hit_tokens / query_tokens. Counted by the scheduler
        # once per request, not per lookup (lookups repeat while a request waits).
        self.query_tokens = 0
        self.hit_tokens = 0
        # Named blocks beyond the pool: a miss in memory is looked up there (filling a free
        # block), and each newly named block is stored there. None: memory only.
        self.store: BlockStore | None = None
        self.store_hit_tokens = 0  # prompt tokens served from it

    # ---- counts ----
    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free(self) -> int:
        return len(self.free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ---- allocation ----
    def _take_free(self) -> int:
        if not self.free:
            raise OutOfBlocks("KV cache pool exhausted")
        block_id, _ = self.free.popitem(last=False)
        block = self.blocks[block_id]
        if block.hash is not None:  # evict its old name
            if self.cached.get(block.hash) == block_id:
                del self.cached[block.hash]
            block.hash, block.tokens, block.parent = None, (), None
        block.ref_count = 1
        return block_id

    def match_prefix(
        self, token_ids: list[int], root: int | None = None
    ) -> tuple[list[int], int | None]:
        """Blocks already holding a prefix of `token_ids` named under `root`, each taken
        (ref + 1), and the hash of the last one (`root` when none matched).

        The last token is never served from the cache: its logits must be computed.
        """
        if not self.enable_prefix_caching:
            return [], root
        taken: list[int] = []
        prev = root
        bs = self.block_size
        for b in range((len(token_ids) - 1) // bs):
            tokens = tuple(token_ids[b * bs : (b + 1) * bs])
            h = chain_hash(prev, tokens)
            block_id = self.cached.get(h)
            if block_id is None:
                block_id = self._from_store(h, prev, tokens)
            if block_id is None:
                break
            block = self.blocks[block_id]
            if block.tokens != tokens or block.parent != prev:  # a hash collision
                break
            if block.ref_count == 0:
                del self.free[block_id]
            block.ref_count += 1
            taken.append(block_id)
            prev = h
        return taken, prev

    def _from_store(self, h: int, parent: int | None, tokens: tuple[int, ...]) -> int | None:
        """A free block filled from the store with the block named h, named so (ref 0: the
        caller takes it as it takes a cached one); None when the store lacks it."""
        if self.store is None or not self.free or not self.store.has(h):
            return None
        block_id = self._take_free()  # the least recently freed
        if not self.store.load(h, parent, tokens, block_id):
            self.blocks[block_id].ref_count = 0
            self.free[block_id] = None
            self.free.move_to_end(block_id, last=False)  # first in line again
            return None
        block = self.blocks[block_id]
        block.hash, block.tokens, block.parent, block.ref_count = h, tokens, parent, 0
        self.free[block_id] = None
        self.cached[h] = block_id
        self.store_hit_tokens += len(tokens)
        return block_id

    def can_grow(self, table: list[int], num_tokens: int) -> bool:
        return self.blocks_for(num_tokens) - len(table) <= self.num_free

    def grow(self, table: list[int], num_tokens: int) -> None:
        """Append blocks to `table` until it holds `num_tokens` tokens."""
        need = self.blocks_for(num_tokens) - len(table)
        if need > self.num_free:
            raise OutOfBlocks(f"need {need} blocks, {self.num_free} free")
        for _ in range(need):
            table.append(self._take_free())

    def release(self, table: list[int]) -> None:
        """Drop a sequence's claim on its blocks (reverse order: tails are evicted first)."""
        for block_id in reversed(table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free[block_id] = None
        table.clear()

    def truncate(self, table: list[int], num_tokens: int) -> int:
        """Give back the blocks of `table` past its first `num_tokens` tokens (a
        verification's rejected guesses, engine/speculative.py); returns how many. They
        were taken for those guesses this step, so no one else holds them and none is
        named: their tokens were never committed."""
        keep = self.blocks_for(num_tokens)
        dropped = table[keep:]
        for block_id in dropped:
            block = self.blocks[block_id]
            assert block.ref_count == 1 and block.hash is None, block
        self.release(dropped)
        del table[keep:]
        return len(dropped)

    def commit_full_blocks(self, seq) -> None:
        """Name a sequence's newly full, computed blocks so later prompts can reuse them.

        `seq` is an engine Sequence; its `committed_blocks`/`last_hash` remember how far
        naming got, so each block is hashed once.
        """
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        full = seq.num_computed // bs
        while seq.committed_blocks < full:
            b = seq.committed_blocks
            block = self.blocks[seq.block_table[b]]
            tokens = tuple(seq.token_at(i) for i in range(b * bs, (b + 1) * bs))
            h = chain_hash(seq.last_hash, tokens)
            if block.hash is None:
                block.hash, block.tokens, block.parent = h, tokens, seq.last_hash
                self.cached.setdefault(h, block.id)
                if self.store is not None:
                    self.store.store(h, seq.last_hash, tokens, block.id)
            seq.last_hash = h
            seq.committed_blocks += 1

    # ---- invariants (used by tests) ----
    def check_invariants(self, tables: list[list[int]]) -> None:
        refs = [0] * self.num_blocks
        for table in tables:
            for block_id in table:
                refs[block_id] += 1
        for block in self.blocks:
            assert block.ref_count == refs[block.id], (block, refs[block.id])
            assert (block.ref_count == 0) == (block.id in self.free), block
        for h, block_id in self.cached.items():
            assert self.blocks[block_id].hash == h
