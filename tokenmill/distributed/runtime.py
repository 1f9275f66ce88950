"""Running one engine over several processes: start them, give each its part of the
model, drive every step from rank 0, stop them all.

    rank 0        the engine: scheduler, block manager, sampler, server; its own part of
                  the model; sends each step's packed batch to the other ranks
    ranks 1..N-1  workers (`worker_main`): their part of the model, nothing else; each
                  step: receive the batch, run it (the collectives inside the model join
                  them to rank 0's run), wait for the next

Two ways in. On one machine the engine spawns the workers itself (torch.multiprocessing,
gloo over loopback; cores split between ranks and each rank pinned to its own). Across
machines `torchrun` starts every process with RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT
set: rank 0 runs the CLI command, the others `worker_main` (tokenmill/cli.py routes them).

Failure is loud and quick: rank 0 watches its spawned workers and exits with one line
naming the dead rank; a worker whose engine disappears exits too; collectives time out
(TOKENMILL_DIST_TIMEOUT seconds, default 60) instead of hanging forever.
"""

from __future__ import annotations

import datetime
import os
import socket
import sys
import threading
import time
from dataclasses import dataclass, field, replace

import torch
import torch.distributed as dist

from tokenmill.distributed.group import PPGroup, TPGroup
from tokenmill.distributed.plan import (
    pp_local_config,
    pp_plan,
    tp_local_config,
    tp_plan,
)
from tokenmill.distributed.shard import pp_checkpoint, tp_checkpoint
from tokenmill.engine.model_runner import ModelRunner
from tokenmill.loader import Checkpoint


@dataclass
class ParallelSpec:
    """What every rank needs to build its part of the model (picklable, sent at spawn)."""

    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    model_path: str = ""
    dtype: str = "float32"
    quantization: str | None = None
    block_size: int = 16
    num_blocks: int = 0
    threads: int | None = None  # per rank; None: the machine's cores split between ranks
    extra: dict = field(default_factory=dict)

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    def check(self) -> None:
        if self.tensor_parallel_size < 1 or self.pipeline_parallel_size < 1:
            raise ValueError("tensor_parallel_size and pipeline_parallel_size must be >= 1")
        if self.tensor_parallel_size > 1 and self.pipeline_parallel_size > 1:
            raise ValueError("use tensor or pipeline parallelism, not both in one run")


def timeout() -> datetime.timedelta:
    return datetime.timedelta(seconds=float(os.environ.get("TOKENMILL_DIST_TIMEOUT", "60")))


# ------------------------------------------------------------------ a rank's part of the model


def local_part(ckpt: Checkpoint, spec: ParallelSpec, rank: int):
    """(the rank's config, its view of the checkpoint, its group) for `rank`."""
    if spec.tensor_parallel_size > 1:
        plan = tp_plan(ckpt.config, spec.tensor_parallel_size)
        cfg = tp_local_config(ckpt.config, plan[rank])
        return cfg, tp_checkpoint(ckpt, plan[rank]), TPGroup(plan, rank)
    stages = pp_plan(ckpt.config, spec.pipeline_parallel_size)
    return (
        pp_local_config(ckpt.config, stages[rank]),
        pp_checkpoint(ckpt, stages[rank]),
        PPGroup(stages[rank]),
    )


def build_part(ckpt: Checkpoint, spec: ParallelSpec, rank: int, progress=None):
    """The rank's model, loaded (only its tensors, cut), with its group attached."""
    from tokenmill.engine.llm_engine import DTYPES
    from tokenmill.models.transformer import Transformer

    cfg, view, group = local_part(ckpt, spec, rank)
    model = Transformer(cfg)
    if isinstance(group, TPGroup):
        model.set_tensor_parallel(group)
    else:
        model.set_pipeline_stage(group.stage)
    model.load_weights(view, DTYPES[spec.dtype], progress, spec.quantization)
    return model.eval(), cfg, group


def describe(ckpt: Checkpoint, spec: ParallelSpec) -> list[str]:
    """One line per rank: what it holds."""
    if spec.tensor_parallel_size > 1:
        plan = tp_plan(ckpt.config, spec.tensor_parallel_size)
        return [s.describe(ckpt.config.head_dim) for s in plan]
    return [s.describe() for s in pp_plan(ckpt.config, spec.pipeline_parallel_size)]


