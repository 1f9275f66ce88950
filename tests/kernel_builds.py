"""The kernel library built for several targets, so each instruction-set path is tested
on any CI machine: the host's own build ("native"), and on x86-64 the AVX2 path
(x86-64-v3), the AVX-VNNI path over an exact AVX2 emulation of its two instructions
(no CPU here has them, and QEMU's TCG does not implement them), and the portable scalar
path (x86-64-v2). A target the host cannot execute is skipped, with the reason. AArch64
NEON is tested under emulation in test_kernels_aarch64.py.
"""

from __future__ import annotations

import ctypes
import platform
from pathlib import Path

import pytest

from tokenmill import kernels

# target -> (-march flags or None for the default, CPU flags it needs, the ISA it runs)
X86_BUILDS = {
    "native": (None, (), None),
    "x86-64-v3": (("-march=x86-64-v3",), ("avx2", "fma", "f16c", "bmi1", "bmi2", "movbe"), "avx2"),
    "avx-vnni-emulated": (
        ("-march=x86-64-v3", "-DTM_EMULATE_AVXVNNI"),
        ("avx2", "fma", "f16c", "bmi1", "bmi2", "movbe"),
        "avx2+vnni(emulated)",
    ),
    "x86-64-v2": (("-march=x86-64-v2",), ("sse4_2", "popcnt", "ssse3"), "scalar"),
}
BUILDS = list(X86_BUILDS) if platform.machine() in ("x86_64", "AMD64") else ["native"]

_loaded: dict[str, ctypes.CDLL] = {}


def _cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def library_for(build: str) -> ctypes.CDLL:
    """The library compiled for `build` (cached per session); skips if the host lacks
    the instructions or the build cannot be made."""
    if build not in _loaded:
        flags, needs, _ = X86_BUILDS.get(build, (None, (), None))
        missing = [f for f in needs if f not in _cpu_flags()]
        if missing:
            pytest.skip(f"this CPU cannot run the {build} build (no {', '.join(missing)})")
        if build == "native" and kernels.library() is None:
            pytest.skip("native kernels unavailable")
        try:
            _loaded[build] = kernels.library() if build == "native" else kernels.load(flags)
        except (kernels.BuildError, OSError) as e:
            pytest.skip(f"cannot build the {build} kernels: {e}")
    return _loaded[build]


def use_build(monkeypatch: pytest.MonkeyPatch, build: str) -> ctypes.CDLL:
    """Make `build` the library every kernels.* call uses for the rest of the test."""
    lib = library_for(build)
    expected = X86_BUILDS.get(build, (None, (), None))[2]
    if expected is not None:
        assert lib.tm_isa().decode() == expected, (build, lib.tm_isa())
    monkeypatch.setattr(kernels, "_lib", lib)
    monkeypatch.setattr(kernels, "_tried", True)
    return lib
