"""Quantities as people write and read them: memory sizes in, speeds and sizes out.

Torch-free on purpose: the CLI checks `--kv-cache-memory` with `parse_memory` before
the engine (and torch) is imported.
"""

from __future__ import annotations

import math

_MEMORY_UNITS = {  # longest suffixes first, so "mib" is not read as "b"
    "kib": 1 << 10,
    "mib": 1 << 20,
    "gib": 1 << 30,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "k": 1 << 10,
    "m": 1 << 20,
    "g": 1 << 30,
    "b": 1,
}


def parse_memory(value: int | str | None) -> int | None:
    """'2GiB', '512MB', '1e9', 1073741824 -> bytes; '8192tok' stays a token count (negative).

    Raises ValueError naming the accepted forms for anything else."""
    if value is None:
        return None
    if isinstance(value, int) and not isinstance(value, bool):
        if value < 1:  # negative is this function's own token-count encoding: not an input
            raise ValueError(f"kv_cache_memory must be a positive number of bytes, got {value}")
        return value
    text = value.strip().lower().replace(" ", "")
    number, scale = text, 1
    if text.endswith(("tok", "tokens")):
        number, scale = text.removesuffix("tokens").removesuffix("tok"), -1
    else:
        for suffix, mult in _MEMORY_UNITS.items():
            if text.endswith(suffix):
                number, scale = text[: -len(suffix)], mult
                break
    try:
        amount = float(number)
    except ValueError:
        amount = math.nan
    if not math.isfinite(amount) or amount <= 0:
        raise ValueError(
            f"kv_cache_memory must be a positive size like '512MiB', '2GB' or a token count "
            f"like '8192tok', got {value!r}"
        )
    return int(amount * scale)


def format_rate(per_second: float) -> str:
    """A speed with three significant digits and no exponent: 213, 12.3, 0.312, 0.00041.

    A fixed number of decimals turns a slow but real 0.3 tok/s into a misleading '0'."""
    if per_second <= 0 or not math.isfinite(per_second):
        return "0" if per_second == 0 else str(per_second)
    if per_second >= 1000:
        return f"{per_second:,.0f}"
    decimals = max(0, 2 - math.floor(math.log10(per_second)))
    return f"{per_second:.{decimals}f}"


def format_bytes(n: float) -> str:
    """1536 -> '1.5 KiB'; plain bytes below 1 KiB."""
    units = ["B", "KiB", "MiB", "GiB"]
    while n >= 1024 and len(units) > 1:
        n, units = n / 1024, units[1:]
    return f"{n:,.0f} B" if units[0] == "B" else f"{n:,.1f} {units[0]}"
