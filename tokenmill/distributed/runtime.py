"""Running one engine over several processes: start them, give each its part of the
model, drive every step from rank 0, stop them all.

    rank 0        the engine: scheduler, block manager, sampler, server; its own part of
                  the model; sends each step's packed batch to the other ranks
    ranks 1..N-1  workers (`worker_main`): their part of the model, nothing else; each
                  step: receive the batch, run it (the collectives inside the model join
                  them to rank 0's run), wait for the next

Two ways in. On one machine the engine starts the workers itself, each as its own
process `python -m tokenmill.distributed.worker` (never the user's script re-imported,
so no `if __name__ == "__main__":` guard is needed), gloo over loopback, cores split
between ranks and each rank pinned to its own. Across machines `torchrun` starts every
process with RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT set: rank 0 runs the CLI command,
the others `worker_main` (tokenmill/cli/ routes them).

Two process groups. The default one carries the collectives inside the model and
times out after TOKENMILL_DIST_TIMEOUT seconds (default 60), so a rank that stops
answering mid-step fails the step instead of hanging it. The control group carries
rank 0's step messages, with a timeout per side (gloo's is each process's own): rank
0's send of a step times out like a collective (a gloo send waits for the receiver to
be ready, so a stopped worker would hold it forever), while a worker waits there for
the next step as long as the server is idle (a gloo receive on the default group
timed out after 60 idle seconds and took the worker down).

Rank 0 watches the workers it started from the moment they start (before the
rendezvous), over two pipes per worker: its stdout and stderr (copied to rank 0's
stderr, the last lines kept for error messages) and a control pipe (`h` when it is
about to join, `r` when its part of the model is loaded, `d` after each step). So:

- a worker that dies before it is ready fails the engine's start within a moment, with
  its exit code and the tail of its stderr (not a 60 s rendezvous timeout);
- a worker that dies later marks the run failed (`Runtime.failed`): the step in flight
  and every later one raise RankFailure, one line naming the rank and its exit code
  (the raw gloo text, with its build path and ports, goes to the log only); a server
  (`exit_on_failure`) then exits, after a moment for the failed requests' answers;
- `Runtime.health(stall_s)` names a rank that died or has not finished its part of the
  step in flight for stall_s seconds (the server's /health), without blocking;
- a worker exits when its stdin, a pipe from rank 0, ends: at stop(), or when rank 0's
  process is gone however it ended.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import datetime
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path

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
from tokenmill.dtypes import DTYPES
from tokenmill.engine.model_runner import ModelRunner
from tokenmill.loader import Checkpoint

log = logging.getLogger("tokenmill.distributed")

STDERR_TAIL_LINES = 20  # a dead worker's last output lines kept for the error message
EXIT_GRACE_S = 1.5  # a server with a dead rank exits this long after noticing it, so the
# requests in flight get their error answer first
IDLE_TIMEOUT = datetime.timedelta(days=365)  # a worker's on the control group: idle


class RankFailure(ConnectionError):
    """A rank of a parallel run died or stopped answering: the run cannot go on.

    Its text is one line for a client (which rank, its exit code or how long it was
    silent); the collective's own error is logged, not carried here. A ConnectionError,
    so the CLI prints it as one `tokenmill: error:` line."""


@dataclass
class ParallelSpec:
    """What every rank needs to build its part of the model (sent to each worker as
    JSON on its command line, or broadcast under torchrun)."""

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

    @property
    def kind(self) -> str:
        """How the ranks are named in messages."""
        return "tensor-parallel" if self.tensor_parallel_size > 1 else "pipeline-parallel"

    def check(self) -> None:
        if self.tensor_parallel_size < 1 or self.pipeline_parallel_size < 1:
            raise ValueError("tensor_parallel_size and pipeline_parallel_size must be >= 1")
        if self.tensor_parallel_size > 1 and self.pipeline_parallel_size > 1:
            raise ValueError("use tensor or pipeline parallelism, not both in one run")

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))


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


def _exit_description(code: int) -> str:
    """'exit code 1', or 'exit code -9, SIGKILL' for a process a signal ended."""
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"exit code {code}, {signal.Signals(-code).name}"
    return f"exit code {code}"


ADVICE = "the engine cannot go on: restart it"
PACKAGE_ROOT = Path(__file__).resolve().parents[2]  # the folder that holds `tokenmill/`


@dataclass
class _Worker:
    """Rank 0's view of one worker process it started."""

    rank: int
    proc: subprocess.Popen
    output: collections.deque  # its last lines of stdout and stderr
    joining: bool = False  # it said `h`: about to join the rendezvous
    ready: bool = False  # it said `r`: its part of the model is loaded
    done: int = 0  # steps it has finished (`d`)
    readers: list[threading.Thread] = field(default_factory=list)

    def tail(self) -> str:
        return "\n".join(f"    {line}" for line in self.output) or "    (no output)"


