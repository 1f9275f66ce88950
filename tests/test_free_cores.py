"""Engine steps run on no more threads than the cores other processes leave free
(engine/free_cores.py): read from the machine's own counters, with real spinning
neighbours, and followed by a real engine's steps."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time

import pytest
import torch

from tokenmill import LLM, SamplingParams, kernels
from tokenmill.engine import free_cores
from tokenmill.engine.free_cores import Sample, threads_for

CORES = len(os.sched_getaffinity(0))
needs_two = pytest.mark.skipif(CORES < 2, reason="one core: there is no thread to take away")


def test_free_cores_from_two_samples():
    # 2 cores, 0.3 s at 100 ticks a second: 60 ticks; we ran 2 threads, two spinning
    # neighbours got the other half
    assert free_cores.free_cores(Sample(0, 0, 0), Sample(60, 60, 30), 2) == 1.0
    # quiet: only our own ticks are busy
    assert free_cores.free_cores(Sample(0, 0, 0), Sample(40, 60, 40), 2) == 2.0
    # our one thread got 2/3 of a core beside two spinners: 0.67 cores free
    free = free_cores.free_cores(Sample(0, 0, 0), Sample(60, 60, 20), 2)
    assert free == pytest.approx(2 / 3)
    # no time passed: nothing is known to be busy
    assert free_cores.free_cores(Sample(5, 9, 1), Sample(5, 9, 1), 4) == 4.0


@pytest.mark.parametrize(
    ("free", "asked", "threads"),
    [(2.0, 2, 2), (1.4, 2, 1), (1.6, 2, 2), (0.0, 2, 1), (0.67, 2, 1), (15.1, 16, 15), (8.0, 4, 4)],
)
def test_threads_are_the_free_cores_rounded_within_one_and_those_asked(free, asked, threads):
    assert threads_for(free, asked) == threads


@contextlib.contextmanager
def spinning(count: int):
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(count)]
    try:
        yield
    finally:
        for p in procs:
            p.kill()
            p.wait()


def wait_for(predicate, seconds: float = 10.0) -> bool:
    """Whether predicate() became true within `seconds` (the sampler's window is 0.3 s;
    a loaded CI machine may take longer to show the neighbours' ticks)."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(0.05)
    return predicate()


@needs_two
def test_spinning_neighbours_take_the_threads_and_give_them_back():
    machine = free_cores.machine()
    machine.threads(CORES)  # starts the sampler
    with spinning(CORES):
        assert wait_for(lambda: machine.threads(CORES) == 1), machine.free
    assert wait_for(lambda: machine.threads(CORES) == CORES), machine.free


@pytest.mark.slow
@needs_two
def test_engine_steps_follow_the_free_cores(smollm_path):
    llm = LLM(smollm_path, kv_cache_memory="64MiB", threads=CORES)
    params = SamplingParams(max_tokens=4, temperature=0)
    quiet = llm.generate("The capital of France is", params)[0].text
    machine = free_cores.machine()
    with spinning(CORES):
        assert wait_for(lambda: machine.threads(CORES) == 1), machine.free
        assert llm.generate("The capital of France is", params)[0].text == quiet
        assert torch.get_num_threads() == 1  # the step ran on one thread
        was = kernels.adaptive_threads(False)  # the fixed team: every thread asked for
        try:
            llm.generate("The capital of France is", params)
            assert torch.get_num_threads() == CORES
        finally:
            kernels.adaptive_threads(was)
    assert wait_for(lambda: machine.threads(CORES) == CORES), machine.free

    def quiet_step() -> bool:  # (a step may still catch a task runnable for a moment)
        llm.generate("The capital of France is", params)
        return torch.get_num_threads() == CORES

    assert wait_for(quiet_step)


@needs_two
def test_a_neighbour_that_stopped_gives_its_cores_back_at_once(monkeypatch):
    """The window looks back 0.3 s; before a step gives threads up it looks at the tasks
    runnable now. The window is made to say busy: on this quiet machine the look gives
    the threads back, beside spinning neighbours it keeps them given up."""
    monkeypatch.setattr(free_cores, "RECHECK_S", 0.0)  # every call looks
    machine = free_cores.FreeCores()
    machine._pid = os.getpid()  # as if its sampler ran: none overwrites `free`
    machine.free = 0.0
    assert wait_for(lambda: machine.threads(CORES) == CORES)  # a moment with none runnable
    with spinning(CORES):
        time.sleep(0.2)  # the spinners started
        assert machine.threads(CORES) == 1
        assert free_cores._others_runnable() >= CORES  # each spinner, runnable now


@pytest.mark.slow
@needs_two
def test_a_prompt_re_decides_its_threads_before_each_layer(smollm_path):
    llm = LLM(smollm_path, kv_cache_memory="64MiB", threads=CORES)
    model, calls = llm.engine.model, []
    hook = model.before_layer
    model.before_layer = lambda: calls.append(hook())
    llm.generate([list(range(10, 60))], SamplingParams(max_tokens=1))
    # one prompt step: a decision per layer (on a quiet machine all threads but where a
    # look caught another task runnable for a moment)
    assert len(calls) == model.cfg.num_layers and set(calls) <= set(range(1, CORES + 1))
