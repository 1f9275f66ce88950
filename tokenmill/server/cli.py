"""`tokenmill serve`: load a model and serve the OpenAI API over HTTP with uvicorn.

Binds to loopback by default: the server runs arbitrary prompts on this machine's
CPU or GPU, so exposing it (--host 0.0.0.0) is a deliberate choice, best paired
with --api-key.

The listening sockets are bound before the model loads (`bind_sockets`), so a bad
--host, a port out of range or one already in use is a one-line error at once, not
after the seconds of loading; uvicorn starts listening on them once the model is in.
Until then a connection is refused, as before the process started.

Several models: `--model A --model B ...` (repeated) or `--models-dir DIR` (its
sub-folders with a config.json and its .gguf files) serve each under its own names
(server/model_pool.py). The first is loaded at start and is the default; the others load
when a request names them, and the least recently used idle one is evicted when
`--max-loaded-models` or `--models-memory` (weights + KV pool) would be passed. One
`--model` serves exactly as before, with no pool.

--kv-cache-dtype and --speculative / --num-speculative-tokens go to every engine the
server loads; /metrics then shows the cache's bytes per token and speculation's counters
(server/metrics.py).

On SIGTERM (or Ctrl-C) the server stops admitting (the listening socket closes, and
a request that still arrives gets 503), lets running requests finish for up to
--shutdown-timeout seconds, cancels what is left, and exits with status 0.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import functools
import logging
import os
import signal
import socket
from collections.abc import Iterator
from pathlib import Path

from tokenmill import hub
from tokenmill.checks import ArgumentError
from tokenmill.cli.common import add_precision_args, add_speculative_args, positive_int
from tokenmill.server.limits import ServerLimits

# tokenizer/reasoning.py's PARSER_CHOICES, spelled out so that parsing the command line
# imports no tokenizer (tests/test_reasoning.py checks that the two agree)
REASONING_PARSERS = ("auto", "none", "think", "harmony")

API_KEY_ENV = "TOKENMILL_API_KEY"

LOOPBACK = ("127.0.0.1", "localhost", "::1")
WILDCARD = ("0.0.0.0", "::", "")  # every interface: clients name the machine as they like


def _seconds(text: str) -> float:
    value = float(text)
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a number of seconds > 0, got {text}")
    return value


def _port(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a port number, got {text!r}") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be in [0, 65535] (0: any free port), got {value}")
    return value


def _byte_size(text: str) -> int:
    from tokenmill.units import parse_memory

    try:
        value = parse_memory(text)
    except ValueError:
        value = None
    if value is None or value < 1:  # parse_memory's negative values are token counts
        raise argparse.ArgumentTypeError(f"must be a size in bytes such as 4MiB, got {text!r}")
    return value


def register(subparsers, add_model_args, add_sampling_args) -> None:
    p = subparsers.add_parser(
        "serve",
        help="serve the OpenAI, Anthropic, Ollama and rerank APIs and the inspector page over HTTP",
        description="Serve models over HTTP: OpenAI's /v1/completions, /v1/chat/completions, "
        "/v1/embeddings and /v1/responses, Anthropic's /v1/messages (streamed or not, with "
        "tools, structured output and reasoning), Ollama's /api/chat, /api/generate and "
        "the rest of its API, /v1/rerank and /v1/score, /tokenize, /health and /metrics, and at / "
        "the inspector page, which shows each request's pipeline as it runs. The banner "
        "names both addresses.",
        conflict_handler="resolve",  # serve's --model below replaces the shared one
    )
    add_model_args(p)
    p.add_argument(
        "--model",
        action="append",
        default=None,
        metavar="M",
        help=f"checkpoint folder, .gguf file or known model name ({', '.join(hub.KNOWN_MODELS)}); "
        f"default: {hub.DEFAULT_MODEL}. Repeat it to serve several models, loaded when a "
        "request names them; the first is loaded at start and is the default",
    )
    p.add_argument(
        "--models-dir",
        type=Path,
        default=None,
        metavar="DIR",
        help="serve every model in DIR too: each sub-folder with a config.json, each .gguf file",
    )
    p.add_argument(
        "--max-loaded-models",
        type=positive_int,
        default=None,
        metavar="N",
        help="with several models, most loaded at once; the least recently used idle one "
        "is evicted to load another (default: no limit)",
    )
    p.add_argument(
        "--models-memory",
        type=_byte_size,
        default=None,
        metavar="SIZE",
        help="with several models, most memory (weights + KV pools) loaded at once, e.g. "
        "8GiB; the least recently used idle ones are evicted to stay within it",
    )
    p.add_argument(
        "--model-wait-timeout",
        type=_seconds,
        default=60.0,
        help="with several models, seconds a load waits for room while every loaded model "
        "has requests running, before answering 503",
    )
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    p.add_argument("--port", type=_port, default=8000, help="port to listen on (0: any free one)")
    p.add_argument(
        "--api-key",
        nargs="+",
        default=None,
        metavar="KEY",
        help="require 'Authorization: Bearer KEY' on /v1 routes, one key per client "
        f"(default: ${API_KEY_ENV}, comma-separated, else none)",
    )
    p.add_argument(
        "--prefix-cache-scope",
        choices=["global", "per-key"],
        default=None,
        help="who shares cached prompt blocks: every client, or only requests with the same "
        "API key (default: per-key when keys are set, else global); a request's cache_salt "
        "narrows it further",
    )
    p.add_argument(
        "--prefix-cache-dir",
        default=None,
        metavar="PATH",
        help="also keep the prefix cache's full KV blocks in this folder, so a restarted "
        "server reuses the prompts it has seen (keyed by the model, the KV dtype and the "
        "tokens, under each request's cache scope)",
    )
    p.add_argument(
        "--prefix-cache-disk-size",
        default="10GiB",
        metavar="SIZE",
        help="the most the --prefix-cache-dir folder holds; the least recently used blocks "
        "go first (default 10GiB)",
    )
    p.add_argument(
        "--allowed-hosts",
        type=_host_list,
        default=None,
        metavar="HOSTS",
        help="comma-separated names a request's Host header may give, '*' for any "
        "(default without an API key: localhost, 127.0.0.1, ::1 and --host, which keeps "
        "web pages elsewhere out through DNS rebinding; with a key, or on 0.0.0.0: any)",
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
        "--max-num-seqs", type=positive_int, default=64, help="most sequences in one batch"
    )
    p.add_argument(
        "--max-num-batched-tokens",
        type=positive_int,
        default=512,
        help="token budget of one engine step (longer prompts are prefilled in chunks)",
    )
    p.add_argument(
        "--max-waiting",
        type=positive_int,
        default=256,
        help="most sequences waiting for a batch slot; beyond it requests get 429 at once",
    )
    p.add_argument(
        "--max-body-bytes",
        type=_byte_size,
        default=None,
        help="largest request body; larger ones get 413 (default: 64 bytes per context "
        "token, at least 1MiB)",
    )
    p.add_argument(
        "--max-header-bytes",
        type=_byte_size,
        default=ServerLimits.max_header_bytes,
        help="largest request line and headers together; larger ones get 431 (default: 16KiB)",
    )
    # the timeouts, all in seconds: (flag, default, what it bounds)
    for flag, default, what in (
        (
            "--body-timeout",
            ServerLimits.body_timeout_s,
            "seconds to wait for the next chunk of a request body before answering 408",
        ),
        (
            "--body-deadline",
            ServerLimits.body_deadline_s,
            "seconds a whole request body may take to arrive, from the end of its headers, "
            "before answering 408",
        ),
        (
            "--header-timeout",
            ServerLimits.header_timeout_s,
            "seconds a request's line and headers may take to arrive",
        ),
        (
            "--keep-alive-timeout",
            ServerLimits.keep_alive_s,
            "seconds an idle connection stays open between requests",
        ),
        (
            "--shutdown-timeout",
            ServerLimits.shutdown_timeout_s,
            "on SIGTERM, seconds running requests may take to finish",
        ),
        (
            "--health-stall-timeout",
            30.0,
            "/health answers 503 once requests are pending and no engine step (or a "
            "parallel rank's part of one) has finished for this many seconds",
        ),
    ):
        p.add_argument(flag, type=_seconds, default=default, help=what)
    p.add_argument(
        "--reasoning-parser",
        choices=REASONING_PARSERS,
        default="auto",
        help="split a reasoning model's chat answers into reasoning_content and content: "
        "'think' for <think>...</think> (Qwen3, DeepSeek-R1, SmolLM3), 'harmony' for "
        "gpt-oss's channels; 'auto' (the default) by the chat template (<think> or "
        "<|channel|>); 'none' leaves the thinking in content",
    )
    add_precision_args(p)  # checked before loading by cli/common.model_facts
    add_speculative_args(p)
    p.add_argument(
        "--log-level",
        default="info",
        choices=["critical", "error", "warning", "info", "debug"],
        help="server log verbosity",
    )
    p.set_defaults(func=cmd_serve, check=check_serve_args)


def _host_list(text: str) -> tuple[str, ...]:
    hosts = tuple(h.strip() for h in text.split(","))
    if not all(hosts):
        raise argparse.ArgumentTypeError(f"must be comma-separated host names, got {text!r}")
    return hosts


def allowed_hosts_from(args: argparse.Namespace, api_key: object) -> tuple[str, ...] | None:
    """The Host header values the server answers (None: any). --allowed-hosts when given;
    else, on loopback or one address without a key, the loopback names and --host (a
    browser on this machine must not be the way in for any web page);
    else any: a key guards the server, or it listens on every interface anyway."""
    if args.allowed_hosts is not None:
        return None if "*" in args.allowed_hosts else args.allowed_hosts
    if api_key is not None or args.host in WILDCARD:
        return None
    return tuple(dict.fromkeys((*LOOPBACK, args.host)))


def served_model_names(args: argparse.Namespace, path: Path) -> list[str]:
    """The names the server answers to, the one it reports first."""
    model = args.model[0] if isinstance(args.model, list) else args.model  # before check_models
    return list(args.served_model_name or hub.names_for(model, path))


def models_in(folder: Path) -> list[Path]:
    """The models in a --models-dir: its sub-folders with a config.json and its .gguf
    files, by name."""
    if not folder.is_dir():
        raise ArgumentError("--models-dir", f"{folder} is not a folder")
    found = [
        p
        for p in sorted(folder.iterdir())
        if (p.is_dir() and (p / "config.json").is_file())
        or (p.is_file() and p.suffix.lower() == ".gguf")
    ]
    if not found:
        raise ArgumentError(
            "--models-dir", f"{folder} holds no model (sub-folders with a config.json, .gguf files)"
        )
    return found


def check_models(args: argparse.Namespace) -> None:
    """With several models (more than one --model, or --models-dir): every one resolved and
    its file header checked now, each name given to one model only; kept in
    args.served_models as [(the --model value, its path, its names)]. args.model becomes
    the first one, which the shared checks then read and serve loads first. With one
    model: args.model is that one (or None, the default), args.served_models None."""
    from tokenmill.loader import LoadError, sniff_format

    given: list[str | None] = list(args.model or [])
    if args.models_dir is not None:
        given += [str(p) for p in models_in(args.models_dir)]
    args.model = given[0] if given else None
    args.served_models = None
    if len(given) <= 1 and args.models_dir is None:
        return
    if args.served_model_name is not None:
        raise ArgumentError(
            "--served-model-name", "names one model; with several, each is served by its own names"
        )
    if args.tensor_parallel_size > 1 or args.pipeline_parallel_size > 1:
        raise ArgumentError(
            "--tensor-parallel-size"
            if args.tensor_parallel_size > 1
            else "--pipeline-parallel-size",
            "a parallel run serves one model; give one --model",
        )
    served, owner = [], {}
    for model in given:
        try:
            path = hub.resolve_model(model)
            sniff_format(path)
        except (LoadError, hub.FetchError) as e:
            raise ArgumentError("--model", str(e)) from None
        names = hub.names_for(model, path)
        for name in names:
            if owner.setdefault(name, model) != model:
                raise ArgumentError(
                    "--model", f"{owner[name]} and {model} are both called {name!r}; serve one"
                )
        served.append((model, path, names))
    args.served_models = served


def api_key_from(args: argparse.Namespace) -> list[str] | None:
    """--api-key, else $TOKENMILL_API_KEY (comma-separated), else None. An empty key is
    an error, not "no key": whoever typed it meant to protect the server."""
    if args.api_key is not None:
        keys, source = list(args.api_key), "--api-key"
    elif (env := os.environ.get(API_KEY_ENV)) is not None:
        keys, source = env.split(","), f"${API_KEY_ENV}"
    else:
        return None
    if not keys or any(not key.strip() for key in keys):
        raise ValueError(f"{source} is empty; give a key, or leave it unset to serve without one")
    return keys


def check_serve_args(args: argparse.Namespace) -> None:
    """The server's checks before the model loads (tokenmill.cli.check_before_loading): the
    API keys and names, then the address, bound now and kept in args.sockets, then the
    models (check_models)."""
    api_key_from(args)
    if args.served_model_name is not None and not all(n.strip() for n in args.served_model_name):
        raise ArgumentError("--served-model-name", "a name is empty; give names clients can send")
    check_prefix_cache_dir(args)
    args.sockets = bind_sockets(args.host, args.port)
    check_models(args)  # after the address: its errors come first, as with one model


def check_prefix_cache_dir(args: argparse.Namespace) -> None:
    """--prefix-cache-dir must be a folder this process can write (made if missing), and
    --prefix-cache-disk-size a size: refused before the model loads."""
    from tokenmill.units import parse_memory

    try:
        size = parse_memory(args.prefix_cache_disk_size)
    except ValueError:
        size = None
    if size is None or size < 1:
        raise ArgumentError(
            "--prefix-cache-disk-size",
            f"must be a size like 10GiB or 500MB, got {args.prefix_cache_disk_size!r}",
        )
    if args.prefix_cache_dir is None:
        return
    folder = Path(args.prefix_cache_dir).expanduser()
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ArgumentError("--prefix-cache-dir", f"cannot make {folder}: {e.strerror}") from None
    if not os.access(folder, os.W_OK):
        raise ArgumentError("--prefix-cache-dir", f"{folder} is not writable")
    args.prefix_cache_dir = str(folder)


def bind_sockets(host: str, port: int) -> list[socket.socket]:
    """Sockets bound to host:port, one per address the host resolves to, made the way
    asyncio's create_server makes them for uvicorn (SO_REUSEADDR, so a restart does not
    wait out the last run's TIME_WAIT connections; IPv6 sockets IPv6-only, so "", or a
    name with both kinds of address, takes both). Not yet listening: connections are
    refused until uvicorn listens. Port 0 picks a free port, the same for every address.
    Raises ArgumentError naming --host or --port."""
    try:
        infos = socket.getaddrinfo(
            host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )
    except socket.gaierror as e:
        raise ArgumentError("--host", f"cannot resolve {host!r}: {e.strerror}") from None
    sockets: list[socket.socket] = []
    try:
        for family, kind, proto, _, address in dict.fromkeys(infos):  # unique, in order
            sock = socket.socket(family, kind, proto)
            sockets.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            if port == 0 and len(sockets) > 1:  # the port the first address got
                address = (address[0], sockets[0].getsockname()[1], *address[2:])
            try:
                sock.bind(address)
            except OSError as e:
                raise _bind_error(host, address, e) from None
    except BaseException:
        for sock in sockets:
            sock.close()
        raise
    return sockets


def _bind_error(host: str, address: tuple, e: OSError) -> ArgumentError:
    shown = f"[{address[0]}]:{address[1]}" if ":" in address[0] else f"{address[0]}:{address[1]}"
    if e.errno == errno.EADDRINUSE:
        return ArgumentError(
            "--port",
            f"{shown} is already in use (another server listens there); stop it, or pick "
            "another --port (0: any free one)",
        )
    if e.errno == errno.EACCES:
        return ArgumentError(
            "--port",
            f"binding {shown} is not permitted (ports below 1024 need privileges); "
            "pick a port above 1023",
        )
    if e.errno == errno.EADDRNOTAVAIL:
        named = host if host == address[0] else f"{host} ({address[0]})"
        return ArgumentError("--host", f"{named} is not an address of this machine")
    return ArgumentError("--host", f"cannot bind {shown}: {e.strerror}")


def cmd_serve(args: argparse.Namespace) -> None:
    from tokenmill.server.app import STATIC_DIR, create_app

    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    log = logging.getLogger("tokenmill.server")
    api_key = api_key_from(args)  # before the (slow) model load
    if api_key is None and args.host not in LOOPBACK:
        log.warning(
            "serving on %s without an API key: anyone who can reach it can use it", args.host
        )
    engine = load_engine(args, args.model_path)
    if engine.engine.parallel is not None:  # a dead rank ends the server (after its answers)
        engine.engine.parallel.exit_on_failure = True
    limits = ServerLimits(
        max_body_bytes=args.max_body_bytes,
        max_header_bytes=args.max_header_bytes,
        body_timeout_s=args.body_timeout,
        body_deadline_s=args.body_deadline,
        header_timeout_s=args.header_timeout,
        keep_alive_s=args.keep_alive_timeout,
        shutdown_timeout_s=args.shutdown_timeout,
        allowed_hosts=allowed_hosts_from(args, api_key),
    )
    if args.served_models is None:
        name, *aliases = served_model_names(args, engine.engine.path)
        served = engine
    else:
        served = model_pool(args, engine)
        name, aliases = ", ".join(served.names), []
    app = create_app(
        served,
        model_name=name if args.served_models is None else None,
        api_key=api_key,
        aliases=aliases,
        limits=limits,
        prefix_cache_scope=args.prefix_cache_scope,
        reasoning_parser=args.reasoning_parser,
    )
    port = args.sockets[0].getsockname()[1]  # --port 0: the one the system picked
    shown = f"[{args.host}]" if ":" in args.host else args.host or "0.0.0.0"
    base = f"http://{shown}:{port}"
    log.info(
        "serving %s at %s/v1 (request bodies up to %d bytes)", name, base, app.state.max_body_bytes
    )
    if (STATIC_DIR / "index.html").is_file():  # the page that shows the pipeline as it runs
        log.info("the inspector page: %s/", base)
    serve(app, served, args.sockets, limits, args.log_level)


def load_engine(args: argparse.Namespace, path: Path):
    """The model at `path` loaded with serve's options, in an AsyncEngine (not started)."""
    from tokenmill.cli.common import load_llm
    from tokenmill.server.async_engine import AsyncEngine

    # --kv-cache-dtype, --speculative and --num-speculative-tokens reach the engine
    # through load_llm, as generate's do
    llm = load_llm(
        argparse.Namespace(**{**vars(args), "model_path": path}),
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        prefix_cache_dir=args.prefix_cache_dir,
        prefix_cache_disk_size=args.prefix_cache_disk_size,
    )
    return AsyncEngine(
        llm.engine, max_waiting=args.max_waiting, stall_timeout=args.health_stall_timeout
    )


