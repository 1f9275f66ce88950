"""`tokenmill info` names every environment variable the package reads (three once had
been left out of its list), so a bug report shows the settings that changed what ran."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import tokenmill
from tokenmill.cli import info

PACKAGE = Path(tokenmill.__file__).parent
NAME = re.compile(r"\bTOKENMILL_[A-Z0-9_]+\b")


def _names_in_the_package() -> dict[str, str]:
    """Every TOKENMILL_* named in the package's Python and C sources (read through
    os.environ, getenv or a constant such as API_KEY_ENV), but for info.py's own list:
    {name: the first file that names it}."""
    found: dict[str, str] = {}
    for path in sorted(PACKAGE.rglob("*")):
        if path.suffix not in (".py", ".c", ".h") or path == Path(info.__file__):
            continue
        for name in NAME.findall(path.read_text(encoding="utf-8")):
            found.setdefault(name, str(path.relative_to(PACKAGE)))
    return found


def test_every_tokenmill_variable_is_listed():
    listed = {v for v in (*info.ENV_VARS, *info.SECRET_ENV_VARS) if v.startswith("TOKENMILL_")}
    found = _names_in_the_package()
    missing = {name: where for name, where in found.items() if name not in listed}
    assert not missing, f"add to cli/info.py's ENV_VARS (or SECRET_ENV_VARS): {missing}"
    assert listed <= set(found), f"listed but read nowhere: {sorted(listed - set(found))}"
    # what was once found missing stays listed
    assert {"TOKENMILL_MARCH", "TOKENMILL_FUSED_DECODE", "TOKENMILL_DIST_TIMEOUT"} <= listed


def test_a_secret_is_said_to_be_set_but_not_shown(monkeypatch):
    monkeypatch.setenv("TOKENMILL_API_KEY", "sk-do-not-print")
    monkeypatch.setenv("TOKENMILL_DIST_TIMEOUT", "90")
    rows = [value for label, value in info.facts() if label == "env"]
    assert "TOKENMILL_DIST_TIMEOUT=90" in rows
    assert "TOKENMILL_API_KEY is set (not shown)" in rows
    assert not any("sk-do-not-print" in value for value in rows)


def test_gguf_types_say_their_bits_per_weight_held_and_in_the_file():
    """Every GGUF type a layer holds, with its bits per weight on this build against the
    file's; a type held wider than its own bits says so (never widen silently)."""
    from tokenmill import kernels

    if kernels.library() is None:
        pytest.skip("native kernels unavailable")
    line = info.gguf_type_forms()
    assert "Q4_0 4.50 (4.50)" in line and "Q8_0 8.50 (8.50)" in line
    assert "IQ3_S 4.31 (3.44)" in line and "TQ2_0 3.44 (2.06)" in line
    assert "IQ2_XS 3.44 (2.31)" in line and "IQ1_M 3.44 (1.75)" in line
    assert "Q2_K 2.62 (2.62" in line and "MXFP4 4.25 (4.25)" in line
    # every row of whole 256-value super-blocks holds them (AVX-512: 512-value groups, and
    # rows like 768 end in a half group)
    assert "Q6_K 6.56 (6.56)" in line and "Q3_K 3.44 (3.44)" in line and "Q5_K 5.62 (5.50)" in line


@pytest.mark.parametrize(
    "env, reason",
    [
        ({"TOKENMILL_AMX": "0"}, "TOKENMILL_AMX=0"),
        ({"TOKENMILL_MARCH": "x86-64-v4"}, "TOKENMILL_MARCH's target has no AMX"),
        ({}, "the Linux kernel did not grant the tile state"),
    ],
)
def test_an_amx_cpu_whose_gemm_stays_on_vnni_says_why(monkeypatch, env, reason):
    """On a CPU with AMX-INT8, kernels that leave the GEMM on VNNI say so and why in
    `tokenmill info`'s kernels line: no fast path falls back silently. (The CPU's flags
    and the loaded build are stood in for, so this runs on any host.)"""
    from tokenmill import kernels

    for name in ("TOKENMILL_AMX", "TOKENMILL_MARCH"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(info, "kernel_problem", lambda: None)
    monkeypatch.setattr(info, "cpu_model_and_flags", lambda: ("a Xeon", {"avx512f", "amx_int8"}))
    monkeypatch.setattr(kernels, "isa", lambda: "avx512+vnni")
    line = info.kernel_instruction_set()
    assert line.startswith("avx512+vnni (the CPU's AMX tiles unused: ") and reason in line
    monkeypatch.setattr(kernels, "isa", lambda: "avx512+vnni+amx")
    assert info.kernel_instruction_set() == "avx512+vnni+amx"
    monkeypatch.setattr(info, "cpu_model_and_flags", lambda: ("a Zen 4", {"avx512f"}))
    monkeypatch.setattr(kernels, "isa", lambda: "avx512+vnni")
    assert info.kernel_instruction_set() == "avx512+vnni"


def test_the_3_bit_i_quants_at_their_files_bits_say_so(monkeypatch):
    """TOKENMILL_GRID_FILE_BITS=1: IQ3_S and IQ3_XXS held as their file's bits."""
    from tokenmill import kernels
    from tokenmill.layers import quant_linear

    if kernels.library() is None:
        pytest.skip("native kernels unavailable")
    monkeypatch.setenv(quant_linear.GRID_FILE_BITS_ENV, "1")
    line = info.gguf_type_forms()
    assert "IQ3_S 3.44 (3.44)" in line and "IQ3_XXS 3.19 (3.06)" in line
