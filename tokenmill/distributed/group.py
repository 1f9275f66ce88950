"""The collectives a parallel model calls, on torch.distributed (gloo on CPU, NCCL on GPU).

TPGroup: the all-reduce after each row-parallel projection (also called back from the
native decode stack, between its C calls), the vocabulary-split embedding lookup and the
logits gather. PPGroup: point-to-point sends of activations between consecutive stages.
Both count the time spent in collectives, which `tokenmill bench` reports per token.
"""

from __future__ import annotations

import ctypes
import time

import torch
import torch.distributed as dist

from tokenmill import kernels
from tokenmill.distributed.plan import PPStage, TPShard


class TPGroup:
    """Tensor-parallel collectives of one rank (see distributed/plan.py for the cuts)."""

    def __init__(self, plan: list[TPShard], rank: int):
        self.plan, self.shard = plan, plan[rank]
        self.rank, self.size = rank, len(plan)
        self.collective_s = 0.0  # seconds spent in collectives so far
        self.collectives = 0
        self._vmax = max(s.vocab[1] - s.vocab[0] for s in plan)
        # the C stack calls this between its own calls; kept alive with the group
        self.c_allreduce = kernels.ALLREDUCE_FN(self._c_allreduce)
        # an all-reduce that failed inside a C callback: ctypes would print and drop the
        # exception (the step then ending with partial sums), so it waits here for
        # raise_pending() after the C call
        self.error: BaseException | None = None

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """x (a partial sum, contiguous) summed over the ranks, in place."""
        t = time.perf_counter()
        dist.all_reduce(x)
        self.collective_s += time.perf_counter() - t
        self.collectives += 1
        return x

    def _c_allreduce(self, ptr: int, n: int, _ctx) -> None:
        if self.error is not None:  # this step already failed: its result is thrown away
            return
        buf = (ctypes.c_float * n).from_address(ptr)
        try:
            self.all_reduce(torch.frombuffer(buf, dtype=torch.float32))
        except BaseException as e:
            self.error = e

    def raise_pending(self) -> None:
        """Raise the error of an all-reduce that failed inside the C stack, if any."""
        if self.error is not None:
            error, self.error = self.error, None
            raise error

    def embed(self, lookup, ids: torch.Tensor) -> torch.Tensor:
        """Embedding rows of ids [T] when each rank holds a range of the vocabulary:
        every rank looks up the ids it holds (zeros elsewhere), the sum is the table's."""
        v0, v1 = self.shard.vocab
        local = ids - v0
        held = (local >= 0) & (local < v1 - v0)
        rows = lookup(torch.where(held, local, torch.zeros_like(local)))
        rows = rows * held.unsqueeze(-1).to(rows.dtype)
        return self.all_reduce(rows.contiguous())

    def gather_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """Each rank's logits [B, its vocabulary range] -> [B, vocab] on rank 0 (the other
        ranks get their own part back: only rank 0 samples)."""
        t = time.perf_counter()
        B, n = logits.shape
        padded = torch.zeros(B, self._vmax, dtype=logits.dtype)
        padded[:, :n] = logits
        parts = [torch.empty_like(padded) for _ in range(self.size)] if self.rank == 0 else None
        dist.gather(padded, parts, dst=0)
        self.collective_s += time.perf_counter() - t
        self.collectives += 1
        if self.rank != 0:
            return logits
        return torch.cat(
            [p[:, : s.vocab[1] - s.vocab[0]] for p, s in zip(parts, self.plan, strict=True)], dim=1
        )


class PPGroup:
    """Pipeline-parallel point-to-point transfers of one stage."""

    def __init__(self, stage: PPStage):
        self.stage = stage
        self.rank, self.size = stage.rank, stage.size
        self.collective_s = 0.0
        self.collectives = 0

    def send(self, x: torch.Tensor, dst: int) -> dist.Work:
        t = time.perf_counter()
        work = dist.isend(x.contiguous(), dst)
        self.collective_s += time.perf_counter() - t
        self.collectives += 1
        return work

    def recv(self, shape: tuple[int, ...], src: int, dtype=torch.float32) -> torch.Tensor:
        t = time.perf_counter()
        x = torch.empty(shape, dtype=dtype)
        dist.recv(x, src)
        self.collective_s += time.perf_counter() - t
        self.collectives += 1
        return x
