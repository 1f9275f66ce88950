"""Compile the C kernels at first use and cache the shared library.

Why at runtime: `-march=native` code must be built on the machine that runs it, and
plain C with gcc takes a few seconds, so no build step or wheel per CPU is needed
(docs/architecture.md has the decision).

The library lands in `cache.cache_dir()/kernels/quant-<hash>.so`; the hash covers the
sources (every .c and .h here), the compiler command, the compiler version and the CPU
(model and feature flags), so a changed source or a different host never loads a stale
build.

Target: `-march=native` by default, so the host's best instruction set is compiled in
(see tm.h for the paths). TOKENMILL_MARCH names another target, e.g. `x86-64-v3` to build
and benchmark the AVX2 path on an AVX-512 machine, or `x86-64-v2` for the scalar one.

What can go wrong, and what each case does:
- Concurrent processes (parallel test runs) each compile to a private temporary name and
  `os.replace` it into place: the rename is atomic, and identical inputs give an
  identical library, so the last writer wins harmlessly.
- A compiler that fails leaves `quant-<hash>.failed` beside where the library would be,
  holding its message, so the next process reports the same failure at once instead of
  running gcc again (it cost every `tokenmill info` 1.5 s). Its key is the library's, so
  a fixed source, compiler or CPU retries. Only a real compiler verdict is remembered
  (a non-zero exit), not a timeout, a signal or a missing folder. Under
  TOKENMILL_REQUIRE_NATIVE=1 (the test suite) the marker is ignored and the compiler
  runs again: there the fresh compiler output matters more than the seconds.
- A cache folder this process cannot write: the library is compiled into a private
  temporary folder (removed at exit) and loaded from there, with one line saying so.
- A damaged or foreign file at the library's path: every build writes the library's size
  and SHA-256 beside it (`quant-<hash>.so.sha256`), and a cached file is checked against
  them before it is loaded, since dlopen of a file truncated mid-way can die of SIGBUS
  rather than fail. A mismatch (or no checksum) is rebuilt in its place; a file that
  passes the check and still does not load is rebuilt once by `tokenmill.kernels.load`.

OpenMP: we link the `libgomp.so.1` soname. Torch's CPU wheel ships its own
`libgomp.so.1` and loads it first, so the dynamic loader resolves ours to that same
copy and the kernels share torch's thread pool instead of starting a second pool
that would spin against it on the same cores.
"""

from __future__ import annotations

import atexit
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from tokenmill.cache import cache_dir

HERE = Path(__file__).parent
SOURCES = tuple(sorted(HERE.glob("*.c")))  # compiled together into one library
HEADERS = tuple(sorted(HERE.glob("*.h")))
BASE_FLAGS = ("-O3", "-std=gnu11", "-fPIC", "-shared", "-fopenmp")

# What a user is told when the library is unavailable (library() and `tokenmill info`).
COST = "decoding is about 40x slower (the pure-torch path)"
FIX = (
    "install gcc or set CC, or try the AVX2 build with TOKENMILL_MARCH=x86-64-v3 "
    "(TOKENMILL_KERNELS=0: the torch path without this message)"
)
ERROR_LINES = 5  # compiler lines shown to users; the BuildError keeps them all
LINE_CHARS = 160  # longer ones (gcc's list of every -march value) are cut for users

_private: dict[Path, Path] = {}  # cache path -> the build in a private folder (unwritable cache)
_compiled: set[Path] = set()  # the libraries this process compiled (see compiled_here)


class BuildError(RuntimeError):
    """The kernel library could not be compiled (no compiler, or it failed).

    `message` says what failed (the compiler command, for a compiler failure), `output` is
    the compiler's whole error output, `remembered` the failure marker it was read from
    when this failure was remembered from an earlier process rather than seen now.
    """

    def __init__(self, message: str, output: str = "", remembered: Path | None = None):
        self.message, self.output, self.remembered = message, output.strip(), remembered
        text = message + (f":\n{self.output}" if self.output else "")
        if remembered is not None:
            text += f"\n(remembered from an earlier try: delete {remembered} to retry)"
        super().__init__(text)


def require_native() -> bool:
    """Whether TOKENMILL_REQUIRE_NATIVE asks for the native library or an error, never
    the torch fallback (the test suite sets it, so a broken host build fails it)."""
    return os.environ.get("TOKENMILL_REQUIRE_NATIVE", "").strip() not in ("", "0")


def describe_failure(error: BaseException) -> str:
    """What a user reads when the library cannot be built or loaded: one line with what
    failed and why, the cost and what to do, then up to ERROR_LINES compiler lines,
    indented (from its first error, past gcc's "In function" context)."""
    if isinstance(error, BuildError):
        why, output = error.message, error.output.splitlines()
    else:  # an OSError from loading: its first line is the reason
        text = str(error).strip() or type(error).__name__
        why, *output = text.splitlines()
    # Once each: gcc repeats a flag's error for every source file it compiles.
    output = list(dict.fromkeys(ln.rstrip() for ln in output if ln.strip()))
    start = next((i for i, ln in enumerate(output) if "error" in ln.lower()), 0)
    shown = [_cut(ln) for ln in output[start : start + ERROR_LINES]]
    if shown:
        why = f"{why.rstrip(':')}: {shown[0].strip()}"
    lines = [f"native kernels unavailable, so {COST}: {why}. To fix: {FIX}"]
    lines += [f"    {ln}" for ln in shown]
    if isinstance(error, BuildError) and error.remembered is not None:
        lines.append(f"    (remembered from an earlier try: delete {error.remembered} to retry)")
    return "\n".join(lines)


