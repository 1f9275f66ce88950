"""The model runner: turns one scheduled step into tensors, runs the model, returns logits.

Layout of the packed batch: decode rows first (one token each, attending over
their cached context), then prefill chunks (many tokens of one sequence each).
"""

from __future__ import annotations

import torch

from tokenmill.engine.kv_cache import KVCache
from tokenmill.engine.scheduler import ScheduledChunk
from tokenmill.layers.attention import AttentionMetadata, AttentionSite, PrefillSpan
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
        """Run one step. Returns logits [S, vocab] for the S chunks that sample, and
        the indices (into `chunks`) of those chunks, in the same order.
        all_logits=True returns logits [T, vocab] for every packed row instead
        (tests and the inspector compare whole prompts)."""
        input_ids, meta, rows, sampled = self.pack(chunks)
        return self.forward(input_ids, meta, None if all_logits else rows), sampled

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
        decode = [i for i, c in enumerate(chunks) if c.is_decode]
        is_decode = set(decode)
        prefill = [i for i in range(len(chunks)) if i not in is_decode]
        ids: list[int] = []
        positions: list[torch.Tensor] = []
        slot_maps: list[torch.Tensor] = []
        logit_rows: list[int] = []
        sampled: list[int] = []
        meta = AttentionMetadata(positions=None, slot_mapping=None)

        if decode:
            # Few tensor constructions: each torch op costs microseconds, and a batch-1
            # decode step's whole budget is a few milliseconds.
            bs = self.block_size
            seqs = [chunks[i].seq for i in decode]
            ctx = [s.num_computed + 1 for s in seqs]  # context length incl. the new token
            width = -(-max(ctx) // bs)
            tables = [s.block_table[:width] for s in seqs]
            table = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.long)
            # slot of context position j: table[j // bs] * bs + j % bs  -> [Bd, Cmax]
            slots = (table[:, :, None] * bs + self._offsets).view(len(seqs), -1)[:, : max(ctx)]
            slots = slots.contiguous()  # the native attention reads rows of length Cmax
            ids.extend(s.token_at(s.num_computed) for s in seqs)
            positions.append(torch.tensor([c - 1 for c in ctx], dtype=torch.long))
            new = [t[(c - 1) // bs] * bs + (c - 1) % bs for t, c in zip(tables, ctx, strict=True)]
            slot_maps.append(torch.tensor(new, dtype=torch.long))
            ctx_t = torch.tensor(ctx, dtype=torch.long)
            meta.num_decode = len(decode)
            meta.decode_slots = slots.to(self.device)
            meta.decode_context_lens = ctx_t.to(self.device)
            for row, i in enumerate(decode):
                if chunks[i].samples:  # not a prompt's one-token chunk short of its end
                    logit_rows.append(row)
                    sampled.append(i)
                if chunks[i].seq.trace is not None and meta.trace is None:
                    meta.trace, meta.trace_rows = chunks[i].seq.trace, slice(row, row + 1)
                    meta.trace_attn = AttentionSite("decode", row)

        row = len(decode)
        for i in prefill:
            chunk = chunks[i]
            seq, n = chunk.seq, chunk.num_tokens
            start, end = seq.num_computed, seq.num_computed + n
            ids.extend(seq.token_at(p) for p in range(start, end))
            positions.append(torch.arange(start, end))
            all_slots = self._slots(seq.block_table, 0, end)
            slot_maps.append(all_slots[start:end])
            meta.prefills.append(
                PrefillSpan(row, row + n, end, None if start == 0 else all_slots.to(self.device))
            )
            if seq.trace is not None and meta.trace is None:
                meta.trace, meta.trace_rows = seq.trace, slice(row, row + n)
                meta.trace_attn = AttentionSite("prefill", len(meta.prefills) - 1)
            row += n
            if chunk.samples:
                logit_rows.append(row - 1)
                sampled.append(i)

        meta.positions = _cat(positions).to(self.device)
        meta.slot_mapping = _cat(slot_maps).to(self.device)
        input_ids = torch.tensor(ids, dtype=torch.long, device=self.device)
        rows = torch.tensor(logit_rows, dtype=torch.long, device=self.device)
        return input_ids, meta, rows, sampled


def _cat(parts: list[torch.Tensor]) -> torch.Tensor:
    return parts[0] if len(parts) == 1 else torch.cat(parts)
