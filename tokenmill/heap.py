"""Give freed heap memory back to the operating system.

glibc keeps pages that C code (llguidance's grammars, torch's small buffers, the
tokenizers library) frees, in its arenas, one per thread that ever allocated: after a
burst of large requests the process's RSS stays at its peak although nothing uses the
memory. `malloc_trim(0)` returns those pages; it takes a few milliseconds, so it runs
when a cache drops something big and when the engine falls idle, never per step.
"""

from __future__ import annotations

import ctypes


def give_back_memory() -> None:
    """Return freed heap pages to the OS (glibc's malloc_trim; a no-op elsewhere)."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass
