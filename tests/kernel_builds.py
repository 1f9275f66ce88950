"""The kernel library built for every instruction-set layer, so each path is compiled and
executed on any x86-64 CI machine, whatever its own CPU:

    native              the host's own build (-march=native): must build where a C
                        compiler exists (a failure is a failed test, never a skip)
    x86-64-v2           the portable scalar layer (the reference)
    x86-64-v3           AVX2
    avx-vnni-emulated   the AVX2 layer's AVX-VNNI path over an exact AVX2 emulation of
                        its two instructions (QEMU's TCG does not implement them either)
    avx-vnni            the same path on real AVX-VNNI, where the CPU has it
    avx512-simde        the AVX-512 layer without VNNI (x86-64-v4's instructions) over
                        SIMDe (Debian's libsimde-dev), on any AVX2 host
    avx512-vnni-simde   the AVX-512 layer with VNNI over SIMDe
    amx-emulated        that build with the integer GEMM on the AMX tile layer
                        (simd_amx.h) over its plain-C emulation
    x86-64-v4           the AVX-512 layer without VNNI, on real AVX-512, where the CPU has it
    avx512-vnni         with VNNI (and BF16 enabled), on a CPU that has them
    sapphirerapids      -march=sapphirerapids (every AVX-512 extension gcc knows, and
                        the GEMM on AMX tiles)

Every build is compiled with -Wall -Wextra -Werror on every host, and a build that does
not compile or load fails the test, never skips it. A real-instruction build the host
cannot execute is compiled, then its execution skipped with the reason; every emulated
one runs everywhere. AArch64 NEON (with and without dotprod) is compiled the same way
and runs under qemu-user in test_kernels_aarch64.py.
"""

from __future__ import annotations

import ctypes
import platform
from pathlib import Path

import pytest

from tokenmill import kernels
from tokenmill.kernels import build

WERROR = ("-Wall", "-Wextra", "-Werror")

V3 = ("avx2", "fma", "f16c", "bmi1", "bmi2", "movbe")
V4 = (*V3, "avx512f", "avx512bw", "avx512dq", "avx512vl")
SIMDE = ("-march=x86-64-v3", "-DTM_SIMDE_AVX512", "-Wno-psabi")
# target -> (compiler flags or None for the default, CPU flags it needs, the ISA it runs)
X86_BUILDS = {
    "native": (None, (), None),
    "x86-64-v2": (("-march=x86-64-v2",), ("sse4_2", "popcnt", "ssse3"), "scalar"),
    "x86-64-v3": (("-march=x86-64-v3",), V3, "avx2"),
    "avx-vnni-emulated": (
        ("-march=x86-64-v3", "-DTM_EMULATE_AVXVNNI"),
        V3,
        "avx2+vnni(emulated)",
    ),
    "avx-vnni": (("-march=x86-64-v3", "-mavxvnni"), (*V3, "avx_vnni"), "avx2+vnni"),
    "avx512-simde": (SIMDE, V3, "avx512(simde)"),
    "avx512-vnni-simde": ((*SIMDE, "-DTM_SIMDE_AVX512VNNI"), V3, "avx512+vnni(simde)"),
    "amx-emulated": (
        (*SIMDE, "-DTM_SIMDE_AVX512VNNI", "-DTM_EMULATE_AMX"),
        V3,
        "avx512+vnni(simde)+amx(emulated)",
    ),
    "x86-64-v4": (("-march=x86-64-v4",), V4, "avx512"),
    "avx512-vnni": (
        ("-march=x86-64-v4", "-mavx512vnni", "-mavx512bf16"),
        (*V4, "avx512_vnni", "avx512_bf16"),
        "avx512+vnni",
    ),
    # the target the AVX-512 breakage of a5b9eb1 was first seen on (compiled on every host)
    "sapphirerapids": (
        ("-march=sapphirerapids",),
        (*V4, "avx512_vnni", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_int8", "avx_vnni"),
        "avx512+vnni+amx",
    ),
}
BUILDS = list(X86_BUILDS) if platform.machine() in ("x86_64", "AMD64") else ["native"]

_loaded: dict[str, ctypes.CDLL] = {}


def cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def build_flags(name: str) -> tuple[str, ...]:
    """The compiler flags of a test build: its target (the default one for native), with
    every warning an error."""
    flags = X86_BUILDS.get(name, (None, (), None))[0]
    return (*(build.default_arch_flags() if flags is None else flags), *WERROR)


def library_for(name: str) -> ctypes.CDLL:
    """The library compiled for build `name` (cached per session). A build that fails to
    compile fails the test on any host; only the execution of one whose instructions this
    CPU lacks is skipped, after it compiled."""
    if name not in _loaded:
        needs = X86_BUILDS.get(name, (None, (), None))[1]
        missing = [f for f in needs if f not in cpu_flags()]
        try:
            if missing:
                build.compile_library(build_flags(name))
                pytest.skip(f"this CPU cannot run the {name} build (no {', '.join(missing)})")
            _loaded[name] = kernels.load(build_flags(name))
        except (kernels.BuildError, OSError) as e:
            pytest.fail(f"the {name} kernels do not build or load: {e}")
    return _loaded[name]


def use_build(monkeypatch: pytest.MonkeyPatch, name: str) -> ctypes.CDLL:
    """Make build `name` the library every kernels.* call uses for the rest of the test."""
    lib = library_for(name)
    expected = X86_BUILDS.get(name, (None, (), None))[2]
    if expected is not None:
        assert lib.tm_isa().decode() == expected, (name, lib.tm_isa())
    monkeypatch.setattr(kernels, "_lib", lib)
    monkeypatch.setattr(kernels, "_tried", True)
    return lib