def _cut(line: str) -> str:
    return line if len(line) <= LINE_CHARS else line[: LINE_CHARS - 3] + "..."


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
    folder = cache_dir() / "kernels"
    return folder / f"quant-{key.hexdigest()[:20]}.so", cmd


def _exists(path: Path) -> bool:
    try:
        return path.exists()
    except OSError:  # a folder on the way that this process may not search: not usable
        return False


def checksum_file(path: Path) -> Path:
    """Where the size and SHA-256 of the library at `path` are kept."""
    return path.with_name(path.name + ".sha256")


def _digest(path: Path | str) -> str:
    data = Path(path).read_bytes()
    return f"{len(data)} {hashlib.sha256(data).hexdigest()}"


def _intact(path: Path) -> bool:
    """Whether the cached library is the file its build wrote (size and checksum)."""
    try:
        return checksum_file(path).read_text().strip() == _digest(path)
    except OSError:
        return False


def failure_marker(path: Path) -> Path:
    """The file that remembers a failed build of the library at `path` (same key)."""
    return path.with_suffix(".failed")


def _remembered_failure(marker: Path) -> BuildError | None:
    try:
        text = marker.read_text()
    except (OSError, UnicodeDecodeError):  # absent (the usual case) or unreadable: retry
        return None
    message, _, output = text.partition("\n")
    return BuildError(message, output, remembered=marker)


def _remember_failure(marker: Path, error: BuildError) -> None:
    """Best effort: an unwritable cache only costs the next process a compiler run."""
    try:
        fd, tmp = tempfile.mkstemp(prefix=marker.stem + ".", suffix=".tmp", dir=marker.parent)
        with os.fdopen(fd, "w") as f:
            f.write(f"{error.message}\n{error.output}\n")
        os.replace(tmp, marker)  # atomic: a concurrent reader sees all of it or nothing
    except OSError:
        pass


def _private_folder(cache: Path, reason: OSError) -> Path:
    """A fresh folder only this process writes, for a cache folder it cannot write."""
    folder = Path(tempfile.mkdtemp(prefix="tokenmill-kernels-"))
    atexit.register(shutil.rmtree, folder, True)
    print(
        f"tokenmill: cannot write the kernel cache {cache} ({reason.strerror or reason}); "
        f"compiling the kernels into {folder}, again at every start: point TOKENMILL_CACHE "
        "at a writable folder to keep them",
        file=sys.stderr,
    )
    return folder


def compiled_here(path: Path) -> bool:
    """Whether this process compiled the library at `path` (rather than finding it in
    the cache): one it just compiled that fails to load would fail again when rebuilt."""
    return path in _compiled


def compile_library(arch_flags: tuple[str, ...] | None = None, *, rebuild: bool = False) -> Path:
    """Path of the compiled library, compiling it first if it is not cached yet (or, with
    `rebuild`, replacing the cached file). Raises BuildError, for a remembered failure too
    (unless TOKENMILL_REQUIRE_NATIVE=1 or `rebuild`, which run the compiler again)."""
    cached, cmd = library_path(arch_flags)
    path = _private.get(cached, cached)
    if _exists(path) and not rebuild:
        if _intact(path):
            return path
        rebuild = True  # truncated, foreign or without its checksum: built again in place
    marker = failure_marker(cached)
    if not rebuild and not require_native():
        remembered = _remembered_failure(marker)
        if remembered is not None:
            raise remembered
    try:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=path.stem + ".", suffix=".tmp.so", dir=path.parent)
        except OSError as e:  # read-only, not a folder, no space...: build privately
            path = _private[cached] = _private_folder(path.parent, e) / cached.name
            fd, tmp = tempfile.mkstemp(prefix=path.stem + ".", suffix=".tmp.so", dir=path.parent)
        os.close(fd)
    except OSError as e:
        raise BuildError(f"cannot compile the kernels: no folder to write them to: {e}") from None
    try:
        proc = subprocess.run(
            [*cmd, "-o", tmp, *map(str, SOURCES)], capture_output=True, text=True, timeout=300
        )
        if proc.returncode != 0:
            error = BuildError(
                f"{' '.join(cmd)} failed with exit status {proc.returncode}",
                proc.stderr.strip() or proc.stdout.strip(),
            )
            if proc.returncode > 0:  # the compiler's verdict; not a signal (OOM killer...)
                _remember_failure(marker, error)
            raise error
        sums = checksum_file(path)  # first, so a reader never sees the library without it
        fd, tmp_sums = tempfile.mkstemp(prefix=sums.name + ".", suffix=".tmp", dir=path.parent)
        with os.fdopen(fd, "w") as f:
            f.write(_digest(tmp) + "\n")
        os.replace(tmp_sums, sums)
        os.replace(tmp, path)
        _compiled.add(path)
    except (OSError, subprocess.SubprocessError) as e:
        raise BuildError(f"cannot compile the kernels: {e}") from None
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    try:
        marker.unlink(missing_ok=True)  # from a failure that did not recur: wrong now
    except OSError:
        pass
    return path
