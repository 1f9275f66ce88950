"""Range checks for numbers that come from outside: request parameters, checkpoint
configs, file metadata. One-line messages that name the field and its allowed range.

Torch-free: the CLI and the sampling parameters use these before the engine loads.
"""

from __future__ import annotations

import math
import struct
from typing import Any


class ArgumentError(ValueError):
    """A command-line argument that cannot work here, found before the model loads. The
    CLI prints it the way argparse prints its own errors: one line naming the option,
    exit status 2. (Here, not in tokenmill.cli: `python -m tokenmill.cli` runs that module
    as __main__, and the commands' modules import it again as tokenmill.cli, which would
    make a second class that main() does not catch.)"""

    def __init__(self, option: str, problem: str) -> None:
        super().__init__(f"argument {option}: {problem}")
        self.option, self.problem = option, problem


def short_repr(value: Any) -> str:
    """A value for an error message: its repr, cut short (a hostile file can hold a
    megabyte-long string where a number belongs)."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _unwrap(value: Any) -> Any:
    """numpy scalars (GGUF metadata) as Python numbers."""
    if hasattr(value, "dtype") and getattr(value, "shape", None) == ():
        return value.item()
    return value


def check_int(
    name: str, value: Any, lo: int, hi: int | None = None, *, error: type = ValueError
) -> int:
    """`value` if it is an integer in [lo, hi] (bools and floats are not); else `error`
    naming `name`."""
    value = _unwrap(value)
    allowed = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
    if not isinstance(value, int) or isinstance(value, bool):
        raise error(f"{name} must be an integer {allowed}, got {short_repr(value)}")
    if value < lo or (hi is not None and value > hi):
        raise error(f"{name} must be {allowed}, got {value}")
    return value


def check_float(
    name: str,
    value: Any,
    lo: float,
    hi: float | None = None,
    *,
    lo_open: bool = False,
    float32: bool = False,
    error: type = ValueError,
) -> float:
    """`value` as a float if it is a finite number in [lo, hi] ((lo, hi] if lo_open);
    else `error` naming `name`. float32: checked as the float32 it becomes where it is
    used (1e-46 is 0 there, 1e39 is inf), and returned as that float32."""
    value = _unwrap(value)
    if hi is None:
        allowed = f"> {lo}" if lo_open else f">= {lo}"
    else:
        allowed = f"in ({lo}, {hi}]" if lo_open else f"in [{lo}, {hi}]"
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise error(f"{name} must be a number {allowed}, got {short_repr(value)}")
    value = float(value)
    if float32 and math.isfinite(value):
        try:
            value = struct.unpack("f", struct.pack("f", value))[0]
        except OverflowError:
            raise error(f"{name} must be {allowed} (as a float32), got {value}") from None
    above_lo = value > lo if lo_open else value >= lo
    # `not` on the comparisons also rejects NaN; the isfinite check rejects +inf.
    if not math.isfinite(value) or not above_lo or (hi is not None and not value <= hi):
        raise error(f"{name} must be {allowed}, got {value}")
    return value