# ------------------------------------------------------------------ processes


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _pin(rank: int, world: int, threads: int | None) -> None:
    """Give rank `rank` its own share of the cores (or `threads` of them)."""
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    per = max(1, len(cores) // world) if cores else 1
    mine = cores[rank * per : (rank + 1) * per] or cores[-1:]
    if mine and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, mine)
    torch.set_num_threads(threads or max(1, len(mine)))


def launched_by_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ


class Runtime:
    """Rank 0's side: the process group, the spawned workers and their watchdog."""

    def __init__(self, spec: ParallelSpec, on_failure=None):
        spec.check()
        self.spec, self.world = spec, spec.world_size
        self.procs: list = []
        self._stopped = False
        self._restore = None
        if launched_by_torchrun():
            if int(os.environ["WORLD_SIZE"]) != self.world:
                raise ValueError(
                    f"torchrun started {os.environ['WORLD_SIZE']} processes for a run of "
                    f"{self.world} ranks (tensor x pipeline parallel size)"
                )
            dist.init_process_group("gloo", timeout=timeout())
            send_spec(spec)  # the workers build their parts from rank 0's choices
        else:
            port = _free_port()
            # our own cores and threads, given back at stop() (an API user's process)
            self._restore = (
                os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None,
                torch.get_num_threads(),
            )
            ctx = torch.multiprocessing.get_context("spawn")
            for rank in range(1, self.world):
                p = ctx.Process(
                    target=worker_main, args=(rank, self.world, port, spec), daemon=True
                )
                p.start()
                self.procs.append(p)
            _pin(0, self.world, spec.threads)
            dist.init_process_group(
                "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0,
                world_size=self.world, timeout=timeout(),
            )  # fmt: skip
            threading.Thread(target=self._watch, args=(on_failure,), daemon=True).start()

    def _watch(self, on_failure) -> None:
        while not self._stopped:
            for rank, p in enumerate(self.procs, 1):
                if not p.is_alive() and not self._stopped:
                    msg = (
                        f"tokenmill: parallel rank {rank} (pid {p.pid}) died with exit code "
                        f"{p.exitcode}; stopping"
                    )
                    (on_failure or _exit_now)(msg)
                    return
            time.sleep(0.2)

    def stop(self) -> None:
        """Tell the workers to exit, wait for them (bounded), close the group."""
        if self._stopped:
            return
        self._stopped = True
        try:
            dist.broadcast_object_list([("stop",)], src=0)
        except Exception:  # a worker already gone: it will not answer anyway
            pass
        for p in self.procs:
            p.join(timeout=10)
            if p.is_alive():
                p.terminate()
        if dist.is_initialized():
            dist.destroy_process_group()
        if self._restore is not None:
            cores, threads = self._restore
            if cores is not None:
                os.sched_setaffinity(0, cores)
            torch.set_num_threads(threads)


def _exit_now(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)
    for child in torch.multiprocessing.active_children():
        child.terminate()
    os._exit(1)


def send_spec(spec: ParallelSpec) -> None:
    dist.broadcast_object_list([spec], src=0)


def worker_main(rank: int, world: int, port: int | None, spec: ParallelSpec | None = None) -> None:
    """A rank > 0: build its part of the model, then run whatever steps rank 0 sends."""
    from tokenmill.engine.kv_cache import KVCache
    from tokenmill.engine.llm_engine import DTYPES
    from tokenmill.loader import open_checkpoint

    if port is not None:  # spawned by the engine on this machine
        parent = os.getppid()
        threading.Thread(target=_watch_parent, args=(parent,), daemon=True).start()
        _pin(rank, world, spec.threads)
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
            timeout=timeout(),
        )  # fmt: skip
    else:  # torchrun: the machine's cores and threads are the launcher's business
        dist.init_process_group("gloo", timeout=timeout())
        box = [None]
        dist.broadcast_object_list(box, src=0)
        spec = box[0]
        if spec.threads:
            torch.set_num_threads(spec.threads)
    ckpt = open_checkpoint(spec.model_path)
    model, cfg, group = build_part(ckpt, spec, rank)
    dtype = DTYPES[spec.dtype]
    cache = KVCache(cfg, spec.block_size, dtype, torch.device("cpu"), num_blocks=spec.num_blocks)
    model.attach_kv_cache(cache.k, cache.v)
    with torch.inference_mode():
        while True:
            box = [None]
            dist.broadcast_object_list(box, src=0)
            msg = box[0]
            if msg[0] == "stop":
                break
            if msg[0] == "stats":  # rank 0 asks for the time spent in collectives
                dist.gather_object((group.collective_s, group.collectives), None, dst=0)
                continue
            if isinstance(group, TPGroup):
                _, input_ids, meta, rows = msg
                model(input_ids, meta, rows)
            else:
                _run_stage(model, group, msg[1])
    dist.destroy_process_group()


