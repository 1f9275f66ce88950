"""A Jinja sandbox with a budget: a chat template from a model file cannot hang or bloat us.

Jinja's SandboxedEnvironment stops a template reaching Python internals, but not from
spending: `{{ 'a' * 4000000000 }}` builds a 4 GB string, and two nested
`range(100000)` loops run 10^10 times. A chat template comes from the model file, so
a hostile file could otherwise hang every chat request. `LimitedSandbox` renders within
`RenderLimits`:

- steps: every loop iteration, call, filter and intercepted operator costs one; the wall
  clock is checked at each, so a render stops at `max_steps` or `max_seconds`, whichever
  comes first;
- sizes: no string or list a step builds, and not the rendered output, may exceed
  `max_chars`. Operations that multiply (`str * n`, `x ** n`, big-int products, `%` and
  `format` widths, `join`, `replace`, `indent`, serializing filters such as `tojson`) are
  checked *before* they run, from their operands' sizes; every other result is checked
  after. Buffers joined for macros and `{% set %}` blocks go through `concat`, checked
  the same way.

How the hooks attach: operators through Jinja's `intercepted_binops`/`call_binop`, calls
through the sandbox's `call`, filters by wrapping each entry of `filters`, loops and `~`
by a code generator that wraps each `for` iterable and each concatenation in a filter
(rewriting the template's syntax tree before it is compiled). The budget of the render
in progress lives in a context variable, so templates rendered in parallel threads each
have their own.

Exceeding a limit raises TemplateLimitError, a one-line message naming the limit.
"""

from __future__ import annotations

import contextvars
import functools
import re
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from jinja2 import nodes
from jinja2.compiler import CodeGenerator
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.visitor import NodeTransformer


class TemplateLimitError(ValueError):
    """A template render went over one of its RenderLimits."""


@dataclass(frozen=True)
class RenderLimits:
    # Real chat templates take tens of steps per message and render in milliseconds; a
    # hostile one hits a limit in well under a second.
    max_steps: int = 100_000  # loop iterations + calls + filters + intercepted operators
    max_seconds: float = 1.0
    max_chars: int = 1 << 22  # any one string or list built, and the whole output
    max_int_bits: int = 1 << 16  # big-int results (a 20k-digit number is plenty)


class _Budget:
    """One render's spending; `step()` at every hooked operation."""

    def __init__(self, limits: RenderLimits):
        self.limits = limits
        self.steps = 0
        self.deadline = time.monotonic() + limits.max_seconds

    def step(self) -> None:
        self.steps += 1
        if self.steps > self.limits.max_steps:
            raise TemplateLimitError(
                f"chat template exceeded its budget of {self.limits.max_steps} steps "
                "(loop iterations, calls, filters)"
            )
        if time.monotonic() > self.deadline:
            raise TemplateLimitError(
                f"chat template took longer than {self.limits.max_seconds:g} s to render"
            )

    def size(self, n: int, what: str) -> None:
        """Refuse a string, list or width of `n` characters or items."""
        if n > self.limits.max_chars:
            raise TemplateLimitError(
                f"chat template went over its size limit: {what} of {n} "
                f"(limit {self.limits.max_chars} characters or items)"
            )


_BUDGET: contextvars.ContextVar[_Budget | None] = contextvars.ContextVar("_BUDGET", default=None)


def _budget() -> _Budget:
    """The budget of the render in progress. Outside one (Jinja folds constant filters at
    compile time) each operation gets a fresh default budget: its size checks still hold."""
    return _BUDGET.get() or _Budget(RenderLimits())


def _deep_size(value: Any, limits: RenderLimits) -> int:
    """Characters and items `value` spans, counting each reference (a list holding one big
    string 1000 times spans 1000 of them). Stops once past max_chars, and answers "too
    big" (max_chars + 1) after visiting max_steps objects: the walk itself is bounded."""
    total, visited, stack = 0, 0, [value]
    while stack and total <= limits.max_chars:
        visited += 1
        if visited > limits.max_steps:
            return limits.max_chars + 1
        item = stack.pop()
        if isinstance(item, (str, bytes)):
            total += len(item)
        elif isinstance(item, dict):
            total += 1 + len(item)
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, (list, tuple, set, frozenset)):
            total += 1 + len(item)
            stack.extend(item)
        else:
            total += 1
    return total


