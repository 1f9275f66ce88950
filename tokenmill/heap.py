"""Give freed heap memory back to the operating system.

glibc keeps pages that C code (llguidance's grammars, torch's small buffers, the
tokenizers library) frees, in its arenas, one per thread that ever allocated: after a
burst of large requests the process's RSS stays at its peak although nothing uses the
memory. `malloc_trim(0)` returns those pages; it takes a few milliseconds, so it runs
when a cache drops something big, when the engine falls idle, and at most every
TRIM_EVERY_S of steady load, never per step.

A server also caps glibc's arenas (`tune_allocator`): by default glibc opens up to 8 per
core as threads contend, and a server's many short-lived threads (HTTP workers, the
tokenizer pool, llguidance's mask threads) each leave a partly used arena behind that
no trim empties while one live allocation sits at its top.
"""

from __future__ import annotations

import ctypes
import logging
import os
import time

log = logging.getLogger("tokenmill.heap")

M_ARENA_MAX = -8  # glibc's mallopt parameter numbers (malloc.h)
ARENA_MAX = 2  # as MALLOC_ARENA_MAX=2, the setting servers commonly run glibc with
TRIM_EVERY_S = 30.0  # under load that never idles, trim at most this often

_last_trim = 0.0


def _libc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL(None)
        libc.malloc_trim, libc.mallopt  # noqa: B018 - glibc's, or AttributeError
        return libc
    except (OSError, AttributeError):  # not glibc
        return None


def give_back_memory() -> None:
    """Return freed heap pages to the OS (glibc's malloc_trim; a no-op elsewhere)."""
    global _last_trim
    libc = _libc()
    if libc is not None:
        libc.malloc_trim(0)
    _last_trim = time.monotonic()


def give_back_now_and_then() -> None:
    """give_back_memory() if it last ran TRIM_EVERY_S ago or more: for a loop that may
    never idle (a server under steady load), called once per step."""
    if time.monotonic() - _last_trim >= TRIM_EVERY_S:
        give_back_memory()


def tune_allocator() -> bool:
    """Cap glibc's arenas at ARENA_MAX for the arenas opened from now on (a server calls
    this before it starts its threads). The environment's MALLOC_ARENA_MAX, when set,
    is left to rule. True if the cap was set."""
    if "MALLOC_ARENA_MAX" in os.environ:
        return False
    libc = _libc()
    if libc is None or libc.mallopt(M_ARENA_MAX, ARENA_MAX) != 1:
        return False
    log.debug("glibc arenas capped at %d", ARENA_MAX)
    return True