def _watch_parent(parent: int) -> None:
    while True:
        if os.getppid() != parent:  # the engine is gone: nothing will ever come
            os._exit(1)
        time.sleep(0.5)


# ------------------------------------------------------------------ rank 0's runners


class TPRunner(ModelRunner):
    """Rank 0's runner for tensor parallelism: each packed batch goes to every rank, then
    all run it together (logits come back to rank 0 only)."""

    def __init__(self, model, cache, device, runtime: Runtime, group: TPGroup):
        super().__init__(model, cache, device)
        self.runtime, self.group = runtime, group

    def forward(self, input_ids, meta, rows):
        dist.broadcast_object_list([("step", input_ids, replace(meta, trace=None), rows)], src=0)
        return self.model(input_ids, meta, rows)


class PPRunner(ModelRunner):
    """Rank 0's runner for pipeline parallelism (rank 0 is stage 0). A step is cut into
    micro-batches of whole sequences; stage s works on micro-batch m while stage s+1
    works on m-1, so the stages overlap under batched load."""

    def __init__(
        self, model, cache, device, runtime: Runtime, group: PPGroup, micro_batches: int, vocab: int
    ):
        super().__init__(model, cache, device)
        self.runtime, self.group, self.micro_batches = runtime, group, micro_batches
        self.vocab = vocab

    def run(self, chunks, all_logits: bool = False):
        n = max(1, min(self.micro_batches, len(chunks)))
        groups = _split_chunks(chunks, n)
        batches, sampled = [], []
        for idx in groups:
            input_ids, meta, rows, picked = self.pack([chunks[i] for i in idx])
            batches.append((input_ids, replace(meta, trace=None), None if all_logits else rows))
            sampled.extend(idx[i] for i in picked)
        dist.broadcast_object_list([("step", batches)], src=0)
        # stage 0: every micro-batch through our layers, each handed on at once
        works = []
        for input_ids, meta, rows in batches:
            hidden = self.model(input_ids, meta, rows)
            works.append(self.group.send(hidden, 1))
        logits = []
        for input_ids, _, rows in batches:
            n_rows = input_ids.shape[0] if rows is None else rows.shape[0]
            logits.append(self.group.recv((n_rows, self.vocab), self.group.size - 1))
        for w in works:
            w.wait()
        return torch.cat(logits), sampled


def _split_chunks(chunks, n: int) -> list[list[int]]:
    """Indices of `chunks` in n groups of about equal tokens, order kept."""
    total = sum(c.num_tokens for c in chunks)
    groups, cur, acc = [], [], 0
    for i, c in enumerate(chunks):
        cur.append(i)
        acc += c.num_tokens
        left = n - len(groups) - 1
        if left > 0 and acc >= total * (len(groups) + 1) / n and len(chunks) - i - 1 >= left:
            groups.append(cur)
            cur = []
    if cur:
        groups.append(cur)
    return groups


def _run_stage(model, group: PPGroup, batches) -> None:
    """A stage after the first: each micro-batch's hidden states in, its own out."""
    stage = group.stage
    works = []
    for input_ids, meta, rows in batches:
        T = input_ids.shape[0]
        hidden = group.recv((T, model.cfg.hidden_size), stage.rank - 1)
        out = model(input_ids, meta, rows, hidden=hidden)
        works.append(group.send(out, 0 if stage.last else stage.rank + 1))
    for w in works:
        w.wait()
