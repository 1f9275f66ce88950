"""Range checks for numbers that come from outside: request parameters, checkpoint
configs, file metadata. One-line messages that name the field and its allowed range;
a request parameter's error is a ParamError, which carries that name as an attribute.

Torch-free: the CLI and the sampling parameters use these before the engine loads.
"""

from __future__ import annotations

import argparse
import math
import struct
from collections.abc import Mapping
from typing import Any


class ParamError(ValueError):
    """A value that cannot work, carrying the name of the parameter it is about, so that
    the HTTP API (its `param` field) and the CLI (its option) name it without reading
    the message. `param` is None for an error about no one parameter.

        ParamError("prompt is empty", param="prompt")       # a message and its parameter
        ParamError.named("top_k", " must be >= 1, got 0")   # "top_k must be >= 1, got 0"

    A named error keeps the parameter names its message quotes apart from the text
    between them (`parts`: name, text, name, text...), so that a caller that spells them
    differently respells each one (`renamed`): the HTTP API's `top_logprobs` is
    SamplingParams' `logprobs`, its `guided_regex` is `regex`."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param
        self.parts: tuple[str, ...] = ("", message)  # no name to respell

    @classmethod
    def named(cls, *parts: str, param: str | None = None) -> ParamError:
        """The error whose message is "".join(parts), parts alternating a parameter name
        and the text after it; param: parts[0] unless given (None when parts[0] is "")."""
        error = cls("".join(parts), param=param if param is not None else parts[0] or None)
        error.parts = parts
        return error

    @property
    def problem(self) -> str | None:
        """The message after the parameter name it starts with ("must be >= 1, got 0"), for
        a caller that names the parameter its own way; None if it starts with none."""
        if self.param is None or self.parts[0] != self.param:
            return None
        return "".join(self.parts[1:]).strip() or None

    def renamed(self, names: Mapping[str, str]) -> ParamError:
        """This error with each parameter name in `names` respelled, `param` included."""
        parts = tuple(names.get(p, p) if i % 2 == 0 else p for i, p in enumerate(self.parts))
        param = None if self.param is None else names.get(self.param, self.param)
        error = type(self).named(*parts, param=param)
        error.param = param
        return error


class ArgumentError(ValueError):
    """A command-line argument that cannot work here, found before the model loads. The
    CLI prints it the way argparse prints its own errors: one line naming the option,
    exit status 2. (Here, below the top layer: `tokenmill serve`'s and `tokenmill bench`'s
    checks raise it too, and cli, server and bench are independent siblings in the layers
    contract, so none of them may import it from another.)"""

    def __init__(self, option: str, problem: str) -> None:
        super().__init__(f"argument {option}: {problem}")
        self.option, self.problem = option, problem


def int_at_least(lo: int, what: str = "an integer"):
    """An argparse type: an int >= lo, or a one-line error naming what was expected
    (refused when the command line is parsed, before torch loads)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        if value < lo:
            raise argparse.ArgumentTypeError(f"must be {what} >= {lo}, got {value}")
        return value

    return parse


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


def _error(error: type, name: str, at: str, problem: str) -> Exception:
    """`error` saying "<name><at> <problem>"; a ParamError (or subclass) carries `name` as
    its parameter ("logit_bias" for "logit_bias[5] must be ...")."""
    if issubclass(error, ParamError):
        return error.named(name, f"{at} {problem}")
    return error(f"{name}{at} {problem}")


def check_int(
    name: str,
    value: Any,
    lo: int,
    hi: int | None = None,
    *,
    at: str = "",
    error: type = ParamError,
) -> int:
    """`value` if it is an integer in [lo, hi] (bools and floats are not); else `error`
    naming `name` (followed by `at`, e.g. "[5]": which item of it)."""
    value = _unwrap(value)
    allowed = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
    if not isinstance(value, int) or isinstance(value, bool):
        raise _error(error, name, at, f"must be an integer {allowed}, got {short_repr(value)}")
    if value < lo or (hi is not None and value > hi):
        raise _error(error, name, at, f"must be {allowed}, got {value}")
    return value


def check_float(
    name: str,
    value: Any,
    lo: float,
    hi: float | None = None,
    *,
    lo_open: bool = False,
    float32: bool = False,
    at: str = "",
    error: type = ParamError,
) -> float:
    """`value` as a float if it is a finite number in [lo, hi] ((lo, hi] if lo_open);
    else `error` naming `name` (and `at`, as check_int). float32: checked as the float32
    it becomes where it is used (1e-46 is 0 there, 1e39 is inf), and returned as that
    float32."""
    value = _unwrap(value)
    if hi is None:
        allowed = f"> {lo}" if lo_open else f">= {lo}"
    else:
        allowed = f"in ({lo}, {hi}]" if lo_open else f"in [{lo}, {hi}]"
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise _error(error, name, at, f"must be a number {allowed}, got {short_repr(value)}")
    value = float(value)
    if float32 and math.isfinite(value):
        try:
            value = struct.unpack("f", struct.pack("f", value))[0]
        except OverflowError:
            raise _error(
                error, name, at, f"must be {allowed} (as a float32), got {value}"
            ) from None
    above_lo = value > lo if lo_open else value >= lo
    # `not` on the comparisons also rejects NaN; the isfinite check rejects +inf.
    if not math.isfinite(value) or not above_lo or (hi is not None and not value <= hi):
        raise _error(error, name, at, f"must be {allowed}, got {value}")
    return value
