"""`tokenmill generate PROMPT`: stream one answer to stdout, then a speed line on stderr.

`stream_answer` and `speed_line` serve `tokenmill chat` too (cli/chat.py), once per turn.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from tokenmill.cli.common import (
    _params,
    add_precision_args,
    add_speculative_args,
    load_llm,
    stderr_console,
)


def register(subparsers, add_model_args, add_sampling_args) -> None:
    g = subparsers.add_parser(
        "generate",
        help="stream a continuation of PROMPT (or, with --chat, the model's answer to it)",
        description="Stream a continuation of PROMPT, then print time to first token and "
        "speeds on stderr.",
    )
    g.add_argument(
        "prompt",
        metavar="PROMPT",
        help="the text to continue (with --chat: the question to answer)",
    )
    g.add_argument(
        "--chat",
        action="store_true",
        help="send PROMPT as a user message through the model's chat template, the way an "
        "instruct model was trained to be used (tokenmill chat does this every turn)",
    )
    add_model_args(g)
    add_precision_args(g)
    add_speculative_args(g)
    add_sampling_args(g, max_tokens=128)
    g.set_defaults(func=cmd_generate)


def speed_line(out) -> str:
    from tokenmill.units import format_rate

    t = out.timings
    return (
        f"time to first token {t.time_to_first_token * 1000:.0f} ms | "
        f"prefill {t.prefill_tokens} tok at {format_rate(t.prefill_tokens_per_s)} tok/s | "
        f"decode {t.output_tokens} tok at {format_rate(t.decode_tokens_per_s)} tok/s | "
        f"finish: {out.finish_reason}"
    )


def stream_answer(llm, prompt, params, console=None, thinking=None) -> tuple[str, Any]:
    """Stream one completion to stdout; returns its text and a Completion with timings.
    thinking(text): called with each piece of a reasoning model's thinking (params with
    reasoning set: tokenmill chat shows it dimmed), before the answer's text.

    On a terminal a spinner runs on stderr until the first text arrives, so the wait for
    the prefill does not look like a hang (ollama does the same)."""
    from contextlib import closing

    from tokenmill.llm import Completion, _timings

    console = console or stderr_console()
    spinner = console.status("[dim]thinking…", spinner="dots") if console.is_terminal else None
    pieces: list[str] = []
    last = None
    thought = False
    if spinner is not None:
        spinner.start()
    try:
        # closing(): an interrupted answer aborts its request and frees its KV blocks at once
        with closing(llm.stream_outputs(prompt, params)) as outputs:
            for out in outputs:
                if out.reasoning and thinking is not None:
                    if spinner is not None:
                        spinner.stop()
                        spinner = None
                    thinking(out.reasoning)
                    thought = True
                if out.text:
                    if thought and not pieces:  # the answer starts on a line of its own
                        console.print("")
                    if spinner is not None:
                        spinner.stop()
                        spinner = None
                    sys.stdout.write(out.text)
                    sys.stdout.flush()
                    pieces.append(out.text)
                last = out
    finally:
        if spinner is not None:
            spinner.stop()
    text = "".join(pieces)
    timings = _timings(last, last.num_prompt_tokens - last.num_cached_tokens)
    return text, Completion(text, [], last.finish_reason, None, timings)


def cmd_generate(args: argparse.Namespace) -> None:
    params = _params(args)
    llm = load_llm(args)
    prompt = (
        llm.chat_prompt([{"role": "user", "content": args.prompt}]) if args.chat else args.prompt
    )
    console = stderr_console()
    _, done = stream_answer(llm, prompt, params, console)
    sys.stdout.write("\n")
    sys.stdout.flush()
    console.print(speed_line(done), style="dim", highlight=False, soft_wrap=True)
