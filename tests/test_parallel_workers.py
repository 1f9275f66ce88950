"""The worker processes of a parallel run on one machine (tokenmill/distributed/worker.py
and runtime.py): started as `python -m tokenmill.distributed.worker`, so a script needs
no main guard; watched from before the rendezvous, so a rank that dies early fails the
start within seconds with its own output; ended by LLM.close() / `with LLM(...)`, so
parallel LLMs can follow one another in one process."""

from __future__ import annotations

import gc
import os
import signal
import subprocess
import sys
import threading
import time
import weakref
from pathlib import Path

import pytest

from tokenmill import LLM, SamplingParams
from tokenmill.distributed.runtime import ParallelSpec, RankFailure, Runtime

PROMPT = "The capital of France is"
PARAMS = SamplingParams(max_tokens=10, temperature=0)


@pytest.fixture(scope="module")
def reference(smollm_path) -> str:
    """The single-process greedy continuation every parallel run must reproduce."""
    with LLM(smollm_path, kv_cache_memory="64MiB") as llm:
        return llm.generate(PROMPT, PARAMS)[0].text


def _gone(pid: int) -> bool:
    """No such process any more (a zombie would still have /proc/pid: close() reaps)."""
    return not Path(f"/proc/{pid}").exists()


@pytest.mark.slow
def test_script_without_main_guard(tmp_path, smollm_path, reference):
    """The issue's script: LLM(..., tensor_parallel_size=2) at the top level, no
    `if __name__ == "__main__":`. With multiprocessing's spawn the child re-imported it
    and died, and the parent waited 63 s for a rendezvous timeout."""
    script = tmp_path / "no_guard.py"
    script.write_text(
        "import sys\n"
        "from tokenmill import LLM, SamplingParams\n"
        f"llm = LLM({str(smollm_path)!r}, kv_cache_memory='64MiB', tensor_parallel_size=2)\n"
        "out = llm.generate(sys.argv[1], SamplingParams(max_tokens=10, temperature=0))\n"
        "print(repr(out[0].text))\n"
    )
    done = subprocess.run(
        [sys.executable, str(script), PROMPT],
        capture_output=True, text=True, timeout=300, cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == repr(reference)


def test_rank_dying_before_the_rendezvous_is_reported_at_once(tmp_path, monkeypatch):
    """A worker that cannot read the model exits before it joins: the start fails as
    soon as it has exited (it checks before importing torch), naming the
    rank, its exit code and the end of its stderr, and leaves no process behind. The
    timeouts are set long, so only the watching can report it: a wait for a rendezvous
    timeout would end in a "did not get this far within 300 s" error instead."""
    monkeypatch.setenv("TOKENMILL_DIST_TIMEOUT", "300")
    missing = tmp_path / "nowhere" / "model.gguf"
    spec = ParallelSpec(tensor_parallel_size=2, model_path=str(missing))
    with pytest.raises(RankFailure) as caught:
        Runtime(spec)
    message = str(caught.value)
    first, *tail = message.splitlines()
    assert "tensor-parallel rank 1" in first and "exit code 1" in first
    assert "before it joined" in first
    assert "cannot read the model" in tail[-1] and str(missing) in tail[-1]  # its stderr
    pid = int(first.split("(pid ")[1].split(")")[0])
    assert _gone(pid)
    import torch.distributed as dist

    assert not dist.is_initialized()  # a later parallel engine can start


def _workers_of(pid: int) -> list[int]:
    """The tokenmill worker processes whose parent is pid."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes()
        except (OSError, ValueError):
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        if ppid == pid and b"tokenmill.distributed.worker" in cmdline:
            found.append(int(entry.name))
    return found


def test_rank_killed_while_starting_is_reported(smollm_path, monkeypatch):
    """A worker killed while it starts (importing torch, or in the rendezvous): the start
    fails once it is gone, with its exit code and signal, not after a timeout (set long
    here, so that only the watching can end the wait)."""
    monkeypatch.setenv("TOKENMILL_DIST_TIMEOUT", "300")
    outcome = {}

    def start() -> None:
        try:
            outcome["runtime"] = Runtime(ParallelSpec(2, 1, str(smollm_path)))
        except RankFailure as e:
            outcome["error"] = e

    thread = threading.Thread(target=start)
    thread.start()
    deadline = time.monotonic() + 120
    while not (workers := _workers_of(os.getpid())) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert len(workers) == 1
    os.kill(workers[0], signal.SIGKILL)
    thread.join(timeout=120)
    if "runtime" in outcome:  # it had started before the kill landed: not this test's case
        outcome["runtime"].stop()
        pytest.skip("the worker had already joined when it was killed")
    first = str(outcome["error"]).splitlines()[0]
    assert "tensor-parallel rank 1" in first and "exit code -9, SIGKILL" in first
    assert _gone(workers[0])


@pytest.mark.slow
def test_parallel_llms_one_after_another(smollm_path, reference):
    """`with LLM(...)` and close() end the workers (their processes are gone) and release
    the process group: a second parallel LLM then starts in the same process. While one
    is open, another is refused with a line saying what to do."""
    with LLM(smollm_path, kv_cache_memory="64MiB", tensor_parallel_size=2) as first:
        assert first.generate(PROMPT, PARAMS)[0].text == reference
        pids = [w.proc.pid for w in first.engine.parallel.workers]
        assert len(pids) == 1 and not _gone(pids[0])
        with pytest.raises(RuntimeError, match=r"close\(\) it first"):
            LLM(smollm_path, kv_cache_memory="64MiB", pipeline_parallel_size=2)
    assert all(_gone(pid) for pid in pids)
    with pytest.raises(RuntimeError, match="closed"):
        first.generate(PROMPT, PARAMS)

    second = LLM(smollm_path, kv_cache_memory="64MiB", pipeline_parallel_size=2)
    try:
        assert second.generate(PROMPT, PARAMS)[0].text == reference
        pids = [w.proc.pid for w in second.engine.parallel.workers]
    finally:
        second.close()
    assert all(_gone(pid) for pid in pids)
    second.close()  # idempotent


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["tensor_parallel_size", "pipeline_parallel_size"])
def test_dropping_a_parallel_llm_frees_it(smollm_path, reference, kind):
    """`del llm` of a parallel LLM frees it at once, as it frees a plain one: its workers
    end and the next parallel LLM starts. The collector is off, so a reference cycle (or
    an atexit hook holding the engine) would keep it alive and fail this."""
    gc.disable()
    try:
        llm = LLM(smollm_path, kv_cache_memory="64MiB", **{kind: 2})
        assert llm.generate(PROMPT, PARAMS)[0].text == reference
        pids = [w.proc.pid for w in llm.engine.parallel.workers]
        dropped = weakref.ref(llm)
        del llm
        assert dropped() is None, [type(r).__name__ for r in gc.get_referrers(dropped())]
        assert all(_gone(pid) for pid in pids)
        with LLM(smollm_path, kv_cache_memory="64MiB", **{kind: 2}) as again:
            assert again.generate(PROMPT, PARAMS)[0].text == reference
    finally:
        gc.enable()
