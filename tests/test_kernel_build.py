"""The first-use build of the native kernels (tokenmill/kernels/build.py, `kernels.load`)
under concurrency and damage, and what a failed build tells users.

Each test has its own cache folder (TOKENMILL_CACHE), and the builds are real: gcc
compiles the kernels (about 5 s each, so the damage tests reuse the library that the
concurrency test builds). A failing compiler is a small script standing in for CC, which
prints gcc-style errors and counts how often it is asked to compile.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tokenmill import kernels
from tokenmill.kernels import build

needs_cc = pytest.mark.skipif(
    not (os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc"))
    and not build.require_native(),
    reason="no C compiler to build the kernels with",
)

# Stands in for gcc: answers --version, and fails every compile with gcc-style errors
# (more lines than users are shown), after appending a line to `count` beside itself.
FAILING_CC = """#!/bin/sh
for a in "$@"; do [ "$a" = "--version" ] && { echo "failcc 1.0"; exit 0; }; done
echo compile >> "$(dirname "$0")/count"
echo "quant.c: In function 'f':" >&2
i=1; while [ $i -le 9 ]; do echo "quant.c:$i:5: error: boom $i" >&2; i=$((i+1)); done
exit 1
"""

# Waits for a go file, so both processes start building at the same moment.
RACE = """
import os, sys, time
from tokenmill import kernels
from tokenmill.kernels import build
print("ready", flush=True)
while not os.path.exists(sys.argv[1]):
    time.sleep(0.002)
