"""The `tokenmill` command: generate, chat, serve, inspect, bench.

Errors are one clear line on stderr and a non-zero exit status.
"""

from __future__ import annotations

import argparse
import sys

from tokenmill import hub


def _memory_size(text: str) -> str:
    """Check a --kv-cache-memory value when the command line is read, not after the model
    has loaded; the engine parses it again."""
    from tokenmill.engine.kv_cache import parse_memory

    try:
        parse_memory(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e).removeprefix("kv_cache_memory ")) from None
    return text


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model",
        default=None,
        help=f"checkpoint folder, .gguf file or known model name ({', '.join(hub.KNOWN_MODELS)}); "
        f"default {hub.DEFAULT_MODEL}",
    )
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--threads", type=int, default=None, help="CPU threads (default: all cores)")
    p.add_argument(
        "--quantization",
        default="auto",
        choices=["auto", "none", "gguf", "q8", "q4"],
        help="auto: keep a GGUF file's quantized weights packed (fast); none: float weights",
    )
    p.add_argument(
        "--kv-cache-memory",
        default=None,
        type=_memory_size,
        help="KV cache pool size: bytes ('512MiB', '2GB') or tokens ('8192tok')",
    )


def _add_sampling_args(p: argparse.ArgumentParser, max_tokens: int) -> None:
    p.add_argument("--max-tokens", type=int, default=max_tokens)
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--repetition-penalty", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")


def _params(args):
    from tokenmill.sampling import SamplingParams

    return SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        repetition_penalty=args.repetition_penalty,
        seed=args.seed,
        stop=args.stop,
    )


def load_llm(args, **engine_kwargs):
    """Load the model with a progress bar on stderr."""
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from tokenmill.engine.llm_engine import resolve_model
    from tokenmill.llm import LLM

    path = resolve_model(args.model)  # fetches a known model first, with its own message
    with Progress(
        TextColumn("loading {task.description}"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total} tensors"),
        TimeElapsedColumn(),
        transient=True,
        console=_stderr_console(),
    ) as bar:
        task = bar.add_task(path.name, total=None)

        def tick(done: int, total: int) -> None:
            bar.update(task, completed=done, total=total)

        llm = LLM(
            path,
            dtype=args.dtype,
            device=args.device,
            threads=args.threads,
            kv_cache_memory=args.kv_cache_memory,
            quantization=args.quantization,
            progress=tick,
            **engine_kwargs,
        )
    _stderr_console().print(f"[dim]{llm.engine.describe()}[/dim]", soft_wrap=True)
    return llm


def _stderr_console():
    from rich.console import Console

    return Console(stderr=True)


def _speed_line(out) -> str:
    t = out.timings
    return (
        f"time to first token {t.time_to_first_token * 1000:.0f} ms | "
        f"prefill {t.prefill_tokens} tok at {t.prefill_tokens_per_s:.1f} tok/s | "
        f"decode {t.output_tokens} tok at {t.decode_tokens_per_s:.1f} tok/s | "
        f"finish: {out.finish_reason}"
    )


def _stream_answer(llm, prompt, params) -> tuple[str, object]:
    """Stream one completion to stdout; returns its text and a final Output-like record."""
    from tokenmill.llm import Completion, _timings

    pieces = []
    last = None
    for out in llm.stream_outputs(prompt, params):
        if out.text:
            sys.stdout.write(out.text)
            sys.stdout.flush()
            pieces.append(out.text)
        last = out
    text = "".join(pieces)
    timings = _timings(last, last.num_prompt_tokens - last.num_cached_tokens)
    return text, Completion(text, [], last.finish_reason, None, timings)


def cmd_generate(args) -> None:
    params = _params(args)  # validate before the (slow) model load
    llm = load_llm(args)
    _, done = _stream_answer(llm, args.prompt, params)
    sys.stdout.write("\n")
    print(_speed_line(done), file=sys.stderr)


def cmd_chat(args) -> None:
    params = _params(args)
    llm = load_llm(args)
    messages: list[dict] = []
    if args.system:
        messages.append({"role": "system", "content": args.system})
    interactive = sys.stdin.isatty()
    while True:
        if interactive:
            sys.stdout.write("\n> ")
            sys.stdout.flush()
        line = sys.stdin.readline()
        if not line:
            break
        line = line.strip()
        if not line:
            continue
        if line in ("/exit", "/quit"):
            break
        messages.append({"role": "user", "content": line})
        answer, done = _stream_answer(llm, llm.chat_prompt(messages), params)
        sys.stdout.write("\n")
        sys.stdout.flush()
        if args.verbose:
            print(_speed_line(done), file=sys.stderr)
        messages.append({"role": "assistant", "content": answer})


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tokenmill", description="An LLM inference engine that shows its work."
    )
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="stream a continuation of PROMPT")
    g.add_argument("prompt")
    _add_model_args(g)
    _add_sampling_args(g, max_tokens=128)
    g.set_defaults(func=cmd_generate)

    c = sub.add_parser("chat", help="interactive chat with the model's chat template")
    _add_model_args(c)
    _add_sampling_args(c, max_tokens=512)
    c.add_argument("--system", default=None, help="system message")
    c.add_argument("--verbose", action="store_true", help="print speeds after each answer")
    c.set_defaults(func=cmd_chat)

    for register in _optional_commands():
        register(sub, _add_model_args, _add_sampling_args)
    return parser


def _optional_commands():
    """Commands defined next to the code they drive (server, inspector, benchmark)."""
    registrars = []
    for module in ("tokenmill.server.cli", "tokenmill.inspect_cli", "tokenmill.bench"):
        try:
            mod = __import__(module, fromlist=["register"])
        except ModuleNotFoundError as e:
            if e.name != module:
                raise
            continue
        registrars.append(mod.register)
    return registrars


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        args.func(args)
    except KeyboardInterrupt:
        sys.exit(130)
    except BrokenPipeError:
        sys.exit(0)
    except Exception as e:  # one line, no traceback, for every error a user can cause
        from tokenmill.engine.llm_engine import RequestError
        from tokenmill.hub import FetchError
        from tokenmill.loader import LoadError
        from tokenmill.tokenizer import ChatTemplateError

        if isinstance(e, LoadError | FetchError | RequestError | ChatTemplateError | ValueError):
            print(f"tokenmill: error: {e}", file=sys.stderr)
            sys.exit(1)
        raise


if __name__ == "__main__":
    main()
