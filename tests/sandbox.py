"""Run hostile work (load a model file, render a chat template) in a child process with
bounded memory and time.

A hostile input must give a clear error, quickly and without a memory spike. A test
cannot check that in its own process: a regression would hang the run or take the
machine's memory. So each case runs in a process forked from a `forkserver` (which
imported torch and tokenmill once: a fork costs milliseconds, not a fresh interpreter),
with its address space capped by RLIMIT_AS at what it had after imports plus
`memory_bytes`, and killed after `timeout_s`. The outcome says which of these happened.
"""

from __future__ import annotations

import multiprocessing
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

_CTX = multiprocessing.get_context("forkserver")
_CTX.set_forkserver_preload(["torch", "tokenmill.engine.llm_engine", "tokenmill.tokenizer"])


@dataclass
class Outcome:
    kind: str  # "ok" | an expected exception's class name | "crash" | "timeout" | "killed"
    message: str  # fn's return value when "ok", else the error
    seconds: float

    def acceptable(self, path: Path) -> bool:
        """A clean load, or one LoadError line that names the file."""
        if self.kind == "ok":
            return True
        return self.kind == "LoadError" and "\n" not in self.message and str(path) in self.message


def run_bounded(
    fn, *args, expected: tuple[str, ...] = (), timeout_s: float = 60.0, memory_bytes: int = 1 << 30
) -> Outcome:
    """fn(*args) in a sandboxed child. `fn` must be a module-level function; an exception
    whose class name is in `expected` is an outcome of that kind, any other a "crash"."""
    receive, send = _CTX.Pipe(duplex=False)
    child = _CTX.Process(target=_run, args=(fn, args, expected, send, memory_bytes), daemon=True)
    start = time.monotonic()
    child.start()
    send.close()
    try:
        if receive.poll(timeout_s):
            kind, message = receive.recv()
        else:
            kind, message = "timeout", f"no answer after {timeout_s:g} s"
    except EOFError:  # the child died without a word: a signal, or the memory limit in C
        child.join(5)
        kind, message = "killed", f"exit code {child.exitcode}"
    seconds = time.monotonic() - start
    if child.is_alive():
        child.kill()
    child.join(10)
    receive.close()
    return Outcome(kind, message, seconds)


def load_bounded(path: Path, **bounds) -> Outcome:
    """Build an LLMEngine from `path` (as `tokenmill generate` does) in a sandboxed child."""
    return run_bounded(_load_engine, str(path), expected=("LoadError",), **bounds)


def _load_engine(path: str) -> str:
    from tokenmill.engine.llm_engine import LLMEngine

    LLMEngine(path, kv_cache_memory="4MiB", threads=1)
    return ""


def _vm_size() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmSize:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmSize")


def _run(fn, args: tuple, expected: tuple[str, ...], conn, memory_bytes: int) -> None:
    import resource

    import torch

    limit = _vm_size() + memory_bytes
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    torch.set_num_threads(1)
    try:
        conn.send(("ok", fn(*args)))
    except BaseException as e:  # noqa: BLE001 - the kind of failure is the result
        if type(e).__name__ in expected:
            conn.send((type(e).__name__, str(e)))
        else:
            tail = "".join(traceback.format_exception(e)[-3:])
            conn.send(("crash", f"{type(e).__name__}: {str(e)[:500]}\n{tail[-1500:]}"))
    finally:
        conn.close()