lib = kernels.load()
print(lib.tm_isa().decode(), build.compile_library())
"""


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty cache folder, and kernels/build state as a fresh process has it."""
    monkeypatch.setenv("TOKENMILL_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("TOKENMILL_KERNELS", raising=False)
    monkeypatch.delenv("TOKENMILL_REQUIRE_NATIVE", raising=False)
    monkeypatch.setattr(kernels, "_lib", None)
    monkeypatch.setattr(kernels, "_tried", False)
    monkeypatch.setattr(kernels, "_error", None)
    monkeypatch.setattr(build, "_private", {})
    monkeypatch.setattr(build, "_compiled", set())
    return tmp_path / "cache"


@pytest.fixture
def failing_cc(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """CC set to FAILING_CC; returns the file counting its compile runs."""
    cc = tmp_path / "bin" / "cc"
    cc.parent.mkdir()
    cc.write_text(FAILING_CC)
    cc.chmod(0o755)
    monkeypatch.setenv("CC", str(cc))
    return cc.parent / "count"


def compiles(count: Path) -> int:
    return len(count.read_text().splitlines()) if count.exists() else 0


@pytest.fixture(scope="module")
def raced(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    """Two processes that load the kernels at the same moment from one empty cache:
    the ISA they report, and the library's path (checked in test_concurrent_first_use)."""
    root = tmp_path_factory.mktemp("race")
    env = {**os.environ, "TOKENMILL_CACHE": str(root / "cache")}
    env.pop("TOKENMILL_KERNELS", None)
    go = root / "go"
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", RACE, str(go)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    for p in procs:
        assert p.stdout.readline().strip() == "ready", p.communicate()[1]
    go.touch()
    outs = [p.communicate(timeout=180) for p in procs]
    for p, (_, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, err
        assert err == "", err  # nothing to report
    results = [out.split() for out, _ in outs]
    assert results[0] == results[1], results
    isa, path = results[0]
    return isa, Path(path)


@needs_cc
def test_concurrent_first_use(raced: tuple[str, Path]):
    """Both processes end with the same working library and its checksum, and no
    temporary file is left."""
    isa, path = raced
    assert isa not in ("", "none") and path.is_file()
    left = sorted(p.name for p in path.parent.iterdir())
    assert left == [path.name, build.checksum_file(path).name]  # no .tmp.so, no .failed


def counting_compiles(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """Records each compile_library call that kernels.load makes: its `rebuild` flag."""
    calls: list[bool] = []

    def compile_library(arch_flags=None, *, rebuild=False):
        calls.append(rebuild)
        return build.compile_library(arch_flags, rebuild=rebuild)

    monkeypatch.setattr(kernels, "compile_library", compile_library)
    return calls


@needs_cc
@pytest.mark.parametrize("keep", [100, "half"])
def test_truncated_library_is_rebuilt(cache, raced, monkeypatch, keep):
    """A .so cut short (a full disk, a killed copy), with the checksum of the whole one
    beside it, is found damaged before dlopen sees it (a file cut mid-way can SIGBUS
    there) and rebuilt once in its place: a working library."""
    isa, real = raced
    path, _ = build.library_path()
    path.parent.mkdir(parents=True)
    data = real.read_bytes()
    path.write_bytes(data[: len(data) // 2 if keep == "half" else keep])
    shutil.copy(build.checksum_file(real), build.checksum_file(path))
    calls = counting_compiles(monkeypatch)
    assert kernels.load().tm_isa().decode() == isa
    assert calls == [False]  # one call: it checked the file and rebuilt it
    assert path.read_bytes() == data or build._intact(path)
    assert sorted(p.name for p in path.parent.iterdir()) == [path.name, path.name + ".sha256"]


@needs_cc
def test_library_that_passes_its_check_but_fails_to_load_is_rebuilt(cache, raced, monkeypatch):
    """The second line of defence: a file whose checksum matches but which does not load
    (here a cut file with its own checksum written beside it) is rebuilt once by load."""
    isa, real = raced
    path, _ = build.library_path()
    path.parent.mkdir(parents=True)
    path.write_bytes(real.read_bytes()[:100])
    build.checksum_file(path).write_text(build._digest(path) + "\n")
    calls = counting_compiles(monkeypatch)
    assert kernels.load().tm_isa().decode() == isa
    assert calls == [False, True]  # loaded the bad file, rebuilt once


@needs_cc
def test_foreign_library_is_rebuilt(cache, raced, monkeypatch, tmp_path):
    """A .so that loads but is not the kernels (no tm_info) is unloaded, rebuilt in its
    place and loaded: dlopen must not hand back the foreign one it has open."""
    isa, _ = raced
    path, cmd = build.library_path()
    path.parent.mkdir(parents=True)
    src = tmp_path / "foreign.c"
    src.write_text("int x(void) { return 1; }\n")
    subprocess.run([cmd[0], "-shared", "-fPIC", "-o", str(path), str(src)], check=True)
    calls = counting_compiles(monkeypatch)
    build.checksum_file(path).write_text(build._digest(path) + "\n")  # passes the check
    lib = kernels.load()
    assert lib.tm_isa().decode() == isa and lib.tm_info() // 1000 == kernels.ABI
    assert calls == [False, True]


@needs_cc
def test_unwritable_cache_builds_in_a_private_folder(cache, capsys):
    """A cache folder that cannot be made or written (here `kernels` is a file, which
    stops root too): the kernels are compiled into a private temporary folder and load
    from there, with one line saying so; no traceback, no fallback."""
    cache.mkdir()
    (cache / "kernels").write_text("a file where the kernels folder should be")
    lib = kernels.library()
    assert lib is not None and lib.tm_isa().decode() not in ("", "none")
    private = build.compile_library()  # the same private build, not compiled again
    assert cache not in private.parents and private.is_file()
    assert len(build._compiled) == 1
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("tokenmill: cannot write the kernel cache"), err
    assert "TOKENMILL_CACHE" in err[0]


def test_compiler_errors_reach_the_message(cache, failing_cc, capsys):
    """The BuildError carries all the compiler's output; library() prints one tokenmill
    line (cause, cost, what to do) and the first compiler error lines, once."""
    with pytest.raises(build.BuildError) as info:
        build.compile_library()
    assert "error: boom 1" in str(info.value) and "error: boom 9" in str(info.value)
    assert kernels.library() is None
    lines = capsys.readouterr().err.splitlines()
    first, shown = lines[0], lines[1:]
    assert first.startswith("tokenmill: native kernels unavailable")
    for fact in ("-march=", "error: boom 1", "40x slower", "install gcc", "x86-64-v3"):
        assert fact in first, fact
    assert shown == [f"    quant.c:{i}:5: error: boom {i}" for i in range(1, 6)] + [
        f"    (remembered from an earlier try: delete {build.failure_marker(build.library_path()[0])} to retry)"
    ]
    assert kernels.library() is None and capsys.readouterr().err == ""  # once per process
    assert kernels.unavailable() == first.removeprefix("tokenmill: ") + "\n" + "\n".join(shown)


@needs_cc
def test_real_compiler_error_is_shown(cache, monkeypatch):
    """gcc's own message for a well-formed but unknown -march value."""
    monkeypatch.setenv("TOKENMILL_MARCH", "nonexistent-cpu")
    with pytest.raises(build.BuildError) as info:
        build.compile_library()
    assert "nonexistent-cpu" in info.value.output and "error" in info.value.output
    first = build.describe_failure(info.value).splitlines()[0]
    assert "-march=nonexistent-cpu failed" in first
    why = first.partition("failed")[2]  # the compiler's own line (gcc quotes per locale)
    assert "error" in why and "nonexistent-cpu" in why


def test_failed_build_is_remembered(cache, failing_cc, monkeypatch):
    """A compiler failure leaves a marker under the library's key, so later attempts (the
    next process) report it without running the compiler; a changed command, the marker's
    removal or TOKENMILL_REQUIRE_NATIVE=1 run it again."""
    with pytest.raises(build.BuildError) as first:
        build.compile_library()
    marker = build.failure_marker(build.library_path()[0])
    assert marker.name.startswith("quant-") and marker.suffix == ".failed"
    assert "error: boom 1" in marker.read_text() and first.value.remembered is None
    with pytest.raises(build.BuildError) as again:
        build.compile_library()
    assert compiles(failing_cc) == 1
    assert again.value.remembered == marker and again.value.output == first.value.output
    with pytest.raises(build.BuildError):  # another key: other flags
        build.compile_library(("-march=x86-64-v2",))
    assert compiles(failing_cc) == 2
    monkeypatch.setenv("TOKENMILL_REQUIRE_NATIVE", "1")
    with pytest.raises(build.BuildError) as required:
        build.compile_library()
    assert compiles(failing_cc) == 3 and required.value.remembered is None
    monkeypatch.delenv("TOKENMILL_REQUIRE_NATIVE")
    marker.unlink()
    with pytest.raises(build.BuildError):
        build.compile_library()
    assert compiles(failing_cc) == 4


def test_require_native_raises(cache, failing_cc, monkeypatch, capsys):
    """TOKENMILL_REQUIRE_NATIVE=1: a failed build raises, with the compiler's lines, and
    keeps raising; TOKENMILL_KERNELS=0 still means the torch path, silently."""
    monkeypatch.setenv("TOKENMILL_REQUIRE_NATIVE", "1")
    for _ in range(2):
        with pytest.raises(build.BuildError, match="error: boom 1") as info:
            kernels.library()
        assert any("TOKENMILL_REQUIRE_NATIVE" in note for note in info.value.__notes__)
    monkeypatch.setenv("TOKENMILL_KERNELS", "0")
    assert kernels.library() is None and kernels.unavailable() is None
    assert capsys.readouterr().err == ""


def run_info(env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "tokenmill.cli", "info"],
        env={k: v for k, v in env.items() if v is not None},
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_info_reports_unavailable_kernels_first(cache, failing_cc):
    """`tokenmill info` with a failing compiler: the reason is its first line, the command
    exits 3, nothing is printed twice, no traceback; the same under
    TOKENMILL_REQUIRE_NATIVE=1. With TOKENMILL_KERNELS=0 it is a plain listing."""
    env = dict(os.environ)
    for require in (None, "1"):
        r = run_info({**env, "TOKENMILL_REQUIRE_NATIVE": require})
        assert r.returncode == 3, r.stderr
        assert r.stderr == ""
        first = r.stdout.splitlines()[0]
        assert first.startswith("tokenmill: native kernels unavailable"), r.stdout
        assert "error: boom 1" in first and "40x slower" in first and "x86-64-v3" in first
        assert "kernels    none: native kernels unavailable" in r.stdout
    r = run_info({**env, "TOKENMILL_KERNELS": "0"})
    assert r.returncode == 0 and r.stderr == "", r.stderr
    assert r.stdout.startswith("tokenmill ") and "TOKENMILL_KERNELS=0" in r.stdout
    assert compiles(failing_cc) == 2  # once remembered, once retried under REQUIRE_NATIVE