def model_pool(args: argparse.Namespace, first):
    """The ModelPool of args.served_models, the first already loaded (`first`)."""
    from tokenmill.server.model_pool import ModelPool, ServedModel

    models = [
        ServedModel(
            names[0],
            functools.partial(load_engine, args, path),
            tuple(names[1:]),
            path,
            args.reasoning_parser,
        )
        for _, path, names in args.served_models
    ]
    pool = ModelPool(
        models,
        max_loaded=args.max_loaded_models,
        memory_budget=args.models_memory,
        wait_timeout_s=args.model_wait_timeout,
    )
    pool.add_loaded(models[0].name, first)
    return pool


def serve(app, engine, sockets: list[socket.socket], limits, log_level: str) -> None:
    """Run `app` with uvicorn on the bound `sockets` until SIGTERM or SIGINT, then shut down
    gracefully."""
    import uvicorn

    from tokenmill.server.limits import header_timeout_protocol

    class Server(uvicorn.Server):
        """uvicorn's server, draining the engine as soon as a signal arrives and ending
        with status 0 after a SIGTERM: uvicorn re-raises a handled signal once it has
        shut down, which would kill the process with status 143 after a clean stop."""

        def handle_exit(self, sig: int, frame) -> None:
            engine.drain()
            super().handle_exit(sig, frame)

        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            with super().capture_signals():
                yield
                # runs before uvicorn's own exit re-raises what it caught
                self._captured_signals = [s for s in self._captured_signals if s != signal.SIGTERM]

    host, port = sockets[0].getsockname()[:2]
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        http=header_timeout_protocol(
            limits.header_timeout_s, limits.max_header_bytes, app.state.http
        ),
        h11_max_incomplete_event_size=limits.max_header_bytes,
        timeout_keep_alive=limits.keep_alive_s,
        timeout_graceful_shutdown=limits.shutdown_timeout_s,
    )
    Server(config).run(sockets=sockets)
