"""`tokenmill serve`: load a model and serve the OpenAI API over HTTP with uvicorn.

Binds to loopback by default: the server runs arbitrary prompts on this machine's
CPU or GPU, so exposing it (--host 0.0.0.0) is a deliberate choice, best paired
with --api-key.
"""

from __future__ import annotations

import argparse
import logging
import os
from pathlib import Path

from tokenmill import hub

API_KEY_ENV = "TOKENMILL_API_KEY"
LOOPBACK = ("127.0.0.1", "localhost", "::1")


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text}")
    return value


def register(subparsers, add_model_args, add_sampling_args) -> None:
    p = subparsers.add_parser(
        "serve", help="serve the OpenAI API (completions, chat, streaming) over HTTP"
    )
    add_model_args(p)
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    p.add_argument("--port", type=int, default=8000, help="port to listen on")
    p.add_argument(
        "--api-key",
        default=None,
        help=f"require 'Authorization: Bearer KEY' on /v1 routes (default: ${API_KEY_ENV}, "
        "else none)",
    )
    p.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        metavar="NAME",
        help="the model names clients may send; the first is the one responses and "
        "/v1/models use (default: the model's known name, its aliases and its file name)",
    )
    p.add_argument(
        "--max-num-seqs", type=_positive_int, default=64, help="most sequences in one batch"
    )
    p.add_argument(
        "--max-num-batched-tokens",
        type=_positive_int,
        default=512,
        help="token budget of one engine step (longer prompts are prefilled in chunks)",
    )
    p.add_argument(
        "--max-waiting",
        type=_positive_int,
        default=256,
        help="most sequences waiting for a batch slot; beyond it requests get 429 at once",
    )
    p.add_argument(
        "--log-level",
        default="info",
        choices=["critical", "error", "warning", "info", "debug"],
        help="server log verbosity",
    )
    p.set_defaults(func=cmd_serve)


def served_model_names(args: argparse.Namespace, path: Path) -> list[str]:
    """The names the server answers to, the one it reports first."""
    return list(args.served_model_name or hub.names_for(args.model, path))


def cmd_serve(args: argparse.Namespace) -> None:
    import uvicorn

    from tokenmill.cli import load_llm
    from tokenmill.server.app import create_app
    from tokenmill.server.async_engine import AsyncEngine

    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    log = logging.getLogger("tokenmill.server")
    api_key = args.api_key or os.environ.get(API_KEY_ENV) or None
    if api_key is None and args.host not in LOOPBACK:
        log.warning(
            "serving on %s without an API key: anyone who can reach it can use it", args.host
        )
    llm = load_llm(
        args, max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens
    )
    engine = AsyncEngine(llm.engine, max_waiting=args.max_waiting)
    name, *aliases = served_model_names(args, llm.engine.path)
    app = create_app(engine, model_name=name, api_key=api_key, aliases=aliases)
    log.info("serving %s at http://%s:%d/v1", name, args.host, args.port)
    uvicorn.run(
        app,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        timeout_graceful_shutdown=5,
    )
