"""`tokenmill info` (alias `tokenmill doctor`): the facts a bug report or a speed question needs.

vLLM's `collect_env` and `ollama --version` play this role: which tokenmill, Python and
torch; how many threads; which CPU and which instruction set the native kernels run on
(that decides whether decode is fast); where models are cached and which known models
are already there. One command, plain `key: value` lines to paste into an issue.

When the native kernels are unavailable (and TOKENMILL_KERNELS=0 did not turn them off on
purpose), the first line says so, why, what it costs and what to do, with the compiler's
first error lines under it, and the command exits with KERNELS_UNAVAILABLE: a script or CI
step that runs `tokenmill info` sees a slow host as a failure, not as a listing.
"""

from __future__ import annotations

import argparse
import functools
import math
import os
import platform
import sys
from pathlib import Path

# CPU features that change which kernel code path runs, as /proc/cpuinfo spells them.
CPU_FEATURES = (
    "avx2",
    "fma",
    "avx_vnni",
    "avx512f",
    "avx512_vnni",
    "avx512_bf16",
    "amx_tile",
    "amx_int8",
)
# The environment variables that change what runs, printed with their values when set: every
# TOKENMILL_* the package reads (tests/test_info.py fails on one missing here), then others'.
ENV_VARS = (
    "TOKENMILL_CACHE",  # cache.py: where models and built kernels live
    "TOKENMILL_KERNELS",  # kernels/: 0 turns the native kernels off
    "TOKENMILL_MARCH",  # kernels/build.py: the -march the kernels are compiled for
    "TOKENMILL_REQUIRE_NATIVE",  # kernels/build.py: a failed kernel build raises
    "TOKENMILL_ADAPTIVE_THREADS",  # 0: every region and step on the threads asked for
    "TOKENMILL_PREFETCH",  # kernels/linear.c: bytes of weights the GEMV prefetches ahead
    "TOKENMILL_AMX",  # kernels/simd_amx.h: 0 keeps the GEMM off the AMX tiles
    "TOKENMILL_GRID_FILE_BITS",  # layers/quant_linear.py: 1 holds IQ3_S/IQ3_XXS at their bits
    "TOKENMILL_FUSED_DECODE",  # models/paths.py: 0 turns the native decode paths off
    "TOKENMILL_DIST_TIMEOUT",  # distributed/runtime.py: seconds a collective may wait
    "CC",
    "OMP_NUM_THREADS",
    "CUDA_VISIBLE_DEVICES",
)
# Read too, but a secret: a report says whether it is set, never its value.
SECRET_ENV_VARS = ("TOKENMILL_API_KEY",)  # server/cli.py: the keys `serve` accepts
KERNELS_UNAVAILABLE = 3  # exit status; the CLI uses 1 for errors, 2 for bad arguments


def register(subparsers, add_model_args, add_sampling_args) -> None:
    p = subparsers.add_parser(
        "info",
        aliases=["doctor"],
        help="print versions, threads, kernel instruction set, cache folder and known models",
        description="Print what tokenmill runs on: versions, threads, CPU and kernel "
        "instruction set, cache folder and known models. Paste it into bug reports.",
    )
    p.set_defaults(func=cmd_info)


@functools.cache  # one build attempt per process, even where a failure raises
def kernel_problem() -> str | None:
    """Why the native kernels are unavailable (first line: what failed, the cost, what to
    do; then compiler lines), or None when they loaded or TOKENMILL_KERNELS=0 turned them
    off. Compiles them on first use, and prints nothing itself."""
    from tokenmill import kernels
    from tokenmill.kernels.build import BuildError, describe_failure

    try:
        return kernels.unavailable()
    except (BuildError, OSError) as e:  # TOKENMILL_REQUIRE_NATIVE=1: report it, don't crash
        return describe_failure(e)


def kernel_instruction_set() -> str:
    """The instruction set the native kernels run on this machine, as tokenmill.kernels
    reports it (compiling them on first use), with what "none" means."""
    from tokenmill import kernels

    if kernel_problem() is not None:
        return "none: native kernels unavailable (see the first line), pure-torch path (slow)"
    isa = kernels.isa()
    if isa == "none":  # TOKENMILL_KERNELS=0
        return "none: turned off by TOKENMILL_KERNELS=0, pure-torch path (slow)"
    if "amx_int8" in cpu_model_and_flags()[1] and "+amx" not in isa:
        return f"{isa} (the CPU's AMX tiles unused: {amx_unused_reason()})"
    return isa


def amx_unused_reason() -> str:
    """Why a build on an AMX-INT8 CPU leaves the GEMM on VNNI (kernels/simd_amx.h)."""
    if os.environ.get("TOKENMILL_AMX", "").strip() == "0":
        return "TOKENMILL_AMX=0"
    if os.environ.get("TOKENMILL_MARCH", "").strip() not in ("", "native"):
        return "TOKENMILL_MARCH's target has no AMX"
    return "the Linux kernel did not grant the tile state (arch_prctl), so the GEMM runs on VNNI"