class Runtime:
    """Rank 0's side: the process groups, the workers it started and their watchdog.

    on_failure(line) is called once, from the watchdog thread, when a worker dies after
    the start; exit_on_failure (a server sets it) ends this process then, with that line
    on stderr, EXIT_GRACE_S later."""

    def __init__(self, spec: ParallelSpec, on_failure: Callable[[str], None] | None = None):
        spec.check()
        if dist.is_initialized():
            # torch.distributed has one default group per process
            raise RuntimeError(
                "another parallel engine is open in this process: close() it first "
                "(or open it with `with LLM(...) as llm:`)"
            )
        self.spec, self.world, self.kind = spec, spec.world_size, spec.kind
        self.on_failure = on_failure
        self.exit_on_failure = False
        self.workers: list[_Worker] = []  # the processes we started (none under torchrun)
        self.failed: str | None = None  # why the run cannot go on: every later step raises it
        self.steps_sent = 0  # steps rank 0 has started
        self.step_started: float | None = None  # time.monotonic() the step in flight began
        self.control = None  # the process group of the step messages (see the module doc)
        self._stopped = False
        self._restore = None
        if launched_by_torchrun():
            if int(os.environ["WORLD_SIZE"]) != self.world:
                raise ValueError(
                    f"torchrun started {os.environ['WORLD_SIZE']} processes for a run of "
                    f"{self.world} ranks (tensor x pipeline parallel size)"
                )
            dist.init_process_group("gloo", timeout=timeout())
            self.control = dist.new_group(backend="gloo", timeout=timeout())
            send_spec(spec, self.control)  # the workers build their parts from our choices
            return
        # our own cores and threads, given back at stop() (an API user's process)
        self._restore = (
            os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None,
            torch.get_num_threads(),
        )
        try:
            port = self._start_workers()
            _pin(0, self.world, spec.threads)
            self._wait_for(lambda w: w.joining, "before it joined the other ranks")
            self._rendezvous(port)
        except BaseException:
            self._stopped = True
            self._end_workers(grace=0)
            self._give_back_cores()
            raise

    # ---- starting ----
    def _start_workers(self) -> int:
        """Start ranks 1..N-1 as `python -m tokenmill.distributed.worker`; the port of the
        rendezvous they will join."""
        port = _free_port()
        # the worker runs in the folder holding this tokenmill package, so that `-m` finds
        # this copy (not one in the user's folder), with the model's path made absolute
        spec = replace(self.spec, model_path=os.path.abspath(self.spec.model_path))
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in (str(PACKAGE_ROOT), env.get("PYTHONPATH")) if p
        )
        for rank in range(1, self.world):
            ctl_r, ctl_w = os.pipe()
            out_r, out_w = os.pipe()
            try:
                proc = subprocess.Popen(
                    [
                        sys.executable, "-m", "tokenmill.distributed.worker",
                        "--rank", str(rank), "--world", str(self.world), "--port", str(port),
                        "--control-fd", str(ctl_w), "--spec", spec.to_json(),
                    ],
                    stdin=subprocess.PIPE, stdout=out_w, stderr=out_w, pass_fds=(ctl_w,),
                    cwd=PACKAGE_ROOT, env=env,
                    # its own session: a Ctrl-C in the terminal reaches rank 0 only, which
                    # then stops the workers itself
                    start_new_session=True,
                )  # fmt: skip
            except BaseException:
                for fd in (ctl_r, out_r):
                    os.close(fd)
                raise
            finally:
                os.close(ctl_w)
                os.close(out_w)
            worker = _Worker(rank, proc, collections.deque(maxlen=STDERR_TAIL_LINES))
            for target, fd in ((self._read_output, out_r), (self._read_control, ctl_r)):
                t = threading.Thread(
                    target=target, args=(worker, fd), daemon=True, name=f"tokenmill-rank{rank}"
                )
                t.start()
                worker.readers.append(t)
            self.workers.append(worker)
        return port

    @staticmethod
    def _read_output(worker: _Worker, fd: int) -> None:
        """A worker's stdout and stderr: copied to ours (the log), the last lines kept."""
        with os.fdopen(fd, "rb") as f:
            for raw in f:
                line = raw.decode(errors="replace")
                worker.output.append(line.rstrip("\n"))
                with contextlib.suppress(OSError, ValueError):
                    sys.stderr.write(line)
                    sys.stderr.flush()

    @staticmethod
    def _read_control(worker: _Worker, fd: int) -> None:
        with os.fdopen(fd, "rb") as f:
            for raw in f:
                word = raw.strip()
                if word == b"d":
                    worker.done += 1
                elif word == b"r":
                    worker.ready = True
                elif word == b"h":
                    worker.joining = True

    def _dead(self, wait: float = 0.0) -> _Worker | None:
        """The first worker whose process has ended (polling up to `wait` seconds)."""
        deadline = time.monotonic() + wait
        while True:
            for w in self.workers:
                if w.proc.poll() is not None:
                    return w
            if time.monotonic() >= deadline or not self.workers:
                return None
            time.sleep(0.05)

    def _start_failure(self, worker: _Worker, when: str) -> RankFailure:
        for t in worker.readers:  # its last lines, up to the end of its output
            t.join(timeout=1)
        self._fail(self._death_line(worker))  # stop() then ends the others at once
        return RankFailure(
            f"{self.kind} rank {worker.rank} (pid {worker.proc.pid}) exited with "
            f"{_exit_description(worker.proc.returncode)} {when}; its last output:\n"
            f"{worker.tail()}"
        )

    def _wait_for(self, said, when: str, limit: float | None = None) -> None:
        """Until said(w) holds for every worker; RankFailure (with its output) as soon as
        one dies, or when `limit` seconds pass (None: the distributed timeout)."""
        limit = timeout().total_seconds() if limit is None else limit
        deadline = time.monotonic() + limit
        while not all(said(w) for w in self.workers):
            dead = self._dead()
            if dead is not None:
                raise self._start_failure(dead, when)
            if time.monotonic() > deadline:
                late = next(w for w in self.workers if not said(w))
                raise RankFailure(
                    f"{self.kind} rank {late.rank} (pid {late.proc.pid}) did not get this "
                    f"far within {limit:g} s ({when}); its last output:\n{late.tail()}"
                )
            time.sleep(0.05)

    def _rendezvous(self, port: int) -> None:
        """Join the workers' process groups, watching them meanwhile: the joining blocks
        in C++ (up to the distributed timeout), so it runs on a thread of its own."""
        lock, joined, outcome = threading.Lock(), threading.Event(), {}

        def join() -> None:
            try:
                dist.init_process_group(
                    "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0,
                    world_size=self.world, timeout=timeout(),
                )  # fmt: skip
                control = dist.new_group(backend="gloo", timeout=timeout())
                with lock:
                    if outcome.get("abandoned"):  # the start failed meanwhile
                        dist.destroy_process_group()
                    else:
                        outcome["control"] = control
            except BaseException as e:  # reported by the waiting thread
                outcome["error"] = e
            finally:
                joined.set()

        threading.Thread(target=join, daemon=True, name="tokenmill-rendezvous").start()
        while not joined.wait(0.1):
            dead = self._dead()
            if dead is not None:
                with lock:
                    outcome["abandoned"] = True
                raise self._start_failure(dead, "while joining the other ranks")
        if "error" in outcome:
            dead = self._dead(wait=1.0)
            if dead is not None:
                raise self._start_failure(dead, "while joining the other ranks")
            log.error("the rendezvous failed: %s", outcome["error"])
            raise RankFailure(
                f"the {self.kind} ranks did not join within {timeout().total_seconds():g} s "
                f"({type(outcome['error']).__name__}; see the log)"
            )
        self.control = outcome["control"]

    def wait_ready(self) -> None:
        """Until every worker has loaded its part of the model (no time limit: a live
        worker is loading); RankFailure with the dead rank's last output if one dies.
        Then the watchdog starts."""
        self._wait_for(lambda w: w.ready, "while loading its part of the model", float("inf"))
        if self.workers:
            threading.Thread(target=self._watch, daemon=True, name="tokenmill-watch").start()

    # ---- running ----
    def _death_line(self, worker: _Worker) -> str:
        code = worker.proc.returncode
        return f"{self.kind} rank {worker.rank} died ({_exit_description(code)}); {ADVICE}"

    def _fail(self, line: str) -> None:
        if self.failed is None:
            self.failed = line

    def _watch(self) -> None:
        while not self._stopped:
            dead = self._dead()
            if dead is not None and not self._stopped:
                line = self._death_line(dead)
                self._fail(line)
                for t in dead.readers:
                    t.join(timeout=1)
                log.error("%s (pid %d); its last output:\n%s", line, dead.proc.pid, dead.tail())
                if self.on_failure is not None:
                    self.on_failure(line)
                if self.exit_on_failure:
                    time.sleep(EXIT_GRACE_S)
                    self._exit_now(line)
                return
            time.sleep(0.2)

    def _exit_now(self, line: str) -> None:
        print(f"tokenmill: {line}; stopping", file=sys.stderr, flush=True)
        self._end_workers(grace=0)
        os._exit(1)

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        """Around one step on rank 0: counts it (for health()), refuses it once the run
        has failed, and turns a collective's failure into one RankFailure line."""
        if self.failed is not None:
            raise RankFailure(self.failed)
        if self._stopped:
            raise RankFailure("this parallel engine was closed")
        self.steps_sent += 1
        self.step_started = time.monotonic()
        try:
            yield
        except Exception as e:
            failure = self._diagnose(e)
            if failure is None:  # not a collective's failure: rank 0's own error
                raise
            raise failure from None
        finally:
            self.step_started = None

    def _diagnose(self, e: Exception) -> RankFailure | None:
        """The RankFailure a step's exception means, or None for one that is not about
        the ranks. The collective's own text (gloo's source path, the peer's port) is
        logged here and nowhere else."""
        if isinstance(e, RankFailure):
            self._fail(str(e))
            return e
        text = str(e)
        collective = isinstance(e, getattr(dist, "DistError", ())) or "gloo" in text
        timed_out = "timed out" in text.lower()
        # a killed peer's socket closes a moment before its exit can be seen
        dead = self._dead(wait=2.0 if collective and not timed_out else 0.0)
        if not collective and dead is None:
            return None
        log.error("step %d: a collective failed: %s", self.steps_sent, text)
        if dead is not None:
            line = self._death_line(dead)
        elif timed_out:
            behind = [w.rank for w in self.workers if w.done < self.steps_sent]
            who = f"{self.kind} rank {behind[0]}" if behind else f"a {self.kind} rank"
            line = f"{who} did not answer for {timeout().total_seconds():g} s; {ADVICE}"
        else:
            line = f"the {self.kind} ranks lost contact ({type(e).__name__}); {ADVICE}"
        self._fail(line)
        return RankFailure(self.failed)

    def waiting_on_a_rank(self) -> bool:
        """True while a step is in flight and some worker has not finished its part: the
        wait is the ranks' to explain, and health() names the rank once it passes stall_s."""
        step = self.steps_sent
        return self.step_started is not None and any(w.done < step for w in self.workers)

    def health(self, stall_s: float) -> tuple[bool, str]:
        """(False, why) once the run has failed, a worker has died, or a worker has not
        finished its part of the step in flight for more than stall_s seconds; else
        (True, "ok"). Never blocks: for /health."""
        if self.failed is not None:
            return False, self.failed
        if self._stopped:
            return False, "the parallel engine was closed"
        for w in self.workers:
            if w.proc.poll() is not None:
                return False, self._death_line(w)
        started, step = self.step_started, self.steps_sent
        if started is not None and (lag := time.monotonic() - started) > stall_s:
            for w in self.workers:
                if w.done < step:
                    return False, (
                        f"{self.kind} rank {w.rank} has not finished its part of step {step} "
                        f"for {lag:.0f} s"
                    )
        return True, "ok"

    # ---- stopping ----
    def stop(self) -> None:
        """Tell the workers to exit, wait for them (bounded: then killed), close the
        groups, give rank 0's cores back. Idempotent."""
        if self._stopped:
            return
        self._stopped = True
        if self.workers:  # ours: the end of their stdin is the stop (see worker_main)
            for w in self.workers:
                with contextlib.suppress(OSError):
                    w.proc.stdin.close()
        elif dist.is_initialized() and self.control is not None and self.failed is None:
            # torchrun's: a message (a worker already gone will not answer anyway)
            with contextlib.suppress(Exception):
                dist.broadcast_object_list([("stop",)], src=0, group=self.control)
        self._end_workers(grace=10 if self.failed is None else 0)
        if dist.is_initialized():
            dist.destroy_process_group()
        self._give_back_cores()

    def _end_workers(self, grace: float) -> None:
        for w in self.workers:
            with contextlib.suppress(subprocess.TimeoutExpired):
                w.proc.wait(timeout=grace)
            if w.proc.poll() is None:  # also a stopped (SIGSTOP) one: SIGKILL ends it
                w.proc.kill()
                w.proc.wait()
            with contextlib.suppress(OSError):
                w.proc.stdin.close()
        for w in self.workers:
            for t in w.readers:
                if t is not threading.current_thread():
                    t.join(timeout=2)

    def _give_back_cores(self) -> None:
        if self._restore is not None:
            cores, threads = self._restore
            if cores is not None:
                os.sched_setaffinity(0, cores)
            torch.set_num_threads(threads)
            self._restore = None