def _result_size(value: Any) -> int:
    return len(value) if isinstance(value, (str, bytes, list, tuple, dict, set)) else 0


_SPEC_NUMBER = re.compile(r"\d+")
_PERCENT_SPEC = re.compile(r"%(?:\([^)]*\))?[#0\- +]*(\d+|\*)?(?:\.(\d+|\*))?")
_FORMAT_FIELD = re.compile(r"\{[^{}]*(?:\{[^{}]*\}[^{}]*)*\}")


def _check_ints(budget: _Budget, values: Iterable[Any]) -> None:
    """No integer argument may ask for more than max_chars (widths, counts, batch sizes)."""
    for value in values:
        if isinstance(value, int) and not isinstance(value, bool):
            budget.size(abs(value), "size argument")


def _check_format_string(budget: _Budget, fmt: str, percent: bool) -> None:
    """Widths and precisions written into a %- or {}-format string."""
    specs = _PERCENT_SPEC.findall(fmt) if percent else _FORMAT_FIELD.findall(fmt)
    for spec in specs:
        for number in _SPEC_NUMBER.findall("".join(spec) if percent else spec):
            budget.size(int(number), "format width")


class LimitedSandbox(ImmutableSandboxedEnvironment):
    """An immutable sandbox whose renders stay within RenderLimits (see the module doc).
    Render with `render(template, limits, **context)`, which enforces the output limit
    and returns the text."""

    intercepted_binops = frozenset({"*", "**", "%", "+"})

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.filters[_LOOP_FILTER] = _loop_items
        self.filters[_SIZE_FILTER] = _sized

    def finish_setup(self) -> None:
        """Wrap every filter registered so far with the budget checks; call once the
        caller has added its own filters."""
        for name, fn in list(self.filters.items()):
            if name not in (_LOOP_FILTER, _SIZE_FILTER) and not getattr(fn, "_limited", False):
                self.filters[name] = _limited_filter(name, fn)

    def render(self, template: Any, limits: RenderLimits, **context: Any) -> str:
        """`template` rendered with `context`, within `limits`."""
        budget = _Budget(limits)
        token = _BUDGET.set(budget)
        try:
            pieces, total = [], 0
            for piece in template.generate(**context):
                total += len(piece)
                budget.size(total, "output")
                pieces.append(piece)
            return "".join(pieces)
        finally:
            _BUDGET.reset(token)

    # ---- hooks called by compiled templates ----
    def concat(self, pieces: Iterable[str]) -> str:  # type: ignore[override]
        pieces = list(pieces)
        _budget().size(sum(len(p) for p in pieces), "block output")
        return "".join(pieces)

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        budget = _budget()
        budget.step()
        _check_binop(budget, operator, left, right)
        result = super().call_binop(context, operator, left, right)
        budget.size(_result_size(result), f"'{operator}' result")
        return result

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805
        budget = _budget()
        budget.step()
        _check_ints(budget, (*args, *kwargs.values()))
        _check_method_call(budget, __obj, args)
        result = super().call(__context, __obj, *args, **kwargs)
        budget.size(_result_size(result), "call result")
        return result


def _check_binop(budget: _Budget, op: str, left: Any, right: Any) -> None:
    """Refuse an operator whose result would be too big, before computing it."""
    ints = all(isinstance(v, int) for v in (left, right))
    if op == "*":
        for seq, n in ((left, right), (right, left)):
            if isinstance(seq, (str, list, tuple)) and isinstance(n, int):
                budget.size(len(seq) * max(n, 0), "repetition")
        if ints:
            _check_bits(budget, abs(left).bit_length() + abs(right).bit_length())
    elif op == "**" and ints and right > 0:
        _check_bits(budget, abs(left).bit_length() * right)
    elif op == "%" and isinstance(left, str):
        _check_format_string(budget, left, percent=True)
        _check_ints(budget, right if isinstance(right, tuple) else (right,))
    elif op == "+" and not ints:
        budget.size(_result_size(left) + _result_size(right), "concatenation")


def _check_bits(budget: _Budget, bits: int) -> None:
    if bits > budget.limits.max_int_bits:
        raise TemplateLimitError(
            f"chat template arithmetic would make a {bits}-bit number "
            f"(limit {budget.limits.max_int_bits})"
        )


