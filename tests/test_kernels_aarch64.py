"""The AArch64 kernels under emulation: NEON with and without the dot-product extension
against the portable scalar code, on random packed blocks of every format, float weights,
decode attention and the whole decode step.

tests/kernels_driver.c is cross-compiled with Debian's gcc-aarch64-linux-gnu for three
targets (armv8.2-a+dotprod, armv8-a, armv8-a+nosimd: no vector unit at all) and run
under qemu-user (`qemu-aarch64 -cpu max`). The three builds pack codes for the same
vector width (4 blocks per group), so they read the same random bytes the same way and
must agree up to the order of float sums. Missing tools are installed with apt when the
test runs as root (scripts/test.sh installs them too), else the test is skipped.
"""

from __future__ import annotations

import os
import shutil
import struct
import subprocess
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parent.parent
DRIVER = ROOT / "tests" / "kernels_driver.c"
SOURCES = sorted((ROOT / "tokenmill" / "kernels").glob("*.c"))
CC, QEMU = "aarch64-linux-gnu-gcc", "qemu-aarch64"
APT_PACKAGES = ["gcc-aarch64-linux-gnu", "libc6-dev-arm64-cross", "qemu-user"]
# name -> -march: the NEON builds, and the scalar reference they are compared with
BUILDS = {"neon+dotprod": "armv8.2-a+dotprod", "neon": "armv8-a", "scalar": "armv8-a+nosimd"}


def _have_tools() -> bool:
    return bool(shutil.which(CC) and shutil.which(QEMU))


def _install_tools() -> None:
    if _have_tools() or os.geteuid() != 0 or not shutil.which("apt-get"):
        return
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    install = ["apt-get", "install", "-y", "-qq", *APT_PACKAGES]
    if subprocess.run(install, env=env, capture_output=True, timeout=900).returncode != 0:
        subprocess.run(["apt-get", "update", "-qq"], env=env, capture_output=True, timeout=600)
        subprocess.run(install, env=env, capture_output=True, timeout=900)


def read_records(path: Path) -> dict[str, np.ndarray]:
    """The driver's output: [int32 name length][name][int32 n][n float32] records."""
    data, pos, out = path.read_bytes(), 0, {}
    while pos < len(data):
        (length,) = struct.unpack_from("<i", data, pos)
        name = data[pos + 4 : pos + 4 + length].decode()
        (n,) = struct.unpack_from("<i", data, pos + 4 + length)
        start = pos + 8 + length
        out[name] = np.frombuffer(data, np.float32, n, start).astype(np.float64)
        pos = start + 4 * n
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, tuple[list[str], dict[str, np.ndarray]]]:
    """Per build: (the ISA and group size it reports, its output records)."""
    _install_tools()
    if not _have_tools():
        pytest.skip(f"needs {CC} and {QEMU} (apt-get install {' '.join(APT_PACKAGES)})")
    folder = tmp_path_factory.mktemp("aarch64")
    result = {}
    for name, march in BUILDS.items():
        exe, out = folder / f"driver-{name}", folder / f"{name}.bin"
        cmd = [CC, "-O3", "-std=gnu11", "-static", "-fopenmp", f"-march={march}"]
        # a warning in any target fails the test (the driver leaves struct fields zero)
        cmd += ["-Wall", "-Wextra", "-Werror", "-Wno-missing-field-initializers"]
        build = subprocess.run(
            [*cmd, "-o", str(exe), str(DRIVER), *map(str, SOURCES), "-lm"],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert build.returncode == 0, build.stderr
        proc = subprocess.run(
            [QEMU, "-cpu", "max", str(exe), str(out)], capture_output=True, text=True, timeout=600
        )
        assert proc.returncode == 0, proc.stderr
        result[name] = (proc.stdout.split(), read_records(out))
    return result


def test_each_build_runs_its_own_code(runs):
    assert runs["scalar"][0] == ["scalar", "4"]
    assert runs["neon"][0] == ["neon", "4"]
    assert runs["neon+dotprod"][0] == ["neon+dotprod", "4"]


@pytest.mark.parametrize("simd", ["neon+dotprod", "neon"])
def test_neon_matches_scalar(runs, simd):
    got, ref = runs[simd][1], runs["scalar"][1]
    assert got.keys() == ref.keys() and len(ref) > 500
    for name, r in ref.items():
        g = got[name]
        scale = np.abs(r).max() or 1.0
        if name.startswith(("lanes", "rows")):  # dequantization: one rounding, or none
            tol = 1e-6 * scale
        elif name.startswith("stack"):  # 2 layers of norms, exp, quantized activations
            tol = 1e-3 * scale
        else:  # the same integer dots / float products, summed in another order
            tol = 1e-5 * scale
        err = np.abs(g - r).max()
        assert err <= tol, f"{simd} vs scalar, {name}: max error {err:.3g} > {tol:.3g}"
