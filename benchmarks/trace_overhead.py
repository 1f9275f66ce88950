"""What tracing costs: decode tokens/s of one request, three ways.

    stripped    the engine with every trace hook call site removed (the baseline)
    hooks off   the code as it is: hook call sites present, no request traced
    traced      the request traced with a tokenmill.inspect.trace.Trace (what the inspector pays)

"hooks off" vs "stripped" answers whether the hooks cost anything when nobody
traces. The stripped engine is built at run time from the current source: the
methods holding hook call sites are recompiled with every `if <x>.trace is not None`
block (and the engine's list of traced chunks) dropped, so the comparison follows
the code as it changes. Variants run interleaved, round after round, and each
reports the median of its runs, so drifting machine load hits all three alike.

    .venv/bin/python benchmarks/trace_overhead.py [--runs 7] [--tokens 64] [--model PATH]
"""

from __future__ import annotations
import __future__

import argparse
import ast
import contextlib
import inspect
import statistics
import sys
import textwrap
from collections.abc import Callable, Iterator

from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.engine.model_runner import ModelRunner
from tokenmill.inspect.trace import Trace
from tokenmill.layers.attention import Attention
from tokenmill.models.transformer import Block, Transformer
from tokenmill.sampling import SamplingParams

HOOKED_METHODS = [
    (Attention, "forward"),
    (Block, "forward"),
    (Transformer, "forward"),
    (ModelRunner, "run"),
    (LLMEngine, "step"),
]
PROMPT = "The history of the printing press begins"


def _is_trace_check(node: ast.expr) -> bool:
    """`<x>.trace is not None`, or an `and` chain that starts with one."""
    if isinstance(node, ast.BoolOp) and isinstance(node.op, ast.And):
        return _is_trace_check(node.values[0])
    return (
        isinstance(node, ast.Compare)
        and isinstance(node.left, ast.Attribute)
        and node.left.attr == "trace"
        and isinstance(node.ops[0], ast.IsNot)
        and isinstance(node.comparators[0], ast.Constant)
        and node.comparators[0].value is None
    )


def _names(node: ast.AST) -> set[str]:
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}


class _StripHooks(ast.NodeTransformer):
    """Drop `if <x>.trace is not None:` blocks and statements about the `traced` list."""

    def visit_If(self, node: ast.If) -> ast.AST | None:
        if _is_trace_check(node.test):
            if node.orelse:
                raise ValueError("a trace check with an else branch: cannot strip it safely")
            return None
        return self.generic_visit(node)

    def visit_Assign(self, node: ast.Assign) -> ast.AST | None:
        return None if any("traced" in _names(t) for t in node.targets) else node

    def visit_For(self, node: ast.For) -> ast.AST | None:
        return None if "traced" in _names(node.iter) else self.generic_visit(node)


def stripped(cls: type, name: str) -> Callable:
    """`cls.name` recompiled from its source without its trace hook call sites."""
    fn = getattr(cls, name)
    if "__class__" in fn.__code__.co_freevars:
        raise ValueError(f"{cls.__name__}.{name} uses super(); recompiling it would break that")
    tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    before = ast.dump(tree)
    tree = ast.fix_missing_locations(_StripHooks().visit(tree))
    if ast.dump(tree) == before:
        raise ValueError(f"{cls.__name__}.{name} has no trace hook to strip")
    module = sys.modules[fn.__module__]
    namespace: dict = {}
    flags = __future__.annotations.compiler_flag
    code = compile(tree, inspect.getsourcefile(fn), "exec", flags=flags, dont_inherit=True)
    exec(code, vars(module).copy() | {"__name__": module.__name__}, namespace)
    return namespace[name]


@contextlib.contextmanager
def hooks_stripped() -> Iterator[None]:
    originals = [(cls, name, getattr(cls, name)) for cls, name in HOOKED_METHODS]
    replacements = [stripped(cls, name) for cls, name in HOOKED_METHODS]
    try:
        for (cls, name, _), fn in zip(originals, replacements, strict=True):
            setattr(cls, name, fn)
        yield
    finally:
        for cls, name, fn in originals:
            setattr(cls, name, fn)


def decode_tokens_per_s(engine: LLMEngine, tokens: int, trace: Trace | None) -> float:
    """Generate `tokens` tokens greedily for one request; its decode speed."""
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    engine.add_request("bench", PROMPT, params, trace=trace)
    seq = engine.requests["bench"].seq
    while engine.has_unfinished():
        engine.step()
    return (len(seq.output_ids) - 1) / (seq.finish_time - seq.first_token_time)


def run_variant(engine: LLMEngine, variant: str, tokens: int) -> float:
    if variant == "stripped":
        with hooks_stripped():
            return decode_tokens_per_s(engine, tokens, None)
    return decode_tokens_per_s(engine, tokens, Trace() if variant == "traced" else None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct")
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()

    engine = LLMEngine(args.model, threads=args.threads, enable_prefix_caching=False)
    print(engine.describe())
    variants = ["stripped", "hooks off", "traced"]
    for variant in variants:  # warm-up, and a check that every variant runs
        run_variant(engine, variant, 8)
    results: dict[str, list[float]] = {v: [] for v in variants}
    for i in range(args.runs):
        for variant in variants:
            results[variant].append(run_variant(engine, variant, args.tokens))
        print(
            f"round {i + 1}/{args.runs}: "
            + "  ".join(f"{v} {results[v][-1]:.1f}" for v in variants)
        )

    print(f"\ndecode tok/s, median of {args.runs} runs of {args.tokens} tokens:")
    for variant in variants:
        values = results[variant]
        # Paired by round: each run against the stripped run just before it, same machine load.
        ratios = [v / b for v, b in zip(values, results["stripped"], strict=True)]
        print(
            f"  {variant:<10} {statistics.median(values):7.2f} tok/s  "
            f"(runs {min(values):.1f}..{max(values):.1f}; vs stripped in the same round: "
            f"median {(statistics.median(ratios) - 1) * 100:+5.1f}%)"
        )


if __name__ == "__main__":
    main()
