"""Compile the C kernels at first use and cache the shared library.

Why at runtime: `-march=native` code must be built on the machine that runs it, and
plain C with gcc takes about a second, so no build step or wheel per CPU is needed.

The library lands in `hub.cache_dir()/kernels/<hash>.so`; the hash covers the sources
(every .c and .h here), the compiler command, the compiler version and the CPU (model
and feature flags), so a changed source or a different host never loads a stale build.

Target: `-march=native` by default, so the host's best instruction set is compiled in
(see tm.h for the paths). TOKENMILL_MARCH names another target, e.g. `x86-64-v3` to build
and benchmark the AVX2 path on an AVX-512 machine, or `x86-64-v2` for the scalar one. Concurrent processes
(parallel test runs) each compile to a private temporary name and `os.replace` it into
place: the rename is atomic, and identical inputs give an identical library, so the
last writer wins harmlessly.

OpenMP: we link the `libgomp.so.1` soname. Torch's CPU wheel ships its own
`libgomp.so.1` and loads it first, so the dynamic loader resolves ours to that same
copy and the kernels share torch's thread pool instead of starting a second pool
that would spin against it on the same cores.
"""

from __future__ import annotations

import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

HERE = Path(__file__).parent
SOURCES = tuple(sorted(HERE.glob("*.c")))  # compiled together into one library
HEADERS = tuple(sorted(HERE.glob("*.h")))
BASE_FLAGS = ("-O3", "-std=gnu11", "-fPIC", "-shared", "-fopenmp")


class BuildError(RuntimeError):
    """The kernel library could not be compiled (no compiler, or it failed)."""


def _cpu_signature() -> str:
    """Model name and feature flags: what -march=native depends on."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine()
    keep = [ln for ln in text.splitlines() if ln.startswith(("model name", "flags"))]
    return "\n".join(dict.fromkeys(keep))  # one copy per distinct line, not per core


def _compiler() -> str:
    cc = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if not cc:
        raise BuildError("no C compiler found (install gcc or set CC)")
    return cc


def default_arch_flags() -> tuple[str, ...]:
    """-march=native, or the target TOKENMILL_MARCH names."""
    march = os.environ.get("TOKENMILL_MARCH", "").strip() or "native"
    if not all(c.isalnum() or c in "-_.+" for c in march):
        raise BuildError(f"TOKENMILL_MARCH={march!r} is not a -march value")
    return (f"-march={march}",)


def library_path(arch_flags: tuple[str, ...] | None = None) -> tuple[Path, list[str]]:
    """Where the library for this source/compiler/CPU lives, and the command to build it."""
    from tokenmill import hub

    if arch_flags is None:
        arch_flags = default_arch_flags()
    cc = _compiler()
    try:
        version = subprocess.run(
            [cc, "--version"], capture_output=True, text=True, timeout=30
        ).stdout.splitlines()[0]
    except (OSError, subprocess.SubprocessError, IndexError) as e:
        raise BuildError(f"cannot run the C compiler {cc}: {e}") from None
    cmd = [cc, *BASE_FLAGS, *arch_flags]
    key = hashlib.sha256()
    parts = [p.name.encode() + b"\0" + p.read_bytes() for p in SOURCES + HEADERS]
    for part in (*parts, " ".join(cmd).encode(), version.encode()):
        key.update(part)
        key.update(b"\0")
    key.update(_cpu_signature().encode())
    folder = hub.cache_dir() / "kernels"
    return folder / f"quant-{key.hexdigest()[:20]}.so", cmd


def compile_library(arch_flags: tuple[str, ...] | None = None) -> Path:
    """Path of the compiled library, compiling it first if it is not cached yet."""
    path, cmd = library_path(arch_flags)
    if path.exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=path.stem + ".", suffix=".tmp.so", dir=path.parent)
    os.close(fd)
    try:
        proc = subprocess.run(
            [*cmd, "-o", tmp, *map(str, SOURCES)], capture_output=True, text=True, timeout=300
        )
        if proc.returncode != 0:
            raise BuildError(f"{' '.join(cmd)} failed:\n{proc.stderr.strip()}")
        os.replace(tmp, path)
    except (OSError, subprocess.SubprocessError) as e:
        raise BuildError(f"cannot compile the kernels: {e}") from None
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path