def cpu_model_and_flags() -> tuple[str, set[str]]:
    """The model name and feature flags of the first processor in /proc/cpuinfo (the
    platform's processor name and no flags where it does not exist)."""
    model, flags = platform.processor() or platform.machine(), set()
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        text = ""
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "model name" and value.strip():
            model = value.strip()
        elif key.strip() == "flags":
            flags = set(value.split())
            break  # the first processor's entry is enough
    return model, flags


def cpu_description() -> str:
    """Model name and the kernel-relevant feature flags, from /proc/cpuinfo where it exists."""
    model, flags = cpu_model_and_flags()
    have = [f for f in CPU_FEATURES if f in flags]
    cores = os.cpu_count() or 0
    return f"{model}, {cores} logical cores" + (f"; {' '.join(have)}" if have else "")


def gguf_type_forms() -> str:
    """Each GGUF type's bits per weight in memory on this build against the file's (the grid
    i-quants held wider: IQ3_S and IQ3_XXS as 4-bit table codes unless
    TOKENMILL_GRID_FILE_BITS=1, those of at most 8 points as 3-bit ones), and where rows of
    another length are held otherwise: "Q4_K 4.62 (4.50), ..., IQ3_S 4.31 (3.44), ...".
    Measured on layers packed from zero blocks (QuantLinear.held_bits)."""
    from gguf.constants import GGML_QUANT_SIZES

    from tokenmill import kernels
    from tokenmill.layers.quant_linear import QUANT_GGUF_TYPES, QuantLinear

    group = 32 * kernels.group_blocks()  # values per lane-order group
    whole = 256 * group // math.gcd(256, group)  # rows of whole groups and of 256-value blocks
    other = whole + 256 if (whole + 256) % group else None  # 256-multiple rows that are not
    parts = []
    for qtype in sorted(QUANT_GGUF_TYPES, key=lambda t: t.name):
        block, size = GGML_QUANT_SIZES[qtype]
        held = QuantLinear.held_bits(qtype, whole)
        note = f"{held:.2f} ({8 * size / block:.2f}"
        if other is not None:
            elsewhere = QuantLinear.held_bits(qtype, other)
            if abs(elsewhere - held) > 0.01:
                note += f"; {elsewhere:.2f} on rows not a multiple of {group} values"
        parts.append(f"{qtype.name} {note})")
    return "bits per weight held (file): " + ", ".join(parts)


def _size(path: Path) -> str:
    from tokenmill.units import format_bytes

    return format_bytes(path.stat().st_size)


def facts() -> list[tuple[str, str]]:
    """(label, value) rows, in the order they are printed."""
    import torch

    import tokenmill
    from tokenmill import hub

    cuda = torch.version.cuda
    rows = [
        ("tokenmill", f"{tokenmill.__version__} ({Path(tokenmill.__file__).parent})"),
        ("python", f"{platform.python_version()} ({sys.executable})"),
        ("platform", platform.platform()),
        ("cpu", cpu_description()),
        ("torch", f"{torch.__version__} ({f'CUDA {cuda}' if cuda else 'CPU build'})"),
        ("threads", f"{torch.get_num_threads()} (torch intra-op; --threads N changes it)"),
        ("kernels", kernel_instruction_set()),
    ]
    if cuda:
        gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none visible"
        rows.append(("gpu", gpu))
    if kernel_problem() is None:
        rows.append(("gguf types", gguf_type_forms()))
    cache = hub.cache_dir()
    rows.append(("cache", str(cache)))
    for model in hub.KNOWN_MODELS.values():
        path = cache / model.filename
        state = (
            f"cached, {_size(path)}"
            if path.exists()
            else f"not fetched yet (first use fetches it, or: python -m tokenmill.hub {model.name})"
        )
        default = " (default)" if model.name == hub.DEFAULT_MODEL else ""
        aliases = f"; also: {', '.join(model.aliases)}" if model.aliases else ""
        rows.append(("model", f"{model.name}{default}: {model.filename}, {state}{aliases}"))
    for var in ENV_VARS:
        if var in os.environ:
            rows.append(("env", f"{var}={os.environ[var]}"))
    for var in SECRET_ENV_VARS:
        if var in os.environ:
            rows.append(("env", f"{var} is set (not shown)"))
    return rows


def cmd_info(args: argparse.Namespace) -> int:
    """Prints the facts; returns the exit status: KERNELS_UNAVAILABLE when the native
    kernels could not be built or loaded, else 0."""
    problem = kernel_problem()
    if problem is not None:  # first, where it is seen, and in what a report pastes
        print(f"tokenmill: {problem}")
    rows = facts()
    width = max(len(label) for label, _ in rows)
    for label, value in rows:
        print(f"{label.ljust(width)}  {value}")
    return KERNELS_UNAVAILABLE if problem is not None else 0
