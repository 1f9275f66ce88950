"""How many threads an engine step runs on: those asked for, but no more than the cores
the rest of the machine leaves free.

Why: a parallel region lasts as long as its slowest thread. On a machine whose cores
other processes keep busy, the OS gives each of our threads a share of a core, time
slice by time slice, and every barrier of a step waits for the thread it left out.
On 2 cores beside two spinning processes, 2 threads took 537 ms to the first token of
a 128-token prompt against 317 ms for one thread, and decoded at 0.79x one thread's
speed. The kernels' own team (kernels/team.c) shrinks after stalls it sees inside its
regions, but torch's prefill ops and a fully busy machine escape it. The machine's own
counters say directly how busy the other processes keep our cores.

What: a daemon thread reads, every PERIOD_S, the busy and total time of each core this
process may run on (/proc/stat; steal counts as busy: a hypervisor's other guests) and
this process's own CPU time (/proc/self/stat). Over the last WINDOW samples:

    others = (busy time of our cores - our own time) / (total time / cores)   [cores]
    free   = cores - others

and each step runs on min(asked, max(1, round(free))) threads (`FreeCores.threads`).
Beside one spinning process on 2 cores that is 1 thread, beside two it is 1. Two
tokenmill processes on one machine each see the other and settle on their share. The
figures are clock ticks (USER_HZ, 100 a second): over 0.3 s and 2 cores, 60 ticks, fine
enough to tell whole cores apart.

The window looks back, so right after another process's burst (a benchmark's previous
engine, a build that just ended) it still counts that process busy. Before a step
gives threads up, the machine is asked how many other tasks are runnable at this
moment (/proc/stat's procs_running less this process's threads in state R), and the
step takes the larger of the two answers' free cores: a neighbour that has stopped
gives its cores back at the next step (or layer: a prompt's step re-decides before each
layer), one that still spins keeps them. A look costs ~30 us and is taken only while the
window says threads are to be given up: RECHECK_S after a look that found the cores
free or found others for the first time (that may be a task runnable for a moment, the
client that just sent the request), twice as long after each further look that found
them busy, up to RECHECK_MAX_S.

Off (every step runs on the threads asked for) without /proc (not Linux), for one
thread, and with TOKENMILL_ADAPTIVE_THREADS=0 or kernels.adaptive_threads(False), which
fix the kernels' team too.
"""

from __future__ import annotations

import collections
import os
import threading
import time
from dataclasses import dataclass

import torch

from tokenmill import kernels

PERIOD_S = 0.1  # between samples
WINDOW = 3  # samples the decision looks back over: 0.3 s
RECHECK_S = 0.002  # how long a look at the runnable tasks stands, at first
RECHECK_MAX_S = 0.05  # ... and at most, while looks keep finding the cores busy


@dataclass(frozen=True)
class Sample:
    """Cumulative clock ticks at one moment."""

    busy: int  # ticks our cores spent running anything (user, system, irq, steal...)
    total: int  # all ticks of our cores, idle included
    ours: int  # ticks this process ran (user + system, all its threads)


def free_cores(old: Sample, new: Sample, cores: int) -> float:
    """The cores the other processes left free between two samples (0..cores)."""
    total = new.total - old.total
    if total <= 0:
        return float(cores)
    others = max(0, (new.busy - old.busy) - (new.ours - old.ours)) / (total / cores)
    return min(float(cores), max(0.0, cores - others))


def threads_for(free: float, asked: int) -> int:
    """The threads a step runs on: at most `asked`, at least 1, the free cores rounded."""
    return max(1, min(asked, int(free + 0.5)))


def _others_runnable() -> int:
    """Tasks of other processes runnable at this moment: /proc/stat's procs_running (every
    core's run queues, the caller's thread included) less this process's threads in
    state R."""
    total = 0
    with open("/proc/stat", "rb") as f:
        for line in f:
            if line.startswith(b"procs_running"):
                total = int(line.split()[1])
                break
    ours = 0
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat", "rb") as f:
                stat = f.read()
        except OSError:  # the thread ended meanwhile
            continue
        ours += stat.rsplit(b")", 1)[1].split()[0] == b"R"
    return max(0, total - ours)


