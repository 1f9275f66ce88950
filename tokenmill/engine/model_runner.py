"""The model runner: turns one scheduled step into tensors, runs the model, returns logits.

Layout of the packed batch: decode rows first (one token each, attending over
their cached context), then prefill chunks (many tokens of one sequence each). A
speculative verification (engine/speculative.py) is the sequence's last token and its k
guesses over its cached context, all 1 + k rows un-embedded: 1 + k decode rows after the
plain ones where the step takes the fused decode stack (one pass over the weights for
them all), else a chunk like a prefill's.

An embedding sequence (seq.pool, engine/pooling.py) samples nothing: the step also takes
the final-norm hidden states at the rows its pooling keeps and hands them to its PoolState.
"""

from __future__ import annotations

import torch

from tokenmill.engine.kv_cache import KVCache
from tokenmill.engine.pooling import PoolState
from tokenmill.engine.scheduler import ScheduledChunk
from tokenmill.layers.attention import AttentionMetadata, AttentionSite, PrefillSpan, TracedRows
from tokenmill.models import paths
from tokenmill.models.transformer import Transformer


class ModelRunner:
    def __init__(self, model: Transformer, cache: KVCache, device: torch.device):
        self.model = model
        self.cache = cache
        self.device = device
        self.block_size = cache.block_size
        self._offsets = torch.arange(cache.block_size)  # [bs] slot offsets within a block
        model.attach_kv_cache(cache.k, cache.v)

    def _slots(self, table: list[int], start: int, end: int) -> torch.Tensor:
        """[end - start] cache slots of token positions start..end-1 of a sequence."""
        bs = self.block_size
        pos = torch.arange(start, end)
        blocks = torch.tensor(table, dtype=torch.long)[pos // bs]
        return blocks * bs + pos % bs

    @torch.inference_mode()
    def run(
        self, chunks: list[ScheduledChunk], all_logits: bool = False
    ) -> tuple[torch.Tensor, list[int]]:
        """Run one step. Returns logits [S, vocab] for the S rows that sample, and the
        index (into `chunks`) of each row's chunk, in the same order: one row per chunk
        that samples, but 1 + k consecutive rows for a chunk verifying k guesses.
        all_logits=True returns logits [T, vocab] for every packed row instead
        (tests and the inspector compare whole prompts)."""
        input_ids, meta, rows, sampled, pools = self._pack(chunks)
        if not pools:
            return self.forward(input_ids, meta, None if all_logits else rows), sampled
        return self._run_pooled(input_ids, meta, rows, pools), sampled

    def _run_pooled(
        self,
        input_ids: torch.Tensor,
        meta: AttentionMetadata,
        rows: torch.Tensor,
        pools: list[tuple[PoolState, list[int], bool]],
    ) -> torch.Tensor:
        """A step with embedding rows: the final-norm hidden states at the sampled rows
        [S] and the pooled rows [P] in one pass, logits [S, vocab] from the first S, each
        PoolState fed its rows. (LLMEngine refuses embeddings on a parallel run, whose
        runners override forward.)"""
        pool_rows = [r for _, kept, _ in pools for r in kept]
        every = torch.cat([rows, torch.tensor(pool_rows, dtype=torch.long, device=self.device)])
        hidden = self.model(input_ids, meta, every, head=False)  # [S + P, d]
        n = rows.shape[0]
        at = n
        for state, kept, restart in pools:
            state.add(hidden[at : at + len(kept)], restart)
            at += len(kept)
        if n == 0:
            return hidden.new_zeros(0, self.model.cfg.vocab_size, dtype=torch.float32)
        return self.model.unembed(hidden[:n])

    def forward(
        self, input_ids: torch.Tensor, meta: AttentionMetadata, rows: torch.Tensor | None
    ) -> torch.Tensor:
        """The model on one packed batch (a parallel runner also sends it to the others)."""
        return self.model(input_ids, meta, rows)

    def pack(
        self, chunks: list[ScheduledChunk]
    ) -> tuple[torch.Tensor, AttentionMetadata, torch.Tensor, list[int]]:
        """One step's chunks as a packed batch: (input_ids [T], metadata, the rows that
        sample [S], the indices into `chunks` of those rows' chunks)."""
        input_ids, meta, rows, sampled, _ = self._pack(chunks)
        return input_ids, meta, rows, sampled

    def _verify_as_decode(self, chunks: list[ScheduledChunk], num_decode: int) -> list[int]:
        """The verification chunks to pack as decode rows, one row per token (their
        indices into `chunks`): all of them where the step then takes the fused decode
        stack (models/paths.py: untraced, decode rows only, a model the stack runs),
        which runs a sequence's 1 + k rows in one pass like a batch's decode rows (stack.c
        chains their attention); else none, and they run as chunked prefill."""
        verify = [i for i, c in enumerate(chunks) if c.proposal]
        if not verify or num_decode + len(verify) < len(chunks):  # a prefill chunk too
            return []
        if any(c.seq.trace is not None for c in chunks):  # traced: the torch path
            return []
        return verify if self.model.decode_path().name == paths.STACK else []

    def _pack(
        self, chunks: list[ScheduledChunk]
    ) -> tuple[
        torch.Tensor,
        AttentionMetadata,
        torch.Tensor,
        list[int],
        list[tuple[PoolState, list[int], bool]],
    ]:
        """pack(), and for each embedding chunk: its PoolState, the packed rows its
        pooling keeps, and whether the chunk starts the prompt over (position 0)."""
        decode = [i for i, c in enumerate(chunks) if c.is_decode]
        verify = self._verify_as_decode(chunks, len(decode))
        is_decode = set(decode) | set(verify)
        prefill = [i for i in range(len(chunks)) if i not in is_decode]
        ids: list[int] = []
        positions: list[torch.Tensor] = []
        slot_maps: list[torch.Tensor] = []
        logit_rows: list[int] = []
        sampled: list[int] = []
        pools: list[tuple[PoolState, list[int], bool]] = []
        meta = AttentionMetadata(positions=None, slot_mapping=None)

        if decode or verify:
            # Few tensor constructions: each torch op costs microseconds, and a batch-1
            # decode step's whole budget is a few milliseconds.
            bs = self.block_size
            seqs = [chunks[i].seq for i in decode]
            ctx = [s.num_computed + 1 for s in seqs]  # context length incl. the new token
            toks = [s.token_at(s.num_computed) for s in seqs]
            for i in verify:  # its 1 + k rows: row j sees the context up to its own token
                c = chunks[i]
                seqs.extend([c.seq] * c.num_tokens)
                ctx.extend(range(c.seq.num_computed + 1, c.seq.num_computed + c.num_tokens + 1))
                toks.extend(c.token_at(p - 1) for p in ctx[-c.num_tokens :])
            width = -(-max(ctx) // bs)
            tables = [s.block_table[:width] for s in seqs]
            table = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.long)
            # slot of context position j: table[j // bs] * bs + j % bs  -> [Bd, Cmax]
            slots = (table[:, :, None] * bs + self._offsets).view(len(seqs), -1)[:, : max(ctx)]
            slots = slots.contiguous()  # the native attention reads rows of length Cmax
            ids.extend(toks)
            positions.append(torch.tensor([c - 1 for c in ctx], dtype=torch.long))
            new = [t[(c - 1) // bs] * bs + (c - 1) % bs for t, c in zip(tables, ctx, strict=True)]
            slot_maps.append(torch.tensor(new, dtype=torch.long))
            ctx_t = torch.tensor(ctx, dtype=torch.long)
            meta.num_decode = len(seqs)
            meta.decode_slots = slots.to(self.device)
            meta.decode_context_lens = ctx_t.to(self.device)
            for row, i in enumerate(decode):
                pool = chunks[i].seq.pool
                if pool is not None:  # an embedding's one-token chunk: nothing to sample
                    kept = pool.rows(ctx[row] - 1, ctx[row], len(chunks[i].seq))
                    pools.append((pool, [row] * len(kept), False))
                elif chunks[i].samples:  # not a prompt's one-token chunk short of its end
                    logit_rows.append(row)
                    sampled.append(i)
                if chunks[i].seq.trace is not None and meta.trace is None:
                    site = AttentionSite("decode", row)
                    meta.trace = TracedRows(chunks[i].seq.trace, slice(row, row + 1), site)
            row = len(decode)
            for i in verify:  # every row samples (the last token's, each guess's)
                logit_rows.extend(range(row, row + chunks[i].num_tokens))
                sampled.extend([i] * chunks[i].num_tokens)
                row += chunks[i].num_tokens

        row = meta.num_decode
        for i in prefill:
            chunk = chunks[i]
            seq, n = chunk.seq, chunk.num_tokens
            start, end = seq.num_computed, seq.num_computed + n
            ids.extend(chunk.token_at(p) for p in range(start, end))
            positions.append(torch.arange(start, end))
            all_slots = self._slots(seq.block_table, 0, end)
            slot_maps.append(all_slots[start:end])
            meta.prefills.append(
                PrefillSpan(row, row + n, end, None if start == 0 else all_slots.to(self.device))
            )
            if seq.trace is not None and meta.trace is None:
                site = AttentionSite("prefill", len(meta.prefills) - 1)
                meta.trace = TracedRows(seq.trace, slice(row, row + n), site)
            if seq.pool is not None:
                kept = seq.pool.rows(start, end, len(seq))
                pools.append((seq.pool, [row + p - start for p in kept], start == 0))
            row += n
            if chunk.proposal:  # a verification: every row samples (the last token's, a guess's)
                logit_rows.extend(range(row - n, row))
                sampled.extend([i] * n)
            elif chunk.samples and seq.pool is None:
                logit_rows.append(row - 1)
                sampled.append(i)

        meta.positions = _cat(positions).to(self.device)
        meta.slot_mapping = _cat(slot_maps).to(self.device)
        input_ids = torch.tensor(ids, dtype=torch.long, device=self.device)
        rows = torch.tensor(logit_rows, dtype=torch.long, device=self.device)
        return input_ids, meta, rows, sampled, pools


def _cat(parts: list[torch.Tensor]) -> torch.Tensor:
    return parts[0] if len(parts) == 1 else torch.cat(parts)
