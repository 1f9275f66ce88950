"""glibc's heap under a server's threads (tokenmill/heap.py: "RSS flat").

Each new thread that allocates opens its own glibc arena, up to 8 per core; a server's
short-lived threads left partly used arenas behind, and RSS under steady load crept up
(1.24x over a 10-minute soak) although nothing held the memory."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from tokenmill import heap

pytestmark = pytest.mark.skipif(
    heap._libc() is None, reason="not glibc: no arenas to cap and no malloc_trim"
)

_ARENAS = textwrap.dedent(
    """
    import ctypes, os, sys, tempfile, threading
    from tokenmill import heap
    capped = heap.tune_allocator() if sys.argv[1] == "cap" else False
    held, together = [], threading.Barrier(6)
    def work():
        held.append([bytearray(1 << 16) for _ in range(8)])  # malloc'd, not pymalloc'd
        together.wait()  # all alive at once: none hands its arena on to the next
    threads = [threading.Thread(target=work) for _ in range(6)]
    for t in threads: t.start()
    for t in threads: t.join()
    libc = ctypes.CDLL(None)
    libc.fopen.restype = ctypes.c_void_p
    path = tempfile.mktemp()
    f = libc.fopen(path.encode(), b"w")
    libc.malloc_info(0, ctypes.c_void_p(f)); libc.fclose(ctypes.c_void_p(f))
    print(capped, open(path).read().count("<heap nr="))
    os.unlink(path)
    """
)


def _arenas(mode: str) -> tuple[str, int]:
    env = {k: v for k, v in os.environ.items() if k != "MALLOC_ARENA_MAX"}
    out = subprocess.run(
        [sys.executable, "-c", _ARENAS, mode], capture_output=True, text=True, env=env, check=True
    ).stdout.split()
    return out[0], int(out[1])


def test_the_cap_keeps_threads_to_two_arenas():
    capped, arenas = _arenas("cap")
    assert capped == "True" and arenas <= heap.ARENA_MAX
    _, uncapped = _arenas("none")
    assert uncapped > heap.ARENA_MAX  # the control: without it, one per thread


def test_the_environment_rules(monkeypatch):
    monkeypatch.setenv("MALLOC_ARENA_MAX", "4")
    assert heap.tune_allocator() is False


def test_trimming_now_and_then(monkeypatch):
    calls = []
    monkeypatch.setattr(heap, "_libc", lambda: type("L", (), {"malloc_trim": calls.append})())
    heap.give_back_memory()
    assert calls == [0]
    heap.give_back_now_and_then()  # just trimmed: not again
    assert calls == [0]
    monkeypatch.setattr(heap, "_last_trim", heap._last_trim - heap.TRIM_EVERY_S)
    heap.give_back_now_and_then()
    assert calls == [0, 0]


def test_trim_returns_freed_pages():
    """malloc_trim really gives memory back: a freed 64 MiB of small blocks leaves RSS."""
    script = textwrap.dedent(
        """
        import ctypes
        from tokenmill import heap
        libc = ctypes.CDLL(None)
        libc.malloc.restype = ctypes.c_void_p
        def rss():
            return int(open("/proc/self/statm").read().split()[1]) * 4096
        blocks = [libc.malloc(4096) for _ in range(16384)]  # 64 MiB below mmap's threshold
        for b in blocks: ctypes.memset(b, 1, 4096)
        keep = libc.malloc(64)  # a live block at the top: free() alone cannot shrink the heap
        for b in blocks: libc.free(ctypes.c_void_p(b))
        before = rss()
        heap.give_back_memory()
        print(before - rss())
        """
    )
    freed = int(
        subprocess.run(
            [sys.executable, "-c", script], capture_output=True, text=True, check=True
        ).stdout
    )
    assert freed > 48 * 2**20, freed