def _check_method_call(budget: _Budget, obj: Any, args: tuple) -> None:
    """String methods whose result can dwarf their inputs, checked from the inputs."""
    method = getattr(obj, "__wrapped__", obj)  # the sandbox wraps str.format
    owner, name = getattr(method, "__self__", None), getattr(method, "__name__", "")
    if not isinstance(owner, str):
        return
    if name == "join" and args:
        budget.size(_deep_size(args[0], budget.limits), "join")
    elif name == "replace" and len(args) >= 2 and all(isinstance(a, str) for a in args[:2]):
        old, new = args[0], args[1]
        hits = owner.count(old) if old else len(owner) + 1
        budget.size(len(owner) + hits * max(len(new) - len(old), 0), "replace result")
    elif name in ("format", "format_map"):
        _check_format_string(budget, owner, percent=False)
    elif name == "expandtabs":
        width = args[0] if args and isinstance(args[0], int) else 8
        budget.size(len(owner) + owner.count("\t") * max(width, 0), "expandtabs result")


def _limited_filter(name: str, fn: Callable) -> Callable:
    """`fn` with a step, its inputs' sizes checked before and its result's after."""

    @functools.wraps(fn)  # keeps jinja_pass_arg (context / environment arguments)
    def limited(*args: Any, **kwargs: Any) -> Any:
        budget = _budget()
        budget.step()
        values = [a for a in (*args, *kwargs.values()) if isinstance(a, (str, list, tuple, dict))]
        budget.size(sum(_deep_size(v, budget.limits) for v in values), f"'{name}' filter input")
        _check_ints(budget, (*args[1:], *kwargs.values()))
        _check_filter(budget, name, args, kwargs)
        result = fn(*args, **kwargs)
        budget.size(_result_size(result), f"'{name}' filter result")
        return result

    limited._limited = True  # type: ignore[attr-defined]
    return limited


def _check_filter(budget: _Budget, name: str, args: tuple, kwargs: dict) -> None:
    """Filters whose output can be much bigger than their input."""
    text = next((a for a in args if isinstance(a, str)), None)
    if name == "indent" and text is not None:
        width = kwargs.get("width", args[1] if len(args) > 1 else 4)
        width = len(width) if isinstance(width, str) else abs(int(width))
        budget.size(len(text) + (text.count("\n") + 1) * width, "indent result")
    elif name == "replace" and len([a for a in args if isinstance(a, str)]) >= 3:
        s, old, new = [a for a in args if isinstance(a, str)][:3]
        hits = s.count(old) if old else len(s) + 1
        budget.size(len(s) + hits * max(len(new) - len(old), 0), "replace result")
    elif name == "format" and text is not None:
        _check_format_string(budget, text, percent=True)
    elif name == "sum":
        # adding sequences copies the running total each time: quadratic in the input
        items = next((a for a in args if isinstance(a, (list, tuple))), [])
        if any(isinstance(i, (str, list, tuple)) for i in items[:1]):
            total = _deep_size(items, budget.limits)
            budget.size(len(items) * total, "sum of sequences (copies)")


_LOOP_FILTER = "_limited_loop"
_SIZE_FILTER = "_limited_size"


def _loop_items(items: Any) -> Iterator[Any]:
    """A for loop's iterable, one step per item."""
    budget = _budget()
    for item in items:
        budget.step()
        yield item


def _sized(value: Any) -> Any:
    """A `~` concatenation's result, checked."""
    _budget().size(_result_size(value), "'~' result")
    return value


class _WrapLoopsAndConcats(NodeTransformer):
    def visit_For(self, node: nodes.For) -> nodes.Node:
        node = self.generic_visit(node)
        node.iter = nodes.Filter(node.iter, _LOOP_FILTER, [], [], None, None, lineno=node.lineno)
        return node

    def visit_Concat(self, node: nodes.Concat) -> nodes.Node:
        node = self.generic_visit(node)
        return nodes.Filter(node, _SIZE_FILTER, [], [], None, None, lineno=node.lineno)


class _BudgetedCodeGenerator(CodeGenerator):
    def visit_Template(self, node: nodes.Template, frame: Any = None) -> None:
        super().visit_Template(_WrapLoopsAndConcats().visit(node), frame)


LimitedSandbox.code_generator_class = _BudgetedCodeGenerator