def _read_sample(cpus: frozenset[int]) -> Sample:
    busy = total = 0
    with open("/proc/stat", "rb") as f:
        for line in f:
            if not line.startswith(b"cpu"):
                break
            name, *fields = line.split()
            if name == b"cpu" or int(name[3:]) not in cpus:
                continue
            # user nice system idle iowait irq softirq steal [guest guest_nice]: guest
            # time is already in user
            ticks = [int(x) for x in fields[:8]]
            idle = ticks[3] + ticks[4]
            total += sum(ticks)
            busy += sum(ticks) - idle
    with open("/proc/self/stat", "rb") as f:
        stat = f.read()
    after_name = stat.rsplit(b")", 1)[1].split()  # the name may hold spaces
    ours = int(after_name[11]) + int(after_name[12])  # utime, stime (fields 14, 15)
    return Sample(busy, total, ours)


class FreeCores:
    """The process's sampler of free cores (one for every engine in it: `machine()`)."""

    def __init__(self) -> None:
        self.cpus = (
            frozenset(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else frozenset()
        )
        self.samples: collections.deque[Sample] = collections.deque(maxlen=WINDOW + 1)
        self.free = float(len(self.cpus))  # cores, as of the last sample
        self._pid: int | None = None  # the process whose thread samples (a fork has none)
        self._lock = threading.Lock()
        self.applied = 0  # the count apply() last set (0: none yet)
        self._now: tuple[float, float] = (-1.0, 0.0)  # (when, free cores) of the last look
        self._recheck = RECHECK_S  # how long it stands
        self.available = bool(self.cpus) and os.path.exists("/proc/stat")
        if self.available:
            try:
                _read_sample(self.cpus)
            except (OSError, ValueError, IndexError):
                self.available = False

    def threads(self, asked: int) -> int:
        """The threads a step should run on, of the `asked` (starts the sampler)."""
        if asked <= 1 or not self.available:
            return max(1, asked)
        if self._pid != os.getpid():
            self._start()
        free = self.free
        if threads_for(free, asked) < asked:  # are the others still busy?
            free = max(free, self._free_now())
        return threads_for(free, asked)

    def _free_now(self) -> float:
        """The cores free of other runnable tasks at this moment (a look stands a while:
        see the module's docstring)."""
        when, free = self._now
        now = time.monotonic()
        if now - when > self._recheck:
            busy_before = when >= 0 and free < len(self.cpus)
            try:
                free = float(max(0, len(self.cpus) - _others_runnable()))
            except (OSError, ValueError, IndexError):
                free = 0.0  # unknown: the window's answer stands
            busy = free < len(self.cpus)
            # (RECHECK_S read here: the tests set it)
            self._recheck = (
                min(RECHECK_MAX_S, 2 * self._recheck) if busy and busy_before else RECHECK_S
            )
            self._now = (now, free)
        return free

    def apply(self, asked: int) -> int:
        """Set torch's (and so the kernels') threads for the next step to threads(asked),
        or to `asked` while threads do not adapt; returns the count. It is set only when
        it changes or something (another model's load) raised it: a count the kernels'
        team lowered meanwhile (team.c) stays theirs."""
        n = self.threads(asked) if kernels.threads_adapt() else asked
        if n != self.applied or torch.get_num_threads() > n:
            torch.set_num_threads(n)
            self.applied = n
        return n

    def _start(self) -> None:
        with self._lock:
            if self._pid == os.getpid():
                return
            self._pid = os.getpid()
            self.samples.clear()
            self.samples.append(_read_sample(self.cpus))
            threading.Thread(target=self._run, daemon=True, name="tokenmill-free-cores").start()

    def _run(self) -> None:
        pid = os.getpid()
        while self._pid == pid:
            time.sleep(PERIOD_S)
            try:
                self.samples.append(_read_sample(self.cpus))
            except (OSError, ValueError, IndexError):
                continue
            self.free = free_cores(self.samples[0], self.samples[-1], len(self.cpus))


_machine: FreeCores | None = None


def machine() -> FreeCores:
    global _machine
    if _machine is None:
        _machine = FreeCores()
    return _machine
