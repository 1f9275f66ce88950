"""`tokenmill info` (alias `tokenmill doctor`): the facts a bug report or a speed question needs.

vLLM's `collect_env` and `ollama --version` play this role: which tokenmill, Python and
torch; how many threads; which CPU and which instruction set the native kernels run on
(that decides whether decode is fast); where models are cached and which known models
are already there. One command, plain `key: value` lines to paste into an issue.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
from pathlib import Path

# CPU features that change which kernel code path runs, as /proc/cpuinfo spells them.
CPU_FEATURES = ("avx2", "fma", "avx_vnni", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile")
ENV_VARS = ("TOKENMILL_CACHE", "TOKENMILL_KERNELS", "OMP_NUM_THREADS", "CUDA_VISIBLE_DEVICES")


def register(subparsers, add_model_args, add_sampling_args) -> None:
    p = subparsers.add_parser(
        "info",
        aliases=["doctor"],
        help="print versions, threads, kernel instruction set, cache folder and known models",
        description="Print what tokenmill runs on: versions, threads, CPU and kernel "
        "instruction set, cache folder and known models. Paste it into bug reports.",
    )
    p.set_defaults(func=cmd_info)


def kernel_instruction_set() -> str:
    """The instruction set the native kernels run on this machine, as tokenmill.kernels
    reports it (compiling them on first use), with what "none" means."""
    from tokenmill import kernels

    isa = kernels.isa()
    if isa == "none":
        return "none: native kernels unavailable, pure-torch fallback (slow)"
    return isa


def cpu_description() -> str:
    """Model name and the kernel-relevant feature flags, from /proc/cpuinfo where it exists."""
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
    have = [f for f in CPU_FEATURES if f in flags]
    cores = os.cpu_count() or 0
    return f"{model}, {cores} logical cores" + (f"; {' '.join(have)}" if have else "")


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
    return rows


def cmd_info(args: argparse.Namespace) -> None:
    rows = facts()
    width = max(len(label) for label, _ in rows)
    for label, value in rows:
        print(f"{label.ljust(width)}  {value}")