def send_spec(spec: ParallelSpec, group=None) -> None:
    dist.broadcast_object_list([spec], src=0, group=group)


class _Control:
    """A worker's end of its control pipe to rank 0 (None under torchrun: no pipe)."""

    def __init__(self, fd: int | None):
        self.fd = fd

    def send(self, word: bytes) -> None:
        if self.fd is not None:
            os.write(self.fd, word + b"\n")


def worker_main(
    rank: int,
    world: int,
    port: int | None,
    spec: ParallelSpec | None = None,
    control_fd: int | None = None,
) -> None:
    """A rank > 0: build its part of the model, then run whatever steps rank 0 sends.

    port: the rendezvous of a run rank 0 started on this machine (spec given, control_fd
    its pipe to rank 0); None under torchrun (the spec comes from rank 0)."""
    from tokenmill.engine.kv_cache import KVCache
    from tokenmill.loader import open_checkpoint

    control = _Control(control_fd)
    if port is not None:  # started by the engine on this machine
        threading.Thread(target=_exit_at_end_of_stdin, daemon=True).start()
        _pin(rank, world, spec.threads)
        # a model this rank cannot open fails here, before the rendezvous, with its own
        # traceback (rank 0 reports it)
        ckpt = open_checkpoint(spec.model_path)
        control.send(b"h")
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
            timeout=timeout(),
        )  # fmt: skip
        steps = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)
    else:  # torchrun: the machine's cores and threads are the launcher's business
        dist.init_process_group("gloo", timeout=timeout())
        steps = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)
        box = [None]
        dist.broadcast_object_list(box, src=0, group=steps)
        spec = box[0]
        if spec.threads:
            torch.set_num_threads(spec.threads)
        ckpt = open_checkpoint(spec.model_path)
    model, cfg, group = build_part(ckpt, spec, rank)
    dtype = DTYPES[spec.dtype]
    cache = KVCache(cfg, spec.block_size, dtype, torch.device("cpu"), num_blocks=spec.num_blocks)
    model.attach_kv_cache(cache.k, cache.v)
    control.send(b"r")
    with torch.inference_mode():
        while True:
            box = [None]
            dist.broadcast_object_list(box, src=0, group=steps)  # idle as long as rank 0 is
            msg = box[0]
            if msg[0] == "stop":
                break
            if msg[0] == "stats":  # rank 0 asks for the time spent in collectives
                dist.gather_object((group.collective_s, group.collectives), None, dst=0)
                continue
            if isinstance(group, TPGroup):
                _, input_ids, meta, rows = msg
                model(input_ids, meta, rows)
                group.raise_pending()  # an all-reduce the C stack called back failed
            else:
                _run_stage(model, group, msg[1])
            control.send(b"d")
    dist.destroy_process_group()


def _exit_at_end_of_stdin() -> None:
    """Rank 0 holds the other end of our stdin: it closes it to stop us, and the kernel
    closes it when rank 0's process ends however it ends. Nothing to save: exit now,
    even from inside a collective."""
    while sys.stdin.buffer.read(1 << 12):
        pass
    os._exit(0)


# ------------------------------------------------------------------ rank 0's runners


class TPRunner(ModelRunner):
    """Rank 0's runner for tensor parallelism: each packed batch goes to every rank, then
    all run it together (logits come back to rank 0 only)."""

    def __init__(self, model, cache, device, runtime: Runtime, group: TPGroup):
        super().__init__(model, cache, device)
        self.runtime, self.group = runtime, group

    def forward(self, input_ids, meta, rows):
        with self.runtime.step():
            message = [("step", input_ids, replace(meta, trace=None), rows)]
            dist.broadcast_object_list(message, src=0, group=self.runtime.control)
            logits = self.model(input_ids, meta, rows)
            self.group.raise_pending()  # an all-reduce the C stack called back failed
        return logits


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
        with self.runtime.step():
            dist.broadcast_object_list([("step", batches)], src=0, group=self.runtime.control)
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
