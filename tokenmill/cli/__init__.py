"""The `tokenmill` command: generate, chat, serve, inspect, bench, pull, list, rm, info.

This package is the command line, the top layer (pyproject.toml's [tool.importlinter]):
    __init__.py   the parser and the dispatch (`main`, the `tokenmill` entry point)
    __main__.py   `python -m tokenmill.cli` (torchrun runs it so)
    common.py     the options every command shares, the checks before loading, load_llm
    generate.py   `generate`, and the streaming that `chat` shares
    chat.py       `chat`'s conversation loop
    inspect.py    `inspect`'s options and run (the view it prints is tokenmill/inspect/)
    models.py     `pull`, `list`, `rm`: models by name in the Hugging Face cache
    info.py       `info` (alias `doctor`): what a bug report needs
`serve` and `bench` register from tokenmill/server/cli.py and tokenmill/bench/.

Startup is kept light on purpose. Building the parsers imports no torch, and before the
engine is imported every command has its arguments parsed and checked (sampling values
by SamplingParams itself), its model resolved to a path and that file's header read
(`common.prepare_model`). So `--help`, a bad value, a missing file or a file or folder
that is not a model (no GGUF magic, no config.json) answer in a fraction of a second instead
of after the seconds torch takes.

What only the model or the machine can decide is checked next, still before the weights
load (`common.check_before_loading`): --device against what this torch build can run on,
the server's address (bound now, the listening socket handed to uvicorn later), and against
the file's config and tokenizer: layer and head indices, the parallel plan, the KV pool's
size, the prompt's length, and the structured-output constraint, compiled by the same
grammar compiler the engine uses.

Errors are one line on stderr and a non-zero exit status: argparse's own errors, and
ours about one argument (`ArgumentError`), say which option is wrong and point at --help
instead of printing the whole usage block (exit status 2); other errors (a model that
cannot load, a file that cannot be written) are `tokenmill: error: ...` (exit status 1).
"""

from __future__ import annotations

import argparse
import os
import sys

import tokenmill
from tokenmill.checks import ArgumentError, ParamError
from tokenmill.cli.common import (
    Parser,
    _add_model_args,
    _add_sampling_args,
    _params,
    check_before_loading,
    load_llm,
    positive_int,
)

# main and build_parser are the package's own; the rest are common.py's, re-exported so that
# `tokenmill.cli` keeps the names it had as one module (tests load a model the CLI's way)
__all__ = ["build_parser", "check_before_loading", "load_llm", "main", "positive_int"]


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="tokenmill",
        description="An LLM inference engine that shows its work. "
        "Run `tokenmill COMMAND --help` for a command's options.",
    )
    parser.add_argument("--version", action="version", version=f"tokenmill {tokenmill.__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    for module in (
        "tokenmill.cli.generate",
        "tokenmill.cli.chat",
        *_OPTIONAL_COMMANDS,
        "tokenmill.cli.models",
        "tokenmill.cli.info",
    ):
        register = _registrar(module)
        if register is not None:
            register(sub, _add_model_args, _add_sampling_args)
    return parser


# Commands defined next to the code they drive; a build without one just lacks it.
_OPTIONAL_COMMANDS = ("tokenmill.server.cli", "tokenmill.cli.inspect", "tokenmill.bench")


def _registrar(module: str):
    try:
        mod = __import__(module, fromlist=["register"])
    except ModuleNotFoundError as e:
        if e.name != module or module not in _OPTIONAL_COMMANDS:
            raise
        return None
    return mod.register


def _check_sampling_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Check the sampling values with SamplingParams (the one place that knows the allowed
    ranges) before any model work; its ParamError names the field, this names the option."""
    try:
        _params(args)
    except ParamError as e:  # e.param names the field; its option is --field-name
        option = None if e.param is None else "--" + e.param.replace("_", "-")
        if e.problem and option in _option_strings(parser, args.command):
            message = f"argument {option}: {e.problem}"
        else:
            message = str(e)
        _usage_error(parser, args, message)


def _usage_error(parser: argparse.ArgumentParser, args: argparse.Namespace, message: str):
    """Exit as argparse does for a bad argument: one line, status 2, pointing at --help."""
    prog = f"{parser.prog} {args.command}"
    parser.exit(2, f"{prog}: error: {message} (see {prog} --help)\n")


def _option_strings(parser: argparse.ArgumentParser, command: str) -> set[str]:
    for action in parser._subparsers._group_actions:  # argparse keeps subparsers here
        if command in action.choices:
            return set(action.choices[command]._option_string_actions)
    return set()


def main(argv: list[str] | None = None) -> None:
    # Under torchrun every rank runs this command; ranks above 0 only run their part of
    # the model for rank 0's engine (tokenmill/distributed/runtime.py).
    if os.environ.get("RANK", "0") != "0" and "WORLD_SIZE" in os.environ:
        from tokenmill.distributed.runtime import worker_main

        worker_main(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), None)
        return
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:  # bare `tokenmill`: show what there is to run
        parser.print_help()
        return
    from tokenmill.hub import FetchError
    from tokenmill.loader import LoadError

    if hasattr(args, "max_tokens"):
        _check_sampling_args(parser, args)
    try:
        check_before_loading(args)
        # None, or an exit status (`info`: non-zero when the native kernels are unavailable)
        status = args.func(args)
    except KeyboardInterrupt:
        sys.exit(130)
    except BrokenPipeError:
        sys.exit(0)
    except ArgumentError as e:
        _usage_error(parser, args, str(e))
    # One line, no traceback, for every error a user can cause. These classes are all
    # torch-free to import; RequestError and ChatTemplateError are ValueErrors.
    except (LoadError, FetchError, ValueError, OSError) as e:
        print(f"tokenmill: error: {e}", file=sys.stderr)
        sys.exit(1)
    if status:
        sys.exit(status)
