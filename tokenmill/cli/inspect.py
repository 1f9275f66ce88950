"""`tokenmill inspect PROMPT`: run a short generation and print every step of the pipeline.

The command part: its options, the check of --layer and --head against the model's config
before the weights load, and the run that feeds a `Trace` (inspect/trace.py) to the
terminal view (inspect/view.py), which prints each step as the engine finishes it.
"""

from __future__ import annotations

import argparse

from rich.console import Console
from rich.text import Text

from tokenmill.checks import ArgumentError, int_at_least
from tokenmill.cli.common import _params, add_speculative_args, load_llm
from tokenmill.inspect.view import DEFAULT_SEED, TerminalView


def register(subparsers, add_model_args, add_sampling_args) -> None:
    p = subparsers.add_parser(
        "inspect", help="run a short generation and print every step of the pipeline"
    )
    p.add_argument("prompt")
    add_model_args(p)
    add_sampling_args(p, max_tokens=4, seed=DEFAULT_SEED)
    p.add_argument(
        "--layer", type=int, default=None, help="layer whose attention to draw (default: middle)"
    )
    p.add_argument("--head", type=int, default=0, help="attention head to draw (default 0)")
    p.add_argument(
        "--top-n", type=int_at_least(1), default=8, help="candidate tokens shown per step"
    )
    p.add_argument("--chat", action="store_true", help="wrap PROMPT in the model's chat template")
    p.add_argument(
        "--json", default=None, metavar="PATH", help="also write the whole trace as JSON"
    )
    p.add_argument(
        "--width",
        type=int_at_least(40, "a number of columns"),
        default=None,
        metavar="N",
        help="output width in columns (default: $COLUMNS, else the terminal's, else 80); "
        "tables keep their rows whole even when wider",
    )
    add_speculative_args(p)  # verification steps show their guesses and what was accepted
    # a nucleus cut by default, so it shows; --layer and --head checked against the model's
    # config before its weights load
    p.set_defaults(func=cmd_inspect, top_p=0.9, check_model=check_view)


def attention_view(args: argparse.Namespace, cfg) -> tuple[int, int]:
    """(layer, head) of the attention map to draw, checked against the model's config.
    cfg: a ModelConfig (from the file's header: no weights needed)."""
    layer = cfg.num_layers // 2 if args.layer is None else args.layer
    if not 0 <= layer < cfg.num_layers:
        raise ArgumentError(
            "--layer",
            f"must be in [0, {cfg.num_layers - 1}] (the model has {cfg.num_layers} layers), "
            f"got {layer}",
        )
    if not 0 <= args.head < cfg.num_heads:
        raise ArgumentError(
            "--head",
            f"must be in [0, {cfg.num_heads - 1}] (the model has {cfg.num_heads} query heads), "
            f"got {args.head}",
        )
    return layer, args.head


def check_view(args: argparse.Namespace, facts) -> None:
    """The check before loading (cli/common.py: check_before_loading); facts: ModelFacts."""
    attention_view(args, facts.config)


def cmd_inspect(args: argparse.Namespace) -> None:
    from tokenmill.inspect.trace import Trace

    llm = load_llm(args)
    engine = llm.engine
    layer, head = attention_view(args, engine.config)
    prompt = (
        llm.chat_prompt([{"role": "user", "content": args.prompt}]) if args.chat else args.prompt
    )
    view = TerminalView(Console(highlight=False, width=args.width), seed=args.seed)
    trace = Trace(layers=[layer], heads=[head], top_n=args.top_n, on_step=view.show_step)
    engine.add_request("inspect", prompt, _params(args), trace=trace)
    try:
        while engine.has_unfinished():
            engine.step()
    finally:
        engine.abort("inspect")
    view.show_summary(trace)
    if args.json:
        trace.save_json(args.json)
        view.console.print(Text(f"trace written to {args.json}", style="dim"))
